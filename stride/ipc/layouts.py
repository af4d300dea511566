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
the launcher creates it after the ranks are ready. Its rows are written for the step in flight after its
descriptor was sent, while the forward runs; :class:`~stride.ipc.messages.MasksReady` tells rank 0 they are there
before it samples (:mod:`stride.grammar.matchers`).

Only the first ``num_seqs`` rows / ``num_tokens`` entries named by the step's :class:`StepDescriptor` are
meaningful. Reuse rule: the loop is synchronous, so the scheduler writes step ``k+1`` only after rank 0's
:class:`StepDone` for step ``k`` arrived, and the worker reads step ``k+1`` only after the descriptor for it
arrived; rank 0 writes outputs before sending StepDone. A block-table row may be rewritten only for a
sequence that is not in the step in flight. The launcher creates (and alone unlinks) every segment; the
scheduler and the ranks attach.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stride.config import CacheConfig, IpcConfig, SchedulerConfig, max_blocks_per_seq
from stride.ipc.shm import SharedArray

MAX_TOP_LOGPROBS = 20


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


class StepBuffers:
    """Every array of :class:`StepLayout`, created by the launcher or attached by the scheduler and ranks."""

    def __init__(self, arrays: dict[str, SharedArray]) -> None:
        self._arrays = arrays
        a = {name: sa.array for name, sa in arrays.items()}
        self.block_tables = a["block_tables"]
        self.token_ids = a["token_ids"]
        self.positions = a["positions"]
        self.seq_slots = a["seq_slots"]
        self.query_lens = a["query_lens"]
        self.context_lens = a["context_lens"]
        self.sample_flags = a["sample_flags"]
        self.sampled_ids = a["sampled_ids"]
        self.logprobs = a["logprobs"]
        self.top_ids = a["top_ids"]
        self.top_logprobs = a["top_logprobs"]

    @classmethod
    def create(cls, ipc: IpcConfig, layout: StepLayout) -> StepBuffers:
        made: dict[str, SharedArray] = {}
        try:
            for name, (shape, dtype) in layout.fields().items():
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
            for name, (shape, dtype) in layout.fields().items():
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
