"""The shared-memory layout of one step: what the scheduler writes for the workers and what rank 0 writes back.

All arrays are C-contiguous, one segment each, named ``stride-<launch>-<field>``. ``S`` = max_num_seqs,
``T`` = max_num_batched_tokens, ``B`` = max blocks per sequence, ``K`` = MAX_TOP_LOGPROBS.

| field          | dtype   | shape   | writer    | readers   | meaning                                            |
|----------------|---------|---------|-----------|-----------|----------------------------------------------------|
| block_tables   | int32   | (S, B)  | scheduler | all ranks | row = sequence slot; logical block → physical block |
| token_ids      | int32   | (T,)    | scheduler | all ranks | the step's input tokens, sequences back to back      |
| positions      | int32   | (T,)    | scheduler | all ranks | position of each input token in its sequence         |
| seq_slots      | int32   | (S,)    | scheduler | all ranks | i-th scheduled sequence → its block-table row        |
| query_lens     | int32   | (S,)    | scheduler | all ranks | tokens the i-th sequence runs this step              |
| context_lens   | int32   | (S,)    | scheduler | all ranks | its KV length after this step (cached + new)         |
| sample_flags   | int8    | (S,)    | scheduler | all ranks | 1 if the i-th sequence samples a token this step     |
| sampled_ids    | int32   | (S,)    | rank 0    | scheduler | sampled token of the i-th sequence (-1: none)        |
| logprobs       | float32 | (S,)    | rank 0    | scheduler | its log-probability                                  |
| top_ids        | int32   | (S, K)  | rank 0    | scheduler | top-K alternatives (when a request asks)             |
| top_logprobs   | float32 | (S, K)  | rank 0    | scheduler | their log-probabilities                              |
| token_bitmask  | int32   | (S, W)  | scheduler | rank 0    | row i: the tokens the i-th sequence may sample, one  |
|                |         |         |           |           | bit each (constrained rows only; :class:`MaskBuffer`)|

``W`` = ceil(vocab / 32). The bitmask is its own segment, made once the vocabulary is known (rank 0 reports it):
the launcher creates it after the ranks are ready. It has one bank: its rows are written for one step at a time,
after that step's descriptor was sent (for a step built ahead, after the step before it sampled and was applied),
while the forward runs; :class:`~stride.ipc.messages.MasksReady` tells rank 0 they are there before it samples
(:mod:`stride.grammar.matchers`).

Every field but ``block_tables`` exists twice, as two **banks** (bank 1's segments end in ``_1``): with
overlapped scheduling the scheduler writes step ``k+1`` into one bank while the ranks read step ``k`` from the
other, and the descriptor names its bank. In a step built ahead, a decode row's input token is not known yet: it
is ``-1 - r``, "the token row ``r`` of the previous step (the other bank) samples", and the ranks substitute it.

Only the first ``num_seqs`` rows / ``num_tokens`` entries named by the step's :class:`StepDescriptor` are
meaningful. Reuse rule: at most two steps are in flight, one per bank; the scheduler writes a bank only when the
step that last used it is done (its :class:`StepDone` arrived), and the worker reads a step only after its
descriptor arrived; rank 0 writes outputs before sending StepDone. A block-table row changes only past the
columns a step in flight reads (a sequence's row grows at its end), or for a slot no step in flight holds.
The launcher creates (and alone unlinks) every segment; the scheduler and the ranks attach.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from stride.config import CacheConfig, IpcConfig, SchedulerConfig, max_blocks_per_seq
from stride.ipc.shm import SharedArray

MAX_TOP_LOGPROBS = 20


class _HasTokenIds(Protocol):
    token_ids: np.ndarray


_B = TypeVar("_B", bound=_HasTokenIds)


@dataclass(frozen=True)
class StepLayout:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_blocks_per_seq: int

    @staticmethod
    def from_config(sched: SchedulerConfig, cache: CacheConfig) -> StepLayout:
        return StepLayout(sched.max_num_seqs, sched.max_num_batched_tokens, max_blocks_per_seq(sched, cache))

    def fields(self) -> dict[str, tuple[tuple[int, ...], type]]:
        s, t, b, k = self.max_num_seqs, self.max_num_batched_tokens, self.max_blocks_per_seq, MAX_TOP_LOGPROBS
        return {
            "block_tables": ((s, b), np.int32),
            "token_ids": ((t,), np.int32),
            "positions": ((t,), np.int32),
            "seq_slots": ((s,), np.int32),
            "query_lens": ((s,), np.int32),
            "context_lens": ((s,), np.int32),
            "sample_flags": ((s,), np.int8),
            "sampled_ids": ((s,), np.int32),
            "logprobs": ((s,), np.float32),
            "top_ids": ((s, k), np.int32),
            "top_logprobs": ((s, k), np.float32),
        }

    def all_fields(self) -> dict[str, tuple[tuple[int, ...], type]]:
        """:meth:`fields` and bank 1's copies (``<name>_1``) of every field but ``block_tables``."""
        fields = self.fields()
        return fields | {f"{name}{BANK_SUFFIX}": spec for name, spec in fields.items() if name != "block_tables"}


