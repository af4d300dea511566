"""The slot table: which request holds each sequence slot, and the per-slot counters the decode path reads as
vectors (a step with a thousand decodes is then a few numpy operations).

One owner: the :class:`~stride.sched.scheduler.Scheduler` holds the table and binds and releases its slots; the
step builder reads it and advances the counters of what it schedules. A slot's row is authoritative while its
request runs (:class:`~stride.sched.request.Request` mirrors what the replies need)."""

from __future__ import annotations

import heapq

import numpy as np

from stride.sched.request import Request


class SlotTable:
    """Rows for ``num_slots`` running sequences, the free slots (lowest first, so runs are deterministic) and
    the slots freed since the last step's plan."""

    def __init__(self, num_slots: int) -> None:
        self.req: list[Request | None] = [None] * num_slots
        self.reqs = np.full(num_slots, None, dtype=object)  # the same, for vector gathers
        self.req_id: list[str] = [""] * num_slots
        self.free = list(range(num_slots))  # a heap
        self.freed: list[int] = []
        """Freed since the last plan: the next descriptor names them so the worker drops their state before it
        sees a new sequence in a reused slot."""
        self.running = np.zeros(num_slots, dtype=bool)
        self.in_step = np.zeros(num_slots, dtype=np.int8)
        """Steps in flight that hold the slot (0, 1 or 2: with overlapped scheduling one is built ahead)."""
        self.num_tokens = np.zeros(num_slots, dtype=np.int64)
        self.num_computed = np.zeros(num_slots, dtype=np.int64)
        self.num_alloc = np.zeros(num_slots, dtype=np.int64)
        """Tokens recorded in the block manager."""
        self.last_token = np.zeros(num_slots, dtype=np.int64)
        self.deadline = np.zeros(num_slots, dtype=np.float64)
        self.seq_no = np.zeros(num_slots, dtype=np.int64)
        self.max_len = np.zeros(num_slots, dtype=np.int64)
        self.itl = np.zeros(num_slots, dtype=np.float64)
        self.stop_on_eos = np.zeros(num_slots, dtype=bool)
        self.has_stop_ids = np.zeros(num_slots, dtype=bool)
        self.aborted = np.zeros(num_slots, dtype=bool)
        """Ended (aborted, or finished while a step built ahead held it too) while a step in flight holds the slot: it
        gets no more tokens, and is freed at the update of the last step that holds it."""
        self.has_first = np.zeros(num_slots, dtype=bool)
        """The request's first token time is set."""
        self.num_prompt = np.zeros(num_slots, dtype=np.int64)
        self.num_cached = np.zeros(num_slots, dtype=np.int64)

    def claim(self) -> int:
        """The lowest free slot, taken."""
        return heapq.heappop(self.free)

    def bind(self, slot: int, req: Request, num_computed: int) -> None:
        """``req`` runs in ``slot`` with all its tokens allocated and ``num_computed`` of them already computed."""
        tokens = req.token_ids
        self.req[slot] = req
        self.reqs[slot] = req
        self.req_id[slot] = req.req_id
        self.has_first[slot] = req.first_token_time is not None
        self.num_prompt[slot] = req.num_prompt_tokens
        self.num_cached[slot] = req.num_cached_tokens
        self.running[slot] = True
        self.num_tokens[slot] = len(tokens)
        self.num_computed[slot] = num_computed
        self.num_alloc[slot] = len(tokens)
        self.last_token[slot] = tokens[-1]
        self.deadline[slot] = req.deadline
        self.seq_no[slot] = req.seq_no
        self.max_len[slot] = req.max_len
        self.itl[slot] = req.service_class.itl_ms / 1000.0
        self.stop_on_eos[slot] = not req.params.ignore_eos
        self.has_stop_ids[slot] = bool(req.params.stop_token_ids)

    def release(self, slot: int) -> None:
        """The slot's sequence left (finished, aborted or preempted); the slot is free again."""
        self.running[slot] = False
        self.aborted[slot] = False
        self.req[slot] = None
        self.reqs[slot] = None
        self.freed.append(slot)
        heapq.heappush(self.free, slot)

    def take_freed(self) -> list[int]:
        """The slots freed since the last call."""
        freed, self.freed = self.freed, []
        return freed

    def running_slots(self) -> np.ndarray:
        return np.flatnonzero(self.running)
