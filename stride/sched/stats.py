"""Scheduler metrics: running counters kept by the scheduler and a snapshot for the process to export."""

from __future__ import annotations

from dataclasses import dataclass, field

from stride.ipc import messages


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

    def to_message(self) -> messages.SchedulerStats:
        """The gauges the frontend exports on ``/metrics``."""
        return messages.SchedulerStats(
            num_running_seqs=self.num_running_seqs, num_waiting_seqs=self.num_waiting_seqs,
            num_blocks_live=self.num_blocks_live, num_blocks_cached=self.num_blocks_cached,
            num_blocks_free=self.num_blocks_free, num_preemptions=self.num_preemptions)
