"""The KV cache event stream (``pagedkv.kv_events``, vLLM's ``vllm/distributed/kv_events.py``): what a consumer
replaying it learns must be the pool's truth.

Random admit / decode / fork / free / reset / evict sequences run on a manager built with
``enable_kv_cache_events=True``; after each operation ``take_events()`` is replayed into a model of the pool:

- a block is stored (``BlockStored``) only while it holds no prefix, and loses it exactly once
  (``BlockRemoved`` or ``AllBlocksCleared``) before it is stored again or handed to another request;
- a block is allocated only with no holder and no cached prefix (its eviction came first), hits are touched
  only while cached, and frees drop a holder that exists;
- after every operation the replayed prefix cache is the pool's hash map (what a KV-aware router believes is
  what the engine holds) and the replayed reference counts are the blocks' ``ref_cnt``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, Request
from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.kv_cache_utils import make_block_hash_with_group_id
from pagedkv.kv_events import (
    AllBlocksCleared,
    BlockCopied,
    BlockRemoved,
    BlocksAllocated,
    BlocksFreed,
    BlockStored,
    BlocksTouched,
    KVCacheEvent,
    RequestForked,
    SkippedBlocksRemoved,
)
from pagedkv.trace import EventTrace, format_kv_event

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5]]


class Replay:
    """A consumer of the event stream: which prefix each block holds, and how many holders it has."""

    def __init__(self) -> None:
        self.stored: dict[int, Any] = {}  # block id -> the prefix-cache key it holds
        self.refs: Counter[int] = Counter()

    def apply(self, event: KVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            assert len(event.block_ids) == len(event.block_hashes) > 0
            assert len(event.token_ids) == event.block_size * len(event.block_ids)
            for block_id, h in zip(event.block_ids, event.block_hashes, strict=True):
                assert block_id not in self.stored, f"block {block_id} stored twice without a removal"
                assert self.refs[block_id] > 0, f"block {block_id} stored while nobody holds it"
                self.stored[block_id] = make_block_hash_with_group_id(h, event.group_idx or 0)
        elif isinstance(event, BlockRemoved):
            (block_id,), (h,) = event.block_ids, event.block_hashes
            assert self.stored.pop(block_id, None) == make_block_hash_with_group_id(h, event.group_idx or 0)
        elif isinstance(event, AllBlocksCleared):
            assert not +self.refs, "the prefix cache was reset while blocks are held"
            self.stored.clear()
        elif isinstance(event, BlocksAllocated):
            for block_id in event.block_ids:
                assert self.refs[block_id] == 0, f"block {block_id} allocated while held"
                assert block_id not in self.stored, f"block {block_id} reused before its prefix was removed"
                self.refs[block_id] += 1
        elif isinstance(event, BlocksTouched):
            for block_id in event.block_ids:
                assert block_id in self.stored, f"cache hit on block {block_id}, which holds no prefix"
                self.refs[block_id] += 1
        elif isinstance(event, RequestForked):
            held = event.block_ids or [i for t in event.tables or [] for i in t if i != 0]
            for block_id in held:
                assert self.refs[block_id] > 0
                self.refs[block_id] += 1
        elif isinstance(event, BlockCopied):
            assert self.refs[event.src] > 1, "copy-on-write of a block nobody else shares"
            assert self.refs[event.dst] == 0 and event.dst not in self.stored
            self.refs[event.src] -= 1
            self.refs[event.dst] += 1
        elif isinstance(event, BlocksFreed | SkippedBlocksRemoved):
            for block_id in event.block_ids:
                assert self.refs[block_id] > 0, f"block {block_id} freed with no holder"
                self.refs[block_id] -= 1
        else:
            raise AssertionError(f"unexpected event {event!r}")
        format_kv_event(event)  # every event has a caption

    def check(self, pool: BlockPool) -> None:
        cached = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
        assert self.stored == cached, "the replayed prefix cache is not the pool's"
        held = {b.block_id: b.ref_cnt for b in pool.blocks if b.ref_cnt > 0 and not b.is_null}
        assert +self.refs == held, "the replayed reference counts are not the blocks'"


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(0, 3), max_size=5)),
        st.tuples(st.just("decode"), st.integers(0, 7), st.integers(0, 3)),
        st.tuples(st.just("fork"), st.integers(0, 7)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("evict"), st.integers(0, 7)),
        st.tuples(st.just("reset")),
    ),
    max_size=40,
)


def run(m: KVCacheManager, ops: list[tuple], forks: bool = True) -> None:
    replay, live, n = Replay(), [], 0
    for op in ops:
        kind = op[0]
        if kind == "admit":
            n += 1
            req = Request(f"r{n}", PREFIXES[op[1]] + op[2])
            hits, num_hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - num_hit, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
        elif kind == "decode" and live:
            req = live[op[1] % len(live)]
            req.append_output_token_ids(op[2])
            if m.allocate_slots(req, 1) is None:
                m.free(req)  # preempted: the pool is short
                live.remove(req)
            else:
                req.num_computed_tokens += 1
        elif kind == "fork" and live and forks:
            parent = live[op[1] % len(live)]
            n += 1
            child = Request(f"r{n}", parent.all_token_ids[: parent.num_computed_tokens])
            m.fork(parent, child)
            live.append(child)
        elif kind == "free" and live:
            m.free(live.pop(op[1] % len(live)))
        elif kind == "evict":
            m.evict_blocks({1 + op[1] % (m.num_gpu_blocks - 1)})
        elif kind == "reset":
            m.reset_prefix_cache()
        for event in m.take_events():
            replay.apply(event)
        replay.check(m.block_pool)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]), ops=OPS)
def test_event_stream_replays_to_the_pool(num_blocks: int, block_size: int, ops: list[tuple]) -> None:
    run(KVCacheManager(num_blocks, block_size, enable_kv_cache_events=True), ops, forks=True)


@settings(max_examples=80, deadline=None)
@given(num_blocks=st.integers(6, 20), window=st.sampled_from([2, 4, 6]), ops=OPS)
def test_event_stream_replays_to_the_pool_with_two_groups(num_blocks: int, window: int, ops: list[tuple]) -> None:
    full = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16")
    swa = SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=window)
    groups = [KVCacheGroupSpec(["full"], full), KVCacheGroupSpec(["swa"], swa)]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    run(KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True), ops, forks=True)


def test_events_off_by_default_and_take_events_drains() -> None:
    m = KVCacheManager(6, 2)
    req = Request("a", [1, 2, 3, 4, 5])
    m.allocate_slots(req, 5)
    assert m.take_events() == [] and m.block_pool.kv_event_queue == []
    m = KVCacheManager(6, 2, enable_kv_cache_events=True)
    req = Request("a", [1, 2, 3, 4, 5])
    m.allocate_slots(req, 5)
    events = m.take_events()
    assert [type(e) for e in events] == [BlocksAllocated, BlockStored]
    assert events[1].block_hashes == req.block_hashes[:2] and events[1].parent_block_hash is None
    assert events[1].token_ids == [1, 2, 3, 4] and events[1].block_ids == [1, 2] and events[1].block_size == 2
    assert m.take_events() == []


def test_a_trace_sees_the_events_and_take_events_still_gets_them() -> None:
    m = KVCacheManager(6, 2, enable_kv_cache_events=True)
    trace = EventTrace()
    m.set_trace(trace)
    m.allocate_slots(Request("a", [1, 2, 3]), 3)
    assert trace.kinds() == ["allocate", "cache"] and len(m.take_events()) == 2
    m.set_trace(None)
    assert m.block_pool.enable_kv_cache_events  # still on for take_events


def test_pool_alone_records_vllms_events() -> None:
    pool = BlockPool(4, enable_kv_cache_events=True)
    req = Request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, block_size=2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, AllBlocksCleared]
    assert pool.take_events() == []
    assert BlockPool(4).take_events() == []


def test_format_refuses_a_non_event() -> None:
    with pytest.raises(ValueError, match="not a KV cache event"):
        format_kv_event("allocate")  # type: ignore[arg-type]
