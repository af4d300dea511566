"""Fill the autotune cache for one model's shapes on this GPU (the worker then launches with those configs).

Reads the model's geometry (HF checkpoint directory or GGUF file; a GGUF needs the ``gguf`` package) and tunes,
through ``stride.kernels.autotune.tune_and_cache`` (correctness gate on fresh random inputs, CUDA-graph timing, Pareto
choice), every shape bucket the worker looks up (``stride/workers/kernel_configs.py``):

- paged decode attention for batch x context buckets (--batches x --contexts, contexts past the model's
  context length dropped);
- the W4A16 GEMM for each projection whose GGUF tensors are Q4_0/Q4_1 (the worker keeps exactly those 4-bit),
  at M = --m (decode row counts; buckets are powers of two);
- paged extend (prefill) attention for --chunks new tokens per sequence, each over a fresh prompt and over a
  cached prefix of --contexts (chunked prefill), for --prefill-batches sequences;
- RMSNorm and SiLU-mul at --rows token counts.

The cache is ``--cache``, else ``STRIDE_AUTOTUNE_CACHE``, else ``~/.cache/stride/autotune.json``; entries are
keyed by GPU name, so one file can hold several GPUs. ``--dry-run`` prints the shapes and needs no GPU.

    PYTHONPATH=. python3 scripts/tune_kernels.py --model /path/to/model.gguf \
        [--kernels decode,extend,w4a16,rmsnorm,silu_mul]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from stride.kernels import autotune as at
from stride.kernels import autotune_specs as specs
from stride.model.args import ModelArgs
from stride.model.files import default_model_path, is_gguf
from stride.workers.kernel_configs import default_cache_path

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
W4A16_GROUP = 32  # W4A16Linear's group size (GGUF Q4 blocks)


@dataclass
class TuneShapes:
    """Every shape to tune, per kernel."""

    decode: list[specs.DecodeShape] = field(default_factory=list)
    extend: list[specs.ExtendShape] = field(default_factory=list)
    w4a16: list[specs.GemmShape] = field(default_factory=list)
    rmsnorm: list[specs.NormShape] = field(default_factory=list)
    silu_mul: list[specs.SiluShape] = field(default_factory=list)


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(N, K) of each merged projection of one rank (tensor parallelism 1), as the worker multiplies them."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    return {
        "self_attn.qkv_proj": (q + 2 * kv, args.hidden_size),
        "self_attn.o_proj": (args.hidden_size, q),
        "mlp.gate_up_proj": (2 * args.intermediate_size, args.hidden_size),
        "mlp.down_proj": (args.hidden_size, args.intermediate_size),
    }


def tuning_shapes(
    args: ModelArgs, q4_projections: set[str], dtype: torch.dtype, block_size: int = 16,
    batches: tuple[int, ...] = (1, 16, 64), contexts: tuple[int, ...] = (1024, 4096, 16384),
    ms: tuple[int, ...] = (1, 2, 4, 8, 16), rows: tuple[int, ...] = (1, 16, 64, 256, 1024, 4096),
    chunks: tuple[int, ...] = (128, 512, 2048), prefill_batches: tuple[int, ...] = (1, 4),
) -> TuneShapes:
    """The shapes for ``args``; ``q4_projections`` names the projections kept 4-bit (keys of
    :func:`projection_shapes`). Contexts past the model's context length are dropped (the longest kept)."""
    ctxs = sorted({min(c, args.max_position_embeddings) for c in contexts})
    out = TuneShapes()
    out.decode = [specs.DecodeShape(b, args.num_heads, args.num_kv_heads, args.head_dim, block_size, c, dtype)
                  for b in batches for c in ctxs]
    gemms = {nk for name, nk in projection_shapes(args).items() if name in q4_projections}
    out.w4a16 = [specs.GemmShape(m, n, k, W4A16_GROUP, dtype) for n, k in sorted(gemms) for m in ms]
    out.extend = sorted({specs.ExtendShape(b, args.num_heads, args.num_kv_heads, args.head_dim, block_size, q, c,
                                           dtype)
                         for b in prefill_batches for q in chunks if q <= ctxs[-1]
                         for c in (q, *(c for c in ctxs if c > q))},
                        key=lambda s: (s.num_seqs, s.query_len, s.context_len))
    out.rmsnorm = [specs.NormShape(r, args.hidden_size, dtype) for r in rows]
    out.silu_mul = [specs.SiluShape(r, args.intermediate_size, dtype) for r in rows]
    return out


def read_model(path: str) -> tuple[ModelArgs, set[str]]:
    """The model's args and the projections the worker would keep 4-bit (GGUF Q4_0/Q4_1 in every layer)."""
    from stride.workers import gguf_checkpoint, loader

    if not is_gguf(path):
        return loader.read_model_args(path), set()
    from stride.model.gguf import read_gguf

    reader = read_gguf(path)
    args = gguf_checkpoint.gguf_args(reader)
    packed = set(gguf_checkpoint.w4a16_projections(reader, args).values())  # "layers.N.<projection>"
    kinds = {name.split(".", 2)[2] for name in packed}
    # Tuned per shape, so a projection counts when any layer keeps it 4-bit.
    return args, kinds


def geometry_args(text: str) -> ModelArgs:
    """ModelArgs from ``hidden,heads,kv_heads,head_dim,intermediate,context`` (the rest does not shape kernels)."""
    hidden, heads, kv_heads, head_dim, inter, ctx = (int(v) for v in text.split(","))
    return ModelArgs(vocab_size=1, hidden_size=hidden, intermediate_size=inter, num_layers=1, num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=ctx)


