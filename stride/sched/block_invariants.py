"""The block manager's cross-checks, kept apart from the hot path.

Every check compares two things that are maintained separately -- a count with its container, a ref count
with the block tables recomputed, the index with the cached and live sets -- so each one can fail. Raises
``AssertionError`` explicitly (not ``assert``), so the checks also run under ``python -O``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stride.sched.block_pool import EvictableLRU, FreeList, LiveSet
from stride.sched.prefix_hash import chain_hashes
from stride.sched.prefix_index import PrefixIndex


@dataclass(frozen=True)
class BlockState:
    """Everything the block manager keeps, as the checks read it: references to its structures, not copies
    (:meth:`BlockManager.state` builds it), so a count that drifts in the manager drifts here too."""

    num_blocks: int
    block_size: int
    free: FreeList
    cached: EvictableLRU
    live: LiveSet
    ref: np.ndarray
    """Ref count per block."""
    index: PrefixIndex
    block_tables: np.ndarray
    seeds: list[bytes | None]
    """Per slot: the tenant seed of its chain, None for an empty slot."""
    tokens: np.ndarray
    num_tokens: np.ndarray
    num_table_blocks: np.ndarray
    num_hashed: np.ndarray
    last_hash: list[bytes]


def _fail(msg: str) -> None:
    raise AssertionError(f"block manager invariant: {msg}")


def check_invariants(bm: BlockState, *, deep: bool = False) -> None:
    n = bm.num_blocks
    free, cached, live = bm.free, bm.cached, bm.live

    # 1. Each count against the size of the structure that owns it, then the partition identity.
    for name, struct in (("free", free), ("cached", cached), ("live", live)):
        if struct.num != struct.size():
            _fail(f"num_{name} = {struct.num} but the {name} structure holds {struct.size()} blocks")
    if free.num + cached.num + live.num != n:
        _fail(f"live {live.num} + cached {cached.num} + free {free.num} != capacity {n}")

    # 2. No block in two places, none outside the pool, none missing (vectorised: the check runs every step).
    where: dict[str, np.ndarray] = {}
    for name, ids in (("free", free.block_ids()), ("cached", cached.block_ids()), ("live", live.block_ids())):
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            _fail(f"the {name} structure holds a block outside [0, {n})")
        where[name] = np.bincount(arr, minlength=n)
    placed = where["free"] + where["cached"] + where["live"]
    if (placed != 1).any():
        b = int(np.nonzero(placed != 1)[0][0])
        places = [name for name, c in where.items() if c[b]]
        if placed[b] == 0:
            _fail(f"block {b} is nowhere")
        if len(places) == 1:
            _fail(f"block {b} is {places[0]} twice")
        _fail(f"block {b} is both {places[0]} and {places[1]}")
    is_free, is_cached, is_live = where["free"] > 0, where["cached"] > 0, where["live"] > 0

    # 3. Block tables: rows of empty slots are -1, occupied rows hold exactly their blocks, then -1.
    tables = bm.block_tables
    row_blocks = np.zeros(tables.shape[0], dtype=np.int64)
    for slot, seed in enumerate(bm.seeds):
        num_tokens, num_blocks = int(bm.num_tokens[slot]), int(bm.num_table_blocks[slot])
        if seed is None:
            if num_tokens or num_blocks or bm.num_hashed[slot]:
                _fail(f"empty slot {slot} has {num_tokens} tokens, {num_blocks} blocks")
            continue
        want = -(-num_tokens // bm.block_size)
        if num_tokens == 0 or num_blocks != want:
            _fail(f"slot {slot} has {num_blocks} blocks for {num_tokens} tokens (want {want})")
        if bm.num_hashed[slot] > num_tokens // bm.block_size:
            _fail(f"slot {slot} claims {bm.num_hashed[slot]} addressed blocks of {num_tokens} tokens")
        row_blocks[slot] = num_blocks
        row = tables[slot, :num_blocks].tolist()
        if len(set(row)) != len(row):
            _fail(f"slot {slot} holds a block twice: {row}")
    occupied = np.arange(tables.shape[1])[None, :] < row_blocks[:, None]
    if not (tables[~occupied] == -1).all():
        slot = int(np.nonzero((tables != -1) & ~occupied)[0][0])
        _fail(f"block-table row {slot} has an entry past its blocks (or the slot is empty)")
    entries = tables[occupied]
    if entries.size and (entries.min() < 0 or entries.max() >= n):
        _fail(f"a block table holds an id outside [0, {n}): {int(entries.min())}..{int(entries.max())}")

    # 4. Ref counts recomputed from the tables; live <=> referenced.
    counts = np.bincount(entries, minlength=n)
    ref = np.asarray(bm.ref)
    wrong = np.nonzero(counts != ref)[0]
    if wrong.size:
        b = int(wrong[0])
        _fail(f"block {b} has ref count {ref[b]} but {counts[b]} block-table entries")
    if ((counts > 0) != is_live).any():
        b = int(np.nonzero((counts > 0) != is_live)[0][0])
        _fail(f"block {b} is {'live' if is_live[b] else 'not live'} with {counts[b]} references")

    # 5. Index <=> cached/live: every indexed block is live or cached, every cached block is indexed.
    index, block_hashes = bm.index.by_address(), bm.index.addresses()
    hashed = np.fromiter((h is not None for h in block_hashes), dtype=bool, count=n)
    indexed_ids = np.fromiter(index.values(), dtype=np.int64, count=len(index))
    if indexed_ids.size and (indexed_ids.min() < 0 or indexed_ids.max() >= n):
        _fail(f"the index holds a block outside [0, {n})")
    times_indexed = np.bincount(indexed_ids, minlength=n)
    if times_indexed.max(initial=0) > 1:
        _fail(f"two addresses point at block {int(times_indexed.argmax())}")
    if ((times_indexed > 0) != hashed).any():
        _fail(f"block {int(np.nonzero((times_indexed > 0) != hashed)[0][0])} is in the index xor carries "
              "an address")
    for h, b in index.items():
        if block_hashes[b] != h:
            _fail(f"the index maps {h.hex()} to block {b}, which carries another address")
    if (hashed & is_free).any():
        _fail(f"indexed block {int(np.nonzero(hashed & is_free)[0][0])} is on the free list")
    if (is_cached & ~hashed).any():
        _fail(f"cached block {int(np.nonzero(is_cached & ~hashed)[0][0])} is not indexed")
    # The mask free() reads to split freed blocks into cached and free must agree with the addresses.
    if (bm.index.indexed != hashed).any():
        _fail(f"block {int(np.nonzero(bm.index.indexed != hashed)[0][0])}: the index's mask disagrees "
              "with its addresses")

    if deep:
        _check_addresses(bm)


def _check_addresses(bm: BlockState) -> None:
    """Every address a running sequence knows, recomputed from its tokens."""
    for slot, seed in enumerate(bm.seeds):
        if seed is None:
            continue
        num_hashed = int(bm.num_hashed[slot])
        want = chain_hashes(seed, bm.tokens[slot], bm.block_size, num_hashed)
        if (want[-1] if want else seed) != bm.last_hash[slot]:
            _fail(f"slot {slot}: chain address after {num_hashed} blocks disagrees with its tokens")
        row = bm.block_tables[slot, :num_hashed].tolist()
        for i, (b, h) in enumerate(zip(row, want, strict=True)):
            known = bm.index.address(b)
            if known is not None and known != h:
                _fail(f"slot {slot} block {i} (physical {b}) is indexed under another prefix's address")