BANK_SUFFIX = "_1"


MASK_FIELD = "token_bitmask"


class MaskBuffer:
    """The token-bitmask segment ``(max_num_seqs, ceil(vocab / 32))`` int32: a bit per token, set where allowed."""

    def __init__(self, array: SharedArray) -> None:
        self._array = array
        self.bitmask = array.array

    @staticmethod
    def shape(max_num_seqs: int, vocab_size: int) -> tuple[int, int]:
        return (max_num_seqs, max(1, -(-vocab_size // 32)))

    @classmethod
    def create(cls, ipc: IpcConfig, max_num_seqs: int, vocab_size: int) -> MaskBuffer:
        return cls(SharedArray.create(ipc.shm_name(MASK_FIELD), cls.shape(max_num_seqs, vocab_size), np.int32,
                                      fill=-1))

    @classmethod
    def attach(cls, ipc: IpcConfig, max_num_seqs: int, vocab_size: int) -> MaskBuffer:
        return cls(SharedArray.attach(ipc.shm_name(MASK_FIELD), cls.shape(max_num_seqs, vocab_size), np.int32))

    def close(self) -> None:
        self._array.close()


class StepBank:
    """One bank's arrays (and the shared block tables): the attributes of :class:`StepBuffers`."""

    def __init__(self, a: dict[str, np.ndarray], suffix: str = "") -> None:
        self.block_tables = a["block_tables"]
        self.token_ids = a["token_ids" + suffix]
        self.positions = a["positions" + suffix]
        self.seq_slots = a["seq_slots" + suffix]
        self.query_lens = a["query_lens" + suffix]
        self.context_lens = a["context_lens" + suffix]
        self.sample_flags = a["sample_flags" + suffix]
        self.sampled_ids = a["sampled_ids" + suffix]
        self.logprobs = a["logprobs" + suffix]
        self.top_ids = a["top_ids" + suffix]
        self.top_logprobs = a["top_logprobs" + suffix]

    def step_inputs(self, num_tokens: int, ahead: bool, prev: StepBank) -> StepBank:
        """This bank as a rank reads a step: :func:`fill_placeholders`."""
        return fill_placeholders(self, num_tokens, ahead, prev)


def fill_placeholders(bank: _B, num_tokens: int, ahead: bool, prev: Any) -> _B:
    """``bank`` as a rank reads a step of ``num_tokens``: for a step built ahead, with each placeholder ``-1 - r``
    replaced by ``prev.sampled_ids[r]``, the token the step before sampled there (in a copy: the shared array stays
    as the scheduler wrote it; a row that sampled nothing, as a sequence that failed alone, gives token 0 to a row
    whose output is dropped)."""
    if not ahead:
        return bank
    ids = bank.token_ids[:num_tokens]
    holes = ids < 0
    if not holes.any():
        return bank
    filled = ids.copy()
    filled[holes] = np.maximum(prev.sampled_ids[-1 - ids[holes]], 0)
    view = copy.copy(bank)
    view.token_ids = filled
    return view


class StepBuffers(StepBank):
    """Every array of :class:`StepLayout`, created by the launcher or attached by the scheduler and ranks. Its own
    attributes are bank 0's; :meth:`bank` gives either."""

    def __init__(self, arrays: dict[str, SharedArray]) -> None:
        self._arrays = arrays
        a = {name: sa.array for name, sa in arrays.items()}
        super().__init__(a)
        self.banks = (self, StepBank(a, BANK_SUFFIX))

    def bank(self, index: int) -> StepBank:
        return self.banks[index]

    @classmethod
    def create(cls, ipc: IpcConfig, layout: StepLayout) -> StepBuffers:
        made: dict[str, SharedArray] = {}
        try:
            for name, (shape, dtype) in layout.all_fields().items():
                made[name] = SharedArray.create(ipc.shm_name(name), shape, dtype,
                                                fill=-1 if name == "block_tables" else 0)
        except BaseException:
            for sa in made.values():
                sa.close()
            raise
        return cls(made)

    @classmethod
    def attach(cls, ipc: IpcConfig, layout: StepLayout) -> StepBuffers:
        made: dict[str, SharedArray] = {}
        try:
            for name, (shape, dtype) in layout.all_fields().items():
                made[name] = SharedArray.attach(ipc.shm_name(name), shape, dtype)
        except BaseException:
            for sa in made.values():
                sa.close()
            raise
        return cls(made)

    def close(self) -> None:
        """Unmap (and, in the creating process, unlink) every segment."""
        for sa in self._arrays.values():
            sa.close()
