"""Scripted block-manager scenarios with exact block ids, ref counts and eviction order (block_size 4)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from stride.sched.block_manager import BlockManager, NoFreeBlocksError
from stride.sched.prefix_hash import ChainMemo, chain_hashes, tenant_seed

BS = 4
SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks


def make(num_blocks: int = 10, max_num_seqs: int = 4, max_blocks: int = 8, **kw: bool) -> BlockManager:
    return BlockManager(num_blocks, BS, np.full((max_num_seqs, max_blocks), 7, np.int32), **kw)


def run_prompt(bm: BlockManager, slot: int, tenant: str, tokens: list[int]) -> int:
    num_cached = bm.allocate(slot, tenant, tokens)
    bm.mark_computed(slot, len(tokens))
    bm.assert_invariants(deep=True)
    return num_cached


def refs(bm: BlockManager, blocks: list[int]) -> list[int]:
    return [bm.ref_count(b) for b in blocks]


def test_shared_system_prompt_two_requests() -> None:
    bm = make()
    assert run_prompt(bm, 0, "acme", SYSTEM + [100, 101, 102]) == 0
    assert bm.block_table(0) == [0, 1, 2]
    assert run_prompt(bm, 1, "acme", SYSTEM + [200, 201]) == 8
    assert bm.block_table(1) == [0, 1, 3]
    assert refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    # Same bytes, other tenant: a different address, so a miss.
    assert run_prompt(bm, 2, "globex", SYSTEM + [200, 201]) == 0
    assert bm.block_table(2) == [4, 5, 6]
    s = bm.stats
    assert (s.num_live, s.num_cached, s.num_free) == (7, 0, 3)
    assert (s.hit_tokens, s.query_tokens) == (8, 11 + 10 + 10)

    bm.free(0)  # the shared blocks stay live with the other user; the partial tail is freed
    assert refs(bm, [0, 1, 2]) == [1, 1, 0]
    assert bm.eviction_order() == []
    bm.free(1)  # now the system prompt is cached, tail first in eviction order; block 3 was partial
    assert bm.eviction_order() == [1, 0]
    assert (bm.stats.num_live, bm.stats.num_cached, bm.stats.num_free) == (3, 2, 5)
    assert bm.block_tables[0].tolist() == [-1] * 8
    bm.assert_invariants(deep=True)


def test_last_prompt_token_is_recomputed() -> None:
    bm = make()
    assert run_prompt(bm, 0, "t", SYSTEM) == 0
    bm.free(0)
    assert bm.eviction_order() == [1, 0]
    # The whole prompt is cached, but its last block is recomputed into a fresh block.
    assert run_prompt(bm, 0, "t", SYSTEM) == 4
    assert bm.block_table(0) == [0, 2]
    bm.free(0)  # block 2 duplicated indexed content, so it was never indexed and goes free
    assert bm.eviction_order() == [1, 0]  # block 1 stayed cached (oldest); block 0 was used again
    assert bm.stats.num_cached == 2 and bm.stats.num_free == 8
    bm.assert_invariants(deep=True)


def test_eviction_under_pressure_lru_tails_first() -> None:
    bm = make(num_blocks=6)
    run_prompt(bm, 0, "t", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks 0 1 2; 0 and 1 indexed
    run_prompt(bm, 1, "t", [11, 12, 13, 14, 15])  # blocks 3 4; 3 indexed
    bm.free(0)  # older chain: evicted first, its tail (1) before its head (0)
    bm.free(1)
    assert bm.eviction_order() == [1, 0, 3]
    assert bm.stats.num_free == 3  # blocks 5, 2, 4
    assert run_prompt(bm, 0, "t", [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33]) == 0
    assert bm.block_table(0) == [5, 2, 4, 1]  # free ones first, then the LRU tail
    assert bm.stats.num_evictions == 1 and bm.eviction_order() == [0, 3]
    # The first chain lost its tail; its head still serves a shorter match.
    assert run_prompt(bm, 1, "t", [1, 2, 3, 4, 5]) == 4
    assert bm.block_table(1) == [0, 3]  # block 0 revived, block 3 evicted for the new second block
    assert bm.stats.num_evictions == 2 and bm.eviction_order() == []
    assert not bm.can_allocate("t", [40, 41])
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2, "t", [40, 41])
    assert bm.block_tables[2].tolist() == [-1] * 8  # a refused allocation changes nothing
    bm.assert_invariants(deep=True)


def test_revival_of_cached_block() -> None:
    bm = make(num_blocks=6)
    run_prompt(bm, 0, "t", SYSTEM + [9])
    bm.free(0)
    assert bm.eviction_order() == [1, 0] and refs(bm, [0, 1]) == [0, 0]
    assert run_prompt(bm, 1, "t", SYSTEM + [50, 51]) == 8
    assert bm.block_table(1) == [0, 1, 3]
    assert refs(bm, [0, 1]) == [1, 1] and bm.eviction_order() == []
    assert (bm.stats.num_live, bm.stats.num_cached, bm.stats.num_free) == (3, 0, 3)
    # Fill the pool: the revived blocks are live now and never evicted.
    run_prompt(bm, 2, "t", list(range(100, 112)))
    assert bm.block_table(2) == [4, 5, 2]
    assert bm.stats.num_evictions == 0 and refs(bm, [0, 1]) == [1, 1]


def test_blocks_shared_with_live_sequence_are_never_evicted() -> None:
    bm = make(num_blocks=8)
    run_prompt(bm, 0, "t", SYSTEM + [9])  # 0 1 2, live throughout
    run_prompt(bm, 1, "t", SYSTEM + [60, 61, 62, 63, 64])  # hits 0 1, adds 3 (indexed) and 4
    bm.free(1)
    assert bm.eviction_order() == [3] and refs(bm, [0, 1]) == [1, 1]
    # Needs 5 blocks: 4 free and 1 cached; the shared prefix is not available to it.
    assert bm.can_allocate("t", list(range(200, 220)))
    assert not bm.can_allocate("t", list(range(200, 221)))
    run_prompt(bm, 1, "t", list(range(200, 220)))
    assert bm.block_table(1) == [5, 6, 7, 4, 3]
    assert bm.stats.num_evictions == 1 and refs(bm, [0, 1, 2]) == [1, 1, 1]
    # The live prefix still serves hits.
    bm.free(1)
    assert run_prompt(bm, 1, "t", SYSTEM + [70]) == 8


def test_freed_prefix_is_reused_by_same_tenant_only() -> None:
    bm = make()
    run_prompt(bm, 0, "t", SYSTEM + [9, 10, 11, 12, 13])
    bm.free(0)
    assert run_prompt(bm, 1, "other", SYSTEM + [9, 10, 11, 12, 13]) == 0
    assert bm.block_table(1) == [4, 5, 6, 7]
    assert run_prompt(bm, 2, "t", SYSTEM + [9, 10, 11, 12, 13]) == 12
    assert bm.block_table(2) == [0, 1, 2, 8]


def test_uncomputed_blocks_do_not_hit() -> None:
    bm = make(num_blocks=16)
    prompt = SYSTEM + [9, 10, 11, 12, 13]
    assert bm.allocate(0, "t", prompt) == 0
    assert bm.allocate(1, "t", prompt) == 0  # nothing computed yet
    bm.mark_computed(0, 6)  # a chunk: only block 0 is complete
    assert bm.allocate(2, "t", prompt) == 4
    bm.mark_computed(0, 13)
    assert bm.allocate(3, "t", prompt) == 12
    bm.mark_computed(1, 13)  # slot 1 computed the same content: its copies stay unindexed
    bm.assert_invariants(deep=True)
    for slot in range(4):
        bm.free(slot)
    assert bm.stats.num_cached == 3 and bm.stats.num_live == 0
    bm.assert_invariants(deep=True)


def test_release_then_resume_finds_own_blocks() -> None:
    bm = make()
    run_prompt(bm, 0, "t", [1, 2, 3, 4, 5, 6])
    for tok in (7, 8, 9):  # decode: append, then the token is scheduled
        assert bm.can_append(0)
        bm.append(0, tok)
        bm.mark_computed(0, bm.num_tokens(0))
    assert bm.block_table(0) == [0, 1, 2]
    tokens = bm.token_ids(0).tolist()
    bm.release(0)
    assert bm.eviction_order() == [1, 0]  # block 2 holds one token: free
    assert bm.allocate(3, "t", tokens) == 8
    assert bm.block_table(3) == [0, 1, 3]


def test_fork_shares_full_blocks_and_copies_partial() -> None:
    bm = make()
    run_prompt(bm, 0, "t", SYSTEM + [9, 10])
    assert bm.fork(0, 1) == (2, 3)
    assert bm.block_table(1) == [0, 1, 3] and refs(bm, [0, 1, 2, 3]) == [2, 2, 1, 1]
    bm.assert_invariants(deep=True)
    bm.append(0, 11)
    bm.append(1, 12)
    bm.mark_computed(0, 11)
    bm.mark_computed(1, 11)
    assert bm.token_ids(1).tolist() == SYSTEM + [9, 10, 12]
    run_prompt(bm, 2, "t", SYSTEM)
    assert bm.fork(2, 3) is None  # last block full: nothing to copy
    assert bm.block_table(3) == [0, 4] and refs(bm, [0, 1, 4]) == [4, 2, 2]
    bm.append(3, 99)
    assert bm.block_table(3) == [0, 4, 5]
    bm.assert_invariants(deep=True)
    for slot in range(4):
        bm.free(slot)
    assert bm.stats.num_live == 0 and bm.eviction_order() == [1, 0]
    bm.assert_invariants(deep=True)


def test_append_many_matches_append() -> None:
    one, many = make(num_blocks=12), make(num_blocks=12)
    for bm in (one, many):
        bm.allocate(0, "t", [1, 2, 3])
        bm.allocate(2, "t", [5, 6, 7, 8])
    slots = np.array([2, 0])
    for step in range(6):
        ids = np.array([10 + step, 20 + step])
        for s, t in zip(slots.tolist(), ids.tolist(), strict=True):
            one.append(s, t)
            one.mark_computed(s, one.num_tokens(s))
        assert many.num_blocks_to_append(slots) == one.stats.num_live - many.stats.num_live
        many.append_many(slots, ids)
        many.mark_computed_many(slots, many.num_tokens_per_slot[slots])
        assert one.block_tables.tolist() == many.block_tables.tolist()
        assert one._prefix._by_address == many._prefix._by_address
        many.assert_invariants(deep=True)
    with pytest.raises(ValueError, match="distinct"):
        many.append_many(np.array([0, 0]), np.array([1, 2]))


def test_append_many_is_all_or_nothing() -> None:
    bm = make(num_blocks=3)
    bm.allocate(0, "t", [1, 2, 3, 4])
    bm.allocate(1, "t", [1, 2, 3, 4, 5, 6, 7, 8])
    before = bm.block_tables.copy()
    with pytest.raises(NoFreeBlocksError):
        bm.append_many(np.array([0, 1]), np.array([9, 9]))
    assert (bm.block_tables == before).all() and bm.num_tokens(0) == 4
    bm.assert_invariants()


def test_can_allocate_memo_never_goes_stale() -> None:
    bm = make()
    run_prompt(bm, 0, "t", SYSTEM + [9])
    prompt = np.array(SYSTEM + [9], dtype=np.int32)
    assert bm.can_allocate("t", prompt)
    prompt[0] = 99  # the caller edits its array in place before allocating
    assert bm.allocate(1, "t", prompt) == 0
    as_list = SYSTEM + [9]
    assert bm.can_allocate("t", as_list)
    as_list[4] = 99  # the same with a list: block 1 no longer matches
    assert bm.allocate(2, "t", as_list) == 4
    assert bm.can_allocate("t", SYSTEM + [9])
    bm.free(2)
    assert bm.allocate(2, "u", SYSTEM + [9]) == 0  # other tenant
    assert bm.allocate(3, "t", SYSTEM + [9]) == 8


def test_prefix_caching_off() -> None:
    bm = make(enable_prefix_caching=False)
    run_prompt(bm, 0, "t", SYSTEM + [9])
    assert run_prompt(bm, 1, "t", SYSTEM + [9]) == 0
    bm.free(0)
    bm.free(1)
    assert bm.stats.num_cached == 0 and bm.stats.num_free == 10


def test_addresses_are_stable_chained_and_tenant_seeded() -> None:
    tokens = np.array(SYSTEM, dtype=np.int32)
    h = chain_hashes(tenant_seed("acme"), tokens, BS, 2)
    assert h[1] != chain_hashes(tenant_seed("globex"), tokens, BS, 2)[1]
    swapped = np.array(SYSTEM[4:] + SYSTEM[:4], dtype=np.int32)  # same blocks, other order: other path
    assert chain_hashes(tenant_seed("acme"), swapped, BS, 2)[0] != h[1]
    # Another process (another PYTHONHASHSEED) computes the same addresses.
    code = ("import numpy as np; from stride.sched.prefix_hash import chain_hashes, tenant_seed; "
            f"print(chain_hashes(tenant_seed('acme'), np.array({SYSTEM}, dtype=np.int32), {BS}, 2)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == h[1].hex()


def test_rejects_misuse() -> None:
    bm = make()
    bm.allocate(0, "t", [1, 2])
    with pytest.raises(ValueError, match="in use"):
        bm.allocate(0, "t", [1, 2])
    with pytest.raises(ValueError, match="empty"):
        bm.append(1, 5)
    with pytest.raises(ValueError, match="tokens need"):
        bm.allocate(1, "t", list(range(33)))
    with pytest.raises(ValueError, match="computed >"):
        bm.mark_computed(0, 9)
    with pytest.raises(OverflowError):
        bm.allocate(1, "t", [2**31])


# ---- negative controls: every invariant check must be able to fail ------------------------------------
def healthy() -> BlockManager:
    """Slot 0 live (blocks 0 1 2, 0 and 1 shared with slot 1), block 3 cached, the rest free."""
    bm = make()
    run_prompt(bm, 0, "t", SYSTEM + [9])
    run_prompt(bm, 2, "t", [30, 31, 32, 33, 34])
    bm.free(2)  # block 3 cached, block 4 free
    run_prompt(bm, 1, "t", SYSTEM + [10])
    bm.assert_invariants(deep=True)
    assert bm.eviction_order() == [3] and refs(bm, [0, 1, 2]) == [2, 2, 1]
    return bm


def _free_count(bm: BlockManager) -> None:
    bm._free.num += 1


def _cached_count(bm: BlockManager) -> None:
    bm._cached.num -= 1


def _live_count(bm: BlockManager) -> None:
    bm._live.num += 1


def _cached_also_free(bm: BlockManager) -> None:
    bm._free._put(np.array([3]))  # a cached block on the free list, count untouched


def _cached_also_free_counted(bm: BlockManager) -> None:
    bm._free.push(3)  # the same, with the free count agreeing with its list


def _cached_moved_to_free(bm: BlockManager) -> None:
    bm._cached.remove(3)  # "freed" properly as far as the counts go, but the index still points at it
    bm._free.push(3)


def _cached_swapped_onto_free(bm: BlockManager) -> None:
    bm._free.pop_many(1)  # every count and size still agrees; block 3 is in two places, another nowhere
    bm._free.push(3)


def _free_block_lost(bm: BlockManager) -> None:
    bm._free.pop_many(1)  # a block that is nowhere


def _ref_too_high(bm: BlockManager) -> None:
    bm._ref[0] += 1


def _ref_too_low(bm: BlockManager) -> None:
    bm._ref[2] -= 1


def _table_entry_past_end(bm: BlockManager) -> None:
    bm.block_tables[0, 5] = 6


def _table_points_at_free_block(bm: BlockManager) -> None:
    bm.block_tables[0, 2] = 7


def _cached_unindexed(bm: BlockManager) -> None:
    h = bm._prefix.address(3)
    assert h is not None
    del bm._prefix._by_address[h]
    bm._prefix._address_of[3] = None


def _index_points_at_free(bm: BlockManager) -> None:
    bm._prefix._by_address[b"\x01" * 16] = 5


def _index_mask_drift(bm: BlockManager) -> None:
    bm._prefix.indexed[4] = True  # free block 4 would be cached when released, though it has no address


def _slot_count(bm: BlockManager) -> None:
    bm._num_tokens[0] += 4


@pytest.mark.parametrize("corrupt, message", [
    (_free_count, "num_free"),
    (_cached_count, "num_cached"),
    (_live_count, "num_live"),
    (_cached_also_free, "num_free"),
    (_cached_also_free_counted, "!= capacity"),
    (_cached_moved_to_free, "indexed block 3 is on the free list"),
    (_cached_swapped_onto_free, "block 3 is both free and cached"),
    (_free_block_lost, "!= capacity"),
    (_ref_too_high, "block 0 has ref count 3 but 2"),
    (_ref_too_low, "block 2 has ref count 0 but 1"),
    (_table_entry_past_end, "row 0 has an entry past"),
    (_table_points_at_free_block, "block 2 has ref count 1 but 0"),
    (_cached_unindexed, "cached block 3 is not indexed"),
    (_index_points_at_free, "in the index xor"),
    (_slot_count, "slot 0 has 3 blocks for 13 tokens"),
    (_index_mask_drift, "block 4: the index's mask disagrees"),
])
def test_invariant_check_catches_corruption(corrupt, message) -> None:  # type: ignore[no-untyped-def]
    bm = healthy()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        bm.assert_invariants()


def test_deep_check_catches_content_that_disagrees_with_its_address() -> None:
    bm = healthy()
    bm._tokens[1, 0] = 999  # slot 1's first block no longer holds what its address says
    bm.assert_invariants()  # the shallow check does not read tokens
    with pytest.raises(AssertionError, match="slot 1: chain address"):
        bm.assert_invariants(deep=True)


def test_chain_memo_knows_only_equal_leading_blocks() -> None:
    seed, other = tenant_seed("acme"), tenant_seed("globex")
    memo = ChainMemo(BS, max_entries=2)
    base = np.arange(100, 100 + 6 * BS, dtype=np.int32)
    memo.remember(seed, base, chain_hashes(seed, base, BS, 5))
    assert memo.known(seed, base) == chain_hashes(seed, base, BS, 5)
    changed = base.copy()
    changed[2 * BS + 1] = 7  # block 2 differs: blocks 0 and 1 only
    assert memo.known(seed, changed) == chain_hashes(seed, base, BS, 2)
    assert memo.known(seed, base[:2 * BS + 1]) == chain_hashes(seed, base, BS, 2)  # full blocks only
    assert memo.known(other, base) == []  # another tenant's seed: nothing
    changed[0] = 7
    assert memo.known(seed, changed) == []  # first block differs
    # A shorter chain with the same first block does not replace a longer one.
    memo.remember(seed, base, chain_hashes(seed, base, BS, 3))
    assert len(memo.known(seed, base)) == 5
    # Control for the cap: two other prompts push the first out.
    for k in (1, 2):
        p = np.arange(k * 1000, k * 1000 + 3 * BS, dtype=np.int32)
        memo.remember(seed, p, chain_hashes(seed, p, BS, 3))
        assert memo.known(seed, p) == chain_hashes(seed, p, BS, 3)
    assert memo.known(seed, base) == []
