"""What one scheduler step hands out: the step plan, per-request updates, rejections, and plain-array
step buffers for tests, the simulator and replay."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from stride.config import CacheConfig, SchedulerConfig, max_blocks_per_seq
from stride.ipc.layouts import fill_placeholders
from stride.ipc.messages import NewSequence, StepDescriptor

# Rejection reasons and the HTTP status the frontend answers with.
REJECT_STATUS = {"queue_full": 429, "overloaded": 503, "too_long": 400}


@dataclass(frozen=True)
class Rejection:
    """A request refused at once (never queued). ``status`` is the HTTP status to answer with."""

    reason: str
    """``queue_full`` (429), ``overloaded`` (503) or ``too_long`` (400)."""
    message: str

    @property
    def status(self) -> int:
        return REJECT_STATUS[self.reason]


@dataclass(slots=True)
class Update:
    """One request's news from one step: new tokens, and the finish reason when it ended. (Not frozen:
    a step makes one per running sequence, and frozen construction costs twice as much.)"""

    req_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    """``stop`` (EOS or a stop token), ``length`` (max_tokens or max_model_len) or ``abort``."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class UpdateBatch:
    """Every request's news from one step, in columns (one row per request that got a token), so the
    scheduler builds no object per sequence. Row ``i``: request ``req_ids[i]``, at row ``rows[i]`` of the
    step plan, got token ``token_ids[i]``. ``finished`` maps each request that ended to its reason.
    Requests aborted while in flight have no row (their final :class:`Update` came from ``abort``).
    Iterating yields the per-request :class:`Update` form, in row order."""

    req_ids: list[str]
    rows: np.ndarray
    """int64: the step-plan row of each request (where its logprobs are)."""
    token_ids: np.ndarray
    """int64: the token each request got."""
    num_prompt_tokens: np.ndarray
    """int64"""
    num_cached_tokens: np.ndarray
    """int64: prompt tokens served from the prefix cache at first admission."""
    finished: dict[str, str] = field(default_factory=dict)
    """req_id -> ``stop`` (EOS or a stop token) or ``length`` (max_tokens or max_model_len)."""

    @classmethod
    def empty(cls) -> UpdateBatch:
        z = np.zeros(0, dtype=np.int64)
        return cls([], z, z, z, z)

    def __len__(self) -> int:
        return len(self.req_ids)

    def __iter__(self) -> Iterator[Update]:
        finished = self.finished
        for rid, tok, num_prompt, num_cached in zip(self.req_ids, self.token_ids.tolist(),
                                                    self.num_prompt_tokens.tolist(),
                                                    self.num_cached_tokens.tolist(), strict=True):
            yield Update(rid, [tok], finished.get(rid), num_prompt, num_cached)


class StepArraysLike(Protocol):
    """The step arrays the scheduler writes (a subset of :class:`stride.ipc.layouts.StepBuffers`)."""

    block_tables: np.ndarray
    token_ids: np.ndarray
    positions: np.ndarray
    seq_slots: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    sample_flags: np.ndarray

    def bank(self, index: int) -> Any:
        """Bank ``index`` (0 or 1) of the step arrays: the same names, the block tables shared (overlapped steps
        write the other bank than the step in flight)."""


class StepArrays:
    """Plain-numpy stand-in for :class:`~stride.ipc.layouts.StepBuffers` (same names, dtypes, shapes; its own
    attributes are bank 0, :meth:`bank` gives either)."""

    def __init__(self, sched: SchedulerConfig, cache: CacheConfig,
                 block_tables: np.ndarray | None = None) -> None:
        s, t = sched.max_num_seqs, sched.max_num_batched_tokens
        self.block_tables = (np.full((s, max_blocks_per_seq(sched, cache)), -1, dtype=np.int32)
                             if block_tables is None else block_tables)
        self.token_ids = np.zeros(t, dtype=np.int32)
        self.positions = np.zeros(t, dtype=np.int32)
        self.seq_slots = np.zeros(s, dtype=np.int32)
        self.query_lens = np.zeros(s, dtype=np.int32)
        self.context_lens = np.zeros(s, dtype=np.int32)
        self.sample_flags = np.zeros(s, dtype=np.int8)
        self.sampled_ids = np.full(s, -1, dtype=np.int32)
        self._other: StepArrays | None = None
        if block_tables is None:  # bank 0 makes bank 1, which shares its block tables
            self._other = StepArrays(sched, cache, self.block_tables)

    def bank(self, index: int) -> StepArrays:
        if index == 0:
            return self
        assert self._other is not None
        return self._other

    def step_inputs(self, num_tokens: int, ahead: bool, prev: StepArrays) -> StepArrays:
        """As :meth:`stride.ipc.layouts.StepBank.step_inputs`: the placeholders of a step built ahead filled in."""
        return fill_placeholders(self, num_tokens, ahead, prev)


@dataclass
class StepPlan:
    """One step's decisions. Row ``i`` of the arrays is the i-th scheduled sequence, in the order its
    tokens appear in the flattened batch; the same rows were written to the step buffers."""

    step: int
    req_ids: list[str]
    slots: np.ndarray
    """int32 (num_seqs,): block-table row of each scheduled sequence."""
    query_lens: np.ndarray
    """int32: tokens each runs this step."""
    start_positions: np.ndarray
    """int32: position of its first token this step (= tokens already computed)."""
    sample_flags: np.ndarray
    """bool: whether it samples a token (its last prompt/output token runs this step)."""
    new_seqs: list[NewSequence] = field(default_factory=list)
    finished_slots: list[int] = field(default_factory=list)
    """Slots freed since the last step (finished, aborted or preempted). A slot may appear here and in
    ``new_seqs`` of the same step: the worker drops the old sequence first."""
    preempted_ids: list[str] = field(default_factory=list)
    bank: int = 0
    """The bank of the step arrays this step was written to."""
    ahead_slots: np.ndarray | None = None
    """Built ahead (while the step before ran): the slots of the decode rows whose input token is the one that
    step samples (a ``-1 - row`` placeholder in the arrays). None for a step built after its predecessor ended."""

    @property
    def ahead(self) -> bool:
        return self.ahead_slots is not None

    @property
    def num_seqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    def descriptor(self) -> StepDescriptor:
        """The message that sends this step to rank 0 (the arrays travel in shared memory)."""
        return StepDescriptor(step=self.step, num_seqs=self.num_seqs, num_tokens=self.num_tokens,
                              new_seqs=list(self.new_seqs), finished_slots=list(self.finished_slots),
                              bank=self.bank, ahead=self.ahead)

    def decisions(self) -> dict[str, Any]:
        """JSON-ready summary of every decision (what a trace records and replay compares)."""
        ahead = {} if self.ahead_slots is None else {"ahead": self.ahead_slots.tolist()}
        return {
            **ahead,
            "req_ids": list(self.req_ids),
            "slots": self.slots.tolist(),
            "query_lens": self.query_lens.tolist(),
            "start_positions": self.start_positions.tolist(),
            "sample": [int(x) for x in self.sample_flags],
            "new": [[n.slot, n.req_id, n.prompt_len] for n in self.new_seqs],
            "finished_slots": list(self.finished_slots),
            "preempted": list(self.preempted_ids),
        }
