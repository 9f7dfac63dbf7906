"""FreeKVCacheBlockQueue: O(1) linked-list operations and their order rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import FreeKVCacheBlockQueue, KVCacheBlock


def ids(q: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_initial_order_and_count():
    _, q = make(5)
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5 == len(q)


def test_popleft_remove_append_appendleft():
    blocks, q = make(5)
    assert q.popleft().block_id == 0
    q.remove(blocks[2])
    assert ids(q) == [1, 3, 4]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert ids(q) == [2, 1, 3, 4, 0]
    assert q.num_free_blocks == 5


def test_appendleft_n_keeps_group_order():
    blocks, q = make(6)
    taken = q.popleft_n(3)
    q.appendleft_n(taken[::-1])
    assert ids(q) == [2, 1, 0, 3, 4, 5]


def test_popleft_empty_raises():
    _, q = make(1)
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free_blocks == 0


def test_bad_operations_raise_and_change_nothing():
    blocks, q = make(3)
    b = q.popleft()
    with pytest.raises(ValueError):
        q.remove(b)  # not in the queue
    with pytest.raises(ValueError):
        q.append(blocks[1])  # already in the queue
    with pytest.raises(ValueError):
        q.popleft_n(3)  # only 2 free
    assert ids(q) == [1, 2]


@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append", "appendleft"]), st.integers(0, 30)), max_size=80))
def test_matches_a_python_list_model(ops):
    blocks, q = make(12)
    model = list(range(12))
    out: list[int] = []
    for op, k in ops:
        if op == "pop":
            if model:
                assert q.popleft().block_id == model.pop(0)
                out.append(_last_popped(q, blocks, model, out))
            else:
                with pytest.raises(ValueError):
                    q.popleft()
        elif op == "remove" and model:
            bid = model[k % len(model)]
            model.remove(bid)
            q.remove(blocks[bid])
            out.append(bid)
        elif op in ("append", "appendleft") and out:
            bid = out.pop(k % len(out))
            getattr(q, op)(blocks[bid])
            if op == "append":
                model.append(bid)
            else:
                model.insert(0, bid)
        assert ids(q) == model
        assert q.num_free_blocks == len(model)


def _last_popped(q, blocks, model, out):
    # the id just popped is the one not in the model nor in `out`
    present = set(model) | set(out)
    return next(b.block_id for b in blocks if b.block_id not in present)


def test_bad_construction_and_bulk_appends_change_nothing():
    b0, b1 = KVCacheBlock(0), KVCacheBlock(1)
    with pytest.raises(ValueError):
        FreeKVCacheBlockQueue([b0, b1, b0])
    assert b0.prev_free_block is None and b1.prev_free_block is None
    blocks, q = make(4)
    taken = q.popleft_n(2)
    with pytest.raises(ValueError):
        q.append_n([taken[0], blocks[3]])  # block 3 is still queued
    with pytest.raises(ValueError):
        q.appendleft_n([taken[0], taken[0]])
    assert ids(q) == [2, 3] and taken[0].prev_free_block is None
    q.append_n(taken)
    assert ids(q) == [2, 3, 0, 1]
