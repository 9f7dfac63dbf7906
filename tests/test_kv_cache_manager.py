"""KVCacheManager: allocation on demand, prefix caching, forks and copy-on-write, bad input."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from pkv_testing import admit, assert_reads_own_tokens, check_invariants, step

from pagedkv import EventTrace, KVCacheManager, Request, UnknownRequestError
from pagedkv.kv_cache_utils import hash_block_tokens, hash_request_tokens, sha256_hash
from pagedkv.shadow import ShadowKVCache


def free_ids(m: KVCacheManager) -> list[int]:
    return [b.block_id for b in m.block_pool.free_block_queue]


# --- allocation ------------------------------------------------------------------------------------
def test_decode_grows_one_block_at_a_boundary():
    m = KVCacheManager(10, 4)
    r = Request("a", range(6), max_tokens=8)
    assert [b.block_id for b in m.allocate_slots(r, 6)] == [1, 2]
    r.num_computed_tokens = 6
    r.append_output_token_ids(100)
    assert m.allocate_slots(r, 1) == []  # token 7 fits in block 2
    r.num_computed_tokens = 7
    r.append_output_token_ids(101)
    assert m.allocate_slots(r, 1) == []  # token 8 fills block 2
    r.num_computed_tokens = 8
    r.append_output_token_ids(102)
    new = m.allocate_slots(r, 1)  # token 9 crosses into a third block
    assert [b.block_id for b in new] == [3]
    assert m.get_block_ids("a") == [1, 2, 3]
    assert m.get_slot_mapping("a", 7, 9) == [2 * 4 + 3, 3 * 4 + 0]
    check_invariants(m)


def test_allocation_failure_changes_nothing():
    m = KVCacheManager(5, 4)  # 4 usable blocks
    a = Request("a", range(8))
    assert m.allocate_slots(a, 8) is not None
    a.num_computed_tokens = 8
    b = Request("b", range(100, 120))
    before = m.snapshot()
    assert m.allocate_slots(b, 20) is None  # needs 5 blocks, 2 free
    assert m.snapshot() == before and "b" not in m.req_to_blocks


def test_hits_in_the_free_queue_count_against_free_blocks():
    m = KVCacheManager(5, 4)  # 4 usable
    a = Request("a", range(9))
    admit(m, ShadowKVCache(5, 4), a)
    m.free(a)  # blocks 1, 2 cached and free; all 4 free
    b = Request("b", list(range(8)) + list(range(50, 60)))  # 18 tokens: 2 hit blocks + 3 more
    hits, n = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2] and n == 8
    before = m.snapshot()
    # needs 3 fresh + 2 hits that are themselves free: 5 > 4
    assert m.allocate_slots(b, 10, hits) is None
    assert m.snapshot() == before


def test_bad_input():
    with pytest.raises(ValueError):
        KVCacheManager(10, 0)
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
    m = KVCacheManager(10, 4)
    r = Request("r", range(5))
    with pytest.raises(ValueError):
        m.allocate_slots(r, -1)
    with pytest.raises(UnknownRequestError):
        m.get_block_ids("nope")
    with pytest.raises(KeyError):
        m.free(r)
    with pytest.raises(ValueError):
        m.free(r)
    with pytest.raises(ValueError):
        Request("x", [])
    with pytest.raises(ValueError):
        Request("x", [1], max_tokens=0)


def test_free_in_reverse_order_puts_the_last_uncached_block_at_the_head():
    m = KVCacheManager(10, 4, enable_caching=False)
    r = Request("r", range(10))
    m.allocate_slots(r, 10)  # blocks 1 2 3
    m.free(r)
    assert free_ids(m)[:3] == [3, 2, 1]


def test_free_in_reverse_order_evicts_the_deepest_cached_block_first():
    m = KVCacheManager(6, 4)
    r = Request("r", range(13))
    admit(m, ShadowKVCache(6, 4), r)  # blocks 1 2 3 cached, 4 partial
    m.free(r)
    assert free_ids(m) == [4, 5, 3, 2, 1]


# --- prefix caching --------------------------------------------------------------------------------
def test_prefix_hit_and_cut_back_by_one_block():
    m = KVCacheManager(20, 4)
    shadow = ShadowKVCache(20, 4)
    a = Request("a", range(12))
    admit(m, shadow, a)
    b = Request("b", range(12))  # same 12 tokens: a full hit of 3 blocks is cut back to 2
    hits, n = m.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [1, 2] and n == 8
    c = Request("c", list(range(8)) + [99, 98, 97])
    hits, n = m.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [1, 2] and n == 8
    d = Request("d", [7] + list(range(1, 12)))  # first block differs: the chain breaks at once
    assert m.get_computed_blocks(d) == ([], 0)
    assert m.prefix_cache_stats.requests == 4
    assert m.prefix_cache_stats.hits == 16 and m.prefix_cache_stats.queries == 12 + 12 + 11 + 12


def test_hit_takes_outputs_into_account_after_preemption():
    m = KVCacheManager(20, 4)
    shadow = ShadowKVCache(20, 4)
    r = Request("r", range(6), max_tokens=10)
    admit(m, shadow, r)
    for t in (50, 51, 52):
        r.append_output_token_ids(t)
        step(m, shadow, r, 1)
    m.free(r)  # preempted by recompute: its 9 tokens' full blocks stay cached
    r.num_computed_tokens = 0
    hits, n = m.get_computed_blocks(r)
    assert n == 8 and len(hits) == 2  # 9 tokens: 2 full blocks, the last token recomputed
    assert step(m, shadow, r, r.num_tokens - n, hits)
    assert_reads_own_tokens(m, shadow, r)


def test_caching_disabled_never_hits():
    m = KVCacheManager(20, 4, enable_caching=False)
    a = Request("a", range(12))
    admit(m, ShadowKVCache(20, 4), a)
    assert m.get_computed_blocks(Request("b", range(12))) == ([], 0)
    assert all(b.block_hash is None for b in m.block_pool.blocks)


def test_salt_and_adapter_change_the_chain():
    m = KVCacheManager(20, 4)
    shadow = ShadowKVCache(20, 4)
    admit(m, shadow, Request("a", range(12)))
    assert m.get_computed_blocks(Request("b", range(12), cache_salt="tenant-2"))[1] == 0
    assert m.get_computed_blocks(Request("c", range(12), lora_id=3))[1] == 0
    assert m.get_computed_blocks(Request("d", range(12)))[1] == 8


def test_hash_chain_depends_on_parent():
    h = hash_request_tokens(sha256_hash, 2, [1, 2, 3, 4, 1, 2])
    assert h[0] != h[2]  # same tokens (1, 2), different parents
    assert h[1] == hash_block_tokens(sha256_hash, h[0], [3, 4])


def test_sha256_hash_is_the_same_in_every_process():
    code = (
        "from pagedkv.kv_cache_utils import hash_request_tokens, sha256_hash; "
        "print(hash_request_tokens(sha256_hash, 2, [1, 2, 3, 4], ('salt', 'x'))[1].hex())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1


def test_duplicate_prefix_blocks_are_both_cached_and_evicted_one_by_one():
    m = KVCacheManager(10, 4)
    shadow = ShadowKVCache(10, 4)
    a, b = Request("a", range(9)), Request("b", range(9))
    # both miss (neither is computed yet when the other looks up), both compute blocks with equal hashes
    ha, _ = m.get_computed_blocks(a)
    hb, _ = m.get_computed_blocks(b)
    step(m, shadow, a, 9, ha)
    step(m, shadow, b, 9, hb)
    h0 = a.block_hashes[0]
    assert len(m.block_pool.cached_block_hash_to_block[h0]) == 2
    check_invariants(m)


def test_reset_prefix_cache_refused_while_blocks_are_held():
    m = KVCacheManager(10, 4)
    a = Request("a", range(9))
    admit(m, ShadowKVCache(10, 4), a)
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Request("b", range(9))) == ([], 0)


# --- forks and copy-on-write -----------------------------------------------------------------------
def test_fork_shares_everything_and_copies_only_the_partial_last_block():
    m = KVCacheManager(20, 4)
    shadow = ShadowKVCache(20, 4)
    p = Request("p", range(10))
    admit(m, shadow, p)  # blocks 1 2 full (cached), 3 partial (2 tokens)
    children = [Request(f"c{i}", range(10)) for i in range(3)]
    for c in children:
        m.fork(p, c)
        assert c.num_computed_tokens == 10 and m.get_block_ids(c.request_id) == [1, 2, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [4, 4, 4]
    for i, r in enumerate([p, *children]):
        r.append_output_token_ids(200 + i)
        assert step(m, shadow, r, 1)
    # the first three writers get copies; the last one is then the only holder and writes in place
    tables = {r.request_id: m.get_block_ids(r.request_id) for r in [p, *children]}
    assert all(t[:2] == [1, 2] for t in tables.values())
    assert len({t[2] for t in tables.values()}) == 4
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2)] == [4, 4]
    for r in [p, *children]:
        assert_reads_own_tokens(m, shadow, r)
    check_invariants(m)
    m.free(children[0])
    for r in [p, *children[1:]]:
        assert_reads_own_tokens(m, shadow, r)
    check_invariants(m)


def test_fork_at_a_block_boundary_copies_nothing():
    m = KVCacheManager(20, 4)
    shadow = ShadowKVCache(20, 4)
    p = Request("p", range(8))
    admit(m, shadow, p)
    c = Request("c", range(8))
    m.fork(p, c)
    for r, t in ((p, 1), (c, 2)):
        r.append_output_token_ids(t)
        step(m, shadow, r, 1)
    assert m.get_pending_copies() == []
    assert m.get_block_ids("p")[:2] == m.get_block_ids("c")[:2] == [1, 2]
    assert_reads_own_tokens(m, shadow, p)
    assert_reads_own_tokens(m, shadow, c)


def test_copy_on_write_fails_cleanly_when_the_pool_is_short():
    m = KVCacheManager(4, 4)  # 3 usable
    shadow = ShadowKVCache(4, 4)
    p = Request("p", range(6))
    admit(m, shadow, p)  # 2 blocks
    c = Request("c", range(6))
    m.fork(p, c)
    m.allocate_slots(Request("x", range(4)), 4)  # last free block taken
    c.append_output_token_ids(9)
    before = m.snapshot()
    assert m.allocate_slots(c, 1) is None
    assert m.snapshot() == before and m.get_pending_copies() == []


def test_fork_validation():
    m = KVCacheManager(10, 4)
    p = Request("p", range(6))
    admit(m, ShadowKVCache(10, 4), p)
    with pytest.raises(ValueError):
        m.fork(p, Request("bad", [9] * 6))  # different tokens
    with pytest.raises(UnknownRequestError):
        m.fork(Request("ghost", [1]), Request("c", [1]))
    m.fork(p, Request("c", range(6)))
    with pytest.raises(ValueError):
        m.fork(p, Request("c", range(6)))  # already has blocks


# --- trace -----------------------------------------------------------------------------------------
def test_trace_records_plain_events_and_snapshots_are_consistent():
    m = KVCacheManager(4, 4)
    trace = EventTrace()
    states = []
    trace.subscribe(lambda e: states.append(m.snapshot()))
    m.set_trace(trace)
    shadow = ShadowKVCache(4, 4)
    a = Request("a", range(5))
    admit(m, shadow, a)
    m.free(a)
    b = Request("b", range(4, 16))  # needs all 3 blocks: evicts cached block 1
    admit(m, shadow, b)
    assert trace.kinds() == ["allocate", "cache", "free", "evict", "allocate", "cache"]
    assert trace[0].block_ids == (1, 2) and trace[0].request_id == "a"
    assert states[0]["block_tables"] == {"a": [1, 2]}
    assert states[2]["free_queue"] == [2, 3, 1]
    assert states[-1]["block_tables"]["b"] == [2, 3, 1]
    assert all(isinstance(e.to_dict(), dict) for e in trace)
    m.set_trace(None)
    m.free(b)
    assert len(trace) == 6


def test_free_queue_order_after_shared_prefix_requests_and_eviction_order():
    """The order vLLM's own prefix-caching test expects: partial blocks prepended (last freed first),
    never-used blocks next, cached prefix blocks at the tail with the deepest first."""
    m = KVCacheManager(11, 16)
    common = [i for i in range(3) for _ in range(16)]
    r0 = Request("0", common + [3] * 7)
    hits, n = m.get_computed_blocks(r0)
    assert (hits, n) == ([], 0)
    assert [b.block_id for b in m.allocate_slots(r0, 55, hits)] == [1, 2, 3, 4]
    assert [m.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True, True, True, False]
    r1 = Request("1", common + [3] * 5)
    hits, n = m.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [1, 2, 3] and n == 48
    assert [b.block_id for b in m.allocate_slots(r1, 5, hits)] == [5]
    assert all(b.ref_cnt == 2 for b in hits) and m.get_num_free_blocks() == 5
    m.free(r0)
    m.free(r1)
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    r2 = Request("2", common + [3] * 6)
    hits, n = m.get_computed_blocks(r2)
    assert [b.block_id for b in m.allocate_slots(r2, 6, hits)] == [5]
    assert m.get_num_free_blocks() == 6
    m.free(r2)
    r3 = Request("3", [99] * 160)
    hits, n = m.get_computed_blocks(r3)
    assert [b.block_id for b in m.allocate_slots(r3, 160, hits)] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    q = m.block_pool.free_block_queue
    assert q.num_free_blocks == 0 and q.fake_free_list_head.next_free_block is q.fake_free_list_tail


@pytest.mark.parametrize("block_size", [True, False, 0, -4, 4.0, "4", None])
def test_constructor_refuses_a_block_size_that_is_not_a_positive_int(block_size):
    """``True`` is an ``int`` to Python: the shared validator (``check_int``) refuses bools with its message."""
    with pytest.raises(ValueError, match=rf"^block_size must be an int >= 1, got {re.escape(repr(block_size))}$"):
        KVCacheManager(8, block_size)


def test_allocate_slots_refuses_a_bool_token_count_and_changes_nothing():
    m = KVCacheManager(8, 4)
    r = Request("r", [1, 2, 3])
    with pytest.raises(ValueError):
        m.allocate_slots(r, num_new_tokens=True)
    assert m.req_to_blocks == {} and m.get_num_free_blocks() == 7


def _cached_prefix(m: KVCacheManager, tokens: list[int]) -> None:
    owner = Request("owner", tokens, max_tokens=1)
    m.allocate_slots(owner, len(tokens))
    owner.num_computed_tokens = len(tokens)
    m.free(owner)


def test_allocate_slots_refuses_the_same_cache_hit_twice_and_changes_nothing():
    """Issue 9 §5: ``[b1, b1]`` as hits gave table [1, 1, 4] with ref_cnt 3."""
    m = KVCacheManager(8, 2)
    _cached_prefix(m, [1, 2, 3, 4, 5])
    r = Request("r", [1, 2, 3, 4, 5], max_tokens=1)
    hits, _ = m.get_computed_blocks(r)
    assert len(hits) == 2
    snap = m.snapshot()
    for bad in ([hits[0], hits[0]], [hits[0], hits[1], hits[0]]):
        with pytest.raises(ValueError, match="twice|cover all"):
            m.allocate_slots(r, 1, bad)
        assert m.snapshot() == snap
    with pytest.raises(ValueError, match="not a usable block"):
        m.allocate_slots(r, 1, [KVCacheManager(8, 2).block_pool.blocks[1]])
    assert m.snapshot() == snap
    assert m.allocate_slots(r, 1, hits) is not None


@pytest.mark.parametrize("tokens", [[1.9, 2.7], [1, 2.0], [True, 2], [-1], [2**61 - 1], "12"])
def test_request_refuses_tokens_that_are_not_bounded_ints(tokens):
    """Floats are refused, not truncated; bools are not token ids; ids are bounded by MAX_TOKEN_ID."""
    with pytest.raises(ValueError):
        Request("r", tokens)
    r = Request("r", [1, 2])
    with pytest.raises(ValueError):
        r.append_output_token_ids(tokens)
    assert r.all_token_ids == [1, 2] and r.output_token_ids == []


def test_request_takes_integer_scalars_of_numpy_and_torch():
    import numpy as np
    import torch

    r = Request("r", np.array([3, 4]))
    r.append_output_token_ids(np.int64(5))
    r.append_output_token_ids(torch.tensor(6))
    r.append_output_token_ids(torch.tensor([7, 8]))
    assert r.all_token_ids == [3, 4, 5, 6, 7, 8] and all(type(t) is int for t in r.all_token_ids)
    with pytest.raises(ValueError):
        r.append_output_token_ids(torch.tensor(1.5))


def test_largest_token_id_does_not_collide_with_token_zero_under_the_builtin_hash():
    """Issue 9 §5: hash(2**61 - 1) == hash(0), so that id gave a false prefix hit on token 0's block. Every
    id a request accepts hashes to itself."""
    from pagedkv.request import MAX_TOKEN_ID

    assert hash(MAX_TOKEN_ID) == MAX_TOKEN_ID
    m = KVCacheManager(8, 2)
    _cached_prefix(m, [0, 0, 9])
    hits, n = m.get_computed_blocks(Request("r", [MAX_TOKEN_ID, MAX_TOKEN_ID, 9]))
    assert (hits, n) == ([], 0)