def projection_shapes_names() -> list[str]:
    return ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]


def _bench_problems(spec: at.KernelSpec, shape: Any, nbytes: int, device: torch.device, budget: int) -> list:
    """Enough disjoint problems to keep a small shape's data out of L2 while timing (at most 64)."""
    gen = torch.Generator().manual_seed(0)
    count = max(1, min(64, budget // max(1, nbytes)))
    return [spec.make_problem(shape, gen, device) for _ in range(count)]


def _decode_bytes(s: specs.DecodeShape) -> int:
    return s.num_seqs * s.context_len * s.num_kv_heads * s.head_dim * 2 * s.dtype.itemsize


def _extend_bytes(s: specs.ExtendShape) -> int:
    q = s.num_seqs * s.query_len * s.num_heads * s.head_dim * 2  # queries in, outputs out
    kv = s.num_seqs * s.context_len * s.num_kv_heads * s.head_dim * 2
    return (q + kv) * s.dtype.itemsize


def _tune_all(spec: at.KernelSpec, shapes: list, nbytes: Any, cache: at.AutotuneCache, budget: int) -> None:
    device = torch.device("cuda")
    for shape in shapes:
        t0 = time.time()
        problems = _bench_problems(spec, shape, nbytes(shape), device, budget)
        result = at.tune_and_cache(spec, shape, device, cache, timer=at.cuda_graph_timer, bench_problems=problems)
        chosen = result.chosen
        print(f"{spec.name:>12} {spec.bucket(shape):<44} {chosen.latency_ms * 1e3:9.1f} us  "
              f"{len(result.rejected):3d} rejected  {time.time() - t0:5.1f} s  {chosen.candidate.config}", flush=True)
        del problems
        torch.cuda.empty_cache()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF checkpoint dir or GGUF file (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES), help="the worker's run dtype")
    parser.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    parser.add_argument("--kernels", default="decode,extend,w4a16,rmsnorm,silu_mul")
    parser.add_argument("--batches", default="1,16,64", help="decode batch sizes")
    parser.add_argument("--contexts", default="1024,4096,16384", help="decode context lengths")
    parser.add_argument("--m", default="1,2,4,8,16",
                        help="W4A16 row counts (from 17 rows the worker expands W and calls cuBLAS: nothing to tune)")
    parser.add_argument("--rows", default="1,16,64,256,1024,4096", help="RMSNorm and SiLU-mul row counts")
    parser.add_argument("--chunks", default="128,512,2048", help="prefill chunk lengths (new tokens)")
    parser.add_argument("--prefill-batches", default="1,4", help="sequences per prefill step")
    parser.add_argument("--cache", default="", help="cache file (default: STRIDE_AUTOTUNE_CACHE or ~/.cache/...)")
    parser.add_argument("--rotate-mb", type=int, default=256, help="timing data per shape, to defeat the L2")
    parser.add_argument("--geometry", default="", help="instead of --model: hidden,heads,kv_heads,head_dim,"
                        "intermediate,context (e.g. SmolLM2: 576,9,3,64,1536,8192)")
    parser.add_argument("--q4", action="store_true", help="with --geometry: every projection is GGUF Q4 (4-bit)")
    parser.add_argument("--dry-run", action="store_true", help="print the shapes and exit (no GPU needed)")
    opts = parser.parse_args(argv)
    if opts.geometry:
        path = f"geometry {opts.geometry}"
        args, q4 = geometry_args(opts.geometry), set(projection_shapes_names()) if opts.q4 else set()
    else:
        path = opts.model or default_model_path()
        args, q4 = read_model(path)
    shapes = tuning_shapes(args, q4, _DTYPES[opts.dtype], opts.block_size, _ints(opts.batches),
                           _ints(opts.contexts), _ints(opts.m), _ints(opts.rows), _ints(opts.chunks),
                           _ints(opts.prefill_batches))
    wanted = set(opts.kernels.split(","))
    print(f"{path}: hidden {args.hidden_size}, heads {args.num_heads}/{args.num_kv_heads} x {args.head_dim}, "
          f"intermediate {args.intermediate_size}, 4-bit projections: {sorted(q4) or 'none'}")
    plan = [(specs.PAGED_DECODE, shapes.decode, _decode_bytes, "decode"),
            (specs.PAGED_EXTEND, shapes.extend, _extend_bytes, "extend"),
            (specs.W4A16, shapes.w4a16, lambda s: s.n * s.k // 2, "w4a16"),
            (specs.RMSNORM, shapes.rmsnorm, lambda s: 4 * s.num_rows * s.hidden * s.dtype.itemsize, "rmsnorm"),
            (specs.SILU_MUL, shapes.silu_mul, lambda s: 3 * s.num_rows * s.intermediate * s.dtype.itemsize,
             "silu_mul")]
    plan = [p for p in plan if p[3] in wanted]
    for spec, todo, _, _ in plan:
        print(f"{spec.name}: {len(todo)} shapes: {', '.join(spec.bucket(s) for s in todo)}")
    if opts.dry_run:
        return 0
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA GPU (use --dry-run to list the shapes)")
    cache = at.AutotuneCache(default_cache_path(opts.cache))
    print(f"GPU {at.gpu_name(torch.device('cuda'))}, cache {cache.path}")
    for spec, todo, nbytes, _ in plan:
        _tune_all(spec, todo, nbytes, cache, opts.rotate_mb * 2**20)
    print(f"autotune cache: {cache.path} ({len(cache.entries)} entries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
