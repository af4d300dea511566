"""EvictableLRU (a numpy queue with lazy removal) against an OrderedDict model: order, membership, counts,
through compactions and eviction windows that skip many stale entries."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from stride.sched.block_pool import EvictableLRU, NoFreeBlocksError

CAPACITY = 40


def _check(lru: EvictableLRU, model: OrderedDict[int, None]) -> None:
    assert lru.block_ids() == list(model)
    assert lru.num == lru.size() == len(model)
    for b in range(CAPACITY):
        assert (b in lru) == (b in model)


@pytest.mark.parametrize("seed", range(5))
def test_matches_ordered_dict_model(seed: int) -> None:
    rng = random.Random(seed)
    lru, model = EvictableLRU(CAPACITY), OrderedDict[int, None]()
    outside = list(range(CAPACITY))  # blocks not cached
    for _ in range(3000):  # enough pushes to compact the queue (2 * CAPACITY + 16 entries) many times
        op = rng.random()
        if op < 0.45 and outside:
            chunk = rng.sample(outside, rng.randint(1, min(8, len(outside))))
            lru.push_many(chunk) if len(chunk) > 1 else lru.push(chunk[0])
            model.update(dict.fromkeys(chunk))
            outside = [b for b in outside if b not in model]
        elif op < 0.75 and model:
            b = rng.choice(list(model))  # a revival: a stale entry stays in the queue
            lru.remove(b)
            del model[b]
            outside.append(b)
        elif model:
            count = rng.randint(1, len(model))
            expected = [model.popitem(last=False)[0] for _ in range(count)]
            assert lru.pop_oldest_many(count) == expected
            outside.extend(expected)
        _check(lru, model)


def test_errors_and_drift_show() -> None:
    lru = EvictableLRU(CAPACITY)
    lru.push_many([3, 1, 2])
    with pytest.raises(KeyError):
        lru.remove(5)
    with pytest.raises(NoFreeBlocksError):
        lru.pop_oldest_many(4)
    lru.push(1)  # pushed twice: the count says 4, the queue holds 3 (negative control for the invariant check)
    assert (lru.num, lru.size()) == (4, 3)
    assert lru.block_ids() == [3, 2, 1]
    lru.num = 5  # a drifted count: popping runs out of queue instead of inventing a block
    with pytest.raises(AssertionError, match="ran out"):
        lru.pop_oldest_many(5)
