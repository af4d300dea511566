"""``stride simulate``: a synthetic workload through the scheduler and the simulated backend, in logical
time. Step times come from the planner's cost model for the model, GPU and TP degree, so this answers
"what happens to my latency targets with this many users on this hardware" without the hardware.

Goodput counts finished requests that met their class's targets: TTFT within ``ttft_ms`` and mean
inter-token latency within ``itl_ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stride.config import CacheConfig, SchedulerConfig, WorkerConfig
from stride.sched.plan import StepArrays
from stride.sched.scheduler import Scheduler
from stride.sim.backend import SimBackend, StepTimeFn, linear_step_time
from stride.sim.workload import Arrival, Workload, generate, parse_class_mix


@dataclass
class _ReqTimes:
    service_class: str
    arrival: float
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class SimResult:
    """Logical-time outcome of one simulated run."""

    duration_s: float
    num_steps: int
    requests: dict[str, _ReqTimes]
    rejected: dict[str, str]
    metrics: dict[str, Any]
    targets: dict[str, tuple[float, float]]

    def report(self) -> dict[str, Any]:
        """Per-class TTFT/ITL percentiles (ms) and goodput, plus totals; JSON-ready."""
        per_class: dict[str, Any] = {}
        num_good = 0
        for name, (ttft_target, itl_target) in self.targets.items():
            reqs = [r for r in self.requests.values() if r.service_class == name and r.token_times]
            if not reqs:
                continue
            ttft = np.array([r.token_times[0] - r.arrival for r in reqs]) * 1000
            gaps = [np.diff(r.token_times) * 1000 for r in reqs]
            itl = np.concatenate(gaps) if gaps else np.zeros(0)
            good = sum(1 for r, g in zip(reqs, gaps, strict=True)
                       if r.finish_reason is not None and (r.token_times[0] - r.arrival) * 1000 <= ttft_target
                       and (len(g) == 0 or float(g.mean()) <= itl_target))
            num_good += good
            per_class[name] = {
                "num_requests": len(reqs),
                "ttft_ms": _percentiles(ttft),
                "itl_ms": _percentiles(itl),
                "ttft_target_ms": ttft_target, "itl_target_ms": itl_target,
                "num_meeting_targets": good,
            }
        num_finished = sum(1 for r in self.requests.values() if r.finish_reason is not None)
        m = self.metrics
        reasons = list(self.rejected.values())
        return {
            "duration_s": round(self.duration_s, 3),
            "num_steps": self.num_steps,
            "num_finished": num_finished,
            "num_rejected": len(self.rejected),
            "rejections": {why: reasons.count(why) for why in sorted(set(reasons))},
            "num_preemptions": m["num_preemptions"],
            "prefix_hit_rate": round(m["prefix_hit_rate"], 4),
            "goodput_rps": round(num_good / self.duration_s, 3) if self.duration_s else 0.0,
            "goodput_fraction": round(num_good / max(1, num_finished + len(self.rejected)), 4),
            "classes": per_class,
        }


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": round(float(p50), 2), "p90": round(float(p90), 2), "p99": round(float(p99), 2)}


def run_simulation(sched_cfg: SchedulerConfig, cache_cfg: CacheConfig, arrivals: list[Arrival], *,
                   vocab_size: int = 32000, eos_token_ids: tuple[int, ...] = (2,),
                   step_time: StepTimeFn = linear_step_time,
                   on_step: Callable[[Scheduler], None] | None = None) -> SimResult:
    """Run ``arrivals`` to completion in logical time: arrivals up to ``now`` enter, one step runs and
    takes its modelled time; when idle, time jumps to the next arrival."""
    buffers = StepArrays(sched_cfg, cache_cfg)
    sched = Scheduler(sched_cfg, cache_cfg, buffers, eos_token_ids=eos_token_ids)
    backend = SimBackend(sched_cfg.max_num_seqs, vocab_size, eos_token_ids=eos_token_ids, step_time=step_time)
    times: dict[str, _ReqTimes] = {}
    rejected: dict[str, str] = {}
    now, i, num_steps = 0.0, 0, 0
    while i < len(arrivals) or sched.has_work():
        while i < len(arrivals) and arrivals[i].time <= now:
            a = arrivals[i]
            i += 1
            refusal = sched.add_request(a.req_id, a.tenant, a.prompt_token_ids, a.params, a.service_class,
                                        a.time)
            if refusal is not None:
                rejected[a.req_id] = refusal.reason
            else:
                times[a.req_id] = _ReqTimes(a.service_class, a.time)
        plan = sched.schedule(now)
        if plan.num_seqs == 0:
            if i >= len(arrivals):
                raise RuntimeError(f"scheduler stalled at t={now:.3f}s with {len(sched.waiting)} waiting")
            now = max(now, arrivals[i].time)
            continue
        now += backend.run(plan.descriptor(), buffers, buffers.sampled_ids)
        num_steps += 1
        batch = sched.update(plan, buffers.sampled_ids, now)
        for req_id in batch.req_ids:  # one token each
            times[req_id].token_times.append(now)
        for req_id, reason in batch.finished.items():
            times[req_id].finish_reason = reason
        if on_step is not None:
            on_step(sched)
    m = sched.metrics()
    metrics = {"num_preemptions": m.num_preemptions, "prefix_hit_rate": m.prefix_hit_rate}
    targets = {c.name: (c.ttft_ms, c.itl_ms) for c in sched_cfg.service_classes}
    return SimResult(now, num_steps, times, rejected, metrics, targets)


def planner_step_time(model: str, gpu: str, tp: int) -> tuple[StepTimeFn, int]:
    """Step-time model (the planner's :class:`~stride.planner.cost.StepCostModel`: bytes and FLOPs over
    the GPU's bandwidth and rate, plus a fixed overhead) and vocabulary size for ``model`` on ``tp`` ×
    ``gpu`` from the planner catalog."""
    from stride.planner.cost import StepCostModel
    from stride.planner.geometry import load_geometry
    from stride.planner.hardware import get_gpu

    geometry = load_geometry(model)
    return StepCostModel(geometry, get_gpu(gpu), tp).step_time, geometry.vocab_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b", help="planner catalog name or model path")
    parser.add_argument("--gpu", default=WorkerConfig.gpu, help="GPU name in the planner catalog")
    parser.add_argument("--tp", type=int, default=WorkerConfig.tensor_parallel_size, help="tensor-parallel degree")
    parser.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--prompt-len", type=int, default=512, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="mean output tokens")
    parser.add_argument("--len-sigma", type=float, default=0.5, help="lognormal sigma of lengths (0: fixed)")
    parser.add_argument("--class-mix", default="interactive=0.3,standard=0.5,background=0.2")
    parser.add_argument("--shared-prefix-fraction", type=float, default=0.5)
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens of each tenant's system prompt")
    parser.add_argument("--num-tenants", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=0,
                        help="KV blocks in the pool (default: what the planner gives this deployment)")
    parser.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    parser.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    parser.add_argument("--max-model-len", type=int, default=SchedulerConfig.max_model_len)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _planned_num_blocks(args: argparse.Namespace) -> int:
    from stride.planner.geometry import load_geometry
    from stride.planner.hardware import get_gpu
    from stride.planner.parallel import Parallelism
    from stride.planner.plan import Deployment, plan

    p = plan(Deployment(load_geometry(args.model), get_gpu(args.gpu), Parallelism(tp=args.tp),
                        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len), suggest=False)
    if p.refused:
        raise ValueError(f"the planner refuses this deployment: {p.reason}")
    return p.num_blocks


def main(args: argparse.Namespace) -> int:
    try:
        step_time, vocab_size = planner_step_time(args.model, args.gpu, args.tp)
        num_blocks = args.num_blocks or _planned_num_blocks(args)
        sched_cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len)
        cache_cfg = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                                enable_prefix_caching=not args.no_prefix_caching, check_invariants=False)
        workload = Workload(rate=args.rate, num_requests=args.num_requests, prompt_len=args.prompt_len,
                            output_len=args.output_len, len_sigma=args.len_sigma,
                            class_mix=parse_class_mix(args.class_mix),
                            shared_prefix_fraction=args.shared_prefix_fraction, prefix_len=args.prefix_len,
                            num_tenants=args.num_tenants, seed=args.seed)
        for name in workload.class_mix:
            sched_cfg.service_class(name)
    except ValueError as e:
        print(f"stride simulate: {e}", file=sys.stderr)
        return 2
    eos = (2,)
    arrivals = generate(workload, vocab_size=vocab_size, max_model_len=sched_cfg.max_model_len, avoid_ids=eos)
    result = run_simulation(sched_cfg, cache_cfg, arrivals, vocab_size=vocab_size, eos_token_ids=eos,
                            step_time=step_time)
    report = {"model": args.model, "gpu": args.gpu, "tp": args.tp, "num_blocks": num_blocks,
              "rate": args.rate, **result.report()}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.model} on {args.tp}x {args.gpu}, {num_blocks} KV blocks of {args.block_size}; "
          f"{args.num_requests} requests at {args.rate:g}/s")
    print(f"simulated {report['duration_s']} s in {report['num_steps']} steps; "
          f"finished {report['num_finished']}, rejected {report['num_rejected']}, "
          f"preemptions {report['num_preemptions']}, "
          f"prefix hit rate {report['prefix_hit_rate']:.1%}")
    print(f"goodput {report['goodput_rps']} req/s ({report['goodput_fraction']:.1%} met their targets)")
    print(f"{'class':<12} {'n':>5} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'ITL p50':>8} {'p90':>7} "
          f"{'p99':>7} {'met':>5}")
    for name, c in report["classes"].items():
        t, g = c["ttft_ms"], c["itl_ms"]
        print(f"{name:<12} {c['num_requests']:>5} {t.get('p50', 0):>9.1f} {t.get('p90', 0):>8.1f} "
              f"{t.get('p99', 0):>8.1f} {g.get('p50', 0):>8.1f} {g.get('p90', 0):>7.1f} "
              f"{g.get('p99', 0):>7.1f} {c['num_meeting_targets']:>5}")
    return 0
