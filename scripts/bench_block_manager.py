"""Benchmark (not a test): the block manager's share of one scheduler step.

Each step, with N sequences decoding: append one token to each and schedule it (``append_many`` +
``mark_computed_many``, or the per-sequence verbs with ``--api per-seq``); finish ``--frees`` sequences;
admit as many new prompts of ``--prompt-len`` tokens (``can_allocate`` + ``allocate``, half of them opening
with their tenant's shared system prompt, so a hit); and schedule a prefill chunk of the admitted prompts
(``mark_computed``) with the rest of the token budget, ``--budget`` minus N decode tokens. The remaining
prefill of an admitted prompt is marked outside the timed region: in a real loop it is spread over later
steps, where it costs what the timed chunk costs, since hashing per step is bounded by the budget.

    .venv/bin/python scripts/bench_block_manager.py --seqs 256 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from stride.sched.block_manager import BlockManager

NUM_TENANTS = 8
SYSTEM_LEN = 1024


def run(num_seqs: int, args: argparse.Namespace) -> dict[str, float]:
    rng = np.random.default_rng(0)
    bs = args.block_size
    max_len = args.prompt_len + args.steps + 64
    max_blocks = -(-max_len // bs)
    num_slots = num_seqs + args.frees
    num_blocks = num_slots * max_blocks + 1024
    tables = np.full((num_slots, max_blocks), -1, np.int32)
    bm = BlockManager(num_blocks, bs, tables)
    systems = [rng.integers(0, 50_000, SYSTEM_LEN, dtype=np.int32) for _ in range(NUM_TENANTS)]

    def prompt(length: int, shared: bool, tenant: int) -> np.ndarray | list[int]:
        tail = rng.integers(0, 50_000, length, dtype=np.int32)
        p = np.concatenate([systems[tenant], tail])[:length] if shared else tail
        return p.tolist() if args.prompt_type == "list" else p

    def new_prompt(length: int, shared: bool) -> tuple[str, np.ndarray | list[int]]:
        tenant = int(rng.integers(NUM_TENANTS))
        return f"t{tenant}", prompt(length, shared, tenant)

    def admit(slot: int, tenant: str, p: np.ndarray | list[int]) -> int:
        assert bm.can_allocate(tenant, p)
        return bm.allocate(slot, tenant, p)

    running = list(range(num_seqs))
    spare = list(range(num_seqs, num_slots))
    for slot in running:  # warm state: contexts of 256..3072 tokens, most opening with a system prompt
        n = int(rng.integers(256, 3072))
        admit(slot, *new_prompt(n, shared=bool(rng.random() < 0.75)))
        bm.mark_computed(slot, n)
    chunk = max(args.budget - num_seqs, 0) // max(args.frees, 1)

    times: dict[str, list[float]] = {"decode": [], "free": [], "allocate": [], "step": []}
    for step in range(args.steps + args.warmup):
        ids = rng.integers(0, 50_000, len(running), dtype=np.int32)
        slots = np.array(running, dtype=np.intp)
        victims = rng.choice(len(running), args.frees, replace=False)
        prompts = [new_prompt(args.prompt_len, shared=i % 2 == 0) for i in range(len(spare))]
        t0 = time.perf_counter()
        if args.api == "batch":
            assert bm.num_blocks_to_append(slots) <= bm.num_available_blocks
            bm.append_many(slots, ids)
            bm.mark_computed_many(slots, bm.num_tokens_per_slot[slots])
        else:
            for slot, token in zip(running, ids.tolist(), strict=True):
                assert bm.can_append(slot)
                bm.append(slot, token)
                bm.mark_computed(slot, bm.num_tokens(slot))
        t1 = time.perf_counter()
        freed = [running[i] for i in victims]
        for slot in freed:
            bm.free(slot)
        t2 = time.perf_counter()
        num_cached = [admit(slot, *p) for slot, p in zip(spare, prompts, strict=True)]
        for slot, start in zip(spare, num_cached, strict=True):
            bm.mark_computed(slot, min(start + chunk, args.prompt_len))
        t3 = time.perf_counter()
        # The admitted prompts join the decoders (their prefill is not timed again).
        for slot in spare:
            bm.mark_computed(slot, args.prompt_len)
        running = [s for s in running if s not in set(freed)] + spare
        spare = freed
        if step >= args.warmup:
            for key, dt in (("decode", t1 - t0), ("free", t2 - t1), ("allocate", t3 - t2), ("step", t3 - t0)):
                times[key].append(dt * 1e3)
        if args.check:
            bm.assert_invariants()
    out = {f"{k}_median_ms": statistics.median(v) for k, v in times.items()}
    out["step_p90_ms"] = float(np.percentile(times["step"], 90))
    out["hit_rate"] = bm.stats.hit_tokens / bm.stats.query_tokens
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 1024], help="running sequences")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=2048, help="tokens per step: decodes plus prefill chunks")
    ap.add_argument("--frees", type=int, default=2, help="sequences finished (and prompts admitted) per step")
    ap.add_argument("--api", choices=("batch", "per-seq"), default="batch")
    ap.add_argument("--prompt-type", choices=("ndarray", "list"), default="ndarray")
    ap.add_argument("--check", action="store_true", help="assert_invariants after every step (slow)")
    args = ap.parse_args()
    print(f"api={args.api} prompts={args.prompt_type} block_size={args.block_size} "
          f"prompt_len={args.prompt_len} frees/allocs per step={args.frees} budget={args.budget} "
          f"steps={args.steps}")
    for n in args.seqs:
        r = run(n, args)
        print(f"seqs={n:5d}  step median {r['step_median_ms']:.3f} ms  p90 {r['step_p90_ms']:.3f} ms  "
              f"(decode {r['decode_median_ms']:.3f}, free {r['free_median_ms']:.3f}, "
              f"allocate {r['allocate_median_ms']:.3f})  prompt hit rate {r['hit_rate']:.2f}")


if __name__ == "__main__":
    main()
