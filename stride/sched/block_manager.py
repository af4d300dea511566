"""The paged KV block manager: block tables, content-addressed prefix sharing per tenant, LRU eviction.

Contract (shared with the scheduler):

- ``block_tables`` is an int32 array ``(max_num_seqs, max_blocks_per_seq)``, in production the shared-memory
  view ``StepBuffers.block_tables``. Rows are sequence slots chosen by the caller; this class alone writes
  them (the constructor fills it with ``-1``). Row ``s`` holds ``ceil(num_tokens(s) / block_size)``
  physical block ids, then ``-1``. A row only grows while its sequence runs.
- Every block is in exactly one of: **live** (ref count >= 1 = the number of rows holding it), **cached**
  (ref count 0, still indexed by its content address, evictable) or **free** (no content). A cached block
  is never on the free list, so an allocation can never hand out a block the index still points at.
- A block is indexed only after ``mark_computed`` covers it: an uncomputed block must never hit.
- Addresses chain from a per-tenant seed (:mod:`stride.sched.prefix_hash`); sharing across tenants is
  impossible by construction.
- Eviction takes the least recently freed cached block, chain tails before heads, and only when the free
  list is empty.

Per-slot state lives in numpy arrays (token ids ``(max_num_seqs, max_blocks_per_seq * block_size)`` int32,
like vLLM's input batch), so the decode path has batch forms (:meth:`append_many`,
:meth:`mark_computed_many`) that cost a few vector operations plus Python work only for the sequences
that cross a block boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from stride.sched.block_invariants import BlockState, check_invariants
from stride.sched.block_pool import BlockStats, EvictableLRU, FreeList, LiveSet, NoFreeBlocksError
from stride.sched.prefix_hash import TOKEN_DTYPE, ChainMemo, as_token_array, block_hash, chain_from, tenant_seed
from stride.sched.prefix_index import PrefixIndex

__all__ = ["BlockManager", "BlockStats", "NoFreeBlocksError"]


class _Match(NamedTuple):
    """can_allocate's prefix match, kept for the allocate that usually follows with the same prompt."""

    tenant: str
    tokens: np.ndarray
    as_list: list[int] | None
    index_version: int
    hits: np.ndarray
    last_hash: bytes


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
        max_num_seqs, self.max_blocks_per_seq = block_tables.shape
        block_tables.fill(-1)

        self._free = FreeList(num_blocks)
        self._cached = EvictableLRU(num_blocks)
        self._live = LiveSet(num_blocks)
        self._ref = np.zeros(num_blocks, dtype=np.int32)  # numpy: allocate, fork and free touch many at once
        self._prefix = PrefixIndex(num_blocks)
        self._memo: _Match | None = None
        self._chains = ChainMemo(block_size)

        # Per slot. A slot is occupied iff its seed is not None.
        self._seed: list[bytes | None] = [None] * max_num_seqs
        self._tokens = np.zeros((max_num_seqs, self.max_blocks_per_seq * block_size), dtype=TOKEN_DTYPE)
        self._token_blocks = self._tokens.reshape(max_num_seqs, self.max_blocks_per_seq, block_size)  # a view
        self._num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self._num_table_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # filled entries of the row
        self._num_hashed = np.zeros(max_num_seqs, dtype=np.int64)  # leading blocks whose address is known
        self._last_hash: list[bytes] = [b""] * max_num_seqs  # address of block num_hashed - 1 (or the seed)
        self._tenant_seeds: dict[str, bytes] = {}

        self._hit_tokens = 0
        self._query_tokens = 0
        self._num_evictions = 0

    # ---- allocation -------------------------------------------------------------------------------
    def can_allocate(self, tenant: str, token_ids: Sequence[int] | np.ndarray) -> bool:
        """Whether free plus evictable blocks cover the whole prompt after its prefix hit."""
        tokens = as_token_array(token_ids)
        need = self._blocks_for(len(tokens))
        hits, last_hash = self._match(tenant, tokens)
        # allocate usually follows with the same prompt. Private copies keep a caller's later edit out.
        as_list = list(token_ids) if isinstance(token_ids, list) else None
        self._memo = _Match(tenant, tokens.copy(), as_list, self._prefix.version, hits, last_hash)
        num_revived = int(np.count_nonzero(self._ref[hits] == 0))
        return need - len(hits) <= self._free.num + self._cached.num - num_revived

    def allocate(self, slot: int, tenant: str, token_ids: Sequence[int] | np.ndarray) -> int:
        """Give slot ``slot`` blocks for all of ``token_ids``, reusing this tenant's longest indexed prefix.

        Returns the number of prompt tokens whose KV is already there: a multiple of ``block_size`` and
        always below ``len(token_ids)`` (the last prompt token is recomputed so the model yields logits).
        Raises :class:`NoFreeBlocksError`, changing nothing, when ``can_allocate`` would say False."""
        if self._seed[slot] is not None:
            raise ValueError(f"slot {slot} is in use")
        memo, self._memo = self._memo, None
        if memo is not None and memo.as_list is not None and isinstance(token_ids, list) \
                and token_ids == memo.as_list:
            tokens = memo.tokens  # the list can_allocate just converted (list == list is a C loop)
        else:
            tokens = as_token_array(token_ids)
        n = len(tokens)
        if n == 0:
            raise ValueError("cannot allocate an empty prompt")
        need = self._blocks_for(n)
        # Both are 1-D TOKEN_DTYPE arrays, so equal bytes mean equal tokens (about 2x array_equal's speed).
        if (memo is not None and memo.tenant == tenant and memo.index_version == self._prefix.version
                and (tokens is memo.tokens or memo.tokens.tobytes() == tokens.tobytes())):
            hits, last_hash = memo.hits, memo.last_hash  # just matched, and the index is unchanged
        else:
            hits, last_hash = self._match(tenant, tokens)
        ref = self._ref
        revived = hits[ref[hits] == 0].tolist()
        num_revived = len(revived)
        num_new = need - len(hits)
        if num_new > self._free.num + self._cached.num - num_revived:
            raise NoFreeBlocksError(f"slot {slot}: need {num_new} new blocks, "
                                    f"{self._free.num + self._cached.num - num_revived} available")
        # Revive hits before taking new blocks, or eviction could take a block we are about to reuse.
        for b in revived:
            self._cached.remove(b)
        self._live.add_many(revived)
        ref[hits] += 1
        new = self._take(num_new)
        row = self.block_tables[slot]
        row[:len(hits)] = hits
        row[len(hits):need] = new
        self._tokens[slot, :n] = tokens
        self._num_tokens[slot] = n
        self._num_table_blocks[slot] = need
        self._num_hashed[slot] = len(hits)
        self._last_hash[slot] = last_hash
        self._seed[slot] = self._tenant_seed(tenant)
        num_cached_tokens = len(hits) * self.block_size
        self._hit_tokens += num_cached_tokens
        self._query_tokens += n
        return num_cached_tokens

    def mark_computed(self, slot: int, num_computed_tokens: int) -> None:
        """Tokens ``[0, num_computed_tokens)`` are scheduled: index every full block inside that range."""
        # The per-sequence verbs read scalars with .item(): several times cheaper than numpy scalar indexing.
        if self._seed[slot] is None:
            raise ValueError(f"slot {slot} is empty")
        if not self.enable_prefix_caching:
            return
        if num_computed_tokens // self.block_size > self._num_hashed.item(slot):  # else: nothing new is full
            self._index_upto(slot, num_computed_tokens)

    def mark_computed_many(self, slots: np.ndarray, num_computed_tokens: np.ndarray) -> None:
        """:meth:`mark_computed` for each ``(slots[i], num_computed_tokens[i])``; Python work only for the
        sequences in which a block became full."""
        if not self.enable_prefix_caching:
            return
        slots = np.asarray(slots, dtype=np.intp)
        nums = np.asarray(num_computed_tokens, dtype=np.int64)
        num_full, first = nums // self.block_size, self._num_hashed[slots]
        todo = np.flatnonzero(num_full > first)
        if not todo.size:
            return
        slots, nums, num_full, first = slots[todo], nums[todo], num_full[todo], first[todo]
        if (nums > self._num_tokens[slots]).any():  # also catches an empty slot (0 tokens)
            i = int(np.argmax(nums > self._num_tokens[slots]))
            raise ValueError(f"slot {int(slots[i])}: {int(nums[i])} computed > "
                             f"{int(self._num_tokens[slots[i]])} tokens (or the slot is empty)")
        # The decode case: exactly one block just became full. Gather those blocks' tokens and ids with
        # two vector reads, then hash in one loop.
        one = num_full == first + 1
        if one.all():  # the usual decode step: skip the split (each small numpy call costs ~1 us)
            one_slots, one_first, rest_slots, rest_nums = slots, first, [], []
        else:
            one_slots, one_first = slots[one], first[one]
            rest_slots, rest_nums = slots[~one].tolist(), nums[~one].tolist()
        if one_slots.size:
            data = self._token_blocks[one_slots, one_first].tobytes()
            blocks = self.block_tables[one_slots, one_first].tolist()
            self._num_hashed[one_slots] = one_first + 1
            step, last_hash = self.block_size * TOKEN_DTYPE.itemsize, self._last_hash
            hashes: list[bytes] = []
            for slot, i in zip(one_slots.tolist(), range(0, len(data), step), strict=True):
                last_hash[slot] = h = block_hash(last_hash[slot], data[i:i + step])
                hashes.append(h)
            self._prefix.add_many(blocks, hashes)
        for slot, n in zip(rest_slots, rest_nums, strict=True):
            self._index_upto(slot, n)

    def can_append(self, slot: int) -> bool:
        """Whether one more token fits: room in the last block, or a free or evictable block."""
        nb = self._num_table_blocks.item(slot)
        if nb == 0:
            raise ValueError(f"slot {slot} is empty")
        return self._num_tokens.item(slot) < nb * self.block_size or self._free.num + self._cached.num > 0

    def num_blocks_to_append(self, slots: np.ndarray) -> int:
        """New blocks that appending one token to each of ``slots`` takes (compare with
        :attr:`num_available_blocks`)."""
        slots = np.asarray(slots, dtype=np.intp)
        full = self._num_tokens[slots] == self._num_table_blocks[slots] * self.block_size
        return int(np.count_nonzero(full))

    def append(self, slot: int, token_id: int) -> None:
        """Record one token at the end of the sequence, taking a new block when the last one is full."""
        n = self._num_tokens.item(slot)
        nb = self._num_table_blocks.item(slot)
        if n == nb * self.block_size:
            if nb == 0:
                raise ValueError(f"slot {slot} is empty")
            if nb == self.max_blocks_per_seq:
                raise ValueError(f"slot {slot}: block table row is full ({nb} blocks)")
            if self._free.num:  # the usual case, without _take's list handling
                b = self._free.pop()
                self._live.add(b)
                self._ref[b] = 1
            else:
                b = int(self._take(1)[0])
            self.block_tables[slot, nb] = b
            self._num_table_blocks[slot] = nb + 1
        self._tokens[slot, n] = token_id
        self._num_tokens[slot] = n + 1

    def append_many(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """:meth:`append` ``token_ids[i]`` to ``slots[i]`` for every i (distinct, occupied slots), all or
        nothing: raises before changing anything when the blocks it needs are not there."""
        slots = np.asarray(slots, dtype=np.intp)
        ids = as_token_array(token_ids)
        if len(ids) != len(slots):
            raise ValueError(f"{len(slots)} slots but {len(ids)} token ids")
        nb = self._num_table_blocks[slots]
        if len(slots) and (nb.min() == 0 or np.bincount(slots).max() > 1):
            raise ValueError("append_many needs distinct, occupied slots")
        n = self._num_tokens[slots]
        grow = np.flatnonzero(n == nb * self.block_size)  # positions: two small takes beat two mask scans
        if grow.size:
            grow_slots, grow_nb = slots[grow], nb[grow]
            if grow_nb.max() >= self.max_blocks_per_seq:
                raise ValueError(f"slot {int(grow_slots[grow_nb.argmax()])}: block table row is full")
            self.block_tables[grow_slots, grow_nb] = self._take(len(grow_slots))
            self._num_table_blocks[grow_slots] = grow_nb + 1
        self._tokens[slots, n] = ids
        self._num_tokens[slots] = n + 1

    def set_last_tokens(self, slots: np.ndarray, token_ids: np.ndarray) -> None:
        """Overwrite the last recorded token of each of ``slots`` (a step built ahead appended a placeholder for a
        token not sampled yet). Call before :meth:`mark_computed` covers it: an indexed block's content is fixed."""
        slots = np.asarray(slots, dtype=np.intp)
        last = self._num_tokens[slots] - 1
        if len(slots) and (last.min() < 0 or (last < self._num_hashed[slots] * self.block_size).any()):
            raise ValueError("set_last_tokens: a slot is empty or its last token is in an indexed block")
        self._tokens[slots, last] = as_token_array(token_ids)

    def free(self, slot: int) -> None:
        """The sequence finished or was aborted: indexed blocks become cached, the rest free; row = -1."""
        self._drop(slot)

    def release(self, slot: int) -> None:
        """Preemption: the same accounting as :meth:`free`. The caller keeps the tokens and later calls
        :meth:`allocate` with all of them, usually finding most of its own blocks still cached."""
        self._drop(slot)

    def can_fork(self, parent_slot: int) -> bool:
        self._occupied(parent_slot)
        partial = self._num_tokens[parent_slot] % self.block_size != 0
        return not partial or self._free.num + self._cached.num > 0

    def fork(self, parent_slot: int, child_slot: int) -> tuple[int, int] | None:
        """n>1 sampling: the child shares the parent's full blocks (ref count +1 each); a partial last block
        is copied into a fresh block. Returns ``(src_block, dst_block)`` for the worker to copy, else None."""
        self._occupied(parent_slot)
        if self._seed[child_slot] is not None:
            raise ValueError(f"slot {child_slot} is in use")
        n = int(self._num_tokens[parent_slot])
        nb = int(self._num_table_blocks[parent_slot])
        num_full = n // self.block_size
        row = self.block_tables[parent_slot]
        copy = None
        if nb > num_full:  # take the copy's block first: failing here leaves everything unchanged
            dst = int(self._take(1)[0])
            self.block_tables[child_slot, num_full] = dst
            copy = (int(row[num_full]), dst)
        self._ref[row[:num_full]] += 1
        self.block_tables[child_slot, :num_full] = row[:num_full]
        self._tokens[child_slot, :n] = self._tokens[parent_slot, :n]
        self._num_tokens[child_slot] = n
        self._num_table_blocks[child_slot] = nb
        self._num_hashed[child_slot] = self._num_hashed[parent_slot]
        self._last_hash[child_slot] = self._last_hash[parent_slot]
        self._seed[child_slot] = self._seed[parent_slot]
        return copy

    # ---- queries ----------------------------------------------------------------------------------
    def num_tokens(self, slot: int) -> int:
        if self._seed[slot] is None:
            raise ValueError(f"slot {slot} is empty")
        return self._num_tokens.item(slot)

    @property
    def num_tokens_per_slot(self) -> np.ndarray:
        """Read-only view of every slot's token count (0 when empty): the batch form of :meth:`num_tokens`."""
        view = self._num_tokens.view()
        view.flags.writeable = False
        return view

    def is_allocated(self, slot: int) -> bool:
        return self._seed[slot] is not None

    def token_ids(self, slot: int) -> np.ndarray:
        """A copy of the sequence's tokens."""
        self._occupied(slot)
        return self._tokens[slot, :self._num_tokens[slot]].copy()

    def block_table(self, slot: int) -> list[int]:
        """The physical blocks of slot ``slot`` in logical order (empty for an empty slot)."""
        return self.block_tables[slot, :self._num_table_blocks[slot]].tolist()

    def ref_count(self, block_id: int) -> int:
        return int(self._ref[block_id])

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

    def state(self) -> BlockState:
        """What the invariant checks read: references to every structure this manager keeps."""
        return BlockState(self.num_blocks, self.block_size, self._free, self._cached, self._live, self._ref,
                          self._prefix, self.block_tables, self._seed, self._tokens, self._num_tokens,
                          self._num_table_blocks, self._num_hashed, self._last_hash)

    def assert_invariants(self, *, deep: bool = False) -> None:
        """Raise ``AssertionError`` naming the first disagreement between counts, structures, ref counts,
        block tables and the index. ``deep`` also recomputes every known address from the tokens (slow)."""
        check_invariants(self.state(), deep=deep)

    # ---- internals --------------------------------------------------------------------------------
    def _occupied(self, slot: int) -> None:
        if self._seed[slot] is None:
            raise ValueError(f"slot {slot} is empty")

    def _blocks_for(self, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        if need > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} tokens need {need} blocks; a row holds {self.max_blocks_per_seq}")
        return need

    def _tenant_seed(self, tenant: str) -> bytes:
        seed = self._tenant_seeds.get(tenant)
        if seed is None:
            seed = self._tenant_seeds[tenant] = tenant_seed(tenant)
        return seed

    def _match(self, tenant: str, tokens: np.ndarray) -> tuple[np.ndarray, bytes]:
        """The hit blocks (an index array: allocate reads and writes ref counts and the row with it) and the
        address the hit chain ends on."""
        seed = self._tenant_seed(tenant)
        if not self.enable_prefix_caching:
            return np.zeros(0, dtype=np.intp), seed
        known = self._chains.known(seed, tokens)
        hits, last_hash, hashes = self._prefix.match(seed, tokens, self.block_size, known)
        # Worth remembering only a chain that reaches indexed blocks and learned something new.
        if hits and len(hashes) > len(known):
            self._chains.remember(seed, tokens, hashes)
        return np.array(hits, dtype=np.intp), last_hash

    def _take(self, count: int) -> np.ndarray:
        """``count`` blocks made live with ref count 1: free ones first, then evicted cached ones."""
        if count > self._free.num + self._cached.num:
            raise NoFreeBlocksError(f"need {count} blocks, {self._free.num + self._cached.num} available")
        from_free = min(count, self._free.num)
        out = self._free.pop_many(from_free)
        if count > from_free:
            evicted = self._cached.pop_oldest_many(count - from_free)
            self._prefix.remove_many(evicted)
            out = np.concatenate((out, np.array(evicted, dtype=np.int64)))
            self._num_evictions += len(evicted)
        self._live.add_many(out)
        self._ref[out] = 1
        return out

    def _index_upto(self, slot: int, num_computed_tokens: int) -> None:
        """Address (and index, unless the content is indexed already) the blocks that became full."""
        if num_computed_tokens > self._num_tokens[slot]:
            raise ValueError(f"slot {slot}: {num_computed_tokens} computed > {self._num_tokens[slot]} tokens")
        bs = self.block_size
        first, num_full = int(self._num_hashed[slot]), num_computed_tokens // bs
        self._num_hashed[slot] = num_full
        data = self._tokens[slot, first * bs:num_full * bs].tobytes()
        hashes = chain_from(self._last_hash[slot], data, bs * TOKEN_DTYPE.itemsize)
        if hashes:
            self._prefix.add_many(self.block_tables[slot, first:num_full].tolist(), hashes)
            self._last_hash[slot] = hashes[-1]

    def _drop(self, slot: int) -> None:
        self._occupied(slot)
        nb = int(self._num_table_blocks[slot])
        row = self.block_tables[slot]
        blocks = row[nb - 1::-1] if nb else row[:0]  # tail first: evicted before its head
        blocks = blocks.astype(np.intp)  # a copy, before the row is cleared
        self._ref[blocks] -= 1  # distinct within a row, so the fancy in-place update is exact
        gone = blocks[self._ref[blocks] == 0]
        if gone.size:
            indexed = self._prefix.indexed[gone]
            self._live.remove_many(gone)
            self._cached.push_many(gone[indexed])
            self._free.push_many(gone[~indexed])
        row[:nb] = -1
        self._num_tokens[slot] = 0
        self._num_table_blocks[slot] = 0
        self._num_hashed[slot] = 0
        self._last_hash[slot] = b""
        self._seed[slot] = None
