"""The scheduler's side of structured outputs: one llguidance matcher per constrained sequence, advanced by every
token the sequence is given, and the bitmask of the tokens its next sample may take.

The matcher lives with the request in the scheduler, not in a worker: a preempted sequence keeps its output and
so its matcher's state, with nothing to replay, and the worker stays a function of its inputs. The masks of a step
are computed after its descriptor went out, while the forward runs (:meth:`GrammarMatchers.fill`, on llguidance's
own threads, writing straight into the shared-memory rows the sampler reads); a sequence without a constraint
costs nothing. Matchers in their start state are kept per grammar and copied for each new sequence, so a grammar
is built once however many requests share it.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy as np

from stride.grammar import check_llguidance

check_llguidance()

log = logging.getLogger(__name__)

FRESH_CACHE_SIZE = 256
"""Grammars whose start-state matcher is kept (least recently used out first)."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one sequence's token bitmask (bit ``t % 32`` of word ``t // 32`` allows token ``t``)."""
    return -(-vocab_size // 32)


class MatcherError(RuntimeError):
    """A sequence's matcher cannot go on (its grammar failed to build, or it was given a token it forbids)."""


class GrammarMatchers:
    """Matchers by request id. Not thread-safe: the scheduler's loop alone calls it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 num_threads: int | None = None) -> None:
        """``tokenizer_json``: the model's HF ``tokenizers`` JSON; ``vocab_size``: the model's (the bitmask's
        width; ids past the tokenizer's table are never allowed)."""
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        threads = num_threads or max(1, min(4, (os.cpu_count() or 1) // 4))
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._fresh: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._live: dict[str, llguidance.LLMatcher] = {}
        self.built = 0
        """Grammars built into a matcher (not found among the kept start states)."""

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def add(self, req_id: str, grammar: str, output: Sequence[int] = ()) -> None:
        """Start ``req_id`` under ``grammar`` (already checked by the tokenizer process), past ``output`` tokens it
        was given before (none for a new request). :class:`MatcherError` if the grammar does not build."""
        fresh = self._fresh.get(grammar)
        if fresh is None:
            fresh = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if fresh.is_error():
                raise MatcherError(f"the grammar does not build: {fresh.get_error()}")
            self.built += 1
            self._fresh[grammar] = fresh
            while len(self._fresh) > FRESH_CACHE_SIZE:
                self._fresh.popitem(last=False)
        else:
            self._fresh.move_to_end(grammar)
        m = fresh.deep_copy()
        if output and not m.consume_tokens(list(output)):
            raise MatcherError(f"the output so far does not match the grammar: {m.get_error()}")
        self._live[req_id] = m

    def drop(self, req_id: str) -> None:
        self._live.pop(req_id, None)

    def consume(self, req_id: str, token: int) -> bool:
        """Advance ``req_id`` by the token it sampled; True when its grammar is complete (nothing may follow).
        :class:`MatcherError` if the matcher refuses the token."""
        m = self._live[req_id]
        if not m.consume_token(token):
            raise MatcherError(f"token {token} does not match the grammar: {m.get_error()}")
        return m.is_stopped()

    def fill(self, rows: Sequence[tuple[str, int]], bitmask: np.ndarray) -> None:
        """Write the next-token mask of each ``(req_id, row)`` into ``bitmask[row]`` (an int32 array of
        :func:`bitmask_words` columns, C-contiguous: a shared-memory segment)."""
        if not rows:
            return
        if bitmask.dtype != np.int32 or not bitmask.flags.c_contiguous or bitmask.ndim != 2:
            raise ValueError("the bitmask must be a C-contiguous 2-D int32 array")
        pairs = [(self._live[req_id], row) for req_id, row in rows]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])
