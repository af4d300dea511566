"""The scheduler core: one step at a time, in logical time.

Each :meth:`Scheduler.schedule` call decides one step under ``max_num_batched_tokens`` and the block pool:

1. **decodes first** -- every running sequence with one token left to run gets it, if its block can be
   appended; under memory pressure the running sequence with the most slack is preempted (its blocks
   released, full ones staying cached; its tokens kept; back in the waiting queue);
2. **running prefills** continue into the remaining budget (least slack first);
3. **admission** by slack (deadline - now) from the waiting queue, each admitted request taking blocks for
   all its tokens (reusing its tenant's cached prefix) and a first prefill chunk of what budget is left.

:meth:`Scheduler.update` then applies the step's sampled tokens. ``schedule`` is called with no step in flight;
:meth:`Scheduler.schedule_ahead` builds the next step while one is in flight (overlapped scheduling): its decodes
take the in-flight step's tokens on the device, it preempts nothing, and it may decline, changing nothing. So at
most two steps are in flight, and ``update`` takes them in order. Per-slot numpy arrays carry the state the
decode path needs, so a step with a thousand decodes is a few vector operations plus the block
manager's per-slot calls. Nothing here reads the wall clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stride.config import CacheConfig, SchedulerConfig
from stride.params import SamplingParams
from stride.sched.block_manager import BlockManager
from stride.sched.plan import Rejection, StepArraysLike, StepPlan, Update, UpdateBatch
from stride.sched.queue import WaitingQueue
from stride.sched.request import Request, RequestStatus
from stride.sched.slots import SlotTable
from stride.sched.stats import SchedulerCounters, SchedulerMetrics
from stride.sched.step_builder import build_step
from stride.sched.trace import TraceWriter


class Scheduler:
    """Owns the request table, the waiting queue and the block manager (over ``buffers.block_tables``).

    ``buffers`` is any object with the step arrays of :class:`~stride.sched.plan.StepArraysLike` (the
    shared-memory :class:`~stride.ipc.layouts.StepBuffers` in production, plain arrays in tests).
    """

    def __init__(self, sched_cfg: SchedulerConfig, cache_cfg: CacheConfig, buffers: StepArraysLike, *,
                 eos_token_ids: Sequence[int] = (), trace: TraceWriter | None = None) -> None:
        self.cfg = sched_cfg
        self.cache_cfg = cache_cfg
        self.buffers = buffers
        self.block_size = cache_cfg.block_size
        self.bm = BlockManager(cache_cfg.num_blocks, cache_cfg.block_size, buffers.block_tables,
                               enable_prefix_caching=cache_cfg.enable_prefix_caching)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._eos = np.array(self.eos_token_ids, dtype=np.int64)
        self.waiting = WaitingQueue(sched_cfg.max_waiting_requests, sched_cfg.max_waiting_tokens)
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self._trace = trace
        self.slots = SlotTable(sched_cfg.max_num_seqs)
        self._inflight: list[StepPlan] = []
        """Oldest first; at most two."""
        self._step = 0
        self._seq_counter = 0
        if trace is not None:
            trace.write_config(sched_cfg, cache_cfg, self.eos_token_ids)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req_id: str, tenant: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    service_class: str | None, now: float) -> Rejection | None:
        """Queue a request, or refuse it at once. Unknown ``service_class`` or a duplicate ``req_id``:
        ``ValueError``. A prompt that can never run (longer than max_model_len or than the block pool can
        hold with its output) is refused as ``too_long``; a full queue as ``queue_full``/``overloaded``."""
        klass = self.cfg.service_class(service_class)
        if req_id in self.requests:
            raise ValueError(f"duplicate req_id {req_id!r}")
        prompt = [int(t) for t in prompt_token_ids]
        rejection = self._refusal(prompt, params)
        if self._trace is not None:
            self._trace.write("add", now, req_id=req_id, tenant=tenant, prompt=prompt, params=params,
                              service_class=service_class, rejected=rejection and rejection.reason)
        if rejection is not None:
            self.counters.rejections[rejection.reason] = self.counters.rejections.get(rejection.reason, 0) + 1
            return rejection
        req = Request(req_id, tenant, prompt, params, klass, now, self._seq_counter)
        self._seq_counter += 1
        req.max_len = min(len(prompt) + self._max_new_tokens(len(prompt), params), self.cfg.max_model_len)
        self.requests[req_id] = req
        self.waiting.push(req)
        return None

    def _refusal(self, prompt: list[int], params: SamplingParams) -> Rejection | None:
        n = len(prompt)
        if n == 0:
            return Rejection("too_long", "empty prompt")
        if n >= self.cfg.max_model_len:
            return Rejection("too_long", f"prompt of {n} tokens; max_model_len is {self.cfg.max_model_len} "
                                         "(prompt plus at least one output token)")
        # Admission takes blocks for all tokens at once, so a request that cannot fit the whole pool
        # alone could never run.
        max_new = self._max_new_tokens(n, params)
        need = -(-min(n + max_new, self.cfg.max_model_len) // self.block_size)
        if need > self.cache_cfg.num_blocks:
            return Rejection("too_long", f"prompt ({n}) plus max_tokens ({max_new}) needs {need} "
                                         f"KV blocks; the pool has {self.cache_cfg.num_blocks}")
        why = self.waiting.refusal(n)
        if why == "queue_full":
            return Rejection(why, f"{len(self.waiting)} requests waiting (limit {self.waiting.max_requests})")
        if why == "overloaded":
            return Rejection(why, f"{self.waiting.num_tokens} tokens waiting; {n} more would pass the "
                                  f"limit of {self.waiting.max_tokens}")
        return None

    def _max_new_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """``max_tokens``, or the rest of the context where the request left it open."""
        return params.max_tokens if params.max_tokens is not None else self.cfg.max_model_len - num_prompt

    def abort(self, req_id: str, now: float) -> Update | None:
        """Stop a request (client gone). Its blocks and slot are freed now, or -- when it is in the step
        in flight, whose block-table rows the workers are reading -- at that step's :meth:`update`.
        Returns the final update (``finish_reason="abort"``), or None for an unknown/finished request."""
        req = self.requests.get(req_id)
        if self._trace is not None:
            self._trace.write("abort", now, req_id=req_id)
        if req is None or req.aborted:
            return None
        req.aborted = True
        self.counters.num_aborted += 1
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._finish(req, "abort")
        elif not self.slots.in_step[req.slot]:
            self._finish(req, "abort")
        else:
            self.slots.aborted[req.slot] = True
        return Update(req_id, [], "abort", req.num_prompt_tokens, req.num_cached_tokens)

    def _finish(self, req: Request, reason: str) -> None:
        """``req`` ends. Its slot and blocks are freed now, or -- while a step built ahead still holds the slot --
        at that step's update (the slot is marked ``aborted``: it gets no more tokens)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        if req.slot >= 0:
            if self.slots.in_step[req.slot]:
                self.slots.aborted[req.slot] = True
            else:
                self._free_slot(req)
        del self.requests[req.req_id]
        self.counters.num_finished += 1

    def _free_slot(self, req: Request) -> None:
        self.bm.free(req.slot)
        self._drop_slot(req)

    def _drop_slot(self, req: Request) -> None:
        self.slots.release(req.slot)
        req.slot = -1

    def preempt(self, slot: int, plan_preempted: list[str]) -> None:
        """Release the sequence in ``slot`` (its full blocks stay cached), keep its tokens, and queue it again."""
        req = self.slots.req[slot]
        assert req is not None
        self.bm.release(slot)
        self._drop_slot(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        plan_preempted.append(req.req_id)
        self.waiting.push(req)

    def admit(self, req: Request, slot: int) -> int:
        """Give ``req`` a slot and blocks for all its tokens; returns tokens served by the prefix cache."""
        num_cached = self.bm.allocate(slot, req.tenant, req.token_ids)
        if req.num_preemptions:
            self.counters.num_resumptions += 1
        else:
            req.num_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        req.slot = slot
        req.num_computed_tokens = num_cached
        self.slots.bind(slot, req, num_cached)
        return num_cached

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float) -> StepPlan:
        """Decide the next step and write it into the step buffers (bank 0). An empty plan (``num_seqs == 0``)
        changes nothing: it need not be sent, and needs no :meth:`update`."""
        if self._inflight:
            raise RuntimeError(f"schedule() called before update() of step {self._inflight[0].step}")
        plan = build_step(self, now)
        assert plan is not None  # only a step built ahead declines
        self._record(plan, now)
        return plan

    def schedule_ahead(self, now: float) -> StepPlan | None:
        """Decide the step after the one in flight, in the other bank, before that one's tokens are known: each
        sequence it samples decodes on that token (it cannot finish by length there, as that is known); one that
        then finishes on EOS or a stop token costs its slot of this step, which yields nothing. None, having changed
        nothing, when there is nothing to run or the step would need more than the budget or the pool has for its
        decodes (then :meth:`schedule` decides it after the update, preempting if it must)."""
        if len(self._inflight) != 1:
            raise RuntimeError(f"schedule_ahead() needs exactly one step in flight, not {len(self._inflight)}")
        prev = self._inflight[0]
        plan = build_step(self, now, 1 - prev.bank, prev)
        if plan is None or plan.num_seqs == 0:
            return None
        self._record(plan, now)
        return plan

    def _record(self, plan: StepPlan, now: float) -> None:
        if plan.num_seqs:
            self._step += 1
            self._inflight.append(plan)
            self.slots.in_step[plan.slots] += 1
        if self.cache_cfg.check_invariants:
            self.bm.assert_invariants()
        if self._trace is not None:
            extra = {"ahead": True} if plan.ahead else {}
            self._trace.write("schedule", now, step=plan.step, decisions=plan.decisions(), **extra)

    @property
    def inflight(self) -> list[StepPlan]:
        """The steps in flight, oldest first."""
        return list(self._inflight)

    def update(self, plan: StepPlan, sampled_ids: np.ndarray, now: float,
               stop_rows: Sequence[int] = ()) -> UpdateBatch:
        """Apply step ``plan``'s sampled tokens (row ``i`` of ``sampled_ids`` belongs to row ``i`` of the
        plan; rows that do not sample are ignored). Appends tokens, ends requests on max_tokens /
        max_model_len (``length``) or EOS / a stop token (``stop``), frees what finished. ``stop_rows``: plan rows
        whose token completed their output's grammar (structured outputs): they end with ``stop`` too. Returns
        the step's news in columns (iterate it for one :class:`Update` per request)."""
        if plan.num_seqs == 0:
            return UpdateBatch.empty()
        if not self._inflight or plan is not self._inflight[0]:
            raise RuntimeError(f"update() for step {plan.step}, but the oldest step in flight is "
                               f"{self._inflight[0].step if self._inflight else None}")
        self._inflight.pop(0)
        n = plan.num_seqs
        slots = plan.slots
        self.slots.in_step[slots] -= 1
        sampled = np.asarray(sampled_ids[:n], dtype=np.int64)
        if self._trace is not None:
            extra = {"stop_rows": [int(r) for r in stop_rows]} if len(stop_rows) else {}
            self._trace.write("update", now, step=plan.step,
                              sampled=np.where(plan.sample_flags, sampled, -1).tolist(), **extra)
        rows = np.flatnonzero(plan.sample_flags & ~self.slots.aborted[slots])  # no token for an aborted one
        s_slots = slots[rows]
        toks = sampled[rows]
        new_len = self.slots.num_tokens[s_slots] + 1
        self.slots.num_tokens[s_slots] = new_len
        self.slots.last_token[s_slots] = toks
        deadlines = now + self.slots.itl[s_slots]
        self.slots.deadline[s_slots] = deadlines
        num_computed = self.slots.num_computed[s_slots]
        # 0 = runs on, 1 = stop (EOS), 2 = length; stop token ids are checked per request below.
        verdict = np.where(new_len >= self.slots.max_len[s_slots], 2, 0)
        if len(self._eos):
            verdict[np.isin(toks, self._eos) & self.slots.stop_on_eos[s_slots]] = 1
        verdict[self.slots.has_stop_ids[s_slots] & (verdict != 1)] = -1
        if len(stop_rows):
            verdict[np.isin(rows, np.asarray(stop_rows, dtype=np.int64))] = 1

        # The Request objects stay exact. One lean loop of attribute writes (no branch, no object made per
        # row; everything else is vectorised above or limited to the few rows that need it below).
        reqs: list[Request] = self.slots.reqs[s_slots].tolist()
        tok_list: list[int] = toks.tolist()
        for req, tok, dl, nc in zip(reqs, tok_list, deadlines.tolist(), num_computed.tolist(), strict=True):
            req.output_token_ids.append(tok)
            req.last_token_time = now
            req.deadline = dl
            req.num_computed_tokens = nc
        first = np.flatnonzero(~self.slots.has_first[s_slots])
        if first.size:
            self.slots.has_first[s_slots[first]] = True
            for i in first.tolist():
                reqs[i].first_token_time = now
        for i in np.flatnonzero(verdict == -1).tolist():
            req = reqs[i]
            verdict[i] = 1 if tok_list[i] in req.params.stop_token_ids else (2 if new_len[i] >= req.max_len else 0)
        if self._inflight and self._inflight[0].ahead_slots is not None:
            self._owed_tokens(self._inflight[0].ahead_slots, s_slots, toks, verdict)

        req_ids = plan.req_ids
        batch = UpdateBatch(req_ids=list(req_ids) if len(rows) == n else [req_ids[i] for i in rows.tolist()],
                            rows=rows, token_ids=toks, num_prompt_tokens=self.slots.num_prompt[s_slots],
                            num_cached_tokens=self.slots.num_cached[s_slots])
        for i in np.flatnonzero(verdict).tolist():  # in row order, as a replay expects
            req = reqs[i]
            reason = "stop" if verdict[i] == 1 else "length"
            batch.finished[req.req_id] = reason
            self._finish(req, reason)
        ended = self.slots.aborted[slots] & (self.slots.in_step[slots] == 0)
        for slot in slots[ended].tolist():  # ended in flight: free now that no step holds the slot
            req = self.slots.req[slot]
            assert req is not None
            if req.status is RequestStatus.FINISHED:  # finished while a step built ahead held it
                self._free_slot(req)
            else:
                self._finish(req, "abort")
        return batch

    def _owed_tokens(self, ahead_slots: np.ndarray, s_slots: np.ndarray, toks: np.ndarray,
                     verdict: np.ndarray) -> None:
        """The step built ahead decodes ``ahead_slots`` on the tokens this update brings: the block manager gets
        them in place of its placeholders, and the blocks they filled are indexed (only of sequences that run
        on: a finished one's slot is freed after that step)."""
        got = np.isin(s_slots, ahead_slots)
        if not got.any():
            return
        owed, owed_toks = s_slots[got], toks[got]
        self.bm.set_last_tokens(owed, owed_toks)
        on = verdict[got] == 0
        self.bm.mark_computed_many(owed[on], self.slots.num_computed[owed[on]])

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> SchedulerMetrics:
        """A snapshot of the counters the scheduler process exports."""
        c, b = self.counters, self.bm.stats
        return SchedulerMetrics(
            num_running_seqs=self.num_running, num_waiting_seqs=len(self.waiting),
            num_waiting_tokens=self.waiting.num_tokens, num_blocks_live=b.num_live,
            num_blocks_cached=b.num_cached, num_blocks_free=b.num_free, num_preemptions=c.num_preemptions,
            num_resumptions=c.num_resumptions, num_finished=c.num_finished, num_aborted=c.num_aborted,
            num_rejections=sum(c.rejections.values()), prefix_hit_tokens=b.hit_tokens,
            prefix_query_tokens=b.query_tokens, num_evictions=b.num_evictions, num_steps=self.step)

    @property
    def step(self) -> int:
        """Number of the next non-empty step."""
        return self._step

    @property
    def num_running(self) -> int:
        return int(self.slots.running.sum())

    def has_work(self) -> bool:
        return bool(self.slots.running.any()) or len(self.waiting) > 0
