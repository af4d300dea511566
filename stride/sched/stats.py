"""Scheduler metrics: running counters kept by the scheduler and a snapshot for the process to export."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stride.ipc import messages

if TYPE_CHECKING:
    from stride.sched.scheduler import Scheduler


@dataclass
class SchedulerCounters:
    """Running totals since the scheduler started."""

    num_preemptions: int = 0
    num_resumptions: int = 0
    """Admissions of a previously preempted sequence."""
    num_finished: int = 0
    num_aborted: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    """Refusals by reason (queue_full, overloaded, too_long)."""


@dataclass(frozen=True)
class SchedulerMetrics:
    """Gauges and counters at one moment."""

    num_running_seqs: int
    num_waiting_seqs: int
    num_waiting_tokens: int
    num_blocks_live: int
    num_blocks_cached: int
    num_blocks_free: int
    num_preemptions: int
    num_resumptions: int
    num_finished: int
    num_aborted: int
    num_rejections: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    num_evictions: int
    num_steps: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @staticmethod
    def collect(sched: Scheduler) -> SchedulerMetrics:
        c = sched.counters
        b = sched.bm.stats
        return SchedulerMetrics(
            num_running_seqs=sched.num_running, num_waiting_seqs=len(sched.waiting),
            num_waiting_tokens=sched.waiting.num_tokens, num_blocks_live=b.num_live,
            num_blocks_cached=b.num_cached, num_blocks_free=b.num_free, num_preemptions=c.num_preemptions,
            num_resumptions=c.num_resumptions, num_finished=c.num_finished, num_aborted=c.num_aborted,
            num_rejections=sum(c.rejections.values()), prefix_hit_tokens=b.hit_tokens,
            prefix_query_tokens=b.query_tokens, num_evictions=b.num_evictions, num_steps=sched.step)

    def to_message(self) -> messages.SchedulerStats:
        """The gauges the frontend exports on ``/metrics``."""
        return messages.SchedulerStats(
            num_running_seqs=self.num_running_seqs, num_waiting_seqs=self.num_waiting_seqs,
            num_blocks_live=self.num_blocks_live, num_blocks_cached=self.num_blocks_cached,
            num_blocks_free=self.num_blocks_free, num_preemptions=self.num_preemptions)
