"""Property test: random interleavings of every block-manager operation across tenants and shared prefixes.

A shadow model plays the worker: it remembers, per physical block, what KV it holds (the tenant and the whole
token prefix through the block's end) once the block is fully computed. Then a hit must land on a block whose
shadow equals the query's own prefix under the query's tenant (no stale hit, no cross-tenant hit), and a live
sequence's computed blocks must keep their content (nothing it holds is evicted or handed out).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from stride.sched.block_manager import BlockManager, NoFreeBlocksError

BS = 4
NUM_BLOCKS = 14  # small: allocations are refused and cached blocks evicted often
NUM_SLOTS = 6
MAX_BLOCKS = 8  # 32 tokens per sequence
TENANTS = ("a", "b", "c")
# Shared prefixes that overlap each other, so chains share heads and diverge; every tenant uses them all.
PREFIXES = ((), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9), (1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 0, 1))
TOKENS = st.integers(0, 3)  # a small alphabet makes accidental shared suffixes common


class Seq:
    def __init__(self, tenant: str, tokens: list[int], computed: int) -> None:
        self.tenant, self.tokens, self.computed = tenant, tokens, computed


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, np.full((NUM_SLOTS, MAX_BLOCKS), -1, np.int32))
        self.seqs: dict[int, Seq] = {}
        self.preempted: list[tuple[str, list[int]]] = []
        self.kv: dict[int, tuple[str, tuple[int, ...]] | None] = {}  # block -> content the worker wrote

    # ---- helpers ----------------------------------------------------------------------------------
    def _slots(self, *, done: bool) -> list[int]:
        """Occupied slots whose prompt (and every token so far) is computed, or those with work left."""
        return sorted(s for s, q in self.seqs.items() if (q.computed == len(q.tokens)) == done)

    def _free_slots(self) -> list[int]:
        return [s for s in range(NUM_SLOTS) if s not in self.seqs]

    def _admit(self, slot: int, tenant: str, tokens: list[int]) -> None:
        if not self.bm.can_allocate(tenant, tokens):
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(slot, tenant, tokens)
            return
        num_cached = self.bm.allocate(slot, tenant, tokens)
        assert num_cached % BS == 0 and 0 <= num_cached < len(tokens)
        table = self.bm.block_table(slot)
        for i, b in enumerate(table[:num_cached // BS]):
            assert self.kv.get(b) == (tenant, tuple(tokens[:(i + 1) * BS])), f"stale hit on block {b}"
        for b in table[num_cached // BS:]:
            self.kv[b] = None  # fresh: the worker will overwrite it
        self.seqs[slot] = Seq(tenant, list(tokens), num_cached)

    def _compute(self, slot: int, upto: int) -> None:
        """The worker writes KV for tokens [computed, upto) of ``slot``; the scheduler marks them."""
        seq, table = self.seqs[slot], self.bm.block_table(slot)
        for i in range(seq.computed // BS, -(-upto // BS)):
            content = (seq.tenant, tuple(seq.tokens[:(i + 1) * BS])) if (i + 1) * BS <= upto else None
            old = self.kv.get(table[i])
            # A block someone else may read is never rewritten with different content.
            assert self.bm.ref_count(table[i]) == 1 or old is None or old == content, f"block {table[i]}"
            self.kv[table[i]] = content
        seq.computed = upto

    # ---- operations -------------------------------------------------------------------------------
    @rule(data=st.data(), tenant=st.sampled_from(TENANTS), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(TOKENS, max_size=12))
    def allocate(self, data: st.DataObject, tenant: str, prefix: tuple[int, ...], suffix: list[int]) -> None:
        free = self._free_slots()
        tokens = list(prefix) + suffix or [0]
        if free:
            self._admit(data.draw(st.sampled_from(free)), tenant, tokens)

    @precondition(lambda self: self.preempted and len(self.seqs) < NUM_SLOTS)
    @rule()
    def resume(self) -> None:
        tenant, tokens = self.preempted.pop(0)
        self._admit(self._free_slots()[0], tenant, tokens)

    @precondition(lambda self: any(s.computed < len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def mark_computed(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(self._slots(done=False)))
        seq = self.seqs[slot]
        upto = data.draw(st.integers(seq.computed + 1, len(seq.tokens)))
        self._compute(slot, upto)
        self.bm.mark_computed(slot, upto)

    @precondition(lambda self: any(s.computed == len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data(), token=TOKENS)
    def append(self, data: st.DataObject, token: int) -> None:
        slot = data.draw(st.sampled_from(self._slots(done=True)))
        seq = self.seqs[slot]
        if len(seq.tokens) == MAX_BLOCKS * BS:
            return
        if not self.bm.can_append(slot):
            with pytest.raises(NoFreeBlocksError):
                self.bm.append(slot, token)
            return
        grew = len(seq.tokens) % BS == 0
        self.bm.append(slot, token)
        seq.tokens.append(token)
        if grew:
            self.kv[self.bm.block_table(slot)[-1]] = None

    @precondition(lambda self: any(s.computed == len(s.tokens) for s in self.seqs.values()))
    @rule(tokens=st.lists(TOKENS, min_size=NUM_SLOTS, max_size=NUM_SLOTS))
    def decode_step(self, tokens: list[int]) -> None:
        """The batch path: append one token to every decoding sequence, then schedule it."""
        slots = np.array(sorted(s for s, q in self.seqs.items()
                                if q.computed == len(q.tokens) and len(q.tokens) < MAX_BLOCKS * BS))
        if not slots.size:
            return
        ids = np.array(tokens[:len(slots)])
        if self.bm.num_blocks_to_append(slots) > self.bm.num_available_blocks:
            with pytest.raises(NoFreeBlocksError):
                self.bm.append_many(slots, ids)
            return
        self.bm.append_many(slots, ids)
        for slot, token in zip(slots.tolist(), ids.tolist(), strict=True):
            seq = self.seqs[slot]
            seq.tokens.append(token)
            if len(seq.tokens) % BS == 1:
                self.kv[self.bm.block_table(slot)[-1]] = None
            self._compute(slot, len(seq.tokens))
        self.bm.mark_computed_many(slots, np.array([len(self.seqs[s].tokens) for s in slots.tolist()]))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(slot)
        del self.seqs[slot]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.release(slot)
        seq = self.seqs.pop(slot)
        self.preempted.append((seq.tenant, seq.tokens))

    @precondition(lambda self: len(self.seqs) < NUM_SLOTS
                  and any(s.computed == len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """n>1 sampling forks a sequence whose prompt is computed."""
        parent = data.draw(st.sampled_from(self._slots(done=True)))
        child = self._free_slots()[0]
        if not self.bm.can_fork(parent):
            with pytest.raises(NoFreeBlocksError):
                self.bm.fork(parent, child)
            return
        copy = self.bm.fork(parent, child)
        p_table, c_table = self.bm.block_table(parent), self.bm.block_table(child)
        num_full = len(self.seqs[parent].tokens) // BS
        assert c_table[:num_full] == p_table[:num_full]
        if copy is None:
            assert len(c_table) == num_full
        else:
            assert copy == (p_table[num_full], c_table[num_full]) and copy[0] != copy[1]
            self.kv[copy[1]] = self.kv.get(copy[0])
        p = self.seqs[parent]
        self.seqs[child] = Seq(p.tenant, list(p.tokens), p.computed)

    # ---- checks -----------------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.bm.assert_invariants(deep=True)
        for slot, seq in self.seqs.items():
            assert self.bm.token_ids(slot).tolist() == seq.tokens
            table = self.bm.block_table(slot)
            for i in range(seq.computed // BS):  # what a running sequence computed is still there
                assert self.kv.get(table[i]) == (seq.tenant, tuple(seq.tokens[:(i + 1) * BS]))

    def teardown(self) -> None:
        for slot in list(self.seqs):
            self.bm.free(slot)
        self.bm.assert_invariants(deep=True)
        s = self.bm.stats
        assert s.num_live == 0 and s.num_cached + s.num_free == NUM_BLOCKS  # no leak
        assert (self.bm.block_tables == -1).all()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_block_manager_properties = BlockManagerMachine.TestCase
