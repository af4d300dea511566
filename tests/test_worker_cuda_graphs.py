"""Decode steps through the graph path (:mod:`stride.workers.cuda_graphs`) compute what the eager path does.

CPU: the same padded static-buffer step, uncaptured, through Triton's interpreter on a random tiny Llama
(float32): bucketing, padding rows, the metadata built inside the step, and the eager fallbacks. GPU (marked
gpu): captured graphs against eager steps, greedy tokens and logits, across batch and context buckets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_worker_triton import Steps, cpu_triton, gpu, make_checkpoint

import kernels  # noqa: F401  (first: without CUDA it turns on Triton's interpreter before Triton loads)
from stride.workers.cuda_graphs import DecodeGraphs, batch_buckets, context_bucket
from stride.workers.runner import ModelRunner

pytest.importorskip("triton")


def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


def test_context_bucket() -> None:
    assert context_bucket(1, 16, 100) == 16  # MIN_CONTEXT = 256 tokens
    assert context_bucket(256, 16, 100) == 16
    assert context_bucket(257, 16, 100) == 32
    assert context_bucket(1000, 16, 40) == 40  # never wider than the block table
    assert context_bucket(300, 48, 100) == 11  # 512 tokens in 48-token blocks, rounded up


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny-llama", tmp_path_factory.mktemp("tiny-llama"), torch.float32)


def decode_step(runner: ModelRunner, tokens: list[int], ctx: list[int], tables: np.ndarray) -> torch.Tensor:
    """One decode step of sequences 0..n-1 (slots = rows of ``tables``) at the given context lengths."""
    n = len(tokens)
    c = np.array(ctx, np.int32)
    return runner.forward(np.array(tokens, np.int32), c - 1, np.arange(n, dtype=np.int32), np.ones(n, np.int32),
                          c, tables)


@torch.inference_mode()
@cpu_triton
def test_graph_path_equals_eager_cpu(tiny_path: Path) -> None:
    graphed = ModelRunner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton")
    eager = ModelRunner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton",
                        cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.num_blocks == eager.num_blocks == 40
    assert graphed.kv_cache.k_caches[0].shape[0] == 41  # the padding block, out of the scheduler's ids
    steps = Steps(40, 4, graphed.args.vocab_size)
    want, got = steps.run(eager), steps.run(graphed)
    # The two decode-only steps (3 sequences, padded to 4) went through one graph; the mixed steps did not.
    assert {key: g.replays for key, g in graphed.graphs._graphs.items()} == {(4, 12): 2}
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape
        err = (g - w).abs().max().item()
        assert err <= 1e-5, f"step {i}: max logit error {err:.3g}"
    # The caches agree too, padding block aside: the padding rows wrote nowhere else.
    for kg, ke in zip(graphed.kv_cache.k_caches, eager.kv_cache.k_caches, strict=True):
        assert torch.allclose(kg[:40], ke, atol=1e-6)
        assert kg[40].abs().sum() > 0  # ... and they did write their own
    # Negative control: decodes one position back move the logits past the tolerance on the graph path too.
    wrong = steps.run(graphed, context_shift=1)
    assert max((g - w).abs().max().item() for g, w in zip(wrong[3:], want[3:], strict=True)) > 1e-2


@torch.inference_mode()
@cpu_triton
def test_padding_rows_cannot_reach_real_blocks_cpu(tiny_path: Path) -> None:
    runner = ModelRunner(str(tiny_path), device="cpu", num_blocks=16, block_size=4, attention_backend="triton")
    rng = np.random.default_rng(1)
    tables = rng.permutation(16)[:12].astype(np.int32).reshape(3, 4)
    prompts = [rng.integers(0, runner.args.vocab_size, n) for n in (7, 5, 9)]
    for i, p in enumerate(prompts):  # prefill eagerly, one sequence per step
        runner.forward(p.astype(np.int32), np.arange(len(p), dtype=np.int32), [i], [len(p)], [len(p)], tables)
    ctx = [8, 6, 10]
    want = decode_step(runner, [3, 4, 5], ctx, tables)
    # Whatever the padding block holds only reaches the padding rows: fill it with NaN.
    pad = runner.graphs.pad_block
    for cache in runner.kv_cache.k_caches + runner.kv_cache.v_caches:
        cache[pad] = float("nan")
    got = decode_step(runner, [3, 4, 5], ctx, tables)
    assert torch.isfinite(got).all() and torch.allclose(got, want, atol=1e-6)
    # Negative control: graphs whose padding block is a block sequence 0 reads (its first) corrupt that
    # sequence: its first key and value are overwritten by the padding row.
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.backend, 4, pad_block=int(tables[0, 0]),
                                 max_batch=4, capture=False)
    bad = decode_step(runner, [3, 4, 5], ctx, tables)
    assert (bad[0] - want[0]).abs().max().item() > 1e-3


@torch.inference_mode()
@cpu_triton
def test_steps_without_a_graph_run_eagerly_cpu(tiny_path: Path) -> None:
    runner = ModelRunner(str(tiny_path), device="cpu", num_blocks=16, block_size=4, attention_backend="triton",
                         max_num_seqs=2)
    assert runner.graphs is not None and runner.graphs.max_batch == 2
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    decode_step(runner, [1, 2], [1, 1], tables)
    assert runner.graphs.num_graphs == 1
    decode_step(runner, [1, 2, 3], [2, 2, 1], tables)  # three sequences: past max_batch, eager
    assert runner.graphs.num_graphs == 1
    # Inputs are checked before either path: a block outside the cache, or the padding block, is refused.
    for bad in (16, runner.graphs.pad_block):
        wrong = tables.copy()
        wrong[1, 0] = bad
        with pytest.raises(ValueError, match="outside 0..15"):
            decode_step(runner, [1, 2], [3, 3], wrong)


@torch.inference_mode()
@gpu
@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(tmp_path: Path) -> None:
    """Greedy decode of 1, 3 and 6 sequences from 250-token prompts across the 256-token context bucket:
    graphs (captured) and eager steps pick the same tokens, with float32 logits within 1e-4."""
    path = make_checkpoint("tiny-llama", tmp_path / "ck", torch.float32)
    runners = {
        graphs: ModelRunner(str(path), device="cuda", dtype="float32", num_blocks=200, block_size=16,
                            attention_backend="triton", cuda_graphs=graphs)
        for graphs in (True, False)
    }
    graphed = runners[True]
    assert graphed.graphs is not None and graphed.graphs.capture
    rng = np.random.default_rng(0)
    for batch in (1, 3, 6):
        tables = rng.permutation(200)[: batch * 20].astype(np.int32).reshape(batch, 20)
        prompts = rng.integers(0, graphed.args.vocab_size, (batch, 250)).astype(np.int32)
        tokens: dict[bool, list[list[int]]] = {}
        logits: dict[bool, list[torch.Tensor]] = {}
        for graphs, runner in runners.items():
            out = runner.forward(prompts.reshape(-1), np.tile(np.arange(250, dtype=np.int32), batch),
                                 np.arange(batch, dtype=np.int32), np.full(batch, 250, np.int32),
                                 np.full(batch, 250, np.int32), tables)
            tokens[graphs], logits[graphs] = [], []
            for i in range(12):  # contexts 251..262: two context buckets
                nxt = out.argmax(-1).tolist()
                tokens[graphs].append(nxt)
                out = decode_step(runner, nxt, [251 + i] * batch, tables)
                logits[graphs].append(out)
        assert tokens[True] == tokens[False]
        err = max((g - e).abs().max().item() for g, e in zip(logits[True], logits[False], strict=True))
        assert err <= 1e-4, f"batch {batch}: max logit error {err:.3g}"
        # Negative control: the same comparison one step out of line fails.
        assert max((g - e).abs().max().item() for g, e in zip(logits[True][1:], logits[False], strict=False)) > 1e-2
    assert graphed.graphs.num_graphs == 6  # buckets 1, 4, 8 x contexts 256, 512
    assert all(g.graph is not None and g.replays > 0 for g in graphed.graphs._graphs.values())


def test_enforce_eager_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import argparse

    from stride.launcher import add_arguments, config_from_args

    monkeypatch.setenv("STRIDE_RUNTIME_ROOT", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--backend", "sim", "--model", "llama-3.1-8b", "--max-model-len", "4096"]
    assert config_from_args(parser.parse_args(base)).worker.cuda_graphs
    assert not config_from_args(parser.parse_args([*base, "--enforce-eager"])).worker.cuda_graphs
