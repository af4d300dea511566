"""The simulated backend: answers a step after a modelled step time, with deterministic tokens.

It reads the same step arrays a real rank reads and writes ``sampled_ids`` like rank 0, so the scheduler
(and the whole stack) runs without a GPU. Tokens are a hash of (request id, position): identical whatever
the batching, chunking, preemption or prefix caching, which makes "cache on/off gives the same streams"
testable. EOS ids are never produced, so output lengths are set by ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import Protocol

import numpy as np

from stride.ipc.messages import StepDescriptor


class StepRows(Protocol):
    """What the simulated step reads of one bank of the step arrays."""

    seq_slots: np.ndarray
    context_lens: np.ndarray
    sample_flags: np.ndarray


StepTimeFn = Callable[[int, int, int], float]
"""(num_tokens, num_seqs, context_tokens) -> modelled seconds of one step."""

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def linear_step_time(num_tokens: int, num_seqs: int, context_tokens: int) -> float:
    """A stand-in cost model (an 8B-class model on one H100-class GPU, roughly): fixed overhead plus
    weights read once, per-token compute and KV read."""
    return 2e-3 + 5e-3 + 6e-5 * num_tokens + 1.3e-7 * context_tokens


class SimBackend:
    """Per-slot token seeds plus a step-time model. Use :meth:`run` once per step descriptor."""

    def __init__(self, max_num_seqs: int, vocab_size: int, *, eos_token_ids: Sequence[int] = (),
                 step_time: StepTimeFn = linear_step_time) -> None:
        if vocab_size <= len(set(eos_token_ids)):
            raise ValueError("vocab_size must exceed the number of EOS ids")
        self.vocab_size = vocab_size
        self.step_time = step_time
        self._seeds = np.zeros(max_num_seqs, dtype=np.uint64)
        self._eos = np.array(sorted(set(eos_token_ids)), dtype=np.int64)

    @staticmethod
    def token_seed(req_id: str) -> int:
        return int.from_bytes(blake2b(req_id.encode(), digest_size=8).digest(), "little")

    def token_at(self, req_id: str, position: int) -> int:
        """The token this backend samples for ``req_id`` at ``position`` (what tests compare against)."""
        return int(self._tokens(np.array([self.token_seed(req_id)], dtype=np.uint64),
                                np.array([position], dtype=np.int64))[0])

    def _tokens(self, seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
        h = _mix(seeds ^ _mix(positions.astype(np.uint64) + np.uint64(1)))
        toks = (h % np.uint64(self.vocab_size)).astype(np.int64)
        # Never EOS: step past every EOS id. Ascending passes cover runs of consecutive ids; the second
        # covers a wrap past the end of the vocabulary onto a low id.
        for eos in np.concatenate([self._eos, self._eos]):
            toks = np.where(toks == eos, (toks + 1) % self.vocab_size, toks)
        return toks

    def run(self, desc: StepDescriptor, buffers: StepRows, sampled_ids: np.ndarray) -> float:
        """Apply the descriptor's deltas, write ``sampled_ids`` (row ``i`` = the i-th scheduled sequence;
        -1 where it does not sample) and return the modelled step time in seconds."""
        for slot in desc.finished_slots:
            self._seeds[slot] = 0
        for new in desc.new_seqs:
            self._seeds[new.slot] = self.token_seed(new.req_id)
        n = desc.num_seqs
        slots = buffers.seq_slots[:n]
        context = buffers.context_lens[:n].astype(np.int64)
        sample = buffers.sample_flags[:n].astype(bool)
        # The sampled token lands at position context_len (the next one after the last token run).
        toks = self._tokens(self._seeds[slots], context)
        sampled_ids[:n] = np.where(sample, toks, -1)
        return self.step_time(desc.num_tokens, n, int(context.sum()))
