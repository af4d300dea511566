"""The body of :meth:`Scheduler.schedule`: decodes, preemption, running prefills, admission.

It reads and advances the scheduler's :class:`~stride.sched.slots.SlotTable` and asks the scheduler, through
the :class:`StepHost` interface, to admit or preempt; it never reaches into the scheduler's own fields.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from stride.config import SchedulerConfig
from stride.ipc.messages import NewSequence
from stride.sched.block_manager import BlockManager
from stride.sched.plan import StepArraysLike, StepPlan
from stride.sched.queue import WaitingQueue
from stride.sched.request import Request
from stride.sched.slots import SlotTable


class StepHost(Protocol):
    """What a step is built from: the scheduler, as the step builder sees it."""

    cfg: SchedulerConfig
    buffers: StepArraysLike
    bm: BlockManager
    waiting: WaitingQueue
    slots: SlotTable
    block_size: int

    @property
    def step(self) -> int: ...

    def admit(self, req: Request, slot: int) -> int: ...

    def preempt(self, slot: int, plan_preempted: list[str]) -> None: ...


def _by_slack(sched: StepHost, slots: np.ndarray) -> np.ndarray:
    """``slots`` ordered least slack first (earliest deadline; ties by arrival)."""
    return slots[np.lexsort((sched.slots.seq_no[slots], sched.slots.deadline[slots]))]


def _pick_victim(sched: StepHost, scheduled: np.ndarray) -> int:
    """The running sequence with the most slack among those not yet scheduled in this step (latest
    arrival on ties, so the oldest work is kept)."""
    cand = np.flatnonzero(sched.slots.running & ~scheduled)
    deadlines = sched.slots.deadline[cand]
    cand = cand[deadlines == deadlines.max()]
    return int(cand[np.argmax(sched.slots.seq_no[cand])])


def _decodes(sched: StepHost, budget: int, preempted: list[str]) -> np.ndarray:
    """Slots that run their one remaining token this step, with room appended for it. Preempts (most
    slack first) when the pool cannot give every decode its block."""
    bm = sched.bm
    running = np.flatnonzero(sched.slots.running)
    dec = running[sched.slots.num_tokens[running] - sched.slots.num_computed[running] == 1]
    over_budget = len(dec) > budget
    need = sched.slots.num_alloc[dec] < sched.slots.num_tokens[dec]
    num_new_blocks = int(np.count_nonzero(sched.slots.num_alloc[dec][need] % sched.block_size == 0))
    if not over_budget and num_new_blocks <= bm.num_available_blocks:
        appending = dec[need]
        bm.append_many(appending, sched.slots.last_token[appending])
        sched.slots.num_alloc[appending] += 1
        return dec
    # Slow path: least slack first; under pressure the most-slack unscheduled sequence gives way.
    scheduled = np.zeros(len(sched.slots.running), dtype=bool)
    kept: list[int] = []
    for slot in _by_slack(sched, dec).tolist():
        if len(kept) == budget:
            break
        if not sched.slots.running[slot]:
            continue  # preempted as a victim earlier in this loop
        if sched.slots.num_alloc[slot] < sched.slots.num_tokens[slot]:
            while not bm.can_append(slot):
                victim = _pick_victim(sched, scheduled)
                sched.preempt(victim, preempted)
                if victim == slot:
                    break
            if not sched.slots.running[slot]:
                continue
            bm.append(slot, int(sched.slots.last_token[slot]))
            sched.slots.num_alloc[slot] += 1
        kept.append(slot)
        scheduled[slot] = True
    return np.array(kept, dtype=np.int64)


def _decodes_ahead(sched: StepHost, budget: int, prev: StepPlan) -> tuple[np.ndarray, np.ndarray] | None:
    """The decodes of a step built while ``prev`` runs: (every decode slot, those whose input is ``prev``'s token).
    A sequence ``prev`` samples for decodes on the token it has not got yet, unless that token ends it by length; one
    that ended while in flight does not run. None, having changed nothing, when the budget or the pool cannot take
    every decode: the caller waits for ``prev`` and builds the step then (preemption is decided only there)."""
    st = sched.slots
    live = st.running & ~st.aborted
    owed = np.zeros(len(live), dtype=bool)
    owed[prev.slots[prev.sample_flags]] = True
    ahead = np.flatnonzero(live & owed & (st.num_tokens + 1 < st.max_len))
    known = np.flatnonzero(live & ~owed & (st.num_tokens - st.num_computed == 1))
    need = known[st.num_alloc[known] < st.num_tokens[known]]
    num_new_blocks = (int(np.count_nonzero(st.num_alloc[need] % sched.block_size == 0))
                      + int(np.count_nonzero(st.num_alloc[ahead] % sched.block_size == 0)))
    if len(ahead) + len(known) > budget or num_new_blocks > sched.bm.num_available_blocks:
        return None
    sched.bm.append_many(need, st.last_token[need])
    sched.bm.append_many(ahead, np.zeros(len(ahead), dtype=np.int64))  # the real token is written at prev's update
    st.num_alloc[need] += 1
    st.num_alloc[ahead] += 1
    return np.sort(np.concatenate([known, ahead])), ahead


def _tokens(req: Request, start: int, stop: int) -> list[int]:
    prompt = req.prompt_token_ids
    if stop <= len(prompt):
        return prompt[start:stop]
    return req.token_ids[start:stop]


def build_step(sched: StepHost, now: float, bank: int = 0, prev: StepPlan | None = None) -> StepPlan | None:
    """The next step, written into bank ``bank`` of the step arrays. With ``prev`` (the step in flight) it is built
    ahead: decodes of sequences ``prev`` samples take its token from the device, and nothing is preempted; None,
    having changed nothing, when that cannot be (then the step is built after ``prev`` ends)."""
    cfg = sched.cfg
    buf = sched.buffers.bank(bank)
    bm = sched.bm
    budget = cfg.max_num_batched_tokens
    preempted: list[str] = []
    ahead: np.ndarray | None = None

    # 1. Decodes, vectorised: token = the last sampled one, at position = tokens computed so far.
    if prev is None:
        dec = _decodes(sched, budget, preempted)
    else:
        got = _decodes_ahead(sched, budget, prev)
        if got is None:
            return None
        dec, ahead = got
    n = len(dec)
    pos = sched.slots.num_computed[dec]
    buf.token_ids[:n] = sched.slots.last_token[dec]
    if ahead is not None and len(ahead):
        assert prev is not None
        row_of = np.zeros(len(sched.slots.running), dtype=np.int64)
        row_of[prev.slots] = np.arange(prev.num_seqs)
        owed = np.isin(dec, ahead)
        buf.token_ids[:n][owed] = -1 - row_of[dec[owed]]  # "the token row r of prev samples"
        known = dec[~owed]
        bm.mark_computed_many(known, sched.slots.num_computed[known] + 1)  # the rest at prev's update
    else:
        bm.mark_computed_many(dec, pos + 1)  # indexes the blocks that just filled
    buf.positions[:n] = pos
    buf.seq_slots[:n] = dec
    buf.query_lens[:n] = 1
    buf.context_lens[:n] = pos + 1
    buf.sample_flags[:n] = 1
    sched.slots.num_computed[dec] = pos + 1
    budget -= n

    slots: list[int] = []
    qlens: list[int] = []
    starts: list[int] = []
    samples: list[bool] = []
    new_seqs: list[NewSequence] = []
    offset = n

    def run_chunk(slot: int, req: Request) -> None:
        nonlocal budget, offset
        start = int(sched.slots.num_computed[slot])
        total = int(sched.slots.num_tokens[slot])
        chunk = min(budget, total - start)
        end = start + chunk
        buf.token_ids[offset:offset + chunk] = _tokens(req, start, end)
        buf.positions[offset:offset + chunk] = np.arange(start, end)
        row = n + len(slots)
        buf.seq_slots[row] = slot
        buf.query_lens[row] = chunk
        buf.context_lens[row] = end
        buf.sample_flags[row] = end == total
        slots.append(slot)
        qlens.append(chunk)
        starts.append(start)
        samples.append(end == total)
        sched.slots.num_computed[slot] = end
        req.num_computed_tokens = end
        bm.mark_computed(slot, end)
        offset += chunk
        budget -= chunk

    # 2. Running prefills continue (they already hold their blocks), least slack first.
    if budget > 0:
        running = np.flatnonzero(sched.slots.running & ~sched.slots.aborted)
        pre = running[sched.slots.num_tokens[running] - sched.slots.num_computed[running] > 1]
        for slot in _by_slack(sched, pre).tolist():
            if budget == 0:
                break
            req = sched.slots.req[slot]
            assert req is not None
            run_chunk(slot, req)

    # 3. Admission by slack. The head waits if it cannot fit, and nobody passes it: letting smaller
    # requests overtake would starve long prompts. No admission in a step that had to preempt: the pool
    # is short, and the victim would come straight back on its own cached blocks.
    waiting = sched.waiting
    while budget > 0 and sched.slots.free and not preempted:
        head = waiting.peek()
        if head is None or not bm.can_allocate(head.tenant, head.token_ids):
            break
        waiting.pop()
        slot = sched.slots.claim()
        sched.admit(head, slot)
        new_seqs.append(NewSequence(slot, head.req_id, head.params, head.num_prompt_tokens))
        run_chunk(slot, head)

    all_slots = np.concatenate([dec, np.array(slots, dtype=np.int64)]).astype(np.int32)
    if len(all_slots) == 0:
        return StepPlan(sched.step, [], all_slots, all_slots.copy(), all_slots.copy(),
                        np.zeros(0, dtype=bool), preempted_ids=preempted, bank=bank)
    slot_ids = sched.slots.req_id
    req_ids = [slot_ids[s] for s in all_slots.tolist()]
    finished = sched.slots.take_freed()
    return StepPlan(
        step=sched.step,
        req_ids=req_ids,
        slots=all_slots,
        query_lens=np.concatenate([np.ones(n, dtype=np.int32), np.array(qlens, dtype=np.int32)]),
        start_positions=np.concatenate([pos, np.array(starts, dtype=np.int64)]).astype(np.int32),
        sample_flags=np.concatenate([np.ones(n, dtype=bool), np.array(samples, dtype=bool)]),
        new_seqs=new_seqs,
        finished_slots=finished,
        preempted_ids=preempted,
        bank=bank,
        ahead_slots=ahead,
    )
