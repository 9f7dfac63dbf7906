"""``AsyncScheduler``: output placeholders, and what vLLM 0.26 keeps and discards while a step is in flight.

The driver :func:`batch_queue_steps` calls the scheduler in the order ``EngineCore.step_with_batch_queue`` does
(schedule N+1, then update N); the fake model's token depends only on the tokens so far, read when the step's
output "returns" (by then the sample of every earlier step is in the request).
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import AsyncScheduler, KVCacheManager, Request, RequestStatus
from pagedkv.scheduler import Scheduler
from pagedkv.sim import FakeModel

MODEL = FakeModel(vocab_size=1000, seed=7)


def make(cls=AsyncScheduler, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, **kw):
    return cls(KVCacheManager(num_blocks, block_size), max_num_seqs, budget, **kw)


def samples(s, so, fixed=None):
    """The fake model's sample for every request the step samples (partial prefills get none)."""
    out = {}
    for rid in so.num_scheduled_tokens:
        if rid in so.partial_prefill_req_ids:
            continue
        req = s.requests.get(rid)
        out[rid] = (fixed or {}).get(rid, MODEL.next_token(req.all_token_ids) if req is not None else 0)
    return out


def batch_queue_steps(s, max_steps=10_000):
    """Drive ``s`` as ``step_with_batch_queue`` does (two batches in flight); returns every scheduler output."""
    queue: deque = deque()
    outputs = []
    for _ in range(max_steps):
        if not (s.has_unfinished_requests() or s.has_finished_requests()) and not queue:
            return outputs
        if s.has_unfinished_requests() or s.has_finished_requests():
            so = s.schedule()
            outputs.append(so)
            queue.appendleft(so)
            if len(queue) < 2 and (so.total_num_scheduled_tokens > 0 or s.has_unfinished_requests()):
                continue
        so = queue.pop()
        s.update_from_output(so, samples(s, so))
    raise AssertionError("did not finish")


def test_second_schedule_before_the_first_update_decodes_at_the_placeholder():
    s = make()
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=4)
    s.add_request(a)
    so0 = s.schedule()
    assert so0.num_scheduled_tokens == {"a": 5} and a.num_output_placeholders == 1
    so1 = s.schedule()  # step 0 still "running": a decodes at position 5 before its token exists
    assert so1.num_scheduled_tokens == {"a": 1} and so1.num_computed_tokens == {"a": 5}
    assert a.num_output_placeholders == 2 and a.num_tokens == 5 and a.num_computed_tokens == 6
    s.update_from_output(so0, {"a": 42})
    assert a.output_token_ids == [42] and a.num_output_placeholders == 1
    s.update_from_output(so1, {"a": 43})
    assert a.output_token_ids == [42, 43] and a.num_output_placeholders == 0


def test_a_partial_prefill_gets_no_placeholder():
    s = make(budget=4)
    a = Request("a", list(range(1, 11)), max_tokens=2)
    s.add_request(a)
    so = s.schedule()
    assert so.partial_prefill_req_ids == {"a"} and a.num_output_placeholders == 0


def test_no_step_is_scheduled_past_max_tokens():
    s = make()
    a = Request("a", [1, 2, 3], max_tokens=2)
    s.add_request(a)
    so0, so1 = s.schedule(), s.schedule()
    assert a.num_output_placeholders == 2
    s.update_from_output(so0, {"a": 7})
    so2 = s.schedule()  # step 1 (in flight) samples token 2 = max_tokens: nothing more for a
    assert "a" not in so2.num_scheduled_tokens
    s.update_from_output(so1, {"a": 8})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [7, 8]
    s.update_from_output(so2, {})


def test_finished_while_its_next_step_is_in_flight_discards_that_sample():
    s = make()
    a = Request("a", [1, 2, 3], max_tokens=10, eos_token_id=99)
    s.add_request(a)
    so0, so1 = s.schedule(), s.schedule()
    s.update_from_output(so0, {"a": 99})  # EOS: a stops, though step 1 already computes its next token
    assert a.status == RequestStatus.FINISHED_STOPPED and "a" not in s.requests
    assert s.kv_cache_manager.get_num_free_blocks() == 63
    s.update_from_output(so1, {"a": 5})  # thrown away, as vLLM's update_from_output skips a finished request
    assert a.output_token_ids == [99]
    so2 = s.schedule()
    assert so2.finished_req_ids == {"a"} and so2.is_empty()


