"""``stride plan``: the catalog and example deployments, or one deployment's per-rank plan.

Exit status: 0 when the deployment fits, 1 when the planner refuses it, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from stride.config import SchedulerConfig
from stride.planner.formats import KV_DTYPE_BYTES, WEIGHT_FORMAT_NAMES, weight_format
from stride.planner.geometry import CATALOG, load_geometry
from stride.planner.hardware import GPUS, GiB, get_gpu
from stride.planner.parallel import Parallelism
from stride.planner.plan import Deployment, Plan, plan

KiB = 1 << 10

# (model, gpu, tp, pp, ep, weights): shown when `stride plan` runs without --model
EXAMPLES: tuple[tuple[str, str, int, int, int, str], ...] = (
    ("smollm2-135m", "L40S-48GB", 1, 1, 1, "gguf-q4_1"),
    ("llama-3.1-8b", "H100-SXM-80GB", 1, 1, 1, "bf16"),
    ("llama-3.1-70b", "H100-SXM-80GB", 1, 1, 1, "bf16"),
    ("llama-3.1-70b", "H100-SXM-80GB", 1, 1, 1, "w4a16"),
    ("llama-3.1-70b", "H100-SXM-80GB", 4, 1, 1, "bf16"),
    ("llama-3.1-405b", "H100-SXM-80GB", 8, 1, 1, "bf16"),
    ("llama-3.1-405b", "H200-141GB", 8, 1, 1, "bf16"),
    ("mixtral-8x7b", "H100-SXM-80GB", 2, 1, 1, "bf16"),
    ("mixtral-8x22b", "H100-SXM-80GB", 8, 1, 8, "bf16"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=f"catalog name ({', '.join(CATALOG)}), GGUF file, config.json or "
                        "checkpoint directory; without it, print the catalog and example deployments")
    parser.add_argument("--gpu", help=f"GPU name: {', '.join(GPUS)}")
    parser.add_argument("--gpu-mem-gib", type=float,
                        help="device memory in GiB, for a GPU not in the catalog")
    parser.add_argument("--tp", type=int, default=Parallelism.tp, help="tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=Parallelism.pp, help="pipeline-parallel degree")
    parser.add_argument("--ep", type=int, default=Parallelism.ep, help="expert-parallel degree (MoE; must divide --tp)")
    parser.add_argument("--weights", default=Deployment.weights, choices=WEIGHT_FORMAT_NAMES, help="weight format")
    parser.add_argument("--group-size", type=int, default=Deployment.group_size, help="w4a16 quantization group")
    parser.add_argument("--kv-dtype", default=Deployment.kv_dtype, choices=tuple(KV_DTYPE_BYTES), help="KV cache dtype")
    parser.add_argument("--block-size", type=int, default=Deployment.block_size, help="tokens per KV block")
    parser.add_argument("--gpu-memory-utilization", type=float, default=Deployment.gpu_memory_utilization,
                        help="share of device memory for weights, activations and KV cache")
    parser.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                        help="token budget of one step (sizes the activation reserve)")
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                        help="most sequences per step (sizes the sampling reserve)")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="one sequence this long must fit (default: min(8192, model context))")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no decode CUDA graphs (as `stride serve --enforce-eager`): no memory reserved for them")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    if not args.model:
        return _print_catalog(args.json)
    try:
        deployment = Deployment(
            model=load_geometry(args.model), gpu=get_gpu(args.gpu, args.gpu_mem_gib),
            parallel=Parallelism(args.tp, args.pp, args.ep), weights=args.weights, group_size=args.group_size,
            kv_dtype=args.kv_dtype, block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, cuda_graphs=not args.enforce_eager)
    except ValueError as e:
        print(f"stride plan: {e}", file=sys.stderr)
        return 2
    result = plan(deployment)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(format_plan(result, deployment))
    return 1 if result.refused else 0


def format_plan(p: Plan, d: Deployment) -> str:
    """The plan for people: GiB for memory, KiB for per-token KV."""
    lines = [f"{p.model} on {p.tp * p.pp} × {p.gpu} (tp={p.tp} pp={p.pp} ep={p.ep}), "
             f"weights {p.weights}, KV {p.kv_dtype}",
             f"  parameters          {p.params_total / 1e9:.2f} B total, "
             f"{p.params_active / 1e9:.2f} B active",
             f"  KV per token        {p.kv_bytes_per_token / KiB:.1f} KiB whole model"
             + (f", {p.kv_bytes_per_token_per_rank / KiB:.1f} KiB per rank" if not p.problems else ""),
             f"  usable per rank     {_gib(p.usable_bytes_per_rank)} "
             f"({d.gpu_memory_utilization:.0%} of {_gib(p.gpu_memory_bytes)})"]
    if not p.problems:
        lines += [
            f"  weights per rank    {_gib(p.weights_bytes_per_rank)} "
            f"(whole model {_gib(p.weights_bytes_total)})",
            f"  activation reserve  {_gib(p.activation_reserve_bytes)} "
            f"({d.max_num_batched_tokens} batched tokens, {d.max_num_seqs} sequences"
            + (", and the 4-bit weights' expansion scratch)" if weight_format(d.weights, d.group_size).bits == 4
               else ")"),
            f"  decode graphs       {_gib(p.graph_reserve_bytes)}"
            + ("" if p.graph_reserve_bytes else " (eager decode)" if not d.cuda_graphs else " (MoE: eager decode)"),
            f"  KV cache per rank   {_gib(p.kv_cache_bytes_per_rank)}",
            f"  KV blocks           {p.num_blocks} × {p.block_size} tokens = {p.tokens_total} tokens"]
        for ctx, n in p.concurrency.items():
            lines.append(f"  sequences at {ctx // 1024}k".ljust(22)
                         + (f"{n}" if n is not None else "beyond the model's context"))
    if p.refused:
        lines.append(f"REFUSED: {p.reason}")
    return "\n".join(lines)


def _print_catalog(as_json: bool) -> int:
    models: list[dict[str, Any]] = [
        {"model": g.name, "params_total": g.params_total, "params_active": g.params_active,
         "kv_bytes_per_token": g.kv_bytes_per_token()} for g in CATALOG.values()]
    examples = []
    for model, gpu, tp, pp, ep, weights in EXAMPLES:
        d = Deployment(CATALOG[model], GPUS[gpu], Parallelism(tp, pp, ep), weights=weights)
        examples.append((d, plan(d, suggest=False)))
    if as_json:
        print(json.dumps({"models": models, "gpus": {n: g.memory_bytes for n, g in GPUS.items()},
                          "examples": [p.to_json() for _, p in examples]}, indent=2))
        return 0
    print(f"{'model':<16}{'params total':>14}{'active':>10}{'KV/token (bf16)':>18}")
    for m in models:
        print(f"{m['model']:<16}{m['params_total'] / 1e9:>13.2f}B{m['params_active'] / 1e9:>9.2f}B"
              f"{m['kv_bytes_per_token'] / KiB:>14.1f} KiB")
    print(f"\nGPUs: {', '.join(f'{n} ({_gib(g.memory_bytes)})' for n, g in GPUS.items())}\n")
    print("example deployments (bf16 KV, 16-token blocks, 2048 batched tokens):")
    for _, p in examples:
        where = f"{p.model} {p.weights} on {p.tp * p.pp}×{p.gpu} tp={p.tp} pp={p.pp} ep={p.ep}"
        verdict = (f"refused: weights {_gib(p.weights_bytes_per_rank)}/rank > {_gib(p.usable_bytes_per_rank)}"
                   if p.refused else f"{p.tokens_total} KV tokens, {p.concurrency[4096]} seqs at 4k")
        print(f"  {where:<58} {verdict}")
    print("\ndetail: stride plan --model M --gpu G --tp N [--pp N --ep N --weights F --kv-dtype D] [--json]")
    return 0


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"
