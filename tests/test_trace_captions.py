"""The widget's captions for the lessons' demos are fixed text: the executed notebooks 02, 03, 04 and 08 store
them, so a change to how events are recorded or formatted must leave every frame's event (kind, request,
blocks, caption, data) and state as they were. ``tests/data/trace_captions.json`` was recorded from these
demos (copies of the notebooks' cells) before the trace became an event stream; regenerate it only for a
change that is meant to alter what the widget shows, and re-execute those notebooks with it:
``python tests/test_trace_captions.py --write``."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedkv import BlockPool, KVCacheManager, Request
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.scheduler import Scheduler
from pagedkv.shadow import ShadowKVCache
from pagedkv.sim import FakeModel, SimModelRunner
from pagedkv.widgets import TraceRecorder

GOLDEN = Path(__file__).parent / "data" / "trace_captions.json"


def _frames(rec: TraceRecorder) -> list[dict[str, Any]]:
    """Each frame's event as it is, and its state as a digest (the states are large; any change shows)."""
    out = []
    for f in rec.frames:
        state = json.dumps(f["state"], sort_keys=True)
        out.append({"event": f["event"], "caption": f.get("caption"),
                    "state": hashlib.sha256(state.encode()).hexdigest()[:16]})  # fmt: skip
    return out


def demo_02_preemption() -> TraceRecorder:
    """Lesson 2, section "three requests sharing 9 blocks"."""
    manager = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    rec = TraceRecorder(manager, caption="an empty pool of 9 usable blocks (block 0 is the null block)")
    requests = [Request("A", list(range(6)), max_tokens=10), Request("B", list(range(3)), max_tokens=10),
                Request("C", list(range(5)), max_tokens=8)]  # fmt: skip
    waiting, running, preempted = list(requests), [], []
    next_token = 1000
    for step in range(1, 101):
        if not waiting and not running:
            break
        num_preempted = len(preempted)
        for req in list(running):
            if req not in running:
                continue
            while manager.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is None:
                victim = running.pop()
                manager.free(victim)
                victim.num_computed_tokens = 0
                waiting.insert(0, victim)
                preempted.append((step, victim.request_id))
                rec.note(f"step {step}: pool short, {victim.request_id} preempted (page-out)")
                if victim is req:
                    break
        while (len(preempted) == num_preempted and waiting
               and manager.allocate_slots(waiting[0], waiting[0].num_tokens) is not None):  # fmt: skip
            running.append(waiting.pop(0))
            rec.note(f"step {step}: {running[-1].request_id} admitted ({running[-1].num_tokens} tokens)")
        for req in list(running):
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(next_token)
            next_token += 1
            if req.num_output_tokens >= req.max_tokens:
                running.remove(req)
                manager.free(req)
                rec.note(f"step {step}: {req.request_id} finished after {req.num_output_tokens} tokens")
    rec.detach()
    return rec


def demo_03_fork() -> TraceRecorder:
    """Lesson 3, "fork + copy-on-write"."""
    prompt = list(range(10, 20))
    fm = KVCacheManager(num_blocks=20, block_size=4)
    shadow = ShadowKVCache(20, 4)
    rec = TraceRecorder(fm)
    s0 = Request("s0", prompt)
    fm.allocate_slots(s0, len(prompt))
    shadow.write(fm.get_slot_mapping("s0", 0, 10), prompt)
    s0.num_computed_tokens = 10
    rec.note("s0 computed its 10-token prompt")
    branches = [s0]
    for k in (1, 2, 3):
        child = Request(f"s{k}", prompt)
        fm.fork(s0, child)
        branches.append(child)
    for base in (100, 200, 300):
        for k, r in enumerate(branches):
            r.append_output_token_ids(base + k)
            p = r.num_computed_tokens
            assert fm.allocate_slots(r, 1) is not None
            shadow.copy_blocks(fm.get_pending_copies())
            shadow.write(fm.get_slot_mapping(r.request_id, p, p + 1), [base + k])
            r.num_computed_tokens += 1
    for r in branches:
        fm.free(r)
    rec.detach()
    return rec