def test_aborted_while_in_flight_discards_the_sample():
    s = make()
    a = Request("a", [1, 2, 3], max_tokens=10)
    s.add_request(a)
    so0 = s.schedule()
    s.abort_requests("a")
    s.update_from_output(so0, {"a": 5})
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_while_in_flight_keeps_the_in_flight_sample(mode):
    # 5 usable blocks of 4: a (8 tokens) and b (8 tokens) fill 4; each needs a fresh block at position 8
    s = make(num_blocks=6, preemption_mode=mode, num_cpu_blocks=8)
    a = Request("a", list(range(1, 9)), max_tokens=6)
    b = Request("b", list(range(11, 19)), max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    so0 = s.schedule()  # both prefill 8 tokens: 4 blocks
    so1 = s.schedule()  # both decode at position 8: a takes the last block, b has none: b (newest) preempted
    assert so1.num_scheduled_tokens == {"a": 1} and so1.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    assert b.num_computed_tokens == (8 if mode == "swap" else 0)
    if mode == "swap":
        assert len(so1.blocks_to_swap_out) == 2  # the 8 tokens step 0 writes: swapped out after it ran
    s.update_from_output(so0, {"a": 100, "b": 200})
    assert b.output_token_ids == [200] and b.num_output_placeholders == 0  # kept, as vLLM 0.26 keeps it
    assert b.status == RequestStatus.PREEMPTED and b in list(s.waiting)
    s.update_from_output(so1, {"a": 101})
    assert a.output_token_ids == [100, 101]


def test_preempted_while_in_flight_then_stopped_by_that_sample_leaves_waiting():
    s = make(num_blocks=6)
    a = Request("a", list(range(1, 9)), max_tokens=6)
    b = Request("b", list(range(11, 19)), max_tokens=6, eos_token_id=7)
    s.add_request(a)
    s.add_request(b)
    so0 = s.schedule()
    so1 = s.schedule()
    assert so1.preempted_req_ids == ["b"]
    s.update_from_output(so0, {"a": 100, "b": 7})  # b's in-flight sample is its EOS
    assert b.status == RequestStatus.FINISHED_STOPPED and b not in list(s.waiting) and "b" not in s.requests
    s.update_from_output(so1, {"a": 101})


def test_reset_prefix_cache_with_steps_in_flight_discards_their_samples():
    s = make()
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=5)
    s.add_request(a)
    so0 = s.schedule()
    so1 = s.schedule()
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert a.async_tokens_to_discard == 2 and a.num_output_placeholders == 0 and a.num_computed_tokens == 0
    s.update_from_output(so0, {"a": 9})
    s.update_from_output(so1, {"a": 10})
    assert a.output_token_ids == [] and a.async_tokens_to_discard == 0  # sampled from KV the reset dropped


def test_the_sampled_block_is_cached_when_its_token_arrives():
    s = make()
    a = Request("a", [1, 2, 3], max_tokens=4)  # the first sample, at position 3, fills block 0
    s.add_request(a)
    so0, so1 = s.schedule(), s.schedule()  # step 1 computes position 3's KV
    table = s.kv_cache_manager.get_block_ids("a")
    pool = s.kv_cache_manager.block_pool
    assert pool.blocks[table[0]].block_hash is None  # position 3's token is a placeholder: not hashable
    s.update_from_output(so0, {"a": 4})
    assert pool.blocks[table[0]].block_hash is None  # known now, but its KV is still being computed
    s.update_from_output(so1, {"a": 5})
    assert pool.blocks[table[0]].block_hash is not None  # AsyncScheduler._update_request_with_output cached it


def test_the_plain_scheduler_never_makes_placeholders():
    s = make(cls=Scheduler)
    a = Request("a", [1, 2, 3], max_tokens=3)
    s.add_request(a)
    so = s.schedule()
    assert a.num_output_placeholders == 0
    assert s.schedule().is_empty()  # nothing to compute until its sample arrives
    s.update_from_output(so, {"a": 1})


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 8))
    reqs = [(draw(st.integers(1, 30)), draw(st.integers(1, 12))) for _ in range(n)]
    return {
        "reqs": reqs,
        "block_size": draw(st.sampled_from([2, 4, 8])),
        "budget": draw(st.integers(8, 48)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "mode": draw(st.sampled_from(["recompute", "swap"])),
        "caching": draw(st.booleans()),
        "extra_blocks": draw(st.integers(0, 12)),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_async_scheduling_generates_what_sync_scheduling_generates(w):
    """Under memory pressure (preemption by recompute or swap, chunked prefill, prefix caching), two batches in
    flight change when things happen, never what a request generates; every block comes back."""
    bs = w["block_size"]
    need = max(-(-(p + m) // bs) for p, m in w["reqs"])
    results = []
    for cls in (Scheduler, AsyncScheduler):
        manager = KVCacheManager(need + 1 + w["extra_blocks"], bs, enable_caching=w["caching"])
        s = cls(manager, w["max_num_seqs"], w["budget"], preemption_mode=w["mode"], num_cpu_blocks=need * 3)
        reqs = [Request(str(i), [(7 * i + j) % 50 + 1 for j in range(p)], max_tokens=m)
                for i, (p, m) in enumerate(w["reqs"])]
        for r in reqs:
            s.add_request(r)
        if cls is Scheduler:
            for _ in range(10_000):
                if not s.has_unfinished_requests():
                    break
                so = s.schedule()
                s.update_from_output(so, samples(s, so))
        else:
            batch_queue_steps(s)
        assert manager.get_num_free_blocks() == manager.num_gpu_blocks - 1
        assert all(r.num_output_placeholders == 0 for r in reqs)
        results.append({r.request_id: list(r.output_token_ids) for r in reqs})
    want = {str(i): MODEL.generate([(7 * i + j) % 50 + 1 for j in range(p)], m) for i, (p, m) in enumerate(w["reqs"])}
    assert results[0] == want
    assert results[1] == want
