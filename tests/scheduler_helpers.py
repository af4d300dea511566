"""Shared helpers for the scheduler tests: build a scheduler on plain arrays, run steps on the simulated
backend, and check every step's buffers against the requests' tokens."""

from __future__ import annotations

import numpy as np

from stride.config import CacheConfig, SchedulerConfig
from stride.params import SamplingParams
from stride.sched.plan import StepArrays, StepPlan, UpdateBatch
from stride.sched.scheduler import Scheduler
from stride.sched.trace import TraceWriter
from stride.sim.backend import SimBackend

EOS = 2
VOCAB = 1000


def make(*, trace: TraceWriter | None = None, prefix_caching: bool = True, block_size: int = 4,
         num_blocks: int = 256, **sched_kw: object) -> tuple[Scheduler, StepArrays, SimBackend]:
    sched_kw.setdefault("max_num_seqs", 16)
    sched_kw.setdefault("max_num_batched_tokens", 256)
    sched_kw.setdefault("max_model_len", 8192)
    sc = SchedulerConfig(**sched_kw)  # type: ignore[arg-type]
    cc = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                     check_invariants=True)
    buf = StepArrays(sc, cc)
    sched = Scheduler(sc, cc, buf, eos_token_ids=(EOS,), trace=trace)
    return sched, buf, SimBackend(sc.max_num_seqs, VOCAB, eos_token_ids=(EOS,))


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


def params(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def check_buffers(sched: Scheduler, buf: StepArrays, plan: StepPlan) -> None:
    """Every row's tokens and positions in the buffers are that request's tokens at those positions."""
    offset = 0
    budget = sched.cfg.max_num_batched_tokens
    assert plan.num_tokens <= budget
    for i, req_id in enumerate(plan.req_ids):
        req = sched.requests[req_id]
        start, q = int(plan.start_positions[i]), int(plan.query_lens[i])
        assert buf.seq_slots[i] == plan.slots[i] == req.slot
        assert buf.query_lens[i] == q and buf.context_lens[i] == start + q
        assert buf.positions[offset:offset + q].tolist() == list(range(start, start + q))
        assert buf.token_ids[offset:offset + q].tolist() == req.token_ids[start:start + q]
        assert bool(buf.sample_flags[i]) == (start + q == req.num_tokens) == bool(plan.sample_flags[i])
        offset += q


def step(sched: Scheduler, buf: StepArrays, backend: SimBackend, now: float,
         check: bool = True) -> tuple[StepPlan, UpdateBatch, float]:
    """One scheduled step run on the simulated backend; returns the plan, updates and the new time."""
    plan = sched.schedule(now)
    if plan.num_seqs == 0:
        return plan, UpdateBatch.empty(), now
    if check:
        check_buffers(sched, buf, plan)
    now += backend.run(plan.descriptor(), buf, buf.sampled_ids)
    updates = sched.update(plan, buf.sampled_ids, now)
    sched.bm.assert_invariants()
    return plan, updates, now
