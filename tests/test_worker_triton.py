"""The worker with the Triton backend (paged kernels + fused RMSNorm/SiLU-mul) computes what the torch
reference backend computes. CPU: the very same kernels through Triton's interpreter, float32, a random tiny
Llama. GPU (marked gpu): the 8B-shaped random checkpoint in bf16, logit cosine >= 0.9999."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import kernels  # noqa: F401  (first: without CUDA it turns on Triton's interpreter before Triton loads)
from stride.workers.attention import get_backend
from stride.workers.runner import ModelRunner

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_checkpoint(
    preset: str, out: Path, dtype: torch.dtype, num_layers: int = 0, device: str = "cpu"
) -> Path:
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    cfg = dict(make["PRESETS"][preset])
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    return Path(make["write_checkpoint"](cfg, out, dtype, seed=5, device=device))


class Steps:
    """A fixed schedule of mixed steps over shuffled blocks, replayable on any runner.

    Three sequences: A (prefill 20), B (prefill 37 in two chunks), C (prefill 9, joins late); decodes of
    the running ones ride in the same steps as the chunks; the last steps are decode-only.
    """

    def __init__(self, num_blocks: int, block_size: int, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.tables = rng.permutation(num_blocks)[: 3 * 12].astype(np.int32).reshape(3, 12)
        self.block_size = block_size
        self.prompts = [rng.integers(0, vocab, n) for n in (20, 37, 9)]
        # Each step: (slot, number of new tokens) per sequence; a decode is 1 token.
        self.schedule = [
            [(0, 20), (1, 16)],
            [(0, 1), (1, 21)],
            [(0, 1), (1, 1), (2, 9)],
            [(0, 1), (1, 1), (2, 1)],
            [(2, 1), (0, 1), (1, 1)],
        ]
        self.extra = rng.integers(0, vocab, 64)

    def run(self, runner: ModelRunner, context_shift: int = 0) -> list[torch.Tensor]:
        """Logits of every step; ``context_shift`` feeds decodes a wrong context length (negative control)."""
        lengths = [0, 0, 0]
        out = []
        for step in self.schedule:
            ids, pos, slots, q_lens, ctx = [], [], [], [], []
            for slot, n in step:
                prompt = self.prompts[slot]
                lo = lengths[slot]
                k = lo - len(prompt)
                new = prompt[lo : lo + n] if k < 0 else self.extra[k : k + n]
                ids.append(new)
                pos.append(np.arange(lo, lo + n))
                lengths[slot] += n
                slots.append(slot)
                q_lens.append(n)
                ctx.append(lengths[slot] - (context_shift if n == 1 else 0))
            out.append(
                runner.forward(
                    np.concatenate(ids).astype(np.int32),
                    np.concatenate(pos).astype(np.int32),
                    np.array(slots, np.int32),
                    np.array(q_lens, np.int32),
                    np.array(ctx, np.int32),
                    self.tables,
                )
            )
        return out


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> dict[str, int]:
    """Count calls of ``module.name`` (a function looked up through ``module`` at call time)."""
    calls = {"n": 0}
    real: Callable[..., Any] = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), torch.float32)


@torch.inference_mode()
def test_triton_backend_equals_torch_backend_cpu(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = ModelRunner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="torch")
    tri = ModelRunner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton")
    assert (ref.backend.name, tri.backend.name) == ("torch", "triton")
    import stride.workers.attention_triton as at
    from stride.workers.models import layers

    # The layers reach the kernels through layers._kernel; count on copies of those modules (patching the
    # kernel modules' own globals would confuse Triton's interpreter, which runs with those globals).
    for name in ("rmsnorm", "silu_mul"):
        monkeypatch.setitem(layers._KERNELS, name, SimpleNamespace(**{name: getattr(layers._kernel(name), name)}))
    calls = {
        name: count_calls(monkeypatch, mod, name)
        for mod, name in [
            (at, "paged_extend"),
            (at, "paged_decode"),
            (layers._KERNELS["rmsnorm"], "rmsnorm"),
            (layers._KERNELS["silu_mul"], "silu_mul"),
        ]
    }
    steps = Steps(40, 4, ref.args.vocab_size)
    want = steps.run(ref)
    # Only the triton runner may reach the kernels: the torch path must not call them.
    assert all(c["n"] == 0 for c in calls.values())
    got = steps.run(tri)
    n = ref.args.num_layers
    assert calls["paged_extend"]["n"] == 3 * n and calls["paged_decode"]["n"] == 2 * n
    assert calls["rmsnorm"]["n"] == 5 * (2 * n + 1) and calls["silu_mul"]["n"] == 5 * n
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w).abs().max().item()
        assert err <= 1e-5, f"step {i}: max logit error {err:.3g}"
    # Negative control: decodes attending to one key too few move the logits far past that tolerance.
    wrong = steps.run(tri, context_shift=1)
    assert max((g - w).abs().max().item() for g, w in zip(wrong[3:], want[3:], strict=True)) > 1e-2


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRIDE_ATTENTION_BACKEND", raising=False)
    assert get_backend("", "cpu").name == "torch"
    assert get_backend("", "cuda").name == "triton"
    monkeypatch.setenv("STRIDE_ATTENTION_BACKEND", "triton")
    assert get_backend("", "cpu").name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash", "cpu")


def test_cpu_import_does_not_load_triton() -> None:
    # The triton backend registers lazily: a CPU worker that never asks for it must not import Triton.
    code = (
        "import sys; from stride.workers.runner import ModelRunner; "
        "print(sorted(m for m in ('triton', 'kernels') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "STRIDE_ATTENTION_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@torch.inference_mode()
def test_triton_worker_equals_reference_8b_shaped(tmp_path: Path) -> None:
    """8B shapes (hidden 4096, GQA 32/8, head_dim 128, vocab 128256) in bf16. The checkpoint is
    ``STRIDE_TEST_LLAMA8B`` when set (a directory written by make_random_checkpoint.py), else a random one
    with 8 layers written here."""
    path = os.environ.get("STRIDE_TEST_LLAMA8B") or str(
        make_checkpoint("llama-3.1-8b", tmp_path / "8b", torch.bfloat16, num_layers=8, device="cuda")
    )
    ref = ModelRunner(path, device="cuda", dtype="bfloat16", num_blocks=2048, attention_backend="torch")
    steps = Steps(2048, 16, ref.args.vocab_size, seed=1)
    steps.prompts = [np.random.default_rng(2).integers(0, 128000, n) for n in (700, 1500, 300)]
    steps.schedule = [[(0, 700), (1, 1000)], [(0, 1), (1, 500)], [(0, 1), (1, 1), (2, 300)]]
    steps.schedule += [[(0, 1), (1, 1), (2, 1)]] * 3
    steps.tables = np.random.default_rng(3).permutation(2048)[: 3 * 120].astype(np.int32).reshape(3, 120)
    want = [w.cpu() for w in steps.run(ref)]
    del ref
    torch.cuda.empty_cache()
    tri = ModelRunner(path, device="cuda", dtype="bfloat16", num_blocks=2048, attention_backend="triton")
    got = [g.cpu() for g in steps.run(tri)]
    cos = [min(cosine(g[r], w[r]) for r in range(len(w))) for g, w in zip(got, want, strict=True)]
    print("per-step min logit cosine:", [f"{c:.6f}" for c in cos])
    assert min(cos) >= 0.9999, cos
    # Negative control: random weights make attention nearly uniform, so the logits move little with it;
    # decodes that miss most of one sequence's keys (250 of 303) must still fall below the bound.
    wrong = [g.cpu() for g in steps.run(tri, context_shift=250)]
    off = min(cosine(wrong[-1][r], want[-1][r]) for r in range(3))
    print(f"negative control cosine: {off:.6f}")
    assert off < 0.9999
