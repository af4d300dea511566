"""Prometheus metrics of one frontend, in a registry of its own (never the process-global one, so two apps
in one process — tests — do not collide). Scheduler-side gauges come from :class:`SchedulerStats`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from stride.ipc.messages import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontendMetrics:
    """Counters, gauges and latency histograms the frontend exports on ``/metrics``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        reg = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=reg)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=reg)

        self.requests_running = gauge("stride:num_requests_running", "Requests in flight at the frontend.")
        self.requests_waiting = gauge("stride:num_requests_waiting", "Sequences waiting at the scheduler.")
        self.seqs_running = gauge("stride:num_seqs_running", "Sequences running at the scheduler.")
        self.blocks_live = gauge("stride:kv_blocks_live", "KV blocks referenced by running sequences.")
        self.blocks_cached = gauge("stride:kv_blocks_cached", "KV blocks unreferenced but still indexed.")
        self.blocks_free = gauge("stride:kv_blocks_free", "KV blocks with no content.")
        self.preemptions = counter("stride:num_preemptions", "Sequences preempted by the scheduler.")
        self.prompt_tokens = counter("stride:prompt_tokens", "Prompt tokens of finished sequences.")
        self.generation_tokens = counter("stride:generation_tokens", "Generated tokens.")
        self.cache_queries = counter("stride:prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.cache_hits = counter("stride:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.request_success = counter("stride:request_success", "Finished requests.", ("finished_reason",))
        self.request_failure = counter("stride:request_failure", "Requests answered with an error.",
                                       ("status",))
        self.ttft = histogram("stride:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("stride:inter_token_latency_seconds", "Time between successive output deltas.")
        self.e2e = histogram("stride:e2e_request_latency_seconds", "Time from arrival to the last token.")
        # The step timeline (stride.sched.stats.StepTimeline), running totals from the scheduler.
        self.steps = counter("stride:steps", "Steps the model worker answered.")
        self.step_device = counter("stride:step_device_seconds", "Device span of the steps (CUDA events; the "
                                   "worker's step time on a CPU).")
        self.step_worker = counter("stride:step_worker_seconds", "Rank 0's wall time on the steps.")
        self.step_round_trip = counter("stride:step_round_trip_seconds", "From a step's descriptor sent to its "
                                       "answer back at the scheduler.")
        self.step_gap = counter("stride:step_gap_seconds", "From a step's answer to the next step sent, when one "
                                "followed at once: the scheduler's share of busy time.")
        self.graph_steps = counter("stride:graph_steps", "Steps whose forward replayed a decode CUDA graph, or on a "
                                   "CPU ran the compiled decode step (the others ran eagerly).")
        self.graph_step_device = counter("stride:graph_step_device_seconds", "Device span of the graph steps.")
        self.early_steps = counter("stride:early_steps", "Steps the worker launched before reporting the step "
                                   "before (their input tokens taken on the device: no host round trip between).")
        self._labels = {"model_name": model_name}
        timeline = {"steps": self.steps, "step_device_s": self.step_device, "step_worker_s": self.step_worker,
                    "step_round_trip_s": self.step_round_trip, "step_gap_s": self.step_gap,
                    "graph_steps": self.graph_steps, "graph_step_device_s": self.graph_step_device,
                    "early_steps": self.early_steps}
        for metric in timeline.values():
            self.lbl(metric)  # exported as 0 from the start, so a reader's "before" exists before the first step
        # SchedulerStats field holding a running total → the counter it advances, and the total seen so far.
        self.grammars_built = counter("stride:grammars_built", "Structured-output grammars built into a matcher "
                                      "by the scheduler (a grammar seen again is copied, not built).")
        self.lbl(self.grammars_built)
        self._totals: dict[str, Counter] = {"num_preemptions": self.preemptions, "grammars_built": self.grammars_built,
                                            **timeline}
        self._seen = dict.fromkeys(self._totals, 0.0)

    def lbl(self, metric, **extra: str):  # type: ignore[no-untyped-def]
        return metric.labels(**self._labels, **extra)

    def update_scheduler(self, stats: SchedulerStats) -> None:
        """The metrics hook for the scheduler's periodic :class:`SchedulerStats`."""
        self.lbl(self.seqs_running).set(stats.num_running_seqs)
        self.lbl(self.requests_waiting).set(stats.num_waiting_seqs)
        self.lbl(self.blocks_live).set(stats.num_blocks_live)
        self.lbl(self.blocks_cached).set(stats.num_blocks_cached)
        self.lbl(self.blocks_free).set(stats.num_blocks_free)
        for name, metric in self._totals.items():
            total = float(getattr(stats, name))
            if total > self._seen[name]:
                self.lbl(metric).inc(total - self._seen[name])
                self._seen[name] = total

    def sequence_done(self, num_prompt: int, num_cached: int, num_output: int) -> None:
        self.lbl(self.prompt_tokens).inc(num_prompt)
        self.lbl(self.cache_queries).inc(num_prompt)
        self.lbl(self.cache_hits).inc(num_cached)
        self.lbl(self.generation_tokens).inc(num_output)

    def render(self) -> bytes:
        return generate_latest(self.registry)
