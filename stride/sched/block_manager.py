"""The paged KV block manager: block tables, content-addressed prefix sharing per tenant, LRU eviction.

Contract (shared with the scheduler):

- ``block_tables`` is an int32 array ``(max_num_seqs, max_blocks_per_seq)``, in production the shared-memory
  view ``StepBuffers.block_tables``. Rows are sequence slots chosen by the caller; this class alone writes
  them. Row ``s`` holds ``ceil(num_tokens(s) / block_size)`` physical block ids, then ``-1``. A row only
  grows while its sequence runs.
- Every block is in exactly one of: **live** (ref count >= 1 = the number of rows holding it), **cached**
  (ref count 0, still indexed by its content address, evictable) or **free** (no content). A cached block
  is never on the free list, so an allocation can never hand out a block the index still points at.
- A block is indexed only after ``mark_computed`` covers it: an uncomputed block must never hit.
- Addresses chain from a per-tenant seed (:mod:`stride.sched.prefix_hash`); sharing across tenants is
  impossible by construction.
- Eviction takes the least recently freed cached block, chain tails before heads, and only when the free
  list is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from stride.sched.block_invariants import check_invariants
from stride.sched.block_pool import BlockStats, EvictableLRU, FreeList, LiveSet, NoFreeBlocksError
from stride.sched.prefix_hash import as_token_array, block_hash, tenant_seed

__all__ = ["BlockManager", "BlockStats", "NoFreeBlocksError"]


class _Seq:
    """What the manager remembers about one occupied slot."""

    __slots__ = ("tokens", "num_blocks", "num_hashed", "last_hash", "seed")

    def __init__(self, tokens: Any, num_blocks: int, num_hashed: int, last_hash: bytes, seed: bytes) -> None:
        self.tokens = tokens            # array('i'): every token of the sequence
        self.num_blocks = num_blocks    # filled entries of the block-table row
        self.num_hashed = num_hashed    # leading full blocks whose address is known (hit or computed)
        self.last_hash = last_hash      # address of block num_hashed - 1 (the seed when 0)
        self.seed = seed


class BlockManager:
    """Owns every KV block of one pool and the block-table rows of the running sequences."""

    def __init__(self, num_blocks: int, block_size: int, block_tables: np.ndarray, *,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if block_tables.dtype != np.int32 or block_tables.ndim != 2:
            raise ValueError(f"block_tables must be a 2-D int32 array, got {block_tables.dtype} "
                             f"{block_tables.shape}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_tables = block_tables
        self.enable_prefix_caching = enable_prefix_caching
        self.max_blocks_per_seq = block_tables.shape[1]
        block_tables.fill(-1)

        self._free = FreeList(range(num_blocks))
        self._cached = EvictableLRU()
        self._live = LiveSet()
        self._ref = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}
        self._seqs: list[_Seq | None] = [None] * block_tables.shape[0]
        self._seeds: dict[str, bytes] = {}
        self._hit_tokens = 0
        self._query_tokens = 0
        self._num_evictions = 0

    # ---- allocation -------------------------------------------------------------------------------
    def can_allocate(self, tenant: str, token_ids: Sequence[int]) -> bool:
        """Whether free plus evictable blocks cover the whole prompt after its prefix hit."""
        tokens = as_token_array(token_ids)
        need = self._blocks_for(len(tokens))
        hits, _ = self._match(tenant, tokens)
        num_revived = sum(1 for b in hits if self._ref[b] == 0)
        return need - len(hits) <= self._free.num + self._cached.num - num_revived

    def allocate(self, slot: int, tenant: str, token_ids: Sequence[int]) -> int:
        """Give slot ``slot`` blocks for all of ``token_ids``, reusing this tenant's longest indexed prefix.

        Returns the number of prompt tokens whose KV is already there: a multiple of ``block_size`` and
        always below ``len(token_ids)`` (the last prompt token is recomputed so the model yields logits).
        Raises :class:`NoFreeBlocksError`, changing nothing, when ``can_allocate`` would say False."""
        if self._seqs[slot] is not None:
            raise ValueError(f"slot {slot} is in use")
        tokens = as_token_array(token_ids)
        if len(tokens) == 0:
            raise ValueError("cannot allocate an empty prompt")
        need = self._blocks_for(len(tokens))
        hits, last_hash = self._match(tenant, tokens)
        ref = self._ref
        num_revived = sum(1 for b in hits if ref[b] == 0)
        num_new = need - len(hits)
        if num_new > self._free.num + self._cached.num - num_revived:
            raise NoFreeBlocksError(f"slot {slot}: need {num_new} new blocks, "
                                    f"{self._free.num + self._cached.num - num_revived} available")
        # Revive hits before taking new blocks, or eviction could take a block we are about to reuse.
        for b in hits:
            if ref[b] == 0:
                self._cached.remove(b)
                self._live.add(b)
            ref[b] += 1
        new = self._take(num_new)
        self.block_tables[slot, :need] = hits + new
        self._seqs[slot] = _Seq(tokens, need, len(hits), last_hash, self._seed(tenant))
        num_cached_tokens = len(hits) * self.block_size
        self._hit_tokens += num_cached_tokens
        self._query_tokens += len(tokens)
        return num_cached_tokens

    def mark_computed(self, slot: int, num_computed_tokens: int) -> None:
        """Tokens ``[0, num_computed_tokens)`` are scheduled: index every full block inside that range."""
        seq = self._seqs[slot]
        if seq is None:
            raise ValueError(f"slot {slot} is empty")
        num_full = num_computed_tokens // self.block_size
        if num_full <= seq.num_hashed:  # the common decode step: nothing new became full
            return
        if num_computed_tokens > len(seq.tokens):
            raise ValueError(f"slot {slot}: {num_computed_tokens} computed > {len(seq.tokens)} tokens")
        if self.enable_prefix_caching:
            self._index_range(slot, seq, num_full)
        seq.num_hashed = num_full

    def can_append(self, slot: int) -> bool:
        """Whether one more token fits: room in the last block, or a free or evictable block."""
        seq = self._seqs[slot]
        if seq is None:
            raise ValueError(f"slot {slot} is empty")
        return (len(seq.tokens) < seq.num_blocks * self.block_size
                or self._free.num > 0 or self._cached.num > 0)

    def append(self, slot: int, token_id: int) -> None:
        """Record one token at the end of the sequence, taking a new block when the last one is full."""
        seq = self._seqs[slot]
        if seq is None:
            raise ValueError(f"slot {slot} is empty")
        tokens = seq.tokens
        if len(tokens) == seq.num_blocks * self.block_size:
            if seq.num_blocks == self.max_blocks_per_seq:
                raise ValueError(f"slot {slot}: block table row is full ({self.max_blocks_per_seq} blocks)")
            (b,) = self._take(1)
            self.block_tables[slot, seq.num_blocks] = b
            seq.num_blocks += 1
        tokens.append(token_id)

    def free(self, slot: int) -> None:
        """The sequence finished or was aborted: indexed blocks become cached, the rest free; row = -1."""
        self._drop(slot)

    def release(self, slot: int) -> None:
        """Preemption: the same accounting as :meth:`free`. The caller keeps the tokens and later calls
        :meth:`allocate` with all of them, usually finding most of its own blocks still cached."""
        self._drop(slot)

    def can_fork(self, parent_slot: int) -> bool:
        seq = self._seqs[parent_slot]
        if seq is None:
            raise ValueError(f"slot {parent_slot} is empty")
        partial = len(seq.tokens) % self.block_size != 0
        return not partial or self._free.num + self._cached.num > 0

    def fork(self, parent_slot: int, child_slot: int) -> tuple[int, int] | None:
        """n>1 sampling: the child shares the parent's full blocks (ref count +1 each); a partial last block
        is copied into a fresh block. Returns ``(src_block, dst_block)`` for the worker to copy, else None."""
        parent = self._seqs[parent_slot]
        if parent is None:
            raise ValueError(f"slot {parent_slot} is empty")
        if self._seqs[child_slot] is not None:
            raise ValueError(f"slot {child_slot} is in use")
        num_full = len(parent.tokens) // self.block_size
        partial = parent.num_blocks > num_full
        if partial and self._free.num + self._cached.num == 0:
            raise NoFreeBlocksError(f"fork of slot {parent_slot}: no block for the partial last block")
        row = self.block_tables[parent_slot]
        shared = row[:num_full].tolist()
        ref = self._ref
        for b in shared:
            ref[b] += 1
        self.block_tables[child_slot, :num_full] = row[:num_full]
        copy = None
        if partial:
            (dst,) = self._take(1)
            self.block_tables[child_slot, num_full] = dst
            copy = (int(row[num_full]), dst)
        self._seqs[child_slot] = _Seq(parent.tokens[:], parent.num_blocks, parent.num_hashed,
                                      parent.last_hash, parent.seed)
        return copy

    # ---- queries ----------------------------------------------------------------------------------
    def num_tokens(self, slot: int) -> int:
        seq = self._seqs[slot]
        if seq is None:
            raise ValueError(f"slot {slot} is empty")
        return len(seq.tokens)

    def is_allocated(self, slot: int) -> bool:
        return self._seqs[slot] is not None

    def block_table(self, slot: int) -> list[int]:
        """The physical blocks of slot ``slot`` in logical order (empty for an empty slot)."""
        seq = self._seqs[slot]
        return [] if seq is None else self.block_tables[slot, :seq.num_blocks].tolist()

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def eviction_order(self) -> list[int]:
        """Cached blocks, next to be evicted first."""
        return self._cached.block_ids()

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation may take now: free plus evictable."""
        return self._free.num + self._cached.num

    @property
    def stats(self) -> BlockStats:
        return BlockStats(num_live=self._live.num, num_cached=self._cached.num, num_free=self._free.num,
                          hit_tokens=self._hit_tokens, query_tokens=self._query_tokens,
                          num_evictions=self._num_evictions)

    def assert_invariants(self, *, deep: bool = False) -> None:
        """Raise ``AssertionError`` naming the first disagreement between counts, structures, ref counts,
        block tables and the index. ``deep`` also recomputes every address from the tokens (slow)."""
        check_invariants(self, deep=deep)

    # ---- internals --------------------------------------------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        if need > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} tokens need {need} blocks; a row holds {self.max_blocks_per_seq}")
        return need

    def _seed(self, tenant: str) -> bytes:
        seed = self._seeds.get(tenant)
        if seed is None:
            seed = self._seeds[tenant] = tenant_seed(tenant)
        return seed

    def _match(self, tenant: str, tokens: Any) -> tuple[list[int], bytes]:
        """The longest chain of indexed blocks matching ``tokens`` (never its last token's block)."""
        h = self._seed(tenant)
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits, h
        bs, index = self.block_size, self._index
        for i in range((len(tokens) - 1) // bs):
            nh = block_hash(h, tokens, i * bs, (i + 1) * bs)
            b = index.get(nh)
            if b is None:
                break
            hits.append(b)
            h = nh
        return hits, h

    def _take(self, count: int) -> list[int]:
        """``count`` blocks made live with ref count 1: free ones first, then evicted cached ones."""
        from_free = min(count, self._free.num)
        out = self._free.pop_many(from_free)
        for _ in range(count - from_free):
            if self._cached.num == 0:
                raise NoFreeBlocksError("no free or evictable block left")
            b = self._cached.pop_oldest()
            h = self._block_hash[b]
            assert h is not None
            del self._index[h]
            self._block_hash[b] = None
            self._num_evictions += 1
            out.append(b)
        self._live.add_many(out)
        ref = self._ref
        for b in out:
            ref[b] = 1
        return out

    def _index_range(self, slot: int, seq: _Seq, num_full: int) -> None:
        bs, index, block_hashes = self.block_size, self._index, self._block_hash
        h = seq.last_hash
        blocks = self.block_tables[slot, seq.num_hashed:num_full].tolist()
        for i, b in enumerate(blocks, start=seq.num_hashed):
            h = block_hash(h, seq.tokens, i * bs, (i + 1) * bs)
            known = block_hashes[b]
            if known is not None:  # shared by a fork and indexed through the other sequence
                if known != h:
                    raise AssertionError(f"block {b} has address {known.hex()}, slot {slot} says {h.hex()}")
            elif h not in index:
                index[h] = b
                block_hashes[b] = h
            # else: the same content was computed twice (two requests admitted together); this copy stays
            # unindexed and goes to the free list when released.
        seq.last_hash = h

    def _drop(self, slot: int) -> None:
        seq = self._seqs[slot]
        if seq is None:
            raise ValueError(f"slot {slot} is empty")
        row = self.block_tables[slot]
        ref, block_hashes = self._ref, self._block_hash
        for b in reversed(row[:seq.num_blocks].tolist()):  # tail first: evicted before its head
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                self._live.remove(b)
                if block_hashes[b] is not None:
                    self._cached.push(b)
                else:
                    self._free.push(b)
        row[:seq.num_blocks] = -1
        self._seqs[slot] = None
