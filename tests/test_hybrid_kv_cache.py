"""KV cache groups on one pool (lesson 8): specs, the single-type managers, the coordinators, the manager and
the scheduler over groups.

Fixed cases reproduce what vLLM 0.26 itself does (``docs/vllm-core-on-cpu.md`` records a run of
its own manager with a full and a sliding-window group); the hypothesis machine checks the invariants on random
admit, chunked prefill, decode, fork and free sequences over random configs: every block is free or held with
``ref_cnt`` equal to its number of holders across all groups; a held block belongs to one group; a
sliding-window table holds the null block exactly where the window has moved on and never more real blocks
than its admission cap; and every live request reads its own tokens back, in each group, over every position
its next token attends to (a shadow KV cache).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import KVCacheManager, Request, Scheduler
from pagedkv.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from pagedkv.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
)
from pagedkv.kv_cache_manager import KVCacheBlocks
from pagedkv.shadow import ShadowKVCache
from pagedkv.single_type_kv_cache_manager import SlidingWindowManager


def full(bs: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")


def swa(bs: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window)


def config(num_blocks: int, *specs) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])


def prefill_and_decode(m: KVCacheManager, req: Request, num_decodes: int) -> None:
    hits, n = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - n, hits) is not None
    req.num_computed_tokens = req.num_tokens
    for t in range(num_decodes):
        req.append_output_token_ids(100 + t)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


# --------------------------------------------------------------------------------------------------------
# What vLLM 0.26 does, fixed cases
# --------------------------------------------------------------------------------------------------------
def test_full_plus_window_tables_match_vllm_026():
    """vLLM 0.26's own manager, B=4, W=8: after a 20-token prefill and 12 decodes the tables are
    [[1, 2, 3, 4, 5, 11, 13, 15], [0, 0, 0, 0, 0, 0, 14, 16]]; a second request with the same 20-token prefix
    then hits 20 tokens with tables [[1, 2, 3, 4, 5], [0, 0, 0, 9, 10]]."""
    m = KVCacheManager(config(32, full(4), swa(4, 8)), max_model_len=1024)
    assert isinstance(m.coordinator, HybridKVCacheCoordinator)
    a = Request("a", list(range(20)), max_tokens=20)
    prefill_and_decode(m, a, 12)
    assert m.get_block_ids("a") == ([1, 2, 3, 4, 5, 11, 13, 15], [0, 0, 0, 0, 0, 0, 14, 16])
    b = Request("b", list(range(20)) + [7, 7, 7], max_tokens=3)
    hits, n = m.get_computed_blocks(b)
    assert isinstance(hits, KVCacheBlocks) and n == 20
    assert hits.get_block_ids() == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])


def test_single_group_config_keeps_the_lesson_api():
    """One group: lists, as lessons 2-7 use them, also when it is a sliding-window group (Mistral)."""
    m = KVCacheManager(config(16, swa(2, 4)), max_model_len=64)
    assert isinstance(m.coordinator, UnitaryKVCacheCoordinator)
    r = Request("r", list(range(9)), max_tokens=4)
    prefill_and_decode(m, r, 3)
    table = m.get_block_ids("r")
    assert isinstance(table, list) and len(table) == cdiv(12, 2)
    # 11 tokens computed, then the 12th allocated: the window of position 11 is positions 8..11.
    assert table[:3] == [0, 0, 0] and 0 not in table[4:]
    assert m.get_slot_mapping("r", 11, 12) == [table[5] * 2 + 1]


def test_sliding_hit_is_found_right_to_left():
    """Block size 4, window 8: a hit needs cdiv(7, 4) = 2 contiguous cached blocks before its end; the scan
    starts at the right end of the allowed prefix and the first such run ends the hit."""
    m = KVCacheManager(config(40, swa(4, 8)), max_model_len=1024)
    a = Request("a", list(range(24)), max_tokens=8)
    prefill_and_decode(m, a, 0)
    m.free(a)
    pool = m.block_pool
    # Forget blocks 3 and 5 of a's 6 (positions 12-15 and 20-23): only positions 0-2 and 4 stay cached.
    table = [pool.blocks[i] for i in range(1, 7)]
    pool.evict_blocks({table[3].block_id, table[5].block_id})
    b = Request("b", list(range(24)) + [99], max_tokens=1)
    hits, n = m.get_computed_blocks(b)
    # Right to left from block 5: 5 misses, 4 hits (run 1), 3 misses (run 0), 2 and 1 hit (run 2): found.
    assert n == 12 and [blk.block_id for blk in hits] == [0, table[1].block_id, table[2].block_id]
    # A shorter run counts when it reaches the first block: window 16 needs 4 blocks.
    blocks, length = SlidingWindowManager.find_longest_cache_hit(
        b.block_hashes, 24, [0], pool, swa(4, 16)
    )
    assert length == 12 and [blk.block_id for blk in blocks[0]] == [1, 2, 3]


def test_out_of_window_blocks_are_freed_and_keep_their_hashes():
    m = KVCacheManager(config(20, swa(4, 4)), max_model_len=1024)
    r = Request("r", list(range(16)), max_tokens=8)
    prefill_and_decode(m, r, 0)
    assert m.get_num_free_blocks() == 19 - 4
    r.append_output_token_ids(5)
    m.allocate_slots(r, 1)  # 16 computed: the window of position 16 is 13..16, blocks 0-2 go
    assert m.get_block_ids("r") == [0, 0, 0, 4, 5]
    assert m.get_num_free_blocks() == 19 - 2
    assert all(m.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3))


def test_all_full_sequence_gate_caps_a_sliding_group():
    """The admission gate counts at most max_admission_blocks_per_request blocks of a sliding group: a
    request far longer than the pool is admitted when its window fits."""
    spec = swa(4, 8)
    m = KVCacheManager(config(10, spec), max_model_len=4096, max_in_flight_tokens=8)
    assert spec.max_admission_blocks_per_request(8, 4096) == cdiv(7 + 8, 4) + 1 == 5
    r = Request("r", list(range(400)), max_tokens=1)
    assert m.allocate_slots(r, 8, full_sequence_must_fit=True) is not None
    flat = KVCacheManager(10, 4)
    assert flat.allocate_slots(Request("r", list(range(400)), max_tokens=1), 8, full_sequence_must_fit=True) is None


def test_no_prefix_cache_coordinator_never_hits():
    m = KVCacheManager(config(20, full(2), swa(2, 4)), enable_caching=False)
    assert isinstance(m.coordinator, KVCacheCoordinatorNoPrefixCache)
    a = Request("a", list(range(8)), max_tokens=2)
    prefill_and_decode(m, a, 0)
    hits, n = m.get_computed_blocks(Request("b", list(range(8)) + [1], max_tokens=1))
    assert n == 0 and hits.get_block_ids() == ([], [])


def test_bad_configs_and_hits_are_refused():
    with pytest.raises(ValueError, match="same block_size"):
        KVCacheManager(config(10, full(4), swa(2, 8)))
    with pytest.raises(ValueError, match="sliding_window"):
        swa(4, 0)
    with pytest.raises(ValueError, match="dtype"):
        FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="int3")
    with pytest.raises(ValueError, match="at least one"):
        KVCacheConfig(4, [], [])
    m = KVCacheManager(config(20, full(2), swa(2, 4)))
    a = Request("a", list(range(8)), max_tokens=2)
    prefill_and_decode(m, a, 0)
    b = Request("b", list(range(8)) + [1], max_tokens=1)
    hits, n = m.get_computed_blocks(b)
    before = m.snapshot()
    with pytest.raises(ValueError, match="differ in length"):
        m.allocate_slots(b, 1, KVCacheBlocks((list(hits.blocks[0]), list(hits.blocks[1])[:-1])))
    with pytest.raises(ValueError, match="KV cache groups"):
        m.allocate_slots(b, 1, KVCacheBlocks((list(hits.blocks[0]),)))
    assert m.snapshot() == before


def test_specs_page_sizes_and_memory():
    s = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
    assert s.page_size_bytes == 2 * 16 * 8 * 128 * 2
    assert s.max_memory_usage_bytes(max_model_len=1000) == cdiv(1000, 16) * s.page_size_bytes
    w = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16", sliding_window=128)
    # cdiv(min(127 + 2048, 8192), 16) + 1 = 137 pages
    assert w.max_memory_usage_bytes(max_model_len=8192, max_in_flight_tokens=2048) == 137 * w.page_size_bytes


# --------------------------------------------------------------------------------------------------------
# One full-attention group through the coordinator behaves as the flat lesson manager
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(40))
def test_one_full_group_through_the_coordinator_equals_the_flat_manager(seed):
    rng = random.Random(seed)
    bs, n = rng.choice([1, 2, 4]), rng.randint(5, 20)
    caching = rng.random() < 0.8
    flat = KVCacheManager(n, bs, enable_caching=caching)
    grouped = KVCacheManager(config(n, full(bs)), enable_caching=caching)
    roots = [[rng.randrange(8) for _ in range(rng.randint(1, 3 * bs))] for _ in range(2)]
    live: dict[str, tuple[Request, Request]] = {}
    for i in range(60):
        op = rng.random()
        if op < 0.4 or not live:
            tokens = rng.choice(roots) + [rng.randrange(8) for _ in range(rng.randint(1, 6))]
            pair = (Request(f"r{i}", tokens, max_tokens=9), Request(f"r{i}", tokens, max_tokens=9))
            out = []
            for m, r in zip((flat, grouped), pair, strict=True):
                hits, k = m.get_computed_blocks(r)
                new = m.allocate_slots(r, r.num_tokens - k, hits, full_sequence_must_fit=True)
                out.append((k, [b.block_id for b in hits], None if new is None else [b.block_id for b in new]))
                if new is not None:
                    r.num_computed_tokens = r.num_tokens
            assert out[0] == out[1]
            if out[0][2] is not None:
                live[f"r{i}"] = pair
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            tok = rng.randrange(8)
            res = []
            for m, r in zip((flat, grouped), live[rid], strict=True):
                r.append_output_token_ids(tok)
                new = m.allocate_slots(r, 1)
                if new is not None:
                    r.num_computed_tokens += 1
                res.append(None if new is None else [b.block_id for b in new])
            assert res[0] == res[1]
        else:
            rid = rng.choice(sorted(live))
            for m, r in zip((flat, grouped), live.pop(rid), strict=True):
                m.free(r)
        assert flat.snapshot() == {k: v for k, v in grouped.snapshot().items() if not k.startswith("group")}


# --------------------------------------------------------------------------------------------------------
# Invariants on random workloads over random configs
# --------------------------------------------------------------------------------------------------------
ROOTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5]]


def check_group_invariants(m: KVCacheManager) -> None:
    pool = m.block_pool
    holders: Counter[int] = Counter()
    owner: dict[int, int] = {}
    for g, manager in enumerate(m.single_type_managers):
        for blocks in manager.req_to_blocks.values():
            for b in blocks:
                if b.is_null:
                    continue
                holders[b.block_id] += 1
                assert owner.setdefault(b.block_id, g) == g, f"block {b.block_id} in groups {owner[b.block_id]}, {g}"
    free_ids = [b.block_id for b in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
    assert 0 not in free_ids and 0 not in holders
    for b in pool.blocks[1:]:
        if b.block_id in holders:
            assert b.ref_cnt == holders[b.block_id] and not b.in_free_queue, b
        else:
            assert b.ref_cnt == 0 and b.in_free_queue, b
    for key, blocks in pool.cached_block_hash_to_block.items():
        assert blocks
        for b in blocks.values():
            assert b.block_hash == key
            gid = key[1] if isinstance(key, tuple) else 0
            assert owner.get(b.block_id, gid) == gid, "a held block is cached under its own group's key"
    # Every group's table of a request has the same length.
    for rid in m.req_to_blocks:
        assert len({len(b) for b in m.get_blocks(rid).blocks}) == 1


class HybridMachine(RuleBasedStateMachine):
    @initialize(
        kind=st.sampled_from(["full+swa", "swa", "full+swa+swa", "swa+swa2"]),
        num_blocks=st.integers(6, 40),
        bs=st.sampled_from([1, 2, 4]),
        window=st.integers(2, 12),
        caching=st.booleans(),
    )
    def setup(self, kind, num_blocks, bs, window, caching):
        specs = {
            "full+swa": [full(bs), swa(bs, window)],
            "swa": [swa(bs, window)],
            "full+swa+swa": [full(bs), swa(bs, window), swa(bs, window)],
            "swa+swa2": [swa(bs, window), swa(bs, window + 3)],
        }[kind]
        self.m = KVCacheManager(config(num_blocks, *specs), enable_caching=caching, max_model_len=256)
        self.m.set_max_in_flight_tokens(6)
        self.specs = specs
        self.bs = bs
        self.shadow = ShadowKVCache(num_blocks, bs)
        self.live: dict[str, Request] = {}
        self.n = 0

    def _step(self, req: Request, num_new: int, hits=None) -> bool:
        m = self.m
        new = m.allocate_slots(req, num_new, hits)
        if new is None:
            return False
        self.shadow.copy_blocks(m.get_pending_copies())
        nh = 0
        if hits is not None:
            nh = len(hits.blocks[0]) if isinstance(hits, KVCacheBlocks) else len(hits)
        start = req.num_computed_tokens + nh * self.bs
        slots = m.get_slot_mapping(req.request_id, start, start + num_new)
        for group_slots in slots if isinstance(slots, tuple) else (slots,):
            assert -1 not in group_slots
            self.shadow.write(group_slots, req.all_token_ids[start : start + num_new])
        req.num_computed_tokens = start + num_new
        return True

    @rule(root=st.sampled_from(ROOTS), tail=st.lists(st.integers(0, 3), max_size=5), chunk=st.integers(1, 6))
    def admit(self, root, tail, chunk):
        self.n += 1
        req = Request(f"r{self.n}", root + tail, max_tokens=50)
        hits, n = self.m.get_computed_blocks(req)
        num_new = min(chunk, req.num_tokens - n)
        if self._step(req, num_new, hits):
            self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def grow(self, data, chunk):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(data.draw(st.integers(0, 3)))
        self._step(req, min(chunk, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.n += 1
        child = Request(f"r{self.n}", parent.all_token_ids[: parent.num_computed_tokens] + [2], max_tokens=50)
        self.m.fork(parent, child)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.m.free(self.live.pop(rid))

    @invariant()
    def pool_is_consistent(self):
        if hasattr(self, "m"):
            check_group_invariants(self.m)

    @invariant()
    def every_request_reads_its_window(self):
        if not hasattr(self, "m"):
            return
        m = self.m
        for rid, req in self.live.items():
            c = req.num_computed_tokens
            for manager, table in zip(m.single_type_managers, m.get_blocks(rid).blocks, strict=True):
                spec = manager.kv_cache_spec
                first = max(0, c - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
                for p in range(first, c):
                    block = table[p // self.bs]
                    assert not block.is_null, f"{rid}: position {p} of its window is the null block"
                    got = self.shadow.gpu[block.block_id][p % self.bs]
                    assert got == req.all_token_ids[p], f"{rid} reads {got} at {p}"
                if isinstance(spec, SlidingWindowSpec):
                    real = sum(1 for b in table if not b.is_null)
                    assert real <= manager._max_admission_blocks_per_request, (rid, real)


HybridMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_hybrid_manager_invariants = HybridMachine.TestCase


# --------------------------------------------------------------------------------------------------------
# The scheduler over groups
# --------------------------------------------------------------------------------------------------------
def run_scheduler(s: Scheduler, requests: list[Request], max_steps: int = 500) -> list:
    for r in requests:
        s.add_request(r)
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        outs.append(out)
        samples = {}
        for rid in out.num_scheduled_tokens:
            req = s.requests[rid]
            if rid not in out.partial_prefill_req_ids:
                samples[rid] = len(req.all_token_ids) % 7
        s.update_from_output(out, samples)
    assert not s.has_unfinished_requests()
    return outs


def test_scheduler_over_groups_reports_every_groups_table():
    m = KVCacheManager(config(30, full(4), swa(4, 8)), max_model_len=512)
    s = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=12)
    assert m.max_in_flight_tokens == 12
    reqs = [Request(f"q{i}", list(range(10 + 3 * i)), max_tokens=12) for i in range(4)]
    outs = run_scheduler(s, reqs)
    saw_null = False
    for out in outs:
        for rid in out.num_scheduled_tokens:
            tables = out.tables_per_group(rid)
            assert len(tables) == 2 and out.block_tables[rid] == tables[0]
            assert 0 not in tables[0]
            saw_null |= 0 in tables[1]
            start, n = out.num_computed_tokens[rid], out.num_scheduled_tokens[rid]
            for table, slots in zip(tables, out.slots_per_group(rid), strict=True):
                assert slots == [table[p // 4] * 4 + p % 4 for p in range(start, start + n)]
    assert saw_null
    assert m.get_num_free_blocks() == 29


def test_single_group_scheduler_output_is_unchanged():
    flat = Scheduler(KVCacheManager(20, 4), max_num_seqs=3, max_num_batched_tokens=10)
    grouped = Scheduler(KVCacheManager(config(20, full(4))), max_num_seqs=3, max_num_batched_tokens=10)
    mk = lambda: [Request(f"q{i}", list(range(5 + 4 * i)), max_tokens=6) for i in range(4)]  # noqa: E731
    a, b = run_scheduler(flat, mk()), run_scheduler(grouped, mk())
    assert [(o.num_scheduled_tokens, o.block_tables, o.slot_mapping) for o in a] == [
        (o.num_scheduled_tokens, o.block_tables, o.slot_mapping) for o in b
    ]


def test_all_sliding_model_serves_requests_longer_than_the_pool():
    """Mistral-like, all layers sliding: a 300-token request runs to the end on a 12-block pool of 4-token
    blocks (44 token slots), because out-of-window blocks are released as it goes."""
    m = KVCacheManager(config(12, swa(4, 8)), max_model_len=512)
    s = Scheduler(m, max_num_seqs=2, max_num_batched_tokens=8)
    outs = run_scheduler(s, [Request("long", list(range(280)), max_tokens=20), Request("b", [1, 2, 3], max_tokens=5)])
    assert sum(o.num_scheduled_tokens.get("long", 0) for o in outs) >= 299
    assert m.get_num_free_blocks() == 11


# --------------------------------------------------------------------------------------------------------
# The block-table widget: one table per group, null blocks where the window has moved on
# --------------------------------------------------------------------------------------------------------
def test_widget_draws_one_table_per_group_with_null_entries():
    from pagedkv.widgets import BlockTableWidget, TraceRecorder, frame_to_svg, view_frames
    from pagedkv.widgets.frames import decode_views, encode_views

    m = KVCacheManager(config(24, full(4), swa(4, 8)), max_model_len=256)
    with TraceRecorder(m) as rec:
        prefill_and_decode(m, Request("a", list(range(20)), max_tokens=20), 6)
    views = view_frames(rec.frames)
    last = views[-1]
    assert [row[0] for row in last["tables"]] == ["a", "a"]
    assert [row[3] for row in last["tables"]] == ["full", "window 8"]
    full_row, window_row = last["tables"][0][1], last["tables"][1][1]
    assert 0 not in full_row and window_row[:3] == [0, 0, 0]
    # Every real block of either group is owned by "a"; the null block by nobody.
    for bid in set(full_row) | set(window_row) - {0}:
        assert last["owners"][bid] == ["a"]
    assert last["owners"][0] == []
    kinds = [f["event"]["kind"] for f in rec.frames if f["event"]]
    assert "free" in kinds  # the window moving on is an event of its own
    assert any("fell out of the window" in f["event"]["caption"] for f in rec.frames if f["event"])
    assert decode_views(encode_views(views)) == views
    svg = frame_to_svg(rec.frames[-1])
    assert "window 8" in svg and "null" in svg
    BlockTableWidget(rec, static=False)


def test_widget_of_one_full_group_is_unchanged():
    from pagedkv.widgets import TraceRecorder, view_frames

    flat, grouped = KVCacheManager(16, 4), KVCacheManager(config(16, full(4)))
    out = []
    for m in (flat, grouped):
        with TraceRecorder(m) as rec:
            prefill_and_decode(m, Request("a", list(range(9)), max_tokens=4), 3)
        out.append([v["tables"] for v in view_frames(rec.frames)])
    assert out[0] == out[1] and all(len(row) == 3 for tables in out[0] for row in tables)


@pytest.mark.parametrize("seed", range(30))
def test_scheduler_over_groups_every_step_reads_its_own_window(seed):
    """Random hybrid configs and requests (shared prefixes, long prompts, chunked prefill, preemption): at every
    step, each scheduled token's K/V is written at its slot in every group, and every scheduled request then
    reads back its own tokens over every position its attention covers, in every group."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    window = rng.randint(2, 4 * bs + 3)
    layouts = [[full(bs), swa(bs, window)], [swa(bs, window)], [full(bs), swa(bs, window), swa(bs, window)]]
    specs = rng.choice(layouts)
    num_blocks = rng.randint(12, 40)
    m = KVCacheManager(config(num_blocks, *specs), max_model_len=512, enable_caching=rng.random() < 0.8)
    s = Scheduler(m, max_num_seqs=rng.randint(1, 4), max_num_batched_tokens=rng.randint(4, 24))
    shadow = ShadowKVCache(num_blocks, bs)
    root = [rng.randrange(9) for _ in range(rng.randint(bs, 5 * bs))]
    reqs = []
    for i in range(rng.randint(3, 8)):
        prompt = (root if rng.random() < 0.6 else []) + [rng.randrange(9) for _ in range(rng.randint(1, 10))]
        r = Request(f"q{i}", prompt, max_tokens=rng.randint(1, 12))
        try:
            s.add_request(r)
        except ValueError:
            continue
        reqs.append(r)
    for _ in range(600):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for rid, n in out.num_scheduled_tokens.items():
            req = s.requests[rid]
            start = out.num_computed_tokens[rid]
            for slots in out.slots_per_group(rid):
                shadow.write(slots, req.all_token_ids[start : start + n])
            end = start + n
            for spec, table in zip(specs, out.tables_per_group(rid), strict=True):
                first = max(0, start - spec.sliding_window + 1) if isinstance(spec, SlidingWindowSpec) else 0
                for p in range(first, end):
                    got = shadow.gpu[table[p // bs]][p % bs]
                    assert table[p // bs] != 0 and got == req.all_token_ids[p], (rid, p, table)
        samples = {rid: (len(s.requests[rid].all_token_ids) * 7) % 9 for rid in out.num_scheduled_tokens
                   if rid not in out.partial_prefill_req_ids}  # fmt: skip
        s.update_from_output(out, samples)
    assert not s.has_unfinished_requests()
    assert m.get_num_free_blocks() == num_blocks - 1


def test_a_step_in_flight_keeps_the_blocks_its_window_reads():
    """Two steps scheduled before the first's output comes back (async scheduling): the second must not free
    blocks the first is still computing with. vLLM frees on the processed-token basis (num_computed_tokens -
    num_in_flight_tokens); counting the in-flight step as processed would free positions 0-3 here."""
    m = KVCacheManager(config(20, swa(2, 4)), max_model_len=64)
    s = Scheduler(m, max_num_seqs=1, max_num_batched_tokens=8)
    r = Request("r", list(range(16)), max_tokens=2)
    s.add_request(r)
    first = s.schedule()  # positions 0-7
    assert r.num_in_flight_tokens == 8
    second = s.schedule()  # positions 8-15, while the first step is still running
    assert second.num_scheduled_tokens == {"r": 8} and r.num_in_flight_tokens == 16
    assert 0 not in m.get_block_ids("r")  # position 4 reads 1..4: blocks 0-1 are still needed
    s.update_from_output(first, {})
    assert r.num_in_flight_tokens == 8
    s.update_from_output(second, {"r": 5})
    assert r.num_in_flight_tokens == 0
    s.schedule()  # the decode: 16 computed, the window of position 16 is 13..16
    assert m.get_block_ids("r")[:6] == [0] * 6


@pytest.mark.parametrize("specs", [(full(4),), (full(4), swa(4, 8))], ids=["one group", "full+window"])
def test_cache_blocks_enters_every_groups_block_once_its_sample_arrives(specs):
    """The async scheduler's path (``AsyncScheduler._update_request_with_output`` calls
    ``KVCacheManager.cache_blocks``): slots for two samples are allocated before their tokens exist, so the block
    they fill cannot be hashed then; once the samples arrive, ``cache_blocks`` enters it in every group, and a
    request with those 8 tokens hits all of them. (Before the fix, a several-group manager cached only what the
    allocation had hashed: a hit of 4.)"""
    m = KVCacheManager(config(32, *specs), max_model_len=1024)
    a = Request("a", list(range(6)), max_tokens=20)
    hits, _ = m.get_computed_blocks(a)
    assert m.allocate_slots(a, 6, hits) is not None
    a.num_computed_tokens = 6
    assert m.allocate_slots(a, 2) is not None  # two placeholders: tokens 6 and 7 not sampled yet
    assert [g.num_cached_block["a"] for g in m.coordinator.single_type_managers] == [1] * len(specs)
    a.append_output_token_ids(100)
    a.append_output_token_ids(101)
    a.num_computed_tokens = 8
    m.cache_blocks(a, 8)
    assert [g.num_cached_block["a"] for g in m.coordinator.single_type_managers] == [2] * len(specs)
    assert m.get_computed_blocks(Request("b", [*range(6), 100, 101, 5], max_tokens=3))[1] == 8
