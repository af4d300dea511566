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


@dataclass
class StepTimeline:
    """Where the wall time of busy stretches goes, summed over steps. A busy stretch runs from a descriptor being
    sent with no step in flight to the last answer of the steps sent since: the round trip (transport both ways,
    rank 0's time, of which the device's span is a part; with overlapped scheduling two steps may be in flight,
    and the stretch is counted once). Then the scheduler's gap: from that answer until the next step is sent,
    counted only when a next step followed at once (idle time with nothing to run is no one's overhead). The
    device's idle share of busy time is ``1 - device_s / (round_trip_s + gap_s)``."""

    steps: int = 0
    device_s: float = 0.0
    worker_s: float = 0.0
    round_trip_s: float = 0.0
    gap_s: float = 0.0
    graph_steps: int = 0
    """Steps whose forward replayed a decode graph, and their share of ``device_s``: the rest ran eagerly."""
    graph_device_s: float = 0.0
    early_steps: int = 0
    """Steps rank 0 launched before it reported the step before (early launch)."""
    _in_flight: int = 0
    _sent_at: float | None = None
    _done_at: float | None = None

    def sent(self, now: float) -> None:
        """A descriptor went to rank 0 at ``now``."""
        if self._in_flight == 0:
            if self._done_at is not None:
                self.gap_s += now - self._done_at
                self._done_at = None
            self._sent_at = now
        self._in_flight += 1

    def done(self, now: float, worker_s: float, device_s: float, graphed: bool = False, early: bool = False) -> None:
        """Rank 0's answer to the oldest step in flight came at ``now``."""
        self.early_steps += early
        if graphed:
            self.graph_steps += 1
            self.graph_device_s += device_s
        self._in_flight = max(0, self._in_flight - 1)
        if self._in_flight == 0 and self._sent_at is not None:
            self.round_trip_s += now - self._sent_at
            self._sent_at = None
            self._done_at = now
        self.steps += 1
        self.worker_s += worker_s
        self.device_s += device_s

    def idle(self) -> None:
        """No step followed the last answer: the gap since it is idle time, not overhead."""
        self._done_at = None


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
