"""Benchmark the Triton kernels on a CUDA GPU against the copy bandwidth and bf16 matmul rate of the same run.

Prints a table per kernel and writes every figure to --json. Not a test: nothing here asserts on time.
Each kernel is autotuned (gate on fresh random inputs, Pareto choice) over a reduced space first; the
chosen configs land in the STRIDE_AUTOTUNE_CACHE file. Small shapes cycle through several disjoint
input sets of at least --rotate-mb together, so the figures are HBM, not L2, figures.

    PYTHONPATH=. python3 scripts/bench_kernels.py --json bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
import triton.testing

from stride.kernels import autotune as at
from stride.kernels import autotune_specs as specs
from stride.kernels import paged_common as pc
from stride.kernels import paged_decode as pd
from stride.kernels import paged_extend as pe
from stride.kernels import rmsnorm as rn
from stride.kernels import w4a16 as wq
from stride.kernels import w4a16_format as w4f
from stride.kernels import w4a16_policy as w4p
from stride.kernels.common import set_pdl
from stride.kernels.silu_mul import silu_mul
from stride.workers.kernel_configs import default_cache_path

CUDA = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16  # Llama-3.1-8B
GEMM_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOLLM2_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""SmolLM2-135M's projections (N, K): hidden 576, 9 query and 3 KV heads of 64, intermediate 1536."""


def bench_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_over(fn: Callable[[Any], object], items: list) -> float:
    """Median ms of ``fn(item)``, taking the items in turn (several disjoint sets defeat the L2)."""
    counter = itertools.count()
    return bench_ms(lambda: fn(items[next(counter) % len(items)]))


def graph_over(fn: Callable[[Any], object], items: list, calls: int = 24) -> float:
    """Like :func:`bench_over`, but ``calls`` calls captured in one CUDA graph: no Python launch cost."""
    for item in items[:2]:
        fn(item)  # compile, allocate lazily-made buffers outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(items[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(max(calls, len(items))):
            fn(items[i % len(items)])
    return bench_ms(graph.replay) / max(calls, len(items))


def copies(make: Callable[[int], Any], nbytes: int, rotate_bytes: int) -> list:
    return [make(i) for i in range(max(1, math.ceil(rotate_bytes / nbytes)))]