def _admit(manager: KVCacheManager, request: Request) -> int:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def demo_03_free_queue_order() -> TraceRecorder:
    """Lesson 3, section 7 (``small_story``): the free queue's order, with evictions and a hit; then a reset
    and an explicit eviction (``evict_blocks``), which no lesson shows but the widget can."""
    m = KVCacheManager(9, 4)
    rec = TraceRecorder(m)
    a, b = Request("A", list(range(100, 110))), Request("B", list(range(200, 206)))
    for r in (a, b):
        _admit(m, r)
    m.free(a)
    m.free(b)
    c = Request("C", list(range(300, 318)))
    _admit(m, c)
    again = Request("A2", list(range(100, 110)) + [1])
    _admit(m, again)
    m.evict_blocks({m.get_block_ids("C")[0]})
    m.free(c)
    m.free(again)
    assert m.reset_prefix_cache()
    rec.detach()
    return rec


def demo_03_subclassed_pool() -> TraceRecorder:
    """Lesson 3 swaps in a ``BlockPool`` subclass (``manager_with``): its events are recorded too. (Recorded
    again with the event stream: a replaced pool's evictions now name the request and come once the blocks
    sit in its table, as the manager's own pool's always did; no lesson records this case.)"""

    class AllToTailPool(BlockPool):
        def free_blocks(self, ordered_blocks):  # noqa: ANN001, ANN202
            for block in list(ordered_blocks):
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    self.free_block_queue.append(block)

    m = KVCacheManager(9, 4)
    m.block_pool = AllToTailPool(9, enable_caching=True)
    rec = TraceRecorder(m)
    for rid, tokens in (("A", range(100, 110)), ("B", range(200, 206)), ("C", range(300, 318))):
        r = Request(rid, list(tokens))
        _admit(m, r)
        if rid != "C":
            m.free(r)
    rec.detach()
    return rec


def _pressure_run(mode: str, num_cpu_blocks: int = 0) -> TraceRecorder:
    model = FakeModel(vocab_size=32000, seed=0)
    s = Scheduler(KVCacheManager(7, 4, enable_caching=False), max_num_seqs=4, max_num_batched_tokens=64,
                  preemption_mode=mode, num_cpu_blocks=num_cpu_blocks)  # fmt: skip
    run = SimModelRunner.for_scheduler(s, model)
    rec = TraceRecorder(s)
    for rid, k in (("A", 1), ("B", 2), ("C", 3)):
        s.add_request(Request(rid, [k] * 8, max_tokens=5))
    while s.has_unfinished_requests():
        o = s.schedule()
        s.update_from_output(o, run.execute(o, s.requests))
        if o.step == 0:
            s.add_request(Request("D", [4] * 3, max_tokens=2))
    rec.detach()
    return rec


def demo_04_recompute() -> TraceRecorder:
    """Lesson 4, "preemption by recompute"."""
    return _pressure_run("recompute")


def demo_04_swap() -> TraceRecorder:
    """Lesson 4, "preemption by swap"."""
    return _pressure_run("swap", num_cpu_blocks=4)


def demo_08_groups() -> TraceRecorder:
    """Lesson 8's picture (one table per group, the window's blocks dropping out) on a manager built from a
    ``KVCacheConfig``: hits, evictions, a fork and frees in two groups."""
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    window = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=8)
    config = KVCacheConfig(num_blocks=16, kv_cache_groups=[KVCacheGroupSpec(["full"], full),
                                                           KVCacheGroupSpec(["swa"], window)])  # fmt: skip
    m = KVCacheManager(config, max_model_len=64)
    rec = TraceRecorder(m)
    a = Request("a", list(range(1, 11)))
    _admit(m, a)
    for t in range(20, 26):
        a.append_output_token_ids(t)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    b = Request("b", list(range(1, 11)) + [99])
    _admit(m, b)
    b2 = Request("b2", list(b.all_token_ids))
    m.fork(b, b2)
    m.free(a)
    d = Request("d", list(range(200, 214)))
    _admit(m, d)
    for r in (b, b2, d):
        m.free(r)
    rec.detach()
    return rec


DEMOS = {name: fn for name, fn in globals().items() if name.startswith("demo_")}


def record_all() -> dict[str, list[dict[str, Any]]]:
    return {name: _frames(fn()) for name, fn in DEMOS.items()}


@pytest.mark.parametrize("name", sorted(DEMOS))
def test_demo_frames_unchanged(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())[name]
    got = json.loads(json.dumps(_frames(DEMOS[name]())))
    for k, (g, e) in enumerate(zip(got, golden, strict=False)):
        assert g == e, f"{name}: frame {k} differs:\n  now:      {g}\n  recorded: {e}"
    assert len(got) == len(golden), f"{name}: {len(got)} frames, {len(golden)} recorded"


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("pass --write to overwrite tests/data/trace_captions.json")
    GOLDEN.write_text(json.dumps(record_all(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
