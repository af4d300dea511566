"""Tensor parallelism on two GPUs (NCCL), in bf16: two ranks against one, layer by layer through ``stride diagnose``'s
runs, with a wrong shard planted as the negative control. Marked ``gpu`` and skipped with fewer than two devices
(the multi-GPU issue runs it where they are lent)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from diagnose_helpers import swapped_attention_output_shards
from worker_helpers import make_checkpoint

from stride.diagnose.compare import diagnose
from stride.diagnose.runs import Schedule
from stride.diagnose.spec import RunSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _schedule(vocab: int) -> Schedule:
    rng = np.random.default_rng(5)
    return Schedule(tuple(tuple(int(x) for x in rng.integers(0, vocab, n)) for n in (40, 23, 9)), decode_steps=4)


@pytest.mark.parametrize("preset, config, kv", [
    ("tiny-llama", {}, "auto"), ("tiny-llama", {"num_key_value_heads": 1}, "auto"), ("tiny-mixtral", {}, "auto"),
    ("llama-3.1-8b", {"num_hidden_layers": 4}, "auto"),  # real widths, four layers
    ("llama-3.1-8b", {"num_hidden_layers": 4}, "fp8"),  # the 8-bit cache (keys-inner V) on both sides
])
def test_two_gpus_match_one_in_bf16(preset: str, config: dict[str, int], kv: str, tmp_path: Path) -> None:
    model = str(make_checkpoint(preset, tmp_path / "ck", torch.bfloat16, device="cuda", **config))
    vocab = {"llama-3.1-8b": 128256}.get(preset, 320)
    one, two = RunSpec(dtype="bfloat16", kv=kv, device="cuda"), RunSpec(tp=2, dtype="bfloat16", kv=kv, device="cuda")
    report = diagnose(two, one, model, _schedule(vocab))
    assert report.first_divergent is None, report.text()
    assert not [f for f in report.flips if not f.near_tie], report.text()
    # Negative control: layer 1's attention output holding the other rank's shard is found there.
    bad = diagnose(two, one, model, _schedule(vocab), functools.partial(swapped_attention_output_shards, model,
                                                                         layer=1))
    assert bad.first_divergent is not None and bad.first_divergent.layer == 1, bad.text()
