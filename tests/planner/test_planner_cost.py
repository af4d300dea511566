"""Step cost model: roofline terms against hand-derived bytes and FLOPs, and its monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stride.planner import CATALOG, GPUS, get_gpu
from stride.planner.cost import StepCost, StepCostModel

LLAMA8 = CATALOG["llama-3.1-8b"]
H100 = GPUS["H100-SXM-80GB"]
EMBED = 128256 * 4096  # the input embedding is a gather: its table is not read per step


def test_decode_bytes_and_flops_by_hand() -> None:
    model = StepCostModel(LLAMA8, H100, overhead_s=0.0)
    cost = model.step_cost(num_tokens=32, num_seqs=32, context_tokens=32 * 1000)
    kv_per_token = 128 * 1024
    assert cost.bytes_moved == 2 * (LLAMA8.params_total - EMBED) + kv_per_token * (32 * 1000 + 32)
    layer_params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    pairs = 32 * (1000 - 0.5)  # one new token per sequence: it sees its 1000 keys (itself included)
    flops = 2 * layer_params * 32 + 2 * 128256 * 4096 * 32 + 4 * 32 * 32 * 128 * pairs
    assert cost.flops == pytest.approx(flops, rel=1e-12)
    assert cost.bound == "memory" and cost.memory_s > 10 * cost.compute_s
    assert model.step_time(32, 32, 32000) == pytest.approx(cost.bytes_moved / 3.35e12)


def test_big_prefill_is_compute_bound() -> None:
    model = StepCostModel(LLAMA8, H100)
    cost = model.step_cost(num_tokens=8192, num_seqs=1, context_tokens=8192)
    assert cost.bound == "compute" and cost.compute_s > 10 * cost.memory_s
    assert cost.time_s == pytest.approx(cost.flops / 989e12 + model.overhead_s)
    # negative control: the same model's single decode is memory-bound
    assert model.step_cost(1, 1, 8192).bound == "memory"


def test_overhead_is_added_once() -> None:
    base = StepCostModel(LLAMA8, H100, overhead_s=0.0).step_time(4, 4, 400)
    assert StepCostModel(LLAMA8, H100, overhead_s=0.002).step_time(4, 4, 400) == pytest.approx(base + 0.002)


@settings(max_examples=60, deadline=None)
@given(seqs=st.integers(1, 64), extra=st.integers(0, 4096), ctx=st.integers(0, 200_000),
       more=st.integers(1, 50_000))
def test_monotonic_in_tokens_and_context(seqs: int, extra: int, ctx: int, more: int) -> None:
    model = StepCostModel(CATALOG["mixtral-8x7b"], H100, tp=2)
    tokens = seqs + extra
    t = model.step_time(tokens, seqs, ctx)
    assert model.step_time(tokens, seqs, ctx + more) >= t
    assert model.step_time(tokens + 1, seqs, ctx + 1) >= t
    before = model.step_cost(tokens, seqs, ctx).bytes_moved
    assert model.step_cost(tokens + 1, seqs, ctx + 1).bytes_moved > before


def test_tp_divides_the_per_rank_work() -> None:
    one = StepCostModel(LLAMA8, H100).step_cost(2048, 4, 16000)
    for tp in (2, 4, 8):
        part = StepCostModel(LLAMA8, H100, tp=tp).step_cost(2048, 4, 16000)
        # everything is split but the replicated norms, so the shares are just over 1/tp
        assert 1 / tp < part.bytes_moved / one.bytes_moved < 1.001 / tp
        assert part.flops == pytest.approx(one.flops / tp, rel=1e-9)


def test_moe_reads_active_experts_for_one_token_and_all_for_many() -> None:
    mixtral = CATALOG["mixtral-8x7b"]
    model = StepCostModel(mixtral, H100, tp=1, overhead_s=0.0)
    embed = 32000 * 4096
    assert model.step_cost(1, 1, 1).bytes_moved == pytest.approx(
        2 * (mixtral.params_active - embed) + 2 * 128 * 1024)
    assert model.experts_touched(1) == pytest.approx(2.0)
    assert model.experts_touched(256) == pytest.approx(8.0)
    many = model.step_cost(256, 256, 256)
    assert many.bytes_moved == pytest.approx(2 * (mixtral.params_total - embed) + 512 * 128 * 1024, rel=1e-9)
    # FLOPs follow the active parameters no matter how many experts are touched
    assert model.step_cost(2, 2, 2).flops / model.step_cost(1, 1, 1).flops == pytest.approx(2.0, rel=1e-6)


def test_decode_roofline_on_h200() -> None:
    # FACTS.md: 16.06 GB of weights at ~4.2 TB/s measured → ≈ 260 tok/s; at the 4.8 TB/s peak, faster
    t = StepCostModel(LLAMA8, GPUS["H200-141GB"], overhead_s=0.0).step_time(1, 1, 1)
    assert 260 < 1 / t < 330


def test_refuses_unknown_rates_and_bad_inputs() -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        StepCostModel(LLAMA8, get_gpu(mem_gib=24))
    with pytest.raises(ValueError, match="not divisible"):
        StepCostModel(LLAMA8, H100, tp=3)
    model = StepCostModel(LLAMA8, H100)
    with pytest.raises(ValueError):
        model.step_time(2, 3, 10)  # more sequences than tokens
    assert isinstance(model.step_cost(1, 1, 0), StepCost)
    assert model.step_time(0, 0, 0) == model.overhead_s  # an empty step
    with pytest.raises(ValueError):
        model.step_time(-1, 0, 0)
