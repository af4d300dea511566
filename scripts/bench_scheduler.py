"""Scheduler step time, block work included, with 256 and 1,024 running sequences (a benchmark, not a test).

Each measured step is ``schedule`` (decodes for every running sequence, block appends, indexing of blocks
that fill) plus ``update`` (sampled tokens applied, stop checks). Sequences have long max_tokens so none
finish; tokens come from the simulated backend, whose own time is not counted. Prints per-step figures. With
``--overlap`` each measured step is built ahead (``schedule_ahead`` while the step before is in flight, then that
one's ``update``), as the scheduler process runs by default.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from stride.config import CacheConfig, SchedulerConfig
from stride.params import SamplingParams
from stride.sched.plan import StepArrays
from stride.sched.scheduler import Scheduler
from stride.sim.backend import SimBackend


def bench(num_seqs: int, steps: int, prompt_len: int, overlap: bool = False) -> dict[str, float]:
    sc = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs + 512),
                         max_model_len=4096)
    cc = CacheConfig(block_size=16, num_blocks=num_seqs * 40, check_invariants=False)
    buf = StepArrays(sc, cc)
    sched = Scheduler(sc, cc, buf, eos_token_ids=(2,))
    backend = SimBackend(num_seqs, 32000, eos_token_ids=(2,))
    rng = np.random.default_rng(0)
    system = rng.integers(3, 32000, 64).tolist()
    for i in range(num_seqs):
        ids = system + rng.integers(3, 32000, prompt_len - 64).tolist()
        sched.add_request(f"r{i}", "t", ids, SamplingParams(max_tokens=2000), "standard", 0.0)
    now = 0.0
    while sched.num_running < num_seqs or len(sched.waiting):  # prefill everything first
        plan = sched.schedule(now)
        backend.run(plan.descriptor(), buf, buf.sampled_ids)
        now += 0.01
        sched.update(plan, buf.sampled_ids, now)
    sched_t, update_t = [], []
    inflight = None
    if overlap:
        inflight = sched.schedule(now)
    for _ in range(steps):
        t0 = time.perf_counter()
        if inflight is None:
            plan = sched.schedule(now)
        else:
            ahead = sched.schedule_ahead(now)
            assert ahead is not None
            plan, inflight = inflight, ahead
        t1 = time.perf_counter()
        bank = buf.bank(plan.bank)
        backend.run(plan.descriptor(), bank, bank.sampled_ids)
        now += 0.01
        t2 = time.perf_counter()
        sched.update(plan, bank.sampled_ids, now)
        t3 = time.perf_counter()
        assert plan.num_seqs == num_seqs
        sched_t.append(t1 - t0)
        update_t.append(t3 - t2)
    s, u = np.array(sched_t) * 1e3, np.array(update_t) * 1e3
    return {"schedule_ms": float(np.median(s)), "update_ms": float(np.median(u)),
            "step_ms": float(np.median(s + u)), "step_p90_ms": float(np.percentile(s + u, 90))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--overlap", action="store_true", help="steps built ahead of the one in flight")
    args = parser.parse_args()
    for n in (256, 1024):
        r = bench(n, args.steps, args.prompt_len, args.overlap)
        print(f"{n:5d} running: step {r['step_ms']:.3f} ms median (p90 {r['step_p90_ms']:.3f}) = "
              f"schedule {r['schedule_ms']:.3f} + update {r['update_ms']:.3f}")


if __name__ == "__main__":
    main()
