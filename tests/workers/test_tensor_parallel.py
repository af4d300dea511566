"""Tensor parallelism on the CPU: the sharding arithmetic by hand, then real ranks under gloo against one rank.

The per-rank modules compute partial results; their sums (row-parallel projections, the vocabulary-parallel
embedding) and concatenations (the output head's vocabulary slices) must be the unsharded computation. Then two
processes joined by torch.distributed run a fixed schedule of mixed steps and must agree with one rank at every
layer and in the logits, in float32; a rank holding a wrong shard must not.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from worker_helpers import exit_then_write, make_checkpoint, tp_rank_main

from stride.model.files import default_model_path
from stride.workers.attention import AttentionContext, AttentionMetadata, TorchPagedAttention
from stride.workers.kv_cache import KVCache
from stride.workers.loader import load_model
from stride.workers.models.layers import Embedding, VocabParallelHead, rope_cos_sin
from stride.workers.parallel import TensorParallel, apply_tensor_parallel, vocab_rows

REL = 1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-tp"), torch.float32)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _attention_ctx(model: torch.nn.Module, tp_size: int, n: int) -> tuple[AttentionContext, torch.Tensor]:
    """One sequence prefilling ``n`` tokens into blocks 0.. of a fresh cache of this rank's heads."""
    cache = KVCache(model.args, 8, 4, "cpu", torch.float32, tp_size)
    pos = torch.arange(n)
    tables = torch.arange(8, dtype=torch.int32)[None, :]
    meta = AttentionMetadata.build(pos, np.array([n]), np.array([n]), tables, 4)
    return AttentionContext(meta, TorchPagedAttention(), cache.k_caches, cache.v_caches), pos


@torch.inference_mode()
def test_shards_of_attention_and_mlp_sum_to_the_whole(tiny: Path) -> None:
    full = load_model(str(tiny))
    shards = [load_model(str(tiny), tp_rank=r, tp_size=2) for r in range(2)]
    x = torch.randn(7, full.args.hidden_size, generator=torch.Generator().manual_seed(0))
    want = full.layers[1].mlp(x)
    assert rel_err(sum(s.layers[1].mlp(x) for s in shards), want) <= REL  # type: ignore[arg-type]
    ctx, pos = _attention_ctx(full, 1, 7)
    cos, sin = rope_cos_sin(full.inv_freq, pos, x.dtype)
    want = full.layers[1].self_attn(x, cos, sin, ctx)
    parts = []
    for s in shards:
        ctx, _ = _attention_ctx(s, 2, 7)
        parts.append(s.layers[1].self_attn(x, cos, sin, ctx))
    assert parts[0].shape == want.shape
    assert rel_err(parts[0] + parts[1], want) <= REL
    # Negative control: one rank's half alone is far from the whole.
    assert rel_err(parts[0], want) > 0.1


@torch.inference_mode()
@pytest.mark.parametrize("tp_size", [2, 3])
def test_vocabulary_parallel_embedding_and_head(tiny: Path, tp_size: int) -> None:
    """320 ids over 3 ranks: 107 rows each, the last rank's final row padding past the vocabulary."""
    full = load_model(str(tiny))
    vocab, dim = full.args.vocab_size, full.args.hidden_size
    embeds, heads = [], []
    for r in range(tp_size):
        e, h = Embedding(vocab, dim, r, tp_size), VocabParallelHead(dim, vocab, r, tp_size)
        e.load_full(full.embed_tokens.weight)
        h.load_full(full.lm_head.weight)
        embeds.append(e)
        heads.append(h)
    rows = vocab_rows(vocab, tp_size)
    assert all(e.weight.shape[0] == rows for e in embeds)
    ids = torch.tensor([0, 1, rows - 1, rows, 2 * rows - 1, vocab - 1])
    want = full.embed_tokens(ids)
    assert torch.equal(sum(e(ids) for e in embeds), want)  # type: ignore[arg-type]
    hidden = torch.randn(5, dim, generator=torch.Generator().manual_seed(1))
    logits = torch.cat([h(hidden) for h in heads], dim=-1)[:, :vocab]
    assert torch.allclose(logits, full.lm_head(hidden), rtol=0, atol=1e-6)
    # Negative control: the slices in the wrong order give other logits.
    swapped = torch.cat([h(hidden) for h in reversed(heads)], dim=-1)[:, :vocab]
    assert not torch.allclose(swapped, full.lm_head(hidden), atol=1e-3)


def test_one_rank_adds_no_collectives(tiny: Path) -> None:
    model = load_model(str(tiny))
    apply_tensor_parallel(model, TensorParallel())
    assert not any(m._forward_hooks for m in model.modules())


def _run_ranks(size: int, model: Path, out: Path, corrupt: bool = False) -> dict:
    init = out / f"rendezvous-{size}-{int(corrupt)}"
    if size == 1:
        tp_rank_main(0, 1, str(init), str(model), str(out), corrupt)
    else:
        mp.spawn(tp_rank_main, args=(size, str(init), str(model), str(out), corrupt), nprocs=size, join=True)
    return torch.load(out / f"tp{size}.pt")


def _min_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return min(float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0))
               for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("preset, size", [("tiny-llama", 2), ("tiny-llama-1kv", 2), ("tiny-mixtral", 2),
                                          ("default", 3)])
def test_ranks_under_gloo_match_one_rank_layer_by_layer(preset: str, size: int, tmp_path: Path) -> None:
    """GQA with 2 KV heads, one per rank (tiny-llama); one KV head, replicated on both ranks (tiny-llama-1kv); a
    mixture of experts, each expert split (tiny-mixtral); the default model, SmolLM2-135M (9 heads, 3 KV heads), on
    three ranks."""
    if preset == "default":
        try:
            model = Path(default_model_path())
        except FileNotFoundError as e:
            pytest.skip(str(e))
    elif preset == "tiny-llama-1kv":
        model = make_checkpoint("tiny-llama", tmp_path / "ck", torch.float32, num_key_value_heads=1)
    else:
        model = make_checkpoint(preset, tmp_path / "ck", torch.float32)
    one = _run_ranks(1, model, tmp_path)
    two = _run_ranks(size, model, tmp_path)
    assert len(two["layers"]) == len(one["layers"]) > 0
    for i, (got, want) in enumerate(zip(two["layers"], one["layers"], strict=True)):
        assert rel_err(got, want) <= 1e-5, f"layer output {i}: {rel_err(got, want):.3g}"
    assert _min_cosine(two["layers"], one["layers"]) >= 0.999999
    for got, want in zip(two["logits"], one["logits"], strict=True):
        assert rel_err(got, want) <= 1e-5
    assert _min_cosine(two["logits"], one["logits"]) >= 0.999999
    # Negative control: rank 1 holding a wrong slice of one projection fails at that first layer already.
    bad = _run_ranks(size, model, tmp_path, corrupt=True)
    assert rel_err(bad["layers"][0], one["layers"][0]) > 1e-2


def test_exit_spawned_rank_ends_a_spawned_rank_and_returns_in_the_caller(tmp_path: Path) -> None:
    """A spawned rank exits at once with status 0; the process that runs a rank itself (the tp=1 reference above)
    goes on: exiting there once ended the whole test run early with status 0."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=exit_then_write, args=(str(tmp_path / "child"),))
    child.start()
    child.join(120)
    assert child.exitcode == 0 and not (tmp_path / "child").exists()
    exit_then_write(str(tmp_path / "caller"))
    assert (tmp_path / "caller").read_text() == "went on"
