"""``stride replay TRACE``: re-run a fresh scheduler on a trace's inputs and check every decision.

The trace's inputs (arrivals, cancellations, sampled ids, and the logical time of each) drive a new
:class:`~stride.sched.scheduler.Scheduler` built from the trace's config; each ``schedule`` record's
decisions must come out identical. The first that does not is reported with what differed; the exit code
is non-zero on divergence.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from stride.sched.plan import StepArrays, StepPlan
from stride.sched.scheduler import Scheduler
from stride.sched.trace import configs_from, load_trace, params_from


@dataclass(frozen=True)
class ReplayResult:
    num_records: int
    num_steps: int
    """``schedule`` records replayed and matched."""
    divergence: str | None = None
    """What differed first (None: every decision matched)."""
    diverged_step: int | None = None
    """Step number of the first diverging ``schedule`` record (None for other records)."""
    record_index: int | None = None

    @property
    def ok(self) -> bool:
        return self.divergence is None


def _diff(recorded: dict[str, Any], replayed: dict[str, Any]) -> str:
    parts = []
    for key in sorted(set(recorded) | set(replayed)):
        a, b = recorded.get(key), replayed.get(key)
        if a != b:
            parts.append(f"{key}: recorded {_short(a)}, replayed {_short(b)}")
    return "; ".join(parts)


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def replay_records(records: list[dict[str, Any]]) -> ReplayResult:
    """Replay ``records`` (as :func:`~stride.sched.trace.load_trace` returns them)."""
    sched_cfg, cache_cfg, eos = configs_from(records[0])
    buffers = StepArrays(sched_cfg, cache_cfg)
    sched = Scheduler(sched_cfg, cache_cfg, buffers, eos_token_ids=eos)
    inflight: list[StepPlan] = []  # oldest first: with overlapped scheduling a step is built ahead of one in flight
    num_steps = 0
    for i, rec in enumerate(records[1:], 1):
        kind, now = rec["kind"], rec.get("now", 0.0)
        if kind == "add":
            params = params_from(rec["params"])
            rejection = sched.add_request(rec["req_id"], rec["tenant"], rec["prompt"], params,
                                          rec["service_class"], now)
            got = rejection and rejection.reason
            if got != rec["rejected"]:
                what = f"add {rec['req_id']}: recorded rejected={rec['rejected']!r}, replayed {got!r}"
                return ReplayResult(i, num_steps, what, None, i)
        elif kind == "abort":
            sched.abort(rec["req_id"], now)
        elif kind == "schedule":
            if rec.get("ahead"):
                if len(inflight) != 1:
                    what = f"step {rec['step']} was built ahead of {len(inflight)} steps in flight"
                    return ReplayResult(i, num_steps, what, rec["step"], i)
                ahead = sched.schedule_ahead(now)
                if ahead is None:
                    return ReplayResult(i, num_steps, f"step {rec['step']}: built ahead, replayed none",
                                        rec["step"], i)
                plan = ahead
            else:
                plan = sched.schedule(now)
            if plan.num_seqs:
                inflight.append(plan)
            replayed = plan.decisions()
            if plan.step != rec["step"] or replayed != rec["decisions"]:
                what = _diff({"step": rec["step"], **rec["decisions"]}, {"step": plan.step, **replayed})
                return ReplayResult(i, num_steps, f"step {rec['step']}: {what}", rec["step"], i)
            num_steps += 1
        elif kind == "update":
            if not inflight or inflight[0].step != rec["step"]:
                what = f"update for step {rec['step']} without its schedule record"
                return ReplayResult(i, num_steps, what, rec["step"], i)
            sched.update(inflight.pop(0), np.array(rec["sampled"], dtype=np.int32), now, rec.get("stop_rows", ()))
        else:
            raise ValueError(f"record {i}: unknown kind {kind!r}")
    return ReplayResult(len(records), num_steps)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="JSON-lines trace written by a scheduler (TraceWriter)")


def main(args: argparse.Namespace) -> int:
    try:
        records = load_trace(args.trace)
    except (OSError, ValueError) as e:
        print(f"stride replay: {e}", file=sys.stderr)
        return 2
    result = replay_records(records)
    if result.ok:
        print(f"replay OK: {result.num_steps} steps, {result.num_records} records, every decision matched")
        return 0
    print(f"replay DIVERGED at record {result.record_index} after {result.num_steps} matching steps: "
          f"{result.divergence}")
    return 1
