"""Helpers shared by the library tests: invariants of a KVCacheManager and a shadow-memory driver."""

from __future__ import annotations

from collections import Counter

from pagedkv import KVCacheManager, Request
from pagedkv.shadow import ShadowKVCache


def check_invariants(m: KVCacheManager) -> None:
    """Every usable block is free with ref_cnt 0, or held with ref_cnt = its number of holders."""
    pool = m.block_pool
    holders = Counter(b.block_id for blocks in m.req_to_blocks.values() for b in blocks)
    free_ids = [b.block_id for b in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert 0 not in free_ids and 0 not in holders, "the null block is never free nor held"
    for b in pool.blocks[1:]:
        if b.block_id in holders:
            assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])
            assert not b.in_free_queue, b
        else:
            assert b.ref_cnt == 0 and b.in_free_queue, b
    held = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert held + len(free_ids) == pool.num_gpu_blocks - 1
    for h, blocks in pool.cached_block_hash_to_block.items():
        assert blocks, "empty entries are deleted"
        for bid, b in blocks.items():
            assert b.block_id == bid and b.block_hash == h
    in_map = {bid for blocks in pool.cached_block_hash_to_block.values() for bid in blocks}
    assert in_map == {b.block_id for b in pool.blocks if b.block_hash is not None}
    if not m.enable_caching:
        assert not in_map


def step(m: KVCacheManager, shadow: ShadowKVCache, req: Request, num_new: int, hits=None) -> bool:
    """Allocate ``num_new`` tokens for ``req`` (after its hits), apply pending copies, write its tokens'
    "KV" into the shadow cache and advance ``num_computed_tokens``. False if the pool was short."""
    hits = hits or []
    if m.allocate_slots(req, num_new, hits) is None:
        return False
    shadow.copy_blocks(m.get_pending_copies())
    start = req.num_computed_tokens + len(hits) * m.block_size
    end = start + num_new
    shadow.write(m.get_slot_mapping(req.request_id, start, end), req.all_token_ids[start:end])
    req.num_computed_tokens = end
    return True


def admit(m: KVCacheManager, shadow: ShadowKVCache, req: Request) -> bool:
    """Look up cache hits and prefill the rest of the request's tokens."""
    hits, n = m.get_computed_blocks(req)
    return step(m, shadow, req, req.num_tokens - n, hits)


def assert_reads_own_tokens(m: KVCacheManager, shadow: ShadowKVCache, req: Request) -> None:
    got = shadow.read(m.get_block_ids(req.request_id), req.num_computed_tokens)
    assert got == req.all_token_ids[: req.num_computed_tokens], f"{req.request_id} reads {got}"
