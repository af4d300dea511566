"""Autotuning with a correctness gate, a Pareto choice over (latency, second cost), and a per-GPU cache.

A :class:`KernelSpec` (see :mod:`stride.kernels.autotune_specs`) gives, per kernel: the configuration space,
random problems, the reference, a second cost (bytes of workspace or a register proxy) and the shape
bucket a choice is cached under. :func:`tune` then

1. gates every candidate: it runs on *fresh* random problems of the target shape and of ragged edge
   shapes (length 1, one short of / one past a block, odd sizes) and must match the reference within
   the dtype's tolerance, with no NaN; a candidate that fails any is rejected, never timed;
2. times the survivors (median of repeated runs) and keeps the Pareto front over (latency, cost);
3. picks the fastest point, or a cheaper one within ``slack`` of it, and stores it in the cache.

The cache is a JSON file (``STRIDE_AUTOTUNE_CACHE``, default ``~/.cache/stride/autotune.json``) keyed
by GPU name, kernel and shape bucket. Launchers never read it: the worker (``stride/workers/kernel_configs.py``,
on CUDA) reads the file once and looks each shape bucket up once, as :func:`cached_config` does, and passes
the config to the launcher. ``scripts/tune_kernels.py`` fills it for one model's shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import secrets
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from triton.runtime.errors import OutOfResources

Problem = dict[str, Any]
Output = torch.Tensor | tuple[torch.Tensor, ...]
Timer = Callable[[Callable[[], object]], float]

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    # (atol, rtol) on |out - ref| <= atol + rtol * |ref|, per output dtype.
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(frozen=True)
class Candidate:
    """One runnable variant: a real configuration, or a deliberately broken negative control."""

    name: str
    run: Callable[[Problem], Output]
    config: Any = None


@dataclass(frozen=True)
class KernelSpec:
    name: str
    config_type: type
    space: Callable[[Any], list[Any]]
    """Configurations worth trying for a shape."""
    gate_shapes: Callable[[Any], list[Any]]
    """The target shape plus ragged edge shapes derived from it."""
    make_problem: Callable[[Any, torch.Generator, torch.device], Problem]
    run: Callable[[Any, Problem], Output]
    reference: Callable[[Problem], Output]
    cost: Callable[[Any, Any], float]
    """Second objective (lower is better), e.g. workspace bytes."""
    bucket: Callable[[Any], str]

    def candidate(self, config: Any) -> Candidate:
        def run(problem: Problem) -> Output:
            return self.run(config, problem)

        return Candidate(f"{self.name}:{config}", run, config)

    def candidates(self, shape: Any) -> list[Candidate]:
        return [self.candidate(c) for c in self.space(shape)]


@dataclass(frozen=True)
class GateResult:
    ok: bool
    max_err: float
    detail: str


@dataclass(frozen=True)
class Point:
    candidate: Candidate
    latency_ms: float
    cost: float


@dataclass
class TuneResult:
    chosen: Point
    front: list[Point]
    rejected: dict[str, GateResult] = field(default_factory=dict)


def _poison_allocator(device: torch.device, nbytes: int) -> None:
    # Freed NaN-filled memory is what the next torch.empty of that size tends to get back, so an output
    # element the kernel forgets to write shows up as NaN instead of a lucky stale value.
    torch.full((max(1, nbytes // 4),), float("nan"), dtype=torch.float32, device=device)


def compare(out: Output, ref: Output) -> GateResult:
    """Every output tensor within the dtype's (atol, rtol) of the reference, and finite."""
    if isinstance(ref, tuple):
        if not isinstance(out, tuple) or len(out) != len(ref):
            return GateResult(False, float("inf"), "output arity differs from the reference")
        results = [compare(o, r) for o, r in zip(out, ref, strict=True)]
        bad = [r for r in results if not r.ok]
        return bad[0] if bad else GateResult(True, max(r.max_err for r in results), "")
    assert isinstance(out, torch.Tensor)
    if out.shape != ref.shape:
        return GateResult(False, float("inf"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}")
    atol, rtol = TOLERANCES[ref.dtype] if ref.dtype in TOLERANCES else TOLERANCES[torch.float32]
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return GateResult(False, float("inf"), "non-finite output")
    err = (o - r).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    ok = bool((err <= atol + rtol * r.abs()).all())
    return GateResult(ok, max_err, "" if ok else f"max |err| {max_err:.3g} over atol {atol} rtol {rtol}")


def gate(
    spec: KernelSpec, candidate: Candidate, shape: Any, device: torch.device, seed: int | None = None
) -> GateResult:
    """Run ``candidate`` on fresh random problems of every gate shape; reject on the first mismatch."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    worst = 0.0
    for gshape in spec.gate_shapes(shape):
        problem = spec.make_problem(gshape, gen, device)
        ref = spec.reference(problem)
        _poison_allocator(device, sum(r.numel() for r in (ref if isinstance(ref, tuple) else (ref,))) * 8)
        try:
            out = candidate.run(problem)
        except (AssertionError, RuntimeError, ValueError, OutOfResources) as exc:  # e.g. too much shared memory
            return GateResult(False, float("inf"), f"{gshape}: raised {type(exc).__name__}: {exc}")
        result = compare(out, ref)
        if not result.ok:
            return GateResult(False, result.max_err, f"{gshape}: {result.detail}")
        worst = max(worst, result.max_err)
    return GateResult(True, worst, "")


def pareto_front(points: Sequence[Point]) -> list[Point]:
    """Points no other point beats on both latency and cost (ties kept once), sorted by latency."""
    def dominates(q: Point, p: Point) -> bool:
        no_worse = q.latency_ms <= p.latency_ms and q.cost <= p.cost
        return no_worse and (q.latency_ms < p.latency_ms or q.cost < p.cost)

    front = [p for p in points if not any(dominates(q, p) for q in points)]
    return sorted(front, key=lambda p: (p.latency_ms, p.cost))


def choose(front: Sequence[Point], slack: float = 0.05) -> Point:
    """The cheapest point within ``slack`` (fraction) of the fastest."""
    fastest = min(p.latency_ms for p in front)
    near = [p for p in front if p.latency_ms <= fastest * (1 + slack)]
    return min(near, key=lambda p: (p.cost, p.latency_ms))


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median ms of plain launches (includes the Python launch cost, which dominates small kernels)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def cuda_graph_timer(fn: Callable[[], object], calls: int = 20) -> float:
    """Median ms per call of ``calls`` calls replayed from one CUDA graph: the kernel, not the launcher.

    Plain launch timings of a ~10 us kernel were seen to scatter from 14 to 75 us on an H200 (host
    overhead), enough to make the tuner pick badly; the worker replays graphs, so tune under one.
    """
    import triton.testing

    fn()  # compile and allocate lazily-made buffers outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return float(triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")) / calls


def tune(
    spec: KernelSpec,
    shape: Any,
    device: torch.device,
    timer: Timer | None = None,
    extra_candidates: Sequence[Candidate] = (),
    slack: float = 0.05,
    seed: int | None = None,
    bench_problems: Sequence[Problem] = (),
) -> TuneResult:
    """Gate, time and choose. ``extra_candidates`` (e.g. negative controls) go through the same gate.

    Timing cycles through ``bench_problems`` (default: one random problem of ``shape``); pass several
    disjoint ones to keep a small shape's data out of L2 between runs.
    """
    timer = timer or cuda_graph_timer
    gen = torch.Generator(device="cpu")
    gen.manual_seed(secrets.randbits(63) if seed is None else seed)
    problems = list(bench_problems) or [spec.make_problem(shape, gen, device)]
    points, rejected = [], {}
    for cand in [*spec.candidates(shape), *extra_candidates]:
        result = gate(spec, cand, shape, device, seed=None if seed is None else seed + 1)
        if not result.ok:
            rejected[cand.name] = result
            continue
        latency = timer(partial(_run_cycling, cand, problems, itertools.count()))
        points.append(Point(cand, latency, spec.cost(cand.config, shape)))
    if not points:
        raise RuntimeError(f"{spec.name}: every candidate failed the gate: {rejected}")
    front = pareto_front(points)
    return TuneResult(choose(front, slack), front, rejected)


def _run_cycling(cand: Candidate, problems: Sequence[Problem], counter: itertools.count) -> Output:
    return cand.run(problems[next(counter) % len(problems)])




def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu-interpreter"


class AutotuneCache:
    """JSON file of chosen configurations: ``{"version": 1, "entries": {"gpu|kernel|bucket": {...}}}``."""

    VERSION = 1

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.entries: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            data = json.loads(self.path.read_text())
            if data.get("version") == self.VERSION:
                self.entries = dict(data.get("entries", {}))

    @staticmethod
    def key(gpu: str, kernel: str, bucket: str) -> str:
        return f"{gpu}|{kernel}|{bucket}"

    def get(self, spec: KernelSpec, gpu: str, bucket: str) -> Any | None:
        entry = self.entries.get(self.key(gpu, spec.name, bucket))
        return None if entry is None else spec.config_type(**entry["config"])

    def put(self, spec: KernelSpec, gpu: str, bucket: str, point: Point) -> None:
        self.entries[self.key(gpu, spec.name, bucket)] = {
            "config": dataclasses.asdict(point.candidate.config),
            "latency_ms": point.latency_ms,
            "cost": point.cost,
        }

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename, so a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".autotune-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": self.VERSION, "entries": self.entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def tune_and_cache(
    spec: KernelSpec, shape: Any, device: torch.device, cache: AutotuneCache, timer: Timer | None = None,
    bench_problems: Sequence[Problem] = (),
) -> TuneResult:
    result = tune(spec, shape, device, timer=timer, bench_problems=bench_problems)
    cache.put(spec, gpu_name(device), spec.bucket(shape), result.chosen)
    cache.save()
    return result


def cached_config(spec: KernelSpec, shape: Any, device: torch.device, cache: AutotuneCache) -> Any | None:
    """The cached choice for this GPU and shape bucket, or None (the launcher then uses its heuristic)."""
    return cache.get(spec, gpu_name(device), spec.bucket(shape))
