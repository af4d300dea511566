"""The worker computes what HuggingFace transformers computes: logits per position (prefill, then decodes
through the paged cache) and greedy generation, for SmolLM2 (the real GGUF), a random tiny Llama (GQA,
llama3 RoPE scaling, untied embeddings) and a random tiny Mixtral. CPU float32; bf16 on CUDA (gpu)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from worker_helpers import make_runner

from stride.model.files import default_model_path
from stride.workers.runner import ModelRunner

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
# A ChatML prompt in SmolLM2's vocabulary ("<|im_start|>system ... <|im_start|>assistant\n").
CHAT_IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SETUPS = [
    pytest.param(("cpu", "float32"), id="cpu-fp32"),
    pytest.param(("cuda", "bfloat16"), id="cuda-bf16", marks=[pytest.mark.gpu, gpu]),
]
# The tiny models also run in the other dtypes the worker supports: bf16 on the CPU, fp16 on CUDA.
TINY_SETUPS = SETUPS + [
    pytest.param(("cpu", "bfloat16"), id="cpu-bf16"),
    pytest.param(("cuda", "float16"), id="cuda-fp16", marks=[pytest.mark.gpu, gpu]),
]
LOGIT_ATOL = {"float32": 1e-4}
TIE_MARGIN = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.05}


def logits_close(mine: torch.Tensor, ref: torch.Tensor, dtype: str) -> float:
    """Assert the max abs error is within the dtype's tolerance (bf16: a few ulps of the top logit)."""
    err = (mine.float() - ref.float()).abs().max().item()
    tol = LOGIT_ATOL.get(dtype, 0.03 * ref.abs().max().item())
    assert err <= tol, f"max logit error {err:.3g} > {tol:.3g}"
    return err


def make_checkpoint(preset: str, out: Path, seed: int) -> Path:
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    return make["write_checkpoint"](make["PRESETS"][preset], out, torch.float32, seed=seed)


class OneSeq:
    """Runs one sequence through a runner's paged cache on shuffled blocks, like the scheduler would."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        blocks = np.random.default_rng(seed).permutation(runner.num_blocks).astype(np.int32)
        self.block_tables = blocks[None, :64].copy()
        self.length = 0

    def feed(self, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        pos = np.arange(self.length, self.length + n, dtype=np.int32)
        self.length += n
        return self.runner.forward(
            np.array(tokens, np.int32),
            pos,
            np.array([0], np.int32),
            np.array([n], np.int32),
            np.array([self.length], np.int32),
            self.block_tables,
        )[0]


def per_position_logits(runner: ModelRunner, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits at positions prefill-1 .. len(ids)-1: one prefill, then one decode step per token."""
    seq = OneSeq(runner)
    out = [seq.feed(ids[:prefill])]
    out += [seq.feed([t]) for t in ids[prefill:]]
    return torch.stack(out)


def greedy_matches(runner: ModelRunner, hf: object, ids: list[int], num_new: int, dtype: str) -> int:
    """Our greedy tokens against transformers' generate(); returns how many agreed. Past the first
    disagreement nothing is compared, and a disagreement is only allowed where HF's top two are near-tied."""
    out = hf.generate(
        torch.tensor([ids], device=runner.device),
        max_new_tokens=num_new,
        do_sample=False,  # type: ignore[attr-defined]
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    ref_tokens = out.sequences[0, len(ids) :].tolist()
    seq = OneSeq(runner, seed=7)
    logits = seq.feed(ids)
    for i, ref in enumerate(ref_tokens):
        mine = int(logits.argmax())
        if mine != ref:
            top2 = out.logits[i][0].float().topk(2).values
            margin = (top2[0] - top2[1]).item()
            assert margin < TIE_MARGIN[dtype], f"token {i}: {mine} != {ref} with HF margin {margin:.4f}"
            return i
        logits = seq.feed([mine])
    return len(ref_tokens)


def _hf_model(path: Path | str, device: str, dtype: str, gguf_file: str | None = None) -> object:
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), **kwargs
    )
    return model.to(device).eval()


@pytest.fixture(scope="module", params=SETUPS)
def smollm2(request: pytest.FixtureRequest) -> tuple[ModelRunner, object, str]:
    device, dtype = request.param
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))  # the 98 MB GGUF does not travel to every machine (the GPU one, say)
    if not os.path.isfile(path):
        pytest.skip(f"default model not installed here ({path})")
    runner = make_runner(path, device=device, dtype=dtype, num_blocks=64)
    hf = _hf_model(os.path.dirname(path), device, dtype, gguf_file=os.path.basename(path))
    return runner, hf, dtype


