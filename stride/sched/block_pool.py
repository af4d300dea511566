"""The three places a KV block can be: live, cached (evictable), free.

Each structure keeps its own count (``num``) next to its container, updated by its own methods. The block
manager never derives one count from the others, so :meth:`BlockManager.assert_invariants` can compare
three independent numbers with the capacity and with each container's real size -- and a drifted count
shows up as a failure instead of being absorbed by the algebra.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class NoFreeBlocksError(RuntimeError):
    """Neither a free nor an evictable block is left (the caller skipped ``can_allocate``/``can_append``)."""


class FreeList:
    """Blocks with no content, handed out first-in first-out from a numpy ring, so bulk pops and pushes are
    slices. Owns ``num_free``. The ring's extent (``tail - head``, positions that only grow) is its size,
    kept apart from the count."""

    __slots__ = ("_ring", "_head", "_tail", "num")

    def __init__(self, capacity: int) -> None:
        """Every block ``0 .. capacity - 1`` starts free, lowest id first out."""
        self._ring = np.arange(capacity, dtype=np.int64)
        self._head = 0
        self._tail = capacity
        self.num = capacity

    def _put(self, block_ids: np.ndarray) -> None:
        count, cap = len(block_ids), len(self._ring)
        if self._tail - self._head + count > cap:
            raise AssertionError("free list overflow: a block was freed twice")
        start = self._tail % cap
        first = min(count, cap - start)
        self._ring[start:start + first] = block_ids[:first]
        self._ring[:count - first] = block_ids[first:]
        self._tail += count

    def push(self, block_id: int) -> None:
        self._put(np.array([block_id], dtype=np.int64))
        self.num += 1

    def push_many(self, block_ids: np.ndarray | list[int]) -> None:
        self._put(np.asarray(block_ids, dtype=np.int64))
        self.num += len(block_ids)

    def pop(self) -> int:
        if self._tail == self._head:
            raise NoFreeBlocksError("the free list is empty")
        block_id: int = self._ring.item(self._head % len(self._ring))
        self._head += 1
        self.num -= 1
        return block_id

    def pop_many(self, count: int) -> np.ndarray:
        if count > self._tail - self._head:
            raise NoFreeBlocksError(f"asked for {count} free blocks, have {self._tail - self._head}")
        cap = len(self._ring)
        start = self._head % cap
        first = min(count, cap - start)
        if first == count:  # no wrap: one slice copy, several times cheaper than concatenate
            out = self._ring[start:start + count].copy()
        else:
            out = np.concatenate((self._ring[start:start + first], self._ring[:count - first]))
        self._head += count
        self.num -= count
        return out

    def size(self) -> int:
        return self._tail - self._head

    def block_ids(self) -> list[int]:
        """Next out first."""
        ids: list[int] = self._ring[np.arange(self._head, self._tail) % len(self._ring)].tolist()
        return ids


class EvictableLRU:
    """Cached blocks (ref count 0, still indexed), least recently freed first. Owns ``num_cached``.

    Callers push a freed chain tail first, so within one chain the tail is evicted before its head: a head
    evicted first would strand its still-cached tail (a lookup stops at the first miss).

    A numpy queue in push order with lazy removal, so a freed sequence's blocks go in with one slice write
    (an OrderedDict took ~0.15 us per block). ``_pos[b]`` is the queue position of block b's entry, -1 when
    b is not cached; an entry whose block's ``_pos`` points elsewhere is stale and skipped when popped.
    The queue is compacted when it runs out of room. ``size()`` counts the live entries of the queue
    itself, independently of ``num``."""

    __slots__ = ("_queue", "_pos", "_head", "_tail", "num")

    def __init__(self, capacity: int) -> None:
        self._queue = np.empty(2 * capacity + 16, dtype=np.int64)
        self._pos = np.full(capacity, -1, dtype=np.int64)
        self._head = 0  # entries before head were popped
        self._tail = 0
        self.num = 0

    def _valid(self, start: int, end: int) -> np.ndarray:
        """Which entries of ``_queue[start:end]`` are live (the block's position points back at them)."""
        return self._pos[self._queue[start:end]] == np.arange(start, end)

    def _make_room(self, count: int) -> None:
        if self._tail + count <= len(self._queue):
            return
        keep = self._queue[self._head:self._tail][self._valid(self._head, self._tail)]
        if len(keep) + count > len(self._queue):  # only when blocks were pushed twice; stay exact anyway
            self._queue = np.empty(2 * (len(keep) + count), dtype=np.int64)
        self._queue[:len(keep)] = keep
        self._pos[keep] = np.arange(len(keep))
        self._head, self._tail = 0, len(keep)

    def push(self, block_id: int) -> None:
        self.push_many([block_id])

    def push_many(self, block_ids: np.ndarray | list[int]) -> None:
        """Push in order: the first is evicted first."""
        ids = np.asarray(block_ids, dtype=np.int64)
        count = len(ids)
        self._make_room(count)
        tail = self._tail
        self._queue[tail:tail + count] = ids
        self._pos[ids] = np.arange(tail, tail + count)
        self._tail = tail + count
        self.num += count

    def remove(self, block_id: int) -> None:
        if self._pos.item(block_id) < 0:
            raise KeyError(block_id)
        self._pos[block_id] = -1  # its queue entry is now stale
        self.num -= 1

    def pop_oldest_many(self, count: int) -> list[int]:
        if count > self.num:
            raise NoFreeBlocksError(f"asked to evict {count} blocks, have {self.num}")
        out: list[int] = []
        while len(out) < count:
            need = count - len(out)
            if self._head == self._tail:
                raise AssertionError(f"num_cached = {self.num} but the evictable queue ran out")
            end = min(self._head + max(2 * need, 64), self._tail)  # a window: stale entries are skipped
            live = np.flatnonzero(self._valid(self._head, end))[:need]
            taken = self._queue[self._head + live]
            self._pos[taken] = -1
            out.extend(taken.tolist())
            self._head = self._head + int(live[-1]) + 1 if len(live) == need else end
        self.num -= count
        return out

    def __contains__(self, block_id: int) -> bool:
        pos = self._pos.item(block_id)
        return pos >= self._head and self._queue.item(pos) == block_id

    def size(self) -> int:
        return int(np.count_nonzero(self._valid(self._head, self._tail)))

    def block_ids(self) -> list[int]:
        """Oldest (next to evict) first."""
        ids: list[int] = self._queue[self._head:self._tail][self._valid(self._head, self._tail)].tolist()
        return ids


class LiveSet:
    """Blocks referenced by at least one block table, as a membership mask (bulk adds and removes are one
    fancy assignment). Owns ``num_live``; a block added twice shows up as ``num`` != ``size()``."""

    __slots__ = ("_mask", "num")

    def __init__(self, capacity: int) -> None:
        self._mask = np.zeros(capacity, dtype=bool)
        self.num = 0

    def add(self, block_id: int) -> None:
        self._mask[block_id] = True
        self.num += 1

    def add_many(self, block_ids: np.ndarray | list[int]) -> None:
        self._mask[block_ids] = True
        self.num += len(block_ids)

    def remove_many(self, block_ids: np.ndarray | list[int]) -> None:
        self._mask[block_ids] = False
        self.num -= len(block_ids)

    def __contains__(self, block_id: int) -> bool:
        return bool(self._mask[block_id])

    def size(self) -> int:
        return int(np.count_nonzero(self._mask))

    def block_ids(self) -> list[int]:
        ids: list[int] = np.flatnonzero(self._mask).tolist()
        return ids


@dataclass(frozen=True)
class BlockStats:
    """A snapshot for metrics. The three state counts come from their structures; the rest are counters
    since the manager was made."""

    num_live: int
    num_cached: int
    num_free: int
    hit_tokens: int
    """Prompt tokens served from the prefix cache (``allocate``'s return values, summed)."""
    query_tokens: int
    """Prompt tokens looked up (every ``allocate``)."""
    num_evictions: int
    """Cached blocks dropped from the index to make room."""
