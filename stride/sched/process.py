"""The scheduler process: the one place that reads the clock, once per loop, and passes it down. (The step
timeline, :class:`~stride.sched.stats.StepTimeline`, reads a performance counter of its own: it measures, it
decides nothing.)

It pulls :class:`TokenizedRequest`, :class:`AbortRequest` and rank 0's :class:`StepDone` at
``scheduler_address``; it writes each step into the shared step buffers and pushes a
:class:`StepDescriptor` to rank 0; it pushes each step's outputs to the tokenizer that owns each request,
and refusals and :class:`SchedulerStats` to the frontend. With ``SchedulerConfig.overlap`` (the default) the next
step is built and sent while one runs (:meth:`~stride.sched.scheduler.Scheduler.schedule_ahead`), so rank 0 finds
it waiting when it finishes: up to two steps are in flight. A step built ahead that samples under a grammar gets
its masks once the step before is applied (they depend on its tokens), while it runs; rank 0 waits for them only
before it samples.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from stride.config import StrideConfig
from stride.ipc import messages as m
from stride.ipc.layouts import MaskBuffer, StepBuffers, StepLayout
from stride.ipc.queues import PullQueue, PushQueue
from stride.sched.plan import StepPlan
from stride.sched.scheduler import Scheduler
from stride.sched.stats import StepTimeline
from stride.sched.trace import TraceWriter
from stride.tokenizer.loader import load_tokenizer

if TYPE_CHECKING:
    from stride.grammar.matchers import GrammarMatchers

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 50


class _WorkerFailed(Exception):
    """Rank 0 reported a failed step: the requests are failed and the launcher told; the loop ends."""


class SchedulerLoop:
    """Message handling around :class:`Scheduler`; the socket loop is :func:`run`."""

    def __init__(self, config: StrideConfig, buffers: StepBuffers, eos_token_ids: list[int],
                 trace: TraceWriter | None = None, grammar: GrammarMatchers | None = None,
                 bitmask: np.ndarray | None = None) -> None:
        """``grammar`` and ``bitmask`` (the token-bitmask segment's array): structured outputs; without them a
        request with a grammar is refused."""
        self.config = config
        self.buffers = buffers
        self.grammar = grammar
        self.bitmask = bitmask
        self._masked: dict[int, list[tuple[str, int]]] = {}
        """Step -> (req_id, row) of its rows that sample under a mask, while it is in flight."""
        self._filled: set[int] = set()
        """Steps in flight whose masks are written."""
        self.core = Scheduler(config.scheduler, config.cache, buffers, eos_token_ids=eos_token_ids, trace=trace)
        # req_id -> (owning tokenizer, top-N logprobs asked for or None): one entry, so it ends in one place.
        self.routes: dict[str, tuple[int, int | None]] = {}
        self.overlap = config.scheduler.overlap
        self.timeline = StepTimeline()

    def on_request(self, req: m.TokenizedRequest, now: float) -> m.RequestFailed | None:
        if req.grammar is not None and (self.grammar is None or self.bitmask is None):
            return m.RequestFailed(req.req_id, 400, "structured outputs are not available on this server (its "
                                   "matchers could not be built: see the scheduler's log)", "invalid_constraint")
        try:
            refusal = self.core.add_request(req.req_id, req.tenant, req.prompt_token_ids, req.params,
                                            req.service_class, now)
        except ValueError as e:
            return m.RequestFailed(req.req_id, 400, str(e), "invalid_request")
        except Exception as e:  # a fault in admitting one request fails that request, not the scheduler
            log.exception("scheduler: request %s failed", req.req_id)
            self.core.abort(req.req_id, now)
            return m.RequestFailed(req.req_id, 500, f"internal error: {type(e).__name__}", "internal_error")
        if refusal is not None:
            return m.RequestFailed(req.req_id, refusal.status, refusal.message, refusal.reason)
        if req.grammar is not None and self.grammar is not None:
            from stride.grammar.matchers import MatcherError  # loaded: self.grammar was built from it

            try:
                self.grammar.add(req.req_id, req.grammar)
            except MatcherError as e:
                self.core.abort(req.req_id, now)
                return m.RequestFailed(req.req_id, 400, str(e), "invalid_constraint")
        self.routes[req.req_id] = (req.tokenizer_index, req.params.logprobs)
        return None

    def on_abort(self, req_id: str, now: float) -> None:
        self.core.abort(req_id, now)
        self.routes.pop(req_id, None)
        if self.grammar is not None:
            self.grammar.drop(req_id)

    @property
    def inflight(self) -> list[StepPlan]:
        """Sent and not yet answered, oldest first (the core's: every step it decided is sent)."""
        return self.core.inflight

    def next_step(self, now: float) -> m.StepDescriptor | None:
        """The next step to send: built now if nothing is in flight, ahead if one step is and overlapping is on;
        None if there is none."""
        if len(self.inflight) > 1 or not self.core.has_work():
            return None
        if self.inflight:
            if not self.overlap:
                return None
            plan = self.core.schedule_ahead(now)
            if plan is None:
                return None
        else:
            plan = self.core.schedule(now)
            if plan.num_seqs == 0:
                return None
        desc = plan.descriptor()
        if self.grammar is not None and len(self.grammar):
            g = self.grammar
            masked = [(rid, i) for i, (rid, samples) in enumerate(zip(plan.req_ids, plan.sample_flags.tolist(),
                                                                      strict=True)) if samples and rid in g]
            if masked:
                self._masked[plan.step] = masked
                desc = replace(desc, masked_rows=[i for _, i in masked])
        return desc

    def fill_masks(self) -> m.MasksReady | None:
        """Write the bitmask rows of the step just sent, if it was built with none before it (called after its
        descriptor went out, so this runs while the forward does); the message that tells rank 0 they are there,
        or None. A step built ahead gets its masks after the update of the step before (:meth:`masks_after_update`):
        they depend on that step's tokens."""
        if len(self.inflight) != 1:
            return None
        return self._fill(self.inflight[0].step)

    def masks_after_update(self) -> m.MasksReady | None:
        """After an update with a step built ahead still in flight: that step's masks, now that its matchers have
        every token before it."""
        return self._fill(self.inflight[0].step) if self.inflight else None

    def _fill(self, step: int) -> m.MasksReady | None:
        rows = self._masked.get(step)
        if not rows or step in self._filled:
            return None
        assert self.grammar is not None and self.bitmask is not None
        live = [(rid, row) for rid, row in rows if rid in self.grammar]
        for rid, row in rows:
            if rid not in self.grammar:  # ended since (grammar complete, aborted): its token will be dropped
                self.bitmask[row] = -1
        self.grammar.fill(live, self.bitmask)
        self._filled.add(step)
        return m.MasksReady(step)

    def on_step_done(self, done: m.StepDone, now: float) -> dict[int, list[m.TokenOutput]]:
        """The step's outputs grouped by owning tokenizer. A sequence the worker failed alone ends with an
        error: it is aborted before the update, so its row's token is dropped and its blocks freed."""
        if not self.inflight or done.step != self.inflight[0].step:
            raise RuntimeError(f"StepDone for step {done.step}, in flight: {[p.step for p in self.inflight]}")
        plan = self.inflight[0]  # the core's update below retires it
        out = self.buffers.bank(plan.bank)
        by_owner: dict[int, list[m.TokenOutput]] = defaultdict(list)
        for failure in done.failed:
            log.error("rank 0 failed request %s: %s", failure.req_id, failure.error)
            self.core.abort(failure.req_id, now)
            if self.grammar is not None:
                self.grammar.drop(failure.req_id)
            failed_route = self.routes.pop(failure.req_id, None)
            if failed_route is not None:
                by_owner[failed_route[0]].append(m.TokenOutput(failure.req_id, [], "error",
                                                               error=f"worker error: {failure.error}"))
        n = plan.num_seqs
        sampled = np.array(out.sampled_ids[:n])
        stop_rows = self._advance_matchers(plan.step, sampled, by_owner, now)
        batch = self.core.update(plan, sampled, now, stop_rows)
        finished = batch.finished
        if self.grammar is not None:
            for req_id in finished:
                self.grammar.drop(req_id)
        # Columns of the batch, walked once; every row has exactly one token.
        for req_id, row, tok, num_prompt, num_cached in zip(
                batch.req_ids, batch.rows.tolist(), batch.token_ids.tolist(), batch.num_prompt_tokens.tolist(),
                batch.num_cached_tokens.tolist(), strict=True):
            route = self.routes.get(req_id)
            if route is None:
                continue
            owner, k = route
            lp = top = None
            if k is not None:
                lp = [float(out.logprobs[row])]
                top = [[[int(t), float(v)] for t, v in zip(out.top_ids[row, :k].tolist(),
                                                            out.top_logprobs[row, :k].tolist(),
                                                            strict=True)]]
            reason = finished.get(req_id)
            by_owner[owner].append(m.TokenOutput(req_id, [tok], reason, num_prompt, num_cached, lp, top))
            if reason is not None:
                del self.routes[req_id]
        return by_owner

    def _advance_matchers(self, step: int, sampled: np.ndarray, by_owner: dict[int, list[m.TokenOutput]],
                          now: float) -> list[int]:
        """Give each constrained row's matcher its sampled token; the rows whose grammar is now complete. A matcher
        that refuses its token (it cannot: the token was drawn under its mask) fails that request alone."""
        stop_rows: list[int] = []
        if self.grammar is None:
            return stop_rows
        from stride.grammar.matchers import MatcherError  # loaded: self.grammar was built from it

        rows = self._masked.pop(step, [])
        self._filled.discard(step)
        for req_id, row in rows:
            tok = int(sampled[row])
            if tok < 0 or req_id not in self.grammar:  # failed alone, or aborted while in flight
                continue
            try:
                if self.grammar.consume(req_id, tok):
                    stop_rows.append(row)
            except MatcherError as e:
                log.error("request %s: %s", req_id, e)
                route = self.routes.get(req_id)
                self.on_abort(req_id, now)
                if route is not None:
                    by_owner[route[0]].append(m.TokenOutput(req_id, [], "error", error=str(e)))
        return stop_rows

    def fail_all(self, message: str) -> dict[int, list[m.TokenOutput]]:
        """Every request ends with an error (the worker failed)."""
        by_owner: dict[int, list[m.TokenOutput]] = defaultdict(list)
        for req_id, (owner, _) in self.routes.items():
            by_owner[owner].append(m.TokenOutput(req_id, [], "error", error=message))
        self.routes.clear()
        return by_owner

    def stats(self) -> m.SchedulerStats:
        t = self.timeline
        return replace(self.core.metrics().to_message(), steps=t.steps, step_device_s=t.device_s,
                       step_worker_s=t.worker_s, step_round_trip_s=t.round_trip_s, step_gap_s=t.gap_s,
                       graph_steps=t.graph_steps, graph_step_device_s=t.graph_device_s,
                       early_steps=t.early_steps,
                       grammars_built=self.grammar.built if self.grammar is not None else 0)


def _grammar_matchers(config: StrideConfig) -> GrammarMatchers | None:
    """The structured-output matchers over the model's tokenizer; None (constrained requests refused) where the
    model has no tokenizer of its own (a simulated backend's planner preset) or its vocabulary is not known."""
    if not config.facts.vocab_size:
        return None
    try:
        tok = load_tokenizer(config.worker.model)
    except Exception as e:  # no tokenizer files: the server runs, structured outputs are refused
        log.warning("structured outputs off: no tokenizer for %s (%s)", config.worker.model, e)
        return None
    try:
        from stride.grammar.matchers import GrammarMatchers
    except ImportError as e:  # a broken install: the server runs, structured outputs are refused
        log.error("structured outputs off: %s", e)
        return None
    try:
        return GrammarMatchers(tok.tokenizer.to_str(), config.facts.vocab_size, tok.eos_token_ids)
    except Exception:  # llguidance refused this tokenizer: the same, with the reason in the log
        log.exception("structured outputs off: llguidance could not take %s's tokenizer", config.worker.model)
        return None


def run(config: StrideConfig) -> int:
    """Process entry point. The launcher created the step buffers; this process attaches them."""
    ctx = zmq.Context()
    control: PushQueue[m.Message] = PushQueue(ctx, config.ipc.control_address())
    buffers = None
    masks: MaskBuffer | None = None
    trace = None
    try:
        buffers = StepBuffers.attach(config.ipc, StepLayout.from_config(config.scheduler, config.cache))
        trace = TraceWriter(config.scheduler.trace_path) if config.scheduler.trace_path else None
        grammar = _grammar_matchers(config)
        if grammar is not None:
            masks = MaskBuffer.attach(config.ipc, config.scheduler.max_num_seqs, config.facts.vocab_size)
        loop = SchedulerLoop(config, buffers, list(config.facts.eos_token_ids), trace, grammar,
                             masks.bitmask if masks is not None else None)
        inbox: PullQueue[m.Message] = PullQueue(ctx, config.ipc.scheduler_address(),
                                                m.TO_SCHEDULER + (m.Shutdown,))
        to_worker: PushQueue[m.Message] = PushQueue(ctx, config.ipc.worker_address())
        to_tok = [PushQueue[m.Message](ctx, config.ipc.tokenizer_address(i))
                  for i in range(config.server.tokenizer_workers)]
        to_front: PushQueue[m.Message] = PushQueue(ctx, config.ipc.frontend_address())
        control.put(m.ProcessReady("scheduler", 0, num_blocks=config.cache.num_blocks))
        last_stats = 0.0
        now = arrived = 0.0

        def tokenized(msg: m.TokenizedRequest) -> None:
            failed = loop.on_request(msg, now)
            if failed is not None:
                to_front.put(failed)
                to_tok[msg.tokenizer_index].put(m.ReleaseRequest(msg.req_id))

        def step_done(msg: m.StepDone) -> None:
            if msg.error is not None:
                log.error("rank 0 failed step %d: %s", msg.step, msg.error)
                for owner, outs in loop.fail_all(f"worker error: {msg.error}").items():
                    to_tok[owner].put(m.StepOutputs(outs))
                to_front.put(m.RequestFailed("", 503, "the model worker failed", "worker_dead"))
                control.put(m.ProcessFailed("scheduler", f"worker step failed: {msg.error}"))
                raise _WorkerFailed
            loop.timeline.done(arrived, msg.worker_s, msg.device_s, msg.graphed, msg.early)
            for owner, outs in loop.on_step_done(msg, now).items():
                to_tok[owner].put(m.StepOutputs(outs))
            ready = loop.masks_after_update()  # the step built ahead's masks, while it runs
            if ready is not None:
                to_worker.put(ready)

        handlers: dict[type, Callable[[Any], None]] = {
            m.TokenizedRequest: tokenized,
            m.AbortRequest: lambda msg: loop.on_abort(msg.req_id, now),
            m.StepDone: step_done,
        }
        while True:
            # Blocks until a message arrives: with a step in flight that is its StepDone.
            first = inbox.get(timeout_ms=IDLE_POLL_MS)
            msgs = ([first] if first is not None else []) + inbox.drain()
            arrived = time.perf_counter()
            now = time.monotonic()
            for msg in msgs:
                if isinstance(msg, m.Shutdown):
                    return 0
                handlers[type(msg)](msg)
            sent = False
            while (desc := loop.next_step(now)) is not None:  # with overlap, the next one is built at once
                # Stamped before the send: rank 0 may take the descriptor before put returns here.
                loop.timeline.sent(time.perf_counter())
                to_worker.put(desc)
                sent = True
                ready = loop.fill_masks()  # while the forward runs
                if ready is not None:
                    to_worker.put(ready)
            if not sent and not loop.inflight:
                loop.timeline.idle()
            if now - last_stats >= STATS_INTERVAL_S:
                to_front.put(loop.stats())
                last_stats = now
    except _WorkerFailed:
        return 1
    except Exception as e:
        log.exception("scheduler failed")
        control.put(m.ProcessFailed("scheduler", f"{type(e).__name__}: {e}"))
        return 1
    finally:
        if trace is not None:
            trace.close()
        if buffers is not None:
            buffers.close()
        if masks is not None:
            masks.close()
        ctx.destroy(linger=200)
