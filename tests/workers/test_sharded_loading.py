"""Sharded loading: a tensor-parallel rank reads only its part of each checkpoint tensor from disk.

For every checkpoint format and weight path (safetensors; GGUF dequantised, its Q4 blocks kept packed, Mixtral's
stacked experts; 16-bit weights quantised at load), each rank's model loaded by region must equal, bit for bit, the
model of the old way (the whole tensor read, then this rank's part cut out in memory), and the rank must have read
about 1/N of the split tensors: at most its share plus the tensors every rank holds whole (the norms, the router).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from worker_helpers import make_checkpoint, write_gguf

from stride.model.files import default_model_path
from stride.workers import loader
from stride.workers.loader import LoadReport, load_model
from stride.workers.models import Transformer


class _Whole:
    """A module as the loader saw it before sharded reads: it takes the whole tensor and cuts its part in memory."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def region(self, shard: int, shape: tuple[int, ...]) -> None:
        return None

    def load_part(self, part: Any, shard: int = 0) -> None:
        self.module.load_full(part, shard)


def _whole_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    target = Transformer.target

    def whole(self: Transformer, name: str) -> tuple[Any, int] | None:
        found = target(self, name)
        return None if found is None else (_Whole(found[0]), found[1])

    monkeypatch.setattr(Transformer, "target", whole)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _whole_tensors(model: Path, report: LoadReport) -> int:
    """Elements of the tensors every rank reads whole (1-D: norms; Mixtral's router)."""
    one = LoadReport()
    load_model(str(model), report=one)
    whole = 0
    for t in (loader.gguf_tensors if model.suffix == ".gguf" else loader.safetensors_tensors)(*_reader_args(model)):
        if len(t.shape) == 1 or t.name.endswith("block_sparse_moe.gate.weight"):
            whole += t.numel(None)
    assert one.elements_total == report.elements_total
    return whole


def _reader_args(model: Path) -> tuple[Any, ...]:
    if model.suffix != ".gguf":
        return (model,)
    from stride.model.gguf import read_gguf
    from stride.workers.gguf_checkpoint import gguf_args

    reader = read_gguf(model)
    return (reader, gguf_args(reader), set(), torch.float32)


def _checkpoint(kind: str, tmp: Path) -> Path:
    if kind == "smollm2-gguf":
        try:
            return Path(default_model_path())
        except FileNotFoundError as e:
            pytest.skip(str(e))
    if kind == "tiny-llama":
        return make_checkpoint("tiny-llama", tmp / "hf", torch.bfloat16)
    hf = make_checkpoint("tiny-mixtral", tmp / "hf", torch.float32)
    if kind == "tiny-mixtral":
        return hf
    return write_gguf(hf, tmp / "mixtral.gguf", "Q8_0")  # w2's 48-input halves cut Q8_0's 32-blocks: whole rows


@pytest.mark.parametrize("kind, tp, options", [
    ("tiny-llama", 2, {}),  # safetensors, bfloat16 on disk
    ("tiny-llama", 2, {"quantize_group": 16}),  # quantised at load (80 inputs of down per rank)
    ("tiny-mixtral", 2, {}),  # each expert split
    ("tiny-mixtral-gguf", 2, {}),  # the experts stacked in one GGUF tensor per layer
    ("smollm2-gguf", 3, {}),  # Q8_0 embedding, Q4_1 projections dequantised; 3 KV heads, one per rank
    ("smollm2-gguf", 3, {"w4a16": True}),  # the Q4_1 blocks kept packed, rows and inputs cut from the raw bytes
])
def test_each_rank_reads_its_part_and_loads_what_whole_reads_load(
        kind: str, tp: int, options: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _checkpoint(kind, tmp_path)
    sharded, reports = [], []
    for rank in range(tp):
        reports.append(LoadReport())
        sharded.append(_state(load_model(str(model), tp_rank=rank, tp_size=tp, report=reports[-1], **options)))
    whole_reports = []
    with monkeypatch.context() as m:
        _whole_reads(m)
        # Over three ranks the first and the last (the edges of every cut); each whole load of the default model
        # costs ~7 s here.
        for rank in sorted({0, tp - 1}):
            whole_reports.append(LoadReport())
            want = _state(load_model(str(model), tp_rank=rank, tp_size=tp, report=whole_reports[-1], **options))
            assert want.keys() == sharded[rank].keys()
            for name, tensor in want.items():
                assert torch.equal(sharded[rank][name], tensor), (rank, name)
    total = reports[0].elements_total
    whole = _whole_tensors(model, reports[0])
    share = whole + (total - whole) // tp  # every split here divides evenly: no padding rows, no replicated heads
    assert [r.elements_read for r in reports] == [share] * tp, (reports, whole, total)
    # Negative control: whole reads take every element on every rank, which the check above refuses.
    assert [r.elements_read for r in whole_reports] == [total] * len(whole_reports)


def test_a_packed_shard_must_be_whole_blocks(tmp_path: Path) -> None:
    """A GGUF Q4 projection kept packed cannot take inputs cutting its 32-blocks: refused, not silently wrong."""
    from stride.workers.gguf_checkpoint import _packed_reader
    from stride.workers.models import ModelArgs

    raw = torch.zeros(4, 2 * 20, dtype=torch.uint8).numpy()  # 4 rows of two Q4_1 blocks (64 inputs)
    read = _packed_reader(raw, "Q4_1", "ffn_down", ModelArgs(vocab_size=8, hidden_size=64, intermediate_size=64,
                                                            num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64),
                          torch.float32)
    assert read((1, 32, 32)).in_features == 32
    with pytest.raises(ValueError, match="whole blocks of 32"):
        read((1, 16, 32))
