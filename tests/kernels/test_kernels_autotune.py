"""Autotuner: the correctness gate (with its negative controls), the Pareto choice, and the JSON cache."""

import dataclasses
import itertools
import json

import pytest
import torch

from stride.kernels import paged_decode as pd
from stride.kernels import paged_extend as pe
from stride.kernels import rmsnorm as rn
from stride.kernels import w4a16_policy as w4p
from stride.kernels.autotune import AutotuneCache, Candidate, Point, cached_config, choose, gate, pareto_front, tune
from stride.kernels.autotune_specs import (
    PAGED_DECODE,
    PAGED_EXTEND,
    RMSNORM,
    SILU_MUL,
    W4A16,
    DecodeShape,
    ExtendShape,
    GemmShape,
    NormShape,
    SiluShape,
    broken_block_table_stride,
    broken_dropped_scale,
    broken_extend_block_table_stride,
    broken_extend_causal_shift,
    broken_off_by_one_mask,
    broken_silu_mul_swapped,
)
from stride.kernels.silu_mul import SiluMulConfig
from stride.workers.kernel_configs import default_cache_path

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DECODE_SHAPE = DecodeShape(num_seqs=3, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, context_len=40,
                           dtype=torch.float32)
GEMM_SHAPE = GemmShape(m=3, n=64, k=256, dtype=torch.float32)
EXTEND_SHAPE = ExtendShape(num_seqs=2, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, query_len=20,
                           context_len=45, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_accepts_real_decode_configs(dtype):
    shape = dataclasses.replace(DECODE_SHAPE, dtype=dtype)
    for cfg in (pd.DecodeConfig(block_n=16, partition=0), pd.DecodeConfig(block_n=16, partition=16)):
        result = gate(PAGED_DECODE, PAGED_DECODE.candidate(cfg), shape, DEVICE)
        assert result.ok, result.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make_broken", [broken_off_by_one_mask, broken_block_table_stride])
def test_gate_rejects_broken_decode_variants(dtype, make_broken):
    shape = dataclasses.replace(DECODE_SHAPE, dtype=dtype)
    for cfg in (pd.DecodeConfig(block_n=16, partition=0), pd.DecodeConfig(block_n=16, partition=16)):
        result = gate(PAGED_DECODE, make_broken(cfg), shape, DEVICE)
        assert not result.ok


def test_gate_rejects_dropped_scale_and_accepts_real_gemm():
    cfg = w4p.W4A16Config(block_n=32, block_k=128, split_k=2)
    assert gate(W4A16, W4A16.candidate(cfg), GEMM_SHAPE, DEVICE).ok
    assert not gate(W4A16, broken_dropped_scale(cfg), GEMM_SHAPE, DEVICE).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_accepts_real_extend_configs_and_rejects_broken_ones(dtype):
    shape = dataclasses.replace(EXTEND_SHAPE, dtype=dtype)
    for cfg in (pe.ExtendConfig(block_m=16, block_n=16), pe.ExtendConfig(block_m=32, block_n=16)):
        result = gate(PAGED_EXTEND, PAGED_EXTEND.candidate(cfg), shape, DEVICE)
        assert result.ok, result.detail
        for make_broken in (broken_extend_block_table_stride, broken_extend_causal_shift):
            assert not gate(PAGED_EXTEND, make_broken(cfg), shape, DEVICE).ok, make_broken.__name__


def test_gate_accepts_real_silu_mul_and_rejects_swapped_halves():
    shape = SiluShape(num_rows=4, intermediate=300, dtype=torch.float32)
    for cfg in (SiluMulConfig(block=64, num_warps=1), SiluMulConfig(block=256, num_warps=2)):
        assert gate(SILU_MUL, SILU_MUL.candidate(cfg), shape, DEVICE).ok
        assert not gate(SILU_MUL, broken_silu_mul_swapped(cfg), shape, DEVICE).ok


def test_gate_rejects_a_bug_that_only_ragged_shapes_expose():
    # Correct whenever hidden is a multiple of 64, wrong otherwise: only the gate's odd shapes catch it.
    def rounds_hidden_down(p):
        out, h = rn.rmsnorm(p["x"], p["weight"], p["eps"], p["residual"])
        hidden = p["x"].shape[1]
        keep = hidden - hidden % 64
        if keep != hidden:
            out = out.clone()
            out[:, keep:] = 0
        return out, h

    shape = NormShape(num_rows=4, hidden=128, dtype=torch.float32)
    target_only = dataclasses.replace(RMSNORM, gate_shapes=lambda s: [s])
    # Control: at hidden 128 alone the bug is invisible.
    assert gate(target_only, Candidate("bug", rounds_hidden_down), shape, DEVICE).ok
    assert not gate(RMSNORM, Candidate("bug", rounds_hidden_down), shape, DEVICE).ok


def _pt(name, latency, cost):
    return Point(Candidate(name, lambda p: p), latency, cost)


def test_pareto_front_and_choice():
    pts = [_pt("a", 1.0, 100), _pt("b", 1.02, 0), _pt("c", 2.0, 0), _pt("d", 1.5, 50), _pt("e", 0.9, 200)]
    front = pareto_front(pts)
    assert [p.candidate.name for p in front] == ["e", "a", "b"]  # c and d are dominated by b
    assert choose(front, slack=0.05).candidate.name == "e"  # nothing within 5% of 0.9 is cheaper
    assert choose(front, slack=0.15).candidate.name == "b"  # b is within 15% and costs nothing


def test_tune_rejects_controls_chooses_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("STRIDE_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
    spec = dataclasses.replace(
        PAGED_DECODE,
        space=lambda s: [pd.DecodeConfig(block_n=16, partition=0), pd.DecodeConfig(block_n=16, partition=16)])
    fake_ms = itertools.count(1.0)
    timer = lambda fn: (fn(), next(fake_ms))[1]  # noqa: E731 - deterministic stand-in for the CUDA timer
    controls = [broken_off_by_one_mask(), broken_block_table_stride()]
    result = tune(spec, DECODE_SHAPE, DEVICE, timer=timer, extra_candidates=controls, seed=1)
    assert set(result.rejected) == {"broken:off_by_one_mask", "broken:block_table_stride"}
    # Faster and needs no workspace.
    assert result.chosen.candidate.config == pd.DecodeConfig(block_n=16, partition=0)

    cache = AutotuneCache(default_cache_path())  # STRIDE_AUTOTUNE_CACHE, as the worker reads it
    assert cache.path == tmp_path / "tune.json"
    assert cached_config(spec, DECODE_SHAPE, DEVICE, cache) is None
    cache.put(spec, "cpu-interpreter" if DEVICE.type == "cpu" else torch.cuda.get_device_name(DEVICE),
              spec.bucket(DECODE_SHAPE), result.chosen)
    cache.save()
    reloaded = AutotuneCache(default_cache_path())
    assert cached_config(spec, DECODE_SHAPE, DEVICE, reloaded) == pd.DecodeConfig(block_n=16, partition=0)
    # Another shape bucket (longer contexts) is not served the same entry.
    assert cached_config(spec, dataclasses.replace(DECODE_SHAPE, context_len=4000), DEVICE, reloaded) is None
    data = json.loads((tmp_path / "tune.json").read_text())
    assert data["version"] == 1 and len(data["entries"]) == 1


def test_tune_raises_when_nothing_passes():
    spec = dataclasses.replace(W4A16, space=lambda s: [])
    with pytest.raises(RuntimeError):
        tune(spec, GEMM_SHAPE, DEVICE, timer=lambda fn: 1.0, extra_candidates=[broken_dropped_scale()])


def test_spaces_are_non_empty_and_costs_rank_workspace():
    shape = DecodeShape(16, 32, 8, 128, 16, 4096)
    space = PAGED_DECODE.space(shape)
    assert len(space) >= 8
    costs = {PAGED_DECODE.cost(c, shape) for c in space}
    assert 0.0 in costs and max(costs) > 0
    assert W4A16.space(GemmShape(1, 4096, 4096)) and RMSNORM.space(NormShape(8, 4096))
    assert PAGED_EXTEND.space(EXTEND_SHAPE) and SILU_MUL.space(SiluShape(8, 14336))
    assert len({PAGED_EXTEND.bucket(dataclasses.replace(EXTEND_SHAPE, query_len=q)) for q in (20, 200)}) == 2
    assert W4A16.cost(w4p.W4A16Config(split_k=1), GemmShape(1, 64, 256)) == 0
    # The W4A16 tile space follows the launcher's row blocks: 16 up to M=16, 64 above, 128 too above 64; the
    # default config is in the space it would be tuned over.
    for m, blocks in ((16, {16}), (40, {64}), (100, {64, 128})):
        space = W4A16.space(GemmShape(m, 4096, 4096))
        assert {c.block_m for c in space if not c.gemv} == blocks
        assert w4p.default_config(m, 4096, 4096) in space
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):  # Llama-3.1-8B's projections, decode
        for m in (1, 2, 4, 8):
            shape = GemmShape(m, n, k, group_size=128)
            assert w4p.default_config(m, n, k, 128) in W4A16.space(shape), (m, n, k)
    assert RMSNORM.cost(rn.RMSNormConfig(1, 4), NormShape(8, 4096)) > RMSNORM.cost(rn.RMSNormConfig(1, 16),
                                                                                    NormShape(8, 4096))
