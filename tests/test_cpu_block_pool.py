"""The swap space's free list: a block is handed out once at a time, and bad input changes nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.cpu_block_pool import CPUBlockPool


def test_freeing_a_block_twice_in_one_call_is_refused_and_changes_nothing():
    """``free([a, a])`` used to be accepted (free list [2, 3, 0, 0]); then ``allocate(4)`` handed out 0 twice."""
    pool = CPUBlockPool(4)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match=f"CPU block {a} is given twice"):
        pool.free([a, a])
    assert list(pool.free_blocks) == [2, 3]
    pool.free([a, b])
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad, message", [
    ([7], "in 0..3"), ([-1], "in 0..3"), ([True], "got True"), ([1.0], "got 1.0"), ([2], "free list already"),
])
def test_freeing_what_is_not_allocated_is_refused_and_changes_nothing(bad, message):
    pool = CPUBlockPool(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match=message):
        pool.free([0, *bad])
    assert list(pool.free_blocks) == [2, 3]


@given(st.integers(1, 12), st.lists(st.tuples(st.sampled_from(["take", "free", "free twice"]), st.integers(0, 20)),
                                     max_size=40))
def test_every_block_is_held_at_most_once(num_blocks, ops):
    """Random allocate/free calls (some invalid): held and free blocks always partition the pool."""
    pool = CPUBlockPool(num_blocks)
    held: list[int] = []
    for op, k in ops:
        before = list(pool.free_blocks)
        try:
            if op == "take":
                held += pool.allocate(k)
            else:
                k = max(k, 1) if op == "free twice" else k
                pool.free(held[:k] + (held[:1] if op == "free twice" else []))
                del held[:k]
        except ValueError:
            assert list(pool.free_blocks) == before
        assert sorted(held + list(pool.free_blocks)) == list(range(num_blocks))
