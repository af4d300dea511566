"""Stop strings on the way back to the client.

A stop string is never emitted, and the text ends where the first one to complete begins. Text arrives in
deltas, so a stop string can straddle two (or more) deltas: the checker holds back the longest tail of the
text that could still be the beginning of a stop string and releases it only once it cannot be (or the
sequence ends for another reason).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stride.tokenizer.detokenizer import IncrementalDetokenizer


class StopChecker:
    """Per-request stop-string state. After ``push`` reports a stop, the request is over: later pushes
    return nothing."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop = tuple(stop)
        self._held = ""
        self.stopped_by: str | None = None

    def push(self, delta: str) -> tuple[str, bool]:
        """``(text safe to emit now, whether a stop string was reached)``."""
        if self.stopped_by is not None:
            return "", True
        text = self._held + delta
        if not self.stop:
            self._held = ""
            return text, False
        hit = self._first_stop(text)
        if hit is not None:
            at, stop = hit
            self._held, self.stopped_by = "", stop
            return text[:at], True
        keep = self._longest_partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The sequence ended for another reason: release what was held."""
        text, self._held = self._held, ""
        return "" if self.stopped_by is not None else text

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # The stop completed first wins (generation would have ended there), so the outcome does not
        # depend on how the text was cut into deltas; on equal ends the longer one (earlier start) wins.
        best: tuple[int, int, str] | None = None
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def _longest_partial_tail(self, text: str) -> int:
        """Longest ``k`` such that ``text[-k:]`` is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - k:]):
                    longest = k
                    break
        return longest


@dataclass
class OutputText:
    """One request's way back: token ids in, text deltas out (detokenizer, then stop strings).

    ``push`` returns ``(delta, stopped)``; after ``stopped`` the caller finishes the request with reason
    ``stop`` and aborts it in the scheduler. When the request ends otherwise (EOS, stop token, length),
    ``finish`` returns the text still held back."""

    detokenizer: IncrementalDetokenizer
    stop: StopChecker

    @classmethod
    def create(cls, token_bytes: Sequence[bytes], stop: Sequence[str] = ()) -> OutputText:
        return cls(IncrementalDetokenizer(token_bytes), StopChecker(stop))

    def push(self, token_ids: Iterable[int]) -> tuple[str, bool]:
        return self.stop.push(self.detokenizer.push(token_ids))

    def finish(self) -> tuple[str, bool]:
        """``(last text, whether a stop string completed in it)`` -- an unfinished character flushed at
        the end can still complete one."""
        text, stopped = self.stop.push(self.detokenizer.flush())
        return (text, True) if stopped else (text + self.stop.flush(), False)