@pytest.fixture(
    scope="module",
    params=[("tiny-llama", s) for s in TINY_SETUPS] + [("tiny-mixtral", s) for s in TINY_SETUPS],
    ids=lambda p: f"{p[0]}-{p[1].id}",
)
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelRunner, object, str]:
    preset, setup = request.param
    device, dtype = setup.values[0]
    for mark in setup.marks:
        if mark.name == "skipif" and mark.args[0]:
            pytest.skip("needs CUDA")
    path = make_checkpoint(preset, tmp_path_factory.mktemp(preset), seed=3)
    runner = make_runner(str(path), device=device, dtype=dtype, num_blocks=128)
    return runner, _hf_model(path, device, dtype), dtype


@pytest.mark.slow  # transformers' own GGUF load takes ~10-40 s on 2 cores
@torch.inference_mode()
def test_smollm2_logits_match_transformers(smollm2: tuple[ModelRunner, object, str]) -> None:
    runner, hf, dtype = smollm2
    ref = hf(torch.tensor([CHAT_IDS], device=runner.device)).logits[0, 20 - 1 :]  # type: ignore[operator]
    mine = per_position_logits(runner, CHAT_IDS, prefill=20)
    logits_close(mine, ref, dtype)
    # Negative control: the logits of a neighbouring position are far outside the tolerance.
    assert (mine[1:] - ref[:-1]).abs().max().item() > 1.0


@pytest.mark.slow
@torch.inference_mode()
def test_smollm2_greedy_matches_transformers(smollm2: tuple[ModelRunner, object, str]) -> None:
    runner, hf, dtype = smollm2
    assert greedy_matches(runner, hf, CHAT_IDS, 24, dtype) >= 1


@torch.inference_mode()
def test_tiny_logits_match_transformers(tiny: tuple[ModelRunner, object, str]) -> None:
    runner, hf, dtype = tiny
    ids = np.random.default_rng(0).integers(0, 256, 150).tolist()  # past the llama3 original context (64)
    ref = hf(torch.tensor([ids], device=runner.device)).logits[0, 100 - 1 :]  # type: ignore[operator]
    mine = per_position_logits(runner, ids, prefill=100)
    logits_close(mine, ref, dtype)


@torch.inference_mode()
def test_tiny_greedy_matches_transformers(tiny: tuple[ModelRunner, object, str]) -> None:
    runner, hf, dtype = tiny
    ids = np.random.default_rng(1).integers(0, 256, 30).tolist()
    assert greedy_matches(runner, hf, ids, 40, dtype) >= 1


def test_tiny_llama_really_uses_llama3_scaling(tmp_path: Path) -> None:
    # Negative control for the config path: without llama3 scaling the model's logits move.
    path = make_checkpoint("tiny-llama", tmp_path / "a", seed=3)
    cfg = (path / "config.json").read_text()
    ids = np.random.default_rng(0).integers(0, 256, 100).tolist()
    scaled = OneSeq(make_runner(str(path), device="cpu", num_blocks=16)).feed(ids)
    (path / "config.json").write_text(cfg.replace('"llama3"', '"default"'))
    plain = OneSeq(make_runner(str(path), device="cpu", num_blocks=16)).feed(ids)
    assert (scaled - plain).abs().max().item() > 1e-3


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@torch.inference_mode()
def test_llama_8b_shaped_checkpoint_loads_and_decodes(tmp_path: Path) -> None:
    # Writes ~16 GB of random bf16 weights (or reuses STRIDE_TEST_LLAMA8B, a directory written by
    # make_random_checkpoint.py --preset llama-3.1-8b); the cache is sized from the GPU memory left after loading.
    path = os.environ.get("STRIDE_TEST_LLAMA8B", "")
    if not path:
        make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
        preset = make["PRESETS"]["llama-3.1-8b"]
        path = make["write_checkpoint"](preset, tmp_path / "8b", torch.bfloat16, seed=0, device="cuda")
    runner = make_runner(str(path), device="cuda", dtype="bfloat16")
    assert runner.num_blocks > 1000 and runner.args.num_layers == 32
    ids = np.random.default_rng(0).integers(0, 128000, 300).tolist()
    one_shot = OneSeq(runner, seed=1).feed(ids)
    seq = OneSeq(runner, seed=2)
    for lo in range(0, 300, 30):
        chunked = seq.feed(ids[lo : lo + 30])
    assert torch.nn.functional.cosine_similarity(one_shot, chunked, dim=0).item() >= 0.999
    for _ in range(8):
        logits = seq.feed([int(chunked.argmax())])
        assert torch.isfinite(logits).all()
        chunked = logits
