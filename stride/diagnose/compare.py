"""Two captures of one schedule, measured point by point (each layer after attention, after the MLP, then the
logits), and the report: the first point whose error leaves the pair's band, and the greedy flips.

At each point the hidden states of every observed step are taken together (tokens × hidden), ``a`` against the
reference ``b``: the largest absolute difference, the relative error ‖a − b‖ / ‖b‖, the smallest cosine over
tokens, and the growth (this point's relative error over the point before). A point diverges when its relative
error passes the band there (:func:`stride.diagnose.spec.band_at`: the pair's first band, widening with depth), or
when it jumps :data:`~stride.diagnose.spec.JUMP` times over the point before once past a third of the band:
rounding error grows smoothly, a fault does not.

A flip is a decision point where the two greedy tokens differ; it is expected when the reference's top two
log-probs are within :func:`~stride.diagnose.spec.near_tie` of each other, and a fault otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from stride.diagnose.runs import Capture, Prepare, Schedule, run
from stride.diagnose.spec import DEPTH_SCALE, JUMP, RunSpec, band, band_at, near_tie

REPORT_VERSION = 1


@dataclass(frozen=True)
class Point:
    name: str
    """``layer 3 attention``, ``layer 3 mlp`` or ``logits``."""
    layer: int | None
    where: str
    """``attention``, ``mlp`` or ``logits``."""
    tokens: int
    max_abs: float
    rel: float
    min_cos: float
    growth: float | None
    """``rel`` over the previous point's (None for the first, or after an exact zero)."""
    band: float = 0.0
    """The relative error rounding alone stays under here (:func:`~stride.diagnose.spec.band_at`)."""


@dataclass(frozen=True)
class Flip:
    decision: int
    """0: after the prefill; d: after decode step d."""
    sequence: int
    a: int
    b: int
    margin: float
    """The reference's top-two log-prob margin there."""
    near_tie: bool


@dataclass
class Report:
    a: str
    b: str
    band: float
    near_tie: float
    points: list[Point] = field(default_factory=list)
    first_divergent: Point | None = None
    reason: str = ""
    flips: list[Flip] = field(default_factory=list)
    unobserved: list[str] = field(default_factory=list)
    """Steps whose layers were not observed (replayed from CUDA graphs): their logits only count."""

    @property
    def diverged(self) -> bool:
        return self.first_divergent is not None or any(not f.near_tie for f in self.flips)

    def to_json(self) -> dict[str, Any]:
        """The documented report (``docs/diagnose.md``); ``version`` changes with any change of its keys."""
        return {
            "version": REPORT_VERSION,
            "a": self.a,
            "b": self.b,
            "band": {"rel": self.band, "depth_scale": DEPTH_SCALE, "near_tie": self.near_tie, "jump": JUMP},
            "points": [_finite(asdict(p)) for p in self.points],
            "first_divergent": None if self.first_divergent is None else {
                "name": self.first_divergent.name, "layer": self.first_divergent.layer,
                "where": self.first_divergent.where, "reason": self.reason},
            "flips": [asdict(f) for f in self.flips],
            "unobserved_steps": self.unobserved,
            "diverged": self.diverged,
        }

    def text(self) -> str:
        lines = [f"a = {self.a}   b = {self.b} (reference)   band: relative error <= {self.band:.0e}, "
                 f"widening by that every {DEPTH_SCALE} points",
                 f"{'point':<20} {'tokens':>6} {'max abs':>10} {'rel err':>10} {'band':>8} {'min cos':>10} "
                 f"{'growth':>8}"]
        for p in self.points:
            growth = "-" if p.growth is None else f"{p.growth:.2f}"
            mark = "  <- first divergent" if p is self.first_divergent else ""
            lines.append(f"{p.name:<20} {p.tokens:>6} {p.max_abs:>10.3e} {p.rel:>10.3e} {p.band:>8.1e} "
                         f"{p.min_cos:>10.6f} {growth:>8}{mark}")
        if self.first_divergent is None:
            lines.append("first divergent layer: none (every point within the band, growing smoothly)")
        else:
            lines.append(f"first divergent: {self.first_divergent.name} ({self.reason})")
        near = sum(f.near_tie for f in self.flips)
        lines.append(f"greedy flips: {near} at near ties (expected; margin < {self.near_tie:.0e}), "
                     f"{len(self.flips) - near} elsewhere")
        for f in self.flips:
            kind = "near tie" if f.near_tie else "FAULT"
            lines.append(f"  decision {f.decision} sequence {f.sequence}: a {f.a}, b {f.b}, "
                         f"margin {f.margin:.2e} ({kind})")
        if self.unobserved:
            lines.append(f"layers not observed in {len(self.unobserved)} step(s) replayed from CUDA graphs "
                         "(their logits are compared)")
        return "\n".join(lines)


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no inf/nan: they are written as strings."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _measure(name: str, layer: int | None, where: str, a: torch.Tensor, b: torch.Tensor,
             previous: float | None) -> Point:
    a, b = a.double(), b.double()
    diff = a - b
    ref = float(b.norm())
    rel = float(diff.norm()) / ref if ref > 0 else (0.0 if float(diff.norm()) == 0 else math.inf)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    growth = rel / previous if previous else None
    return Point(name, layer, where, a.shape[0], float(diff.abs().max()) if diff.numel() else 0.0, rel,
                 float(cos.min()) if cos.numel() else 1.0, growth)