def ceilings(results: dict) -> None:
    src = torch.randn(2**29, device=CUDA, dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    results["copy_tb_s"] = 2 * src.numel() * 2 / ms / 1e9
    a, b = (torch.randn(8192, 8192, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
    ms = bench_ms(lambda: a @ b)
    results["matmul_tflop_s"] = 2 * 8192**3 / ms / 1e9
    print(f"copy {results['copy_tb_s']:.2f} TB/s (read+write), "
          f"bf16 matmul {results['matmul_tflop_s']:.0f} TFLOP/s")


def decode_sets(batch: int, ctx: int, rotate_bytes: int, gen: torch.Generator, fp8: bool = False) -> list[dict]:
    """Disjoint problems over one shuffled block pool, every sequence at exactly ``ctx`` tokens; with ``fp8`` the
    caches in 8 bits as the worker stores them (V keys-inner)."""
    per_set = batch * ctx * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2)
    num_sets = max(1, math.ceil(rotate_bytes / per_set))
    nb = ctx // PAGE
    pool = specs.make_paged_problem([ctx] * (batch * num_sets), [1] * (batch * num_sets), HEADS, KV_HEADS,
                                    HEAD_DIM, PAGE, torch.bfloat16, gen, CUDA)
    if fp8:
        pool["k_cache"] = pool["k_cache"].to(pc.FP8_CACHE)
        pool["v_cache"] = pc.keys_inner_copy(pool["v_cache"].to(pc.FP8_CACHE))
    sets = []
    for i in range(num_sets):
        rows = slice(i * batch, (i + 1) * batch)
        sets.append({**pool, "q": pool["q"][rows], "context_lens": pool["context_lens"][rows],
                     "block_tables": pool["block_tables"][rows, :nb].contiguous(), "max_context_len": ctx})
    return sets


def bench_decode(results: dict, cache: at.AutotuneCache, rotate_bytes: int, tune: bool,
                 shapes: list[tuple[int, int]] | None = None, wide: bool = False, fp8: bool = False) -> None:
    block_ns, warps = ((32, 64, 128), (4, 8)) if wide else ((32, 64), (4,))
    space = lambda s: [pd.DecodeConfig(bn, part, w, st) for bn in block_ns for w in warps  # noqa: E731
                       for st in (2, 3) for part in (0, 256, 512, 1024) if part < s.context_len]
    spec = dataclasses.replace(specs.PAGED_DECODE, space=space)
    gen = torch.Generator().manual_seed(0)
    rows = []
    tune = tune and not fp8  # the tuner's problems are 16-bit caches
    print(f"\npaged decode attention, {'8-bit caches (V keys-inner)' if fp8 else 'bf16'}, 32 q / 8 kv heads, "
          "head_dim 128, page 16 (bytes = K+V read)")
    print("(default: plain launches; tuned and TB/s: CUDA-graph replay)")
    print(f"{'batch':>5} {'ctx':>6} {'default ms':>10} {'TB/s':>6} {'tuned ms':>9} {'TB/s':>6} {'%copy':>6}"
          "  config")
    for batch, ctx in shapes or list(itertools.product((1, 16, 64), (1024, 4096, 16384))):
        sets = decode_sets(batch, ctx, rotate_bytes, gen, fp8)
        nbytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2)
        shape = specs.DecodeShape(batch, HEADS, KV_HEADS, HEAD_DIM, PAGE, ctx, torch.bfloat16)
        default_cfg = pd.default_decode_config(batch, KV_HEADS, ctx, sets[0]["k_cache"].dtype,
                                               pc.is_keys_inner(sets[0]["v_cache"]))
        ms_default = bench_over(partial(specs.PAGED_DECODE.run, default_cfg), sets)
        # The tuner times under CUDA graphs, so compare the default the same way.
        ms_default_graph = graph_over(partial(specs.PAGED_DECODE.run, default_cfg), sets)
        row = {"batch": batch, "ctx": ctx, "bytes": nbytes, "default_ms": ms_default,
               "default_graph_ms": ms_default_graph, "default_config": dataclasses.asdict(default_cfg)}
        if tune:
            t0 = time.time()
            res = at.tune_and_cache(spec, shape, CUDA, cache, timer=at.cuda_graph_timer, bench_problems=sets)
            row.update(tuned_ms=res.chosen.latency_ms, rejected=len(res.rejected), front=len(res.front),
                       tuned_config=dataclasses.asdict(res.chosen.candidate.config), tune_s=time.time() - t0)
        best = min(ms_default_graph, row.get("tuned_ms", math.inf))
        row["tb_s"] = nbytes / best / 1e9
        row["pct_copy"] = 100 * row["tb_s"] / results["copy_tb_s"]
        rows.append(row)
        cfg = row.get("tuned_config", row["default_config"])
        print(f"{batch:>5} {ctx:>6} {ms_default:>10.4f} {nbytes / ms_default / 1e9:>6.2f} "
              f"{row.get('tuned_ms', float('nan')):>9.4f} {row['tb_s']:>6.2f} {row['pct_copy']:>5.0f}%"
              f"  {cfg}")
    results["decode"] = rows


def bench_extend(results: dict, cache: at.AutotuneCache, rotate_bytes: int, tune: bool) -> None:
    """Prefill (extend) attention, causal, at chunk x context shapes: TFLOP/s against the matmul rate, for the
    default config, the tuned one, and (to price the hi/lo P@V) the default with P rounded to bf16 first."""
    gen = torch.Generator().manual_seed(2)
    rows = []
    print("\npaged extend (prefill) attention, bf16, 32 q / 8 kv heads, head_dim 128, page 16 (graphs; "
          "FLOPs = 4 * d * heads * visible keys)")
    print(f"{'seqs':>4} {'chunk':>5} {'ctx':>6} {'default us':>10} {'TF/s':>6} {'tuned us':>9} {'TF/s':>6} "
          f"{'P->bf16 us':>10}  tuned config")
    for seqs, chunk, ctx in ((1, 512, 512), (1, 2048, 2048), (4, 512, 4096), (1, 2048, 16384), (4, 2048, 2048)):
        shape = specs.ExtendShape(seqs, HEADS, KV_HEADS, HEAD_DIM, PAGE, chunk, ctx, torch.bfloat16)
        per_set = seqs * (ctx * KV_HEADS * 2 + chunk * HEADS * 2) * HEAD_DIM * 2
        sets = []
        for _ in range(max(1, min(16, rotate_bytes // per_set))):
            sets.append(specs.make_paged_problem([ctx] * seqs, [chunk] * seqs, HEADS, KV_HEADS, HEAD_DIM, PAGE,
                                                 torch.bfloat16, gen, CUDA))
        flops = 4 * HEAD_DIM * HEADS * seqs * (chunk * (ctx - chunk) + chunk * (chunk + 1) // 2)
        default_cfg = pe.ExtendConfig()
        ms = graph_over(partial(specs.PAGED_EXTEND.run, default_cfg), sets)
        pc.ROUND_P_BEFORE_PV = True  # one bf16 P@V instead of hi + lo: what the exact rounding costs
        try:
            ms_rounded = graph_over(partial(specs.PAGED_EXTEND.run, default_cfg), sets)
        finally:
            pc.ROUND_P_BEFORE_PV = False
        row = {"seqs": seqs, "chunk": chunk, "ctx": ctx, "flops": flops, "default_ms": ms,
               "default_tflop_s": flops / ms / 1e9, "p_rounded_ms": ms_rounded,
               "default_config": dataclasses.asdict(default_cfg)}
        if tune:
            res = at.tune_and_cache(specs.PAGED_EXTEND, shape, CUDA, cache, timer=at.cuda_graph_timer,
                                    bench_problems=sets)
            row.update(tuned_ms=res.chosen.latency_ms, tuned_tflop_s=flops / res.chosen.latency_ms / 1e9,
                       rejected=len(res.rejected), tuned_config=dataclasses.asdict(res.chosen.candidate.config))
        rows.append(row)
        print(f"{seqs:>4} {chunk:>5} {ctx:>6} {ms * 1e3:>10.1f} {flops / ms / 1e9:>6.0f} "
              f"{row.get('tuned_ms', math.nan) * 1e3:>9.1f} {row.get('tuned_tflop_s', math.nan):>6.0f} "
              f"{ms_rounded * 1e3:>10.1f}  {row.get('tuned_config', '')}")
    results["extend"] = rows


def _w4_operands(n: int, k: int, rotate_bytes: int,
                 group: int = 32) -> tuple[int, list[w4f.W4A16Weight], list[torch.Tensor]]:
    """Bytes of one packed (N, K) weight, and disjoint 4-bit and bf16 copies of such weights to cycle through."""
    w4_bytes = n * k // 2 + 2 * (k // group) * n * 2
    ws = copies(lambda i: w4f.random_weight(n, k, group, device=CUDA, seed=i), w4_bytes, rotate_bytes)
    wbf = copies(lambda i: torch.randn(n, k, device=CUDA, dtype=torch.bfloat16) * 0.02, n * k * 2, rotate_bytes)
    return w4_bytes, ws, wbf


def _w4_run(x: torch.Tensor, cfg: w4p.W4A16Config, w: w4f.W4A16Weight) -> torch.Tensor:
    return wq.w4a16_matmul(x, w, cfg, dequant=False)


def bench_w4a16(results: dict, cache: at.AutotuneCache, rotate_bytes: int, tune: bool,
                batches: tuple[int, ...] = (1, 16, 2, 4, 8), group: int = 32) -> None:
    """W4A16 against bf16 ``F.linear`` at decode shapes, both timed as CUDA-graph replays (as the worker runs
    decode) and as plain launches; W4A16 in graphs both with and without programmatic dependent launch (the
    graph's calls then overlap, as the worker's kernels do; cuBLAS launches plainly either way). M=1 and M=16
    are autotuned through the gate (the chosen configs land in the cache); M=2, 4, 8 take the faster of those
    two choices and the launcher's default (chosen without PDL). ``group``: inputs per scale and min (32: GGUF's
    Q4_0/Q4_1; 128: ``--quantize w4a16``, GPTQ's and AWQ's usual size)."""
    rows = []
    print(f"\nW4A16 GEMM (group {group}, fp16 scales+mins, {0.5 + 4 / group:.3f} B/weight) vs bf16 F.linear, "
          "Llama-3.1-8B projections")
    print(f"{'proj':>8} {'M':>3} {'bf16 g':>7} {'w4 g':>7} {'x g':>6} {'w4 pdl':>7} {'x pdl':>6} {'bf16':>7} "
          f"{'w4':>7} {'x':>6} {'w4 TB/s':>7}  config (graph timings in us; pdl: W4A16 calls chained by PDL)")
    for name, (n, k) in GEMM_SHAPES.items():
        w4_bytes, ws, wbf = _w4_operands(n, k, rotate_bytes, group)
        tuned: dict[int, w4p.W4A16Config] = {}
        for m in batches:
            x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
            if tune and m in (1, 16):
                problems = [{"x": x, "w": w} for w in ws]
                res = at.tune_and_cache(specs.W4A16, specs.GemmShape(m, n, k, group), CUDA, cache,
                                        timer=at.cuda_graph_timer, bench_problems=problems)
                tuned[m] = res.chosen.candidate.config
            options = {w4p.default_config(m, n, k, group), *tuned.values()}
            timed = sorted((graph_over(partial(_w4_run, x, c), ws), i, c) for i, c in enumerate(options))
            w4_g, _, cfg = timed[0]
            set_pdl(True)
            w4_pdl = graph_over(partial(_w4_run, x, cfg), ws)
            set_pdl(False)
            bf_g = graph_over(partial(F.linear, x), wbf)
            bf, w4 = bench_over(partial(F.linear, x), wbf), bench_over(partial(_w4_run, x, cfg), ws)
            row = {"proj": name, "n": n, "k": k, "m": m, "group": group, "bf16_graph_ms": bf_g, "w4_graph_ms": w4_g,
                   "speedup_graph": bf_g / w4_g, "w4_graph_pdl_ms": w4_pdl, "speedup_graph_pdl": bf_g / w4_pdl,
                   "bf16_ms": bf, "w4_ms": w4, "speedup": bf / w4,
                   "w4_tb_s": w4_bytes / w4_g / 1e9, "config": dataclasses.asdict(cfg)}
            rows.append(row)
            print(f"{name:>8} {m:>3} {bf_g * 1e3:>7.1f} {w4_g * 1e3:>7.1f} {bf_g / w4_g:>5.2f}x "
                  f"{w4_pdl * 1e3:>7.1f} {bf_g / w4_pdl:>5.2f}x {bf * 1e3:>7.1f} "
                  f"{w4 * 1e3:>7.1f} {bf / w4:>5.2f}x {row['w4_tb_s']:>7.2f}  {'gemv' if cfg.gemv else 'tile'} "
                  f"bm{cfg.block_m} bn{cfg.block_n} bk{cfg.block_k} sk{cfg.split_k} w{cfg.num_warps} "
                  f"st{cfg.num_stages}{' scales-first' if cfg.scales_first else ''}")
    for m in sorted(batches):
        per_m = [r for r in rows if r["m"] == m]
        total = sum(r["bf16_graph_ms"] for r in per_m) / sum(r["w4_graph_ms"] for r in per_m)
        pdl = sum(r["bf16_graph_ms"] for r in per_m) / sum(r["w4_graph_pdl_ms"] for r in per_m)
        results[f"w4a16_g{group}_layer_speedup_graph_m{m}"] = total
        results[f"w4a16_g{group}_layer_speedup_graph_pdl_m{m}"] = pdl
        print(f"one layer's four projections at M={m} (graphs): {total:.2f}x faster than bf16, "
              f"{pdl:.2f}x with PDL (group {group})")
    results.setdefault("w4a16", []).extend(rows)


def bench_w4a16_rows(results: dict, cache: at.AutotuneCache, rotate_bytes: int, tune: bool,
                     rows: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 2048),
                     shapes: dict[str, tuple[int, int]] = GEMM_SHAPES, label: str = "w4a16_rows") -> None:
    """W4A16 at many rows: the 4-bit tile kernel (launcher default) against expanding W into the scratch matrix
    and multiplying with cuBLAS (what ``w4a16_matmul`` does from ``DEQUANT_MIN_ROWS``), and bf16 ``F.linear``;
    graphs, each path's error against the float32 reference. No tuning."""
    out = []
    print("\nW4A16 by rows: 4-bit tiles vs expand + cuBLAS vs bf16 F.linear (graphs, us; x = bf16 / path)")
    print(f"{'proj':>8} {'M':>5} {'bf16':>8} {'tiles':>8} {'x':>6} {'expand':>8} {'x':>6}  rel. error tiles / expand")
    totals: dict[int, list[float]] = {}
    for name, (n, k) in shapes.items():
        _, ws, wbf = _w4_operands(n, k, rotate_bytes)
        for m in rows:
            x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
            ref = w4f.w4a16_reference(x, ws[0]).float()
            err = [((wq.w4a16_matmul(x, ws[0], dequant=d).float() - ref).norm() / ref.norm()).item()
                   for d in (False, True)]
            calls = 24 if m <= 256 else 6
            bf = graph_over(partial(F.linear, x), wbf, calls)
            tiles = graph_over(lambda w, x=x: wq.w4a16_matmul(x, w, dequant=False), ws, calls)
            expand = graph_over(lambda w, x=x: wq.w4a16_matmul(x, w, dequant=True), ws, calls)
            t = totals.setdefault(m, [0.0, 0.0, 0.0])
            t[0], t[1], t[2] = t[0] + bf, t[1] + tiles, t[2] + expand
            out.append({"proj": name, "m": m, "bf16_ms": bf, "tiles_ms": tiles, "expand_ms": expand,
                        "tiles_rel_err": err[0], "expand_rel_err": err[1]})
            print(f"{name:>8} {m:>5} {bf * 1e3:>8.1f} {tiles * 1e3:>8.1f} {bf / tiles:>5.2f}x {expand * 1e3:>8.1f} "
                  f"{bf / expand:>5.2f}x  {err[0]:.1e} / {err[1]:.1e}")
        del ws, wbf
        torch.cuda.empty_cache()
    for m, (bf, tiles, expand) in totals.items():
        print(f"   layer {m:>5} {bf * 1e3:>8.1f} {tiles * 1e3:>8.1f} {bf / tiles:>5.2f}x {expand * 1e3:>8.1f} "
              f"{bf / expand:>5.2f}x")
    results[label] = out


def bench_rows_kernel(results: dict, cache: at.AutotuneCache, rotate_bytes: int, tune: bool) -> None:
    hidden, inter = 4096, 14336
    rows = []
    print("\nRMSNorm + residual (bf16, hidden 4096; bytes = x, residual in; out, h out), "
          "SiLU-mul (inter 14336)")
    print(f"{'kernel':>8} {'rows':>6} {'ms':>8} {'TB/s':>6} {'%copy':>6}")
    gen = torch.Generator().manual_seed(1)
    tuned_cfg = None
    for num_rows in (1, 64, 4096, 16384):
        shape = specs.NormShape(num_rows, hidden)
        nbytes = 4 * num_rows * hidden * 2
        sets = copies(lambda i, s=shape: specs.RMSNORM.make_problem(s, gen, CUDA), nbytes, rotate_bytes)
        if tune and num_rows == 16384:
            tuned_cfg = at.tune_and_cache(specs.RMSNORM, shape, CUDA, cache, timer=at.cuda_graph_timer,
                                          bench_problems=sets).chosen.candidate.config
        cfg = tuned_cfg if num_rows >= 4096 and tuned_cfg else rn.default_config(hidden)
        ms = bench_over(partial(specs.RMSNORM.run, cfg), sets)
        rows.append({"kernel": "rmsnorm", "rows": num_rows, "ms": ms, "tb_s": nbytes / ms / 1e9,
                     "config": dataclasses.asdict(cfg)})
    for num_rows in (1, 64, 4096):
        nbytes = 3 * num_rows * inter * 2
        xs = copies(lambda i, r=num_rows: torch.randn(r, 2 * inter, device=CUDA, dtype=torch.bfloat16),
                    nbytes, rotate_bytes)
        ms = bench_over(silu_mul, xs)
        rows.append({"kernel": "silu_mul", "rows": num_rows, "ms": ms, "tb_s": nbytes / ms / 1e9})
    for r in rows:
        r["pct_copy"] = 100 * r["tb_s"] / results["copy_tb_s"]
        print(f"{r['kernel']:>8} {r['rows']:>6} {r['ms']:>8.4f} {r['tb_s']:>6.2f} {r['pct_copy']:>5.0f}%")
    results["rows_kernels"] = rows


def _each_group(bench: Callable[..., None], groups: tuple[int, ...], *args: Any) -> None:
    for group in groups:
        bench(*args, group=group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench_kernels.json")
    parser.add_argument("--parts", default="decode,extend,w4a16,rows",
                        help="comma-separated: decode, extend, w4a16, rows, w4rows (W4A16 tiles vs expansion by rows, "
                             "Llama-3.1-8B shapes), w4rows-smollm2 (the same at SmolLM2-135M's shapes)")
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--rotate-mb", type=int, default=512)
    parser.add_argument("--decode-shapes", default="", help="e.g. 16x4096,64x4096 (default: the 3x3 grid)")
    parser.add_argument("--decode-wide", action="store_true", help="tune over block_n 128 and 8 warps too")
    parser.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp8"),
                        help="decode over 8-bit caches as the worker stores them (no tuning)")
    parser.add_argument("--w4a16-m", default="1,16,2,4,8", help="W4A16 batch rows to time")
    parser.add_argument("--w4a16-groups", default="32,128",
                        help="W4A16 group sizes to time (32: GGUF Q4_0/Q4_1; 128: --quantize w4a16)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench_kernels.py needs a CUDA GPU"
    results: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    print(results)
    ceilings(results)
    cache = at.AutotuneCache(default_cache_path())
    rotate = args.rotate_mb * 2**20
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.decode_shapes.split(",") if s]
    parts = {"decode": partial(bench_decode, shapes=shapes or None, wide=args.decode_wide, fp8=args.kv_dtype == "fp8"),
             "extend": bench_extend, "rows": bench_rows_kernel, "w4rows": bench_w4a16_rows,
             "w4rows-smollm2": partial(bench_w4a16_rows, rows=(8, 16, 17, 24, 32, 64, 128, 512, 2048),
                                       shapes=SMOLLM2_SHAPES, label="w4a16_rows_smollm2"),
             "w4a16": partial(_each_group, partial(bench_w4a16, batches=tuple(int(m) for m in args.w4a16_m.split(","))),
                              tuple(int(g) for g in args.w4a16_groups.split(",")))}
    for part in args.parts.split(","):
        t0 = time.time()
        parts[part](results, cache, rotate, not args.no_tune)
        print(f"[{part}: {time.time() - t0:.0f} s]")
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"autotune cache: {cache.path} ({len(cache.entries)} entries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
