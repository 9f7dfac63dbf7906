"""BlockPool: the null block, allocation, the free order rules, touch, eviction, reset."""

from __future__ import annotations

import pytest

from pagedkv import BlockPool, Request


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def cache(pool: BlockPool, block, h) -> None:
    block.block_hash = h
    pool.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block


def test_null_block_never_handed_out():
    pool = BlockPool(5)
    assert len(pool.blocks) == 5 and pool.blocks[0] is pool.null_block and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 4
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == 1.0


@pytest.mark.parametrize("n", [0, -1, 2.5, "3"])
def test_bad_pool_size(n):
    with pytest.raises(ValueError):
        BlockPool(n)


def test_get_new_blocks_short_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    before = free_ids(pool)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    assert free_ids(pool) == before and [b.ref_cnt for b in pool.blocks] == [0, 1, 0, 0]
    assert pool.get_new_blocks(0) == []


def test_free_order_uncached_to_head_in_given_order_cached_to_tail():
    pool = BlockPool(8)
    a, b, c, d = pool.get_new_blocks(4)  # 1 2 3 4 ; free: 5 6 7
    cache(pool, b, 111)
    cache(pool, d, 222)
    pool.free_blocks([a, b, c, d])
    # uncached a, c to the head as a group (a first); cached b, d to the tail in order
    assert free_ids(pool) == [1, 3, 5, 6, 7, 2, 4]
    assert pool.get_new_blocks(1)[0] is a


def test_double_free_and_null_free_raise_before_any_change():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.free_blocks([a, a])  # ref_cnt 1, freed twice
    with pytest.raises(ValueError):
        pool.free_blocks([a, pool.null_block])
    assert a.ref_cnt == 1 and b.ref_cnt == 1 and free_ids(pool) == [3]
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([b, a])  # a is already free
    assert b.ref_cnt == 1 and free_ids(pool) == [1, 3]


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(5)
    (a,) = pool.get_new_blocks(1)
    cache(pool, a, 7)
    pool.free_blocks([a])
    assert free_ids(pool) == [2, 3, 4, 1] and pool.get_cached_block(7) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and free_ids(pool) == [2, 3, 4]
    pool.touch([a])
    assert a.ref_cnt == 2


def test_eviction_only_when_popped():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    cache(pool, a, 1)
    cache(pool, b, 2)
    pool.free_blocks([b, a])
    assert free_ids(pool) == [2, 1]
    assert pool.get_cached_block(1) is a and pool.get_cached_block(2) is b  # free but still cached
    (x,) = pool.get_new_blocks(1)
    assert x is b and b.block_hash is None and pool.get_cached_block(2) is None  # evicted on reuse
    assert pool.get_cached_block(1) is a and pool.num_evictions == 1


def test_cache_full_blocks_uses_request_hashes():
    pool = BlockPool(4)
    req = Request("r", list(range(8)))
    req.block_hashes = [10, 20]
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert [b.block_hash for b in blocks] == [10, 20]
    assert pool.get_cached_block(20) is blocks[1]


def test_reset_prefix_cache():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    cache(pool, a, 5)
    assert pool.reset_prefix_cache() is False  # a is held
    assert pool.get_cached_block(5) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(5) is None and a.block_hash is None
    assert pool.get_num_free_blocks() == 3


def test_cache_full_blocks_computes_missing_hashes_when_given_the_block_size():
    from pagedkv.kv_cache_utils import KVCacheBlock, builtin_hash, hash_block_tokens

    pool = BlockPool(5)
    req = Request("0", list(range(14)))
    blocks = [KVCacheBlock(block_id=i) for i in range(2)]
    pool.cache_full_blocks(req, blocks, num_cached_blocks=0, num_full_blocks=2, block_size=4)
    assert len(pool.cached_block_hash_to_block) == 2
    assert blocks[0].block_hash == hash_block_tokens(builtin_hash, None, (0, 1, 2, 3))
    assert blocks[1].block_hash == hash_block_tokens(builtin_hash, blocks[0].block_hash, (4, 5, 6, 7))
    blocks.append(KVCacheBlock(block_id=2))
    pool.cache_full_blocks(req, blocks, num_cached_blocks=2, num_full_blocks=3, block_size=4)
    assert len(pool.cached_block_hash_to_block) == 3


def test_touch_refuses_the_null_block_and_foreign_blocks_without_change():
    pool, other = BlockPool(4), BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.touch([a, pool.null_block])
    with pytest.raises(ValueError):
        pool.touch([a, other.blocks[2]])  # a free block of another pool
    assert a.ref_cnt == 1 and pool.null_block.ref_cnt == 0
    assert other.get_num_free_blocks() == 3 and free_ids(other) == [1, 2, 3]


def test_evict_blocks_forgets_hashes_of_held_and_free_blocks_and_refuses_bad_ids():
    """``BlockPool.evict_blocks`` (vLLM 0.26's name): cached blocks leave the map whether held or free;
    a bad id changes nothing."""
    from pagedkv import KVCacheManager

    m = KVCacheManager(6, 2)
    r = Request("r", [1, 2, 3, 4, 5], max_tokens=1)
    m.allocate_slots(r, 5)
    pool = m.block_pool
    assert pool.get_num_cached_blocks() == 2
    with pytest.raises(ValueError):
        pool.evict_blocks([1, 0])
    with pytest.raises(ValueError):
        pool.evict_blocks([True])
    assert pool.get_num_cached_blocks() == 2
    m.evict_blocks({1})
    assert pool.blocks[1].block_hash is None and pool.blocks[1].ref_cnt == 1
    m.free(r)
    pool.evict_blocks([2, 3])  # free ones; 3 has no hash: left alone
    assert pool.get_num_cached_blocks() == 0


def test_a_bool_or_float_is_not_a_count():
    """Issue 9 §5: ``True`` is an int to Python, but never a size or a count; a refused call changes nothing."""
    with pytest.raises(ValueError):
        BlockPool(True)
    pool = BlockPool(8)
    for bad in (True, 1.0):
        with pytest.raises(ValueError):
            pool.get_new_blocks(bad)
    assert pool.get_num_free_blocks() == 7


def test_freeing_a_block_of_a_larger_pool_is_a_value_error_and_changes_nothing():
    small, large = BlockPool(4), BlockPool(16)
    (mine,) = small.get_new_blocks(1)
    (foreign,) = large.get_new_blocks(1)
    (far,) = [b for b in large.get_new_blocks(10) if b.block_id >= 4][:1]
    free_before = [b.block_id for b in small.free_block_queue]
    for bad in (foreign, far, "not a block"):
        with pytest.raises(ValueError, match="does not belong"):
            small.free_blocks([mine, bad])
    assert [b.block_id for b in small.free_block_queue] == free_before and mine.ref_cnt == 1
