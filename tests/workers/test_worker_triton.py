"""The worker with the Triton backend (paged kernels + fused RMSNorm/SiLU-mul) computes what the torch
reference backend computes. CPU: the very same kernels through Triton's interpreter, float32, a random tiny
Llama. GPU (marked gpu): the 8B-shaped random checkpoint, float32 equal, bf16 logit cosine >= 0.9999 at 2 layers
and, at 8, no further apart than a one-ulp input change moves the reference."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from worker_helpers import Steps, count_calls, cpu_triton, gpu, make_checkpoint, make_runner

from stride.config import ATTENTION_BACKENDS, WorkerConfig
from stride.kernels.paged_common import is_keys_inner
from stride.workers.backends import get_backend

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), torch.float32)


@torch.inference_mode()
@cpu_triton
def test_triton_backend_equals_torch_backend_cpu(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="torch")
    tri = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton")
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
    # Steps 2 and 3 lead with decodes: those go to the decode kernel, the chunks after them to extend.
    assert calls["paged_extend"]["n"] == 3 * n and calls["paged_decode"]["n"] == 4 * n
    assert calls["rmsnorm"]["n"] == 5 * (2 * n + 1) and calls["silu_mul"]["n"] == 5 * n
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w).abs().max().item()
        assert err <= 1e-5, f"step {i}: max logit error {err:.3g}"
    # Negative control: decodes one position back (one key fewer, RoPE off by one) move the logits far
    # past that tolerance.
    wrong = steps.run(tri, context_shift=1)
    assert max((g - w).abs().max().item() for g, w in zip(wrong[3:], want[3:], strict=True)) > 1e-2


@torch.inference_mode()
@cpu_triton
def test_fp8_kv_cache_both_backends(tiny_path: Path) -> None:
    """``--kv-dtype fp8``: the caches hold float8_e4m3fn (half the bytes); the triton backend (fused K/V write,
    kernels over 8-bit caches) computes what the torch one does over the same caches, bit for bit in the caches and
    to float32 rounding in the logits; and the 8-bit cache is an approximation of the float32 one, not equal to it."""
    ref = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="torch",
                      kv_dtype="fp8")
    tri = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton",
                      kv_dtype="fp8")
    full = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="torch")
    assert ref.kv_cache.k_caches[0].dtype == tri.kv_cache.k_caches[0].dtype == torch.float8_e4m3fn
    assert 4 * ref.kv_cache.nbytes == full.kv_cache.nbytes  # float32 run, 8-bit cache
    # The 8-bit V is stored keys-inner (stride/workers/kv_cache.py), K and 32-bit caches with head_dim contiguous.
    assert is_keys_inner(ref.kv_cache.v_caches[0]) and is_keys_inner(tri.kv_cache.v_caches[0])
    assert not is_keys_inner(ref.kv_cache.k_caches[0]) and full.kv_cache.v_caches[0].is_contiguous()
    steps = Steps(40, 4, ref.args.vocab_size)
    want, got, wide = steps.run(ref), steps.run(tri), steps.run(full)
    for layer in range(ref.args.num_layers):
        for a, b in ((ref.kv_cache.k_caches[layer], tri.kv_cache.k_caches[layer]),
                     (ref.kv_cache.v_caches[layer], tri.kv_cache.v_caches[layer])):
            b = b[: a.shape[0]]  # the triton runner keeps one more block: its decode graphs' padding rows'
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w).abs().max().item()
        assert err <= 1e-5, f"step {i}: max logit error {err:.3g}"
    # The 8-bit cache moves the logits (the comparison above is not of two float32 caches), but only a little:
    # cosine against the float32 cache's logits.
    moved = max((g - w).abs().max().item() for g, w in zip(want, wide, strict=True))
    cos = min(torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0).item()
              for g, w in zip(want, wide, strict=True))
    assert moved > 1e-4 and cos > 0.999, (moved, cos)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRIDE_ATTENTION_BACKEND", raising=False)
    assert get_backend(WorkerConfig().attention_backend, "cpu").name == "sdpa"
    assert get_backend(WorkerConfig().attention_backend, "cuda").name == "triton"
    monkeypatch.setenv("STRIDE_ATTENTION_BACKEND", "triton")  # the variable supplies the config's default
    assert get_backend(WorkerConfig().attention_backend, "cpu").name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash", "cpu")
    # Every name a launch may give is one the worker builds, and the config refuses the others at once.
    for name in ATTENTION_BACKENDS:
        assert get_backend(name, "cpu").name == name
    with pytest.raises(ValueError, match="attention_backend must be one of torch, sdpa, triton"):
        WorkerConfig(attention_backend="flash")


def test_forward_rejects_position_past_context(tiny_path: Path) -> None:
    runner = make_runner(str(tiny_path), device="cpu", num_blocks=8, block_size=4, attention_backend="torch")
    tables = np.arange(8, dtype=np.int32).reshape(1, 8)
    one = np.array([1], np.int32)
    runner.forward(np.array([5], np.int32), np.array([6], np.int32), np.array([0], np.int32), one, [7], tables)
    with pytest.raises(ValueError, match="last query_len"):
        runner.forward([5], np.array([12], np.int32), np.array([0], np.int32), one, [7], tables)


def test_cpu_import_does_not_load_triton() -> None:
    # The triton backend registers lazily: a CPU worker that never asks for it must not import Triton.
    code = (
        "import sys; from stride.workers.runner import ModelRunner; "
        "print(sorted(m for m in ('triton', 'stride.kernels') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "STRIDE_ATTENTION_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def min_cosine(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """Smallest logit cosine over every step and sequence."""
    return min(
        torch.nn.functional.cosine_similarity(g[r], w[r], dim=0).item()
        for g, w in zip(got, want, strict=True)
        for r in range(len(w))
    )


def run_worker(
    path: str, backend: str, dtype: str, steps: Steps, shifts: tuple[int, ...] = (0,), nudge: bool = False
) -> list[Any]:
    """The schedule's float64 logits on a fresh runner, once per context shift; the runner is freed after.

    ``nudge`` moves one element of one prompt token's embedding by one unit in the last place: the smallest
    change a 16-bit run can see, to measure how much this network amplifies a difference."""
    runner = make_runner(path, device="cuda", dtype=dtype, num_blocks=2048, attention_backend=backend)
    if nudge:
        row = runner.model.embed_tokens.weight.data[int(steps.prompts[0][5])]
        assert row.element_size() == 2
        row[7:8].view(torch.int16).add_(1)
    out = [[x.double().cpu() for x in steps.run(runner, context_shift=s)] for s in shifts]
    del runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def checkpoint_8b_steps() -> Steps:
    steps = Steps(2048, 16, 128256, seed=1)
    steps.prompts = [np.random.default_rng(2).integers(0, 128000, n) for n in (700, 1500, 300)]
    steps.schedule = [[(0, 700), (1, 1000)], [(0, 1), (1, 500)], [(0, 1), (1, 1), (2, 300)]]
    steps.schedule += [[(0, 1), (1, 1), (2, 1)]] * 3
    steps.tables = np.random.default_rng(3).permutation(2048)[: 3 * 120].astype(np.int32).reshape(3, 120)
    return steps


@pytest.mark.gpu
@pytest.mark.slow
@gpu
@torch.inference_mode()
def test_triton_worker_equals_reference_8b_shaped(tmp_path: Path) -> None:
    """8B shapes (hidden 4096, GQA 32/8, head_dim 128, vocab 128256), random weights, 2 and 8 of the 32 layers.

    Both backends compute attention as float32 maths on the same cached K/V and round once (torch: SDPA on
    float32 upcasts; kernels: float32 scores, P carried as bf16 hi + lo in P@V), and the fused layers round
    where transformers rounds, so two bf16 workers differ only where a float32 result lies within its
    summation-order noise of a bf16 rounding boundary. This random network then amplifies any such difference
    with depth. Measured on an H200 (2026-11-30), 1 - cosine between the bf16 workers vs. between the torch
    bf16 worker and itself with ONE embedding element moved by one ulp: 1 layer 1.7e-5 / 1.5e-5, 2 layers
    4.1e-5 / 3.7e-5, 4 layers 9.9e-5 / 8.6e-5, 8 layers 2.4e-4 / 2.1e-4. So the issue's bound (cosine >= 0.9999
    in bf16) is asserted where a one-ulp change does not already break it, at 2 layers; at 8 layers the bf16
    workers must be no further apart than 1.5x the one-ulp nudge moves the reference. float32 (8 layers): the
    kernels equal the reference (cosine >= 0.99999). Negative control everywhere: every decode moved 250
    positions back (the last sequence then sees ~53 keys) fails each bound.
    """
    steps = checkpoint_8b_steps()
    shifted = (0, 250)
    path2 = str(make_checkpoint("llama-3.1-8b", tmp_path / "l2", torch.bfloat16, num_layers=2, device="cuda"))
    (ref16_2,) = run_worker(path2, "torch", "bfloat16", steps)
    tri16_2, wrong16_2 = run_worker(path2, "triton", "bfloat16", steps, shifts=shifted)
    path = str(make_checkpoint("llama-3.1-8b", tmp_path / "l8", torch.bfloat16, num_layers=8, device="cuda"))
    (ref32,) = run_worker(path, "torch", "float32", steps)
    tri32, wrong32 = run_worker(path, "triton", "float32", steps, shifts=shifted)
    (ref16,) = run_worker(path, "torch", "bfloat16", steps)
    (nudged16,) = run_worker(path, "torch", "bfloat16", steps, nudge=True)
    tri16, wrong16 = run_worker(path, "triton", "bfloat16", steps, shifts=shifted)
    figures = {
        "2 layers triton16~torch16": min_cosine(tri16_2, ref16_2),
        "2 layers wrong16~torch16": min_cosine(wrong16_2, ref16_2),
        "triton32~torch32": min_cosine(tri32, ref32),
        "wrong32~torch32": min_cosine(wrong32, ref32),
        "triton16~torch16": min_cosine(tri16, ref16),
        "nudged16~torch16": min_cosine(nudged16, ref16),
        "wrong16~torch16": min_cosine(wrong16, ref16),
    }
    print({k: f"{v:.6f}" for k, v in figures.items()})
    assert figures["2 layers triton16~torch16"] >= 0.9999
    assert figures["2 layers wrong16~torch16"] < 0.9999
    assert figures["triton32~torch32"] >= 0.99999
    assert figures["wrong32~torch32"] < 0.99999
    one_ulp = 1 - figures["nudged16~torch16"]
    assert 0 < one_ulp < 1e-3
    assert 1 - figures["triton16~torch16"] <= 1.5 * one_ulp
    assert 1 - figures["wrong16~torch16"] > 1.5 * one_ulp