def diagnose(a: RunSpec, b: RunSpec, model: str, schedule: Schedule, prepare: Prepare | None = None) -> Report:
    """Run the reference ``b`` on its own greedy tokens, then ``a`` (its ranks' models passed through ``prepare``)
    fed the same tokens, and compare them in ``a`` and ``b``'s band."""
    reference = run(b, model, schedule)
    other = run(a, model, schedule, forced=reference.chosen, prepare=prepare)
    rel = band(a, b)
    return compare(other, reference, rel, near_tie(rel))


def compare(a: Capture, b: Capture, rel_band: float, tie: float) -> Report:
    """``a`` against the reference ``b``, run on the same schedule (``a`` fed ``b``'s tokens)."""
    if [s.phase for s in a.steps] != [s.phase for s in b.steps]:
        raise ValueError("the two captures ran different schedules")
    if a.num_layers != b.num_layers:
        raise ValueError(f"{a.label} has {a.num_layers} layers, {b.label} {b.num_layers}: not one model")
    report = Report(a.label, b.label, rel_band, tie)
    both = [(sa, sb) for sa, sb in zip(a.steps, b.steps, strict=True)
            if sa.attention is not None and sb.attention is not None]
    report.unobserved = [sa.phase for sa, sb in zip(a.steps, b.steps, strict=True)
                         if sa.attention is None or sb.attention is None]
    previous: float | None = None
    for layer in range(a.num_layers):
        for where in ("attention", "mlp"):
            if not both:
                break
            got = torch.cat([getattr(sa, where)[layer] for sa, _ in both])
            want = torch.cat([getattr(sb, where)[layer] for _, sb in both])
            point = _measure(f"layer {layer} {where}", layer, where, got, want, previous)
            report.points.append(point)
            previous = point.rel
    logits = _measure("logits", None, "logits", torch.cat([s.logits for s in a.steps]),
                      torch.cat([s.logits for s in b.steps]), previous)
    report.points.append(logits)
    report.points = [replace(p, band=band_at(rel_band, i)) for i, p in enumerate(report.points)]
    for p in report.points:
        if not p.rel <= p.band:  # NaN too
            report.first_divergent, report.reason = p, f"relative error {p.rel:.2e} > band {p.band:.1e}"
            break
        if p.growth is not None and p.growth > JUMP and p.rel > p.band / 3:
            report.first_divergent = p
            report.reason = f"relative error grew {p.growth:.1f}x over the point before, to {p.rel:.2e}"
            break
    for d, (ca, cb) in enumerate(zip(a.chosen, b.chosen, strict=True)):
        for i, (ta, tb) in enumerate(zip(ca, cb, strict=True)):
            if ta != tb:
                margin = b.margins[d][i]
                report.flips.append(Flip(d, i, ta, tb, margin, margin < tie))
    return report


def plot(report: Report, path: str) -> None:
    """Relative error per point on a log scale, the band drawn across, the first divergent point marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from e
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(report.points)), 3.5))
    xs = range(len(report.points))
    for where, marker in (("attention", "o"), ("mlp", "s"), ("logits", "*")):
        pts = [(i, max(p.rel, 1e-12)) for i, p in enumerate(report.points) if p.where == where]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker, label=where, markersize=4)
    ax.plot(list(xs), [max(p.rel, 1e-12) for p in report.points], "-", color="grey", linewidth=0.6)
    ax.plot(list(xs), [p.band for p in report.points], "--", color="red", linewidth=0.8, label="band")
    if report.first_divergent is not None:
        i = report.points.index(report.first_divergent)
        ax.axvline(i, color="red", linewidth=0.8)
        ax.annotate(report.first_divergent.name, (i, report.first_divergent.band), rotation=90, fontsize=7,
                    va="bottom")
    ax.set_yscale("log")
    ax.set_xlabel("point (layer after attention / after MLP, then logits)")
    ax.set_ylabel("relative error ‖a−b‖/‖b‖")
    ax.set_title(f"a = {report.a}  vs  b = {report.b}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
