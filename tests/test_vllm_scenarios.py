"""vLLM's own unit-test scenarios, replayed on this API.

Each test names the vLLM test it follows (``tests/v1/core/test_scheduler.py``, ``test_prefix_caching.py``,
``test_kv_cache_utils.py`` in vllm-project/vllm) and checks the answer vLLM's test expects: block ids, orders,
``num_computed_tokens``, preempted ids, queue contents, free-queue order and counters. Where our API differs
(one KV cache group, so a block table is a flat list; ``update_from_output`` takes ``{req_id: token}``; the
block hashes are computed by the manager rather than by the ``Request``), the scenario is translated and the
expected answer is the one vLLM's rules give. Where docs/design.md specifies a different rule, the test says
so in a comment and checks ours.
"""

from __future__ import annotations

import pytest

from pagedkv import KVCacheManager, Request, RequestStatus
from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_utils import (
    NONE_HASH,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    sha256_hash,
    update_block_hashes,
)
from pagedkv.sched_output import SchedulerOutput
from pagedkv.scheduler import Scheduler

EOS = 50256  # vLLM's tests/v1/core/utils.py EOS_TOKEN_ID


# ---------------------------------------------------------------------------------------------------
# Helpers: vLLM's create_scheduler / create_requests, on our API
# ---------------------------------------------------------------------------------------------------
def create_scheduler(
    *,
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    **kwargs,
) -> Scheduler:
    manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_prefix_caching, hash_fn="sha256")
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens, **kwargs)


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    *,
    same_prompt: bool = False,
    req_ids: list[str] | None = None,
    starting_idx: int = 0,
    priorities: list[int] | None = None,
    arrival_times: list[float] | None = None,
    eos_token_id: int | None = EOS,
) -> list[Request]:
    """Request ``i`` has id ``str(i + starting_idx)`` and the prompt ``[i + starting_idx] * num_tokens``."""
    req_ids = req_ids or [str(i + starting_idx) for i in range(num_requests)]
    reqs = []
    for i in range(num_requests):
        kw = {}
        if priorities is not None:
            kw["priority"] = priorities[i]
        kw["arrival_time"] = arrival_times[i] if arrival_times is not None else float(i)
        token = starting_idx if same_prompt else i + starting_idx
        reqs.append(Request(req_ids[i], [token] * num_tokens, max_tokens, eos_token_id=eos_token_id, **kw))
    return reqs


def create_priority_scheduler(**kwargs) -> Scheduler:
    """vLLM's create_scheduler_with_priority: the priority policy, prefix caching off by default."""
    kwargs.setdefault("enable_prefix_caching", False)
    return create_scheduler(policy="priority", **kwargs)


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def step(s: Scheduler, token: int = 1000):
    """schedule() then update_from_output() with ``token`` for every request whose chunk reached its end."""
    out = s.schedule()
    samples = {rid: token for rid in out.num_scheduled_tokens if rid not in out.partial_prefill_req_ids}
    s.update_from_output(out, samples)
    return out


def run_until_idle(s: Scheduler, token: int = 1000, max_steps: int = 10_000) -> int:
    for n in range(max_steps):
        if not s.has_unfinished_requests():
            return n
        step(s, token)
    raise AssertionError("scheduler did not drain")


# ===================================================================================================
# tests/v1/core/test_scheduler.py
# ===================================================================================================
def test_add_finish_and_count_requests():
    # vLLM: test_add_requests, test_finish_request, test_get_num_unfinished_requests
    s = create_scheduler()
    reqs = create_requests(10)
    for i, r in enumerate(reqs):
        s.add_request(r)
        assert r.request_id in s.requests and len(s.waiting) == i + 1
    for i, r in enumerate(reqs):
        s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert r.request_id not in s.requests
        assert len(s.waiting) == 9 - i
        assert s.get_num_unfinished_requests() == len(reqs) - i - 1
        assert r.status == RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_schedule(enable_prefix_caching):
    # vLLM: test_schedule -- every prompt scheduled whole in one step, waiting -> running in order.
    s = create_scheduler(enable_prefix_caching=enable_prefix_caching)
    reqs = create_requests(10)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == 10
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert len(out.finished_req_ids) == 0
    for rid, n in out.num_scheduled_tokens.items():
        assert n == len(reqs[int(rid)].prompt_token_ids)
    assert len(s.waiting) == 0 and s.running == reqs
    # one block each (10 tokens < 16), handed out in admission order from the head of the free queue
    assert [d.block_ids for d in out.scheduled_new_reqs] == [[i + 1] for i in range(10)]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_schedule_concurrent_partial_requests(enable_prefix_caching):
    # vLLM: test_schedule_concurrent_partial_requests (long_prefill_token_threshold=400, budget 1024).
    s = create_scheduler(
        max_num_batched_tokens=1024, long_prefill_token_threshold=400, enable_prefix_caching=enable_prefix_caching
    )
    reqs = create_requests(3, num_tokens=800)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == 3 and out.scheduled_cached_reqs.num_reqs == 0
    assert out.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    assert out.partial_prefill_req_ids == {"0", "1", "2"}
    s.update_from_output(out, {})  # all three are partial prefills: no sample is needed

    out1 = s.schedule()
    assert len(s.running) == 3
    assert len(out1.scheduled_new_reqs) == 0 and out1.scheduled_cached_reqs.num_reqs == 3
    assert out1.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    assert out1.num_computed_tokens == {"0": 400, "1": 400, "2": 224}
    s.update_from_output(out1, {"0": 0, "1": 0})  # "0" and "1" finished their prompts; "2" is partial

    out2 = s.schedule()
    assert out2.scheduled_cached_reqs.num_reqs == 3
    assert out2.num_scheduled_tokens == {"0": 1, "1": 1, "2": 800 - 224 - 224}
    assert [r.num_computed_tokens for r in reqs] == [801, 801, 800]


def test_stop_via_update_from_output():
    # vLLM: test_stop_via_update_from_output (cases 1 and 3, one token per step: no speculative decoding here).
    # Requests are put straight into `running`, fully computed, and a hand-built output is applied.
    def inject(s: Scheduler, reqs):
        for r in reqs:
            r.num_computed_tokens = r.num_tokens
            s.requests[r.request_id] = r
            s.running.append(r)
            r.status = RequestStatus.RUNNING

    # EOS: the first request stops, the second goes on.
    s = create_scheduler()
    reqs = create_requests(2, max_tokens=10)
    inject(s, reqs)
    s.update_from_output(SchedulerOutput(num_scheduled_tokens={"0": 1, "1": 1}), {"0": EOS, "1": 10})
    assert ids(s.running) == ["1"]
    assert reqs[0].status == RequestStatus.FINISHED_STOPPED and reqs[0].get_finished_reason() == "stop"
    assert "0" in s.finished_req_ids
    assert reqs[0].output_token_ids == [EOS] and reqs[1].output_token_ids == [10]

    # max_tokens: the first request reaches it and is capped, the second goes on.
    s = create_scheduler()
    reqs = create_requests(2, max_tokens=2)
    reqs[0].append_output_token_ids(10)  # already one token out
    inject(s, reqs)
    s.update_from_output(SchedulerOutput(num_scheduled_tokens={"0": 1, "1": 1}), {"0": 11, "1": 13})
    assert ids(s.running) == ["1"]
    assert reqs[0].status == RequestStatus.FINISHED_LENGTH_CAPPED and reqs[0].get_finished_reason() == "length"
    assert reqs[0].output_token_ids == [10, 11] and reqs[1].output_token_ids == [13]

    # No EOS id (vLLM's ignore_eos=True): the EOS token is just a token.
    s = create_scheduler()
    (r,) = create_requests(1, max_tokens=10, eos_token_id=None)
    inject(s, [r])
    s.update_from_output(SchedulerOutput(num_scheduled_tokens={"0": 1}), {"0": EOS})
    assert s.running == [r] and not r.is_finished() and r.output_token_ids == [EOS]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_schedule_concurrent_batches(enable_prefix_caching):
    # vLLM: test_schedule_concurrent_batches -- a second step is scheduled before the first one's output.
    s = create_scheduler(max_num_batched_tokens=1024, max_num_seqs=2, enable_prefix_caching=enable_prefix_caching)
    reqs = create_requests(2, num_tokens=512)
    s.add_request(reqs[0])
    out0 = s.schedule()
    assert len(out0.scheduled_new_reqs) == 1 and out0.num_scheduled_tokens == {"0": 512}
    s.add_request(reqs[1])
    out1 = s.schedule()  # "0" has nothing new until its sample arrives: only "1" is scheduled
    assert len(out1.scheduled_new_reqs) == 1 and out1.num_scheduled_tokens == {"1": 512}
    s.update_from_output(out0, {"0": 0})
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"0": 1}
    s.update_from_output(out1, {"1": 0})
    assert reqs[1].output_token_ids == [0]


def test_schedule_order_with_chunked_prefill():
    # vLLM: test_schedule_order (enable_chunked_prefill=True; chunked prefill is always on here).
    s = create_scheduler(max_num_batched_tokens=1024, max_num_seqs=3)
    long_reqs = create_requests(2, num_tokens=800, req_ids=["1", "2"])
    reqs = long_reqs + create_requests(2, num_tokens=10, req_ids=["3", "4"])
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    # The long requests are chunked; the short ones behind them wait (no skipping ahead in FCFS).
    assert [d.req_id for d in out.scheduled_new_reqs] == ["1", "2"]
    assert out.num_scheduled_tokens == {"1": 800, "2": 224}
    assert ids(s.waiting) == ["3", "4"]


def test_preempt_during_execution():
    # vLLM: test_preempt_during_execution. 11 blocks: 10 usable (block 0 is the null block).
    s = create_scheduler(max_num_batched_tokens=100, block_size=16, num_blocks=11, enable_prefix_caching=False)
    reqs = create_requests(2, num_tokens=80)
    s.add_request(reqs[0])
    out0 = s.schedule()
    assert len(out0.num_scheduled_tokens) == 1
    assert out0.scheduled_new_reqs[0].block_ids == [1, 2, 3, 4, 5]
    s.add_request(reqs[1])  # scheduled while "0" is still executing (two batches in flight)
    out1 = s.schedule()
    assert len(out1.num_scheduled_tokens) == 1
    assert out1.scheduled_new_reqs[0].block_ids == [6, 7, 8, 9, 10]
    s.update_from_output(out0, {"0": 0})
    out2 = s.schedule()  # "0" needs a 6th block: the pool is full, so "1" (the newest) is preempted
    assert s.running == [reqs[0]]
    assert reqs[1].status == RequestStatus.PREEMPTED and reqs[1].num_computed_tokens == 0
    assert list(out2.preempted_req_ids) == ["1"] and out2.num_scheduled_tokens == {"0": 1}
    # "1"'s blocks came back (no hashes: caching is off) to the head in the order freed, last block first,
    # and "0" took the first of them.
    assert s.kv_cache_manager.get_block_ids("0") == [1, 2, 3, 4, 5, 10]
    assert free_queue_ids(s.kv_cache_manager) == [9, 8, 7, 6]
    s.update_from_output(out1, {"1": 42})  # the preempted request keeps the sample of the step it ran in
    assert reqs[1].output_token_ids == [42]


def test_scheduler_reset_prefix_cache():
    # vLLM: test_scheduler_reset_prefix_cache
    s = create_scheduler()
    reqs = create_requests(10)
    for r in reqs:
        s.add_request(r)
    s.schedule()
    assert len(s.waiting) == 0 and s.running == reqs
    assert not s.reset_prefix_cache()  # running requests hold blocks
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert len(s.running) == 0 and len(s.waiting) == len(reqs)
    for i, r in enumerate(reqs):
        assert s.waiting[i] == r  # back in their order
        assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
    assert s.kv_cache_manager.get_num_free_blocks() == 999
    assert not s.kv_cache_manager.block_pool.cached_block_hash_to_block


def test_memory_leak():
    # vLLM: test_memory_leak / assert_scheduler_empty
    s = create_scheduler()
    for r in create_requests(5, num_tokens=10, max_tokens=10):
        s.add_request(r)
        step(s)
    run_until_idle(s)
    s.schedule()  # hands over the last finished ids
    assert len(s.requests) == 0 and len(s.waiting) == 0 and len(s.running) == 0
    assert len(s.finished_req_ids) == 0
    m = s.kv_cache_manager
    assert m.req_to_blocks == {} and m.num_cached_block == {}
    assert m.block_pool.free_block_queue.num_free_blocks == m.block_pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in m.block_pool.blocks)


def test_unable_to_allocate_waits_then_runs():
    # vLLM: test_kv_connector_unable_to_allocate, without the connector: 9 usable blocks of 4, two requests
    # of 24 tokens (6 blocks each): one runs, the other waits until it has finished.
    s = create_scheduler(block_size=4, num_blocks=10)
    reqs = create_requests(2, num_tokens=24, max_tokens=2)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 24}
    assert len(s.running) == 1 and len(s.waiting) == 1
    s.update_from_output(out, {"0": 1000})
    step(s)
    assert s.kv_cache_manager.get_num_free_blocks() == 9
    assert len(s.running) == 0 and len(s.waiting) == 1
    out = s.schedule()
    assert out.num_scheduled_tokens == {"1": 24}
    assert len(s.running) == 1 and len(s.waiting) == 0
    s.update_from_output(out, {"1": 1000})
    step(s)
    assert s.kv_cache_manager.get_num_free_blocks() == 9
    assert len(s.running) == 0 and len(s.waiting) == 0


def test_preemption_and_resume_with_prefix_hits():
    # vLLM: test_kv_connector_handles_preemption, without the connector (local prefix hits only).
    # Blocks of 2 tokens, 7 blocks (6 usable); two 5-token prompts, 4 tokens each to generate.
    s = create_scheduler(block_size=2, num_blocks=7)
    r0, r1 = create_requests(2, num_tokens=5, max_tokens=4)
    s.add_request(r0)
    s.add_request(r1)
    m = s.kv_cache_manager

    out = step(s)  # 1st token: both prompts fit, 3 blocks each
    assert out.num_scheduled_tokens == {"0": 5, "1": 5} and len(s.running) == 2
    assert m.get_block_ids("0") == [1, 2, 3] and m.get_block_ids("1") == [4, 5, 6]
    out = step(s)  # 2nd token: still 3 blocks each
    assert out.num_scheduled_tokens == {"0": 1, "1": 1} and len(s.running) == 2

    out = s.schedule()  # 3rd token: "0" needs a 4th block, so "1" (the newest) is preempted
    assert out.num_scheduled_tokens == {"0": 1} and list(out.preempted_req_ids) == ["1"]
    assert len(s.running) == 1 and len(s.waiting) == 1
    # "1"'s three full blocks went to the tail, last first ([6, 5, 4]); "0" took 6 and evicted its prefix.
    assert m.get_block_ids("0") == [1, 2, 3, 6] and free_queue_ids(m) == [5, 4]
    s.update_from_output(out, {"0": 1000, "1": None})  # an empty entry for an unscheduled request is ignored
    assert len(s.running) == 1 and len(s.waiting) == 1

    out = s.schedule()  # 4th (last) token of "0"; "1" hits blocks 4 and 5 but cannot get 2 more: it waits
    assert out.num_scheduled_tokens == {"0": 1} and len(s.waiting) == 1 and len(s.running) == 1
    s.update_from_output(out, {"0": 1000})
    assert len(s.running) == 0 and r0.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert m.get_num_free_blocks() == 6

    out = s.schedule()  # "1" resumes: 7 tokens (5 prompt + 2 outputs), 4 of them hit in blocks 4 and 5
    assert out.num_computed_tokens == {"1": 4} and out.num_scheduled_tokens == {"1": 3}
    assert len(s.running) == 1 and len(s.waiting) == 0
    assert out.scheduled_cached_reqs.num_reqs == 1 and out.scheduled_new_reqs == []
    assert out.scheduled_cached_reqs.resumed_req_ids == {"1"}
    assert m.get_block_ids("1") == [4, 5, 6, 3]
    s.update_from_output(out, {"1": 1000})
    out = step(s)  # 4th (last) token of "1"
    assert out.num_scheduled_tokens == {"1": 1} and out.scheduled_cached_reqs.num_reqs == 1
    assert len(s.running) == 0 and m.get_num_free_blocks() == 6
    assert r1.output_token_ids == [1000] * 4


# --- prefix-cache statistics through the scheduler --------------------------------------------------
def test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request(monkeypatch):
    # vLLM: test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request
    s = create_scheduler(block_size=16)
    m = s.kv_cache_manager
    (seed,) = create_requests(1, num_tokens=32, max_tokens=2, same_prompt=True, req_ids=["seed"])
    s.add_request(seed)
    run_until_idle(s)
    m.make_prefix_cache_stats()  # start a fresh accumulator
    stats = m.prefix_cache_stats
    (retried,) = create_requests(1, num_tokens=48, max_tokens=1, same_prompt=True, req_ids=["retried"])
    s.add_request(retried)

    real_allocate = m.allocate_slots
    results = []

    def allocate_once_refused(*args, **kwargs):
        result = None if not results else real_allocate(*args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(m, "allocate_slots", allocate_once_refused)
    assert not s.schedule().scheduled_new_reqs
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)
    assert "retried" in s.schedule().num_scheduled_tokens
    assert results[0] is None and results[1] is not None
    assert (stats.requests, stats.queries, stats.hits) == (1, 48, 32)


def test_prefix_cache_stats_counted_once_for_a_request_blocked_by_memory():
    # The same rule without a spy: a request stuck at the head of the queue for three steps is one lookup.
    s = create_scheduler(block_size=4, num_blocks=5)  # 4 usable blocks
    m = s.kv_cache_manager
    big = Request("big", [1] * 12, max_tokens=4)
    s.add_request(big)
    step(s)
    s.add_request(Request("w", [2] * 8, max_tokens=2))
    for _ in range(3):
        out = step(s)
        assert "w" not in out.num_scheduled_tokens
    assert (m.prefix_cache_stats.requests, m.prefix_cache_stats.queries) == (1, 12)
    out = step(s)
    assert "w" in out.num_scheduled_tokens
    assert (m.prefix_cache_stats.requests, m.prefix_cache_stats.queries) == (2, 20)


def test_prefix_cache_stats_not_recorded_when_caching_disabled():
    # vLLM: test_prefix_cache_stats_not_recorded_when_caching_disabled
    s = create_scheduler(enable_prefix_caching=False)
    for r in create_requests(2):
        s.add_request(r)
    s.schedule()
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_preemption_re_records_prefix_cache_query():
    # vLLM: test_preemption_re_records_prefix_cache_query (we keep no separate preempted_requests counter).
    s = create_scheduler()
    (r,) = create_requests(1)
    s.add_request(r)
    out = s.schedule()
    stats = s.kv_cache_manager.prefix_cache_stats
    assert stats.requests == 1
    s.running.remove(r)
    s._preempt_request(r)
    assert r.status == RequestStatus.PREEMPTED
    s.update_from_output(out, {"0": 1000})
    assert r.output_token_ids == [1000]
    out = s.schedule()
    assert r.status == RequestStatus.RUNNING and stats.requests == 2 and stats.queries == 10 + 11
    assert out.scheduled_cached_reqs.resumed_req_ids == {"0"}


@pytest.mark.parametrize(("num_tokens", "hit", "scheduled"), [(32, 16, 16), (33, 32, 1)])
def test_full_prompt_hit_recomputes_the_last_token(num_tokens, hit, scheduled):
    # vLLM: the identical-prompt setup of test_spec_decode_padding_first_decode_step (33 tokens -> 32 hit,
    # 1 scheduled) and the full-block case, where the whole-prompt hit is cut back by one block.
    s = create_scheduler(block_size=16)
    r1, r2 = create_requests(2, num_tokens=num_tokens, same_prompt=True)
    s.add_request(r1)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": num_tokens}
    s.update_from_output(out, {"0": 100})
    s.add_request(r2)
    out = s.schedule()
    assert out.num_computed_tokens["1"] == hit and out.num_scheduled_tokens["1"] == scheduled
    table0, table1 = s.kv_cache_manager.get_block_ids("0"), s.kv_cache_manager.get_block_ids("1")
    assert table1[: hit // 16] == table0[: hit // 16]


# --- priority scheduling --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("priorities", "arrivals", "expected"),
    [
        ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),  # test_priority_scheduling_basic_ordering
        ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),  # test_priority_scheduling_arrival_time_tiebreaker
        ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),  # ..._mixed_priority_and_arrival
        ([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0], ["1", "3", "2", "0"]),  # test_priority_scheduling_fcfs_fallback
    ],
)
def test_priority_scheduling_order(priorities, arrivals, expected):
    s = create_priority_scheduler()
    for r in create_requests(len(priorities), priorities=priorities, arrival_times=arrivals):
        s.add_request(r)
    out = s.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == expected
    assert list(out.num_scheduled_tokens) == expected and ids(s.running) == expected


def test_priority_full_tie_goes_to_the_smaller_request_id():
    # vLLM's Request.__lt__: (priority, arrival_time, request_id). Added out of id order, admitted in id order.
    s = create_priority_scheduler(max_num_seqs=1)
    for rid in ["b", "c", "a"]:
        s.add_request(Request(rid, [1] * 4, priority=0, arrival_time=0.0))
    assert ids(s.waiting) == ["a", "b", "c"]
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a"] and ids(s.waiting) == ["b", "c"]


@pytest.mark.parametrize(
    ("priorities", "arrivals", "first", "waiting"),
    [
        ([3, 2, 0], [1.0, 2.0, 3.0], "2", ["1", "0"]),  # test_priority_scheduling_preemption_victim_selection
        ([2, 2, 2], [3.0, 1.0, 2.0], "1", ["2", "0"]),  # test_priority_scheduling_equal_priority_preemption
        ([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], "3", ["1", "2", "0"]),  # ..._waiting_queue_order
    ],
)
def test_priority_waiting_queue_order_with_one_slot(priorities, arrivals, first, waiting):
    s = create_priority_scheduler(max_num_seqs=1)
    reqs = create_requests(len(priorities), priorities=priorities, arrival_times=arrivals)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == [first]
    assert ids(s.waiting) == waiting
    assert [r.priority for r in s.waiting] == sorted(r.priority for r in s.waiting)


def test_priority_scheduling_with_limited_slots():
    # vLLM: test_priority_scheduling_with_limited_slots
    s = create_priority_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    for r in create_requests(4, priorities=[3, 1, 2, 0], arrival_times=[1.0, 2.0, 3.0, 4.0]):
        s.add_request(r)
    out = s.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["3", "1"]
    assert [r.priority for r in s.waiting] == [2, 3] and ids(s.waiting) == ["2", "0"]


def test_priority_scheduling_heap_property():
    # vLLM: test_priority_scheduling_heap_property
    s = create_priority_scheduler(max_num_seqs=1)
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    reqs = create_requests(len(priorities), priorities=priorities, arrival_times=[float(i) for i in range(8)])
    for r in reqs:
        s.add_request(r)
    seen = []
    while s.waiting:
        out = s.schedule()
        if out.scheduled_new_reqs:
            rid = out.scheduled_new_reqs[0].req_id
            seen.append(reqs[int(rid)].priority)
            s.update_from_output(out, {rid: 100})
            s.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
    assert seen == sorted(priorities)


def test_priority_scheduling_preemption():
    # vLLM: test_priority_scheduling_preemption. 5 usable blocks of 16.
    s = create_priority_scheduler(max_num_seqs=3, max_num_batched_tokens=200, num_blocks=6)
    (lo1,) = create_requests(1, num_tokens=32, priorities=[5], arrival_times=[1.0], req_ids=["lo1"])
    s.add_request(lo1)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == 1
    s.update_from_output(out, {"lo1": 100})  # lo1: 33 tokens, needs a 3rd block next step
    (hi1,) = create_requests(1, num_tokens=32, priorities=[0], arrival_times=[2.0], req_ids=["hi1"])
    s.add_request(hi1)
    out = s.schedule()  # lo1 gets its 3rd block, hi1 is admitted with 2: the pool is full
    assert [d.req_id for d in out.scheduled_new_reqs] == ["hi1"] and len(s.running) == 2
    assert s.kv_cache_manager.get_num_free_blocks() == 0
    s.update_from_output(out, {"lo1": 101, "hi1": 100})
    out = s.schedule()  # hi1 needs a 3rd block: the victim is lo1 (priority 5), even though hi1 came later
    assert lo1.status == RequestStatus.PREEMPTED and list(out.preempted_req_ids) == ["lo1"]
    assert ids(s.running) == ["hi1"] and out.num_scheduled_tokens == {"hi1": 1}


def test_priority_scheduling_no_preemption_when_space_available():
    # vLLM: test_priority_scheduling_no_preemption_when_space_available
    s = create_priority_scheduler(max_num_seqs=3, max_num_batched_tokens=200)
    low = create_requests(2, num_tokens=30, priorities=[5, 5], arrival_times=[1.0, 2.0], req_ids=["lo1", "lo2"])
    for r in low:
        s.add_request(r)
    step(s, 100)
    (hi,) = create_requests(1, num_tokens=30, priorities=[0], arrival_times=[3.0], req_ids=["hi1"])
    s.add_request(hi)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == 1 and not out.preempted_req_ids
    assert len(s.running) == 3 and len(s.waiting) == 0


def test_priority_scheduling_preemption_and_resumption_when_out_of_kv():
    # vLLM: test_priority_scheduling_preemption_and_resumption_when_out_of_kv. 4 usable blocks of 16.
    s = create_priority_scheduler(max_num_seqs=2, max_num_batched_tokens=200, num_blocks=5)
    (low,) = create_requests(1, num_tokens=30, priorities=[1], arrival_times=[0.0], starting_idx=0)
    s.add_request(low)
    out = s.schedule()
    assert len(out.scheduled_new_reqs) == 1 and len(s.waiting) == 0 and len(s.running) == 1
    s.update_from_output(out, {"0": 100})
    (high,) = create_requests(1, num_tokens=32, priorities=[0], arrival_times=[1.0], starting_idx=1)
    s.add_request(high)
    out = s.schedule()
    assert s.kv_cache_manager.get_num_free_blocks() == 0
    assert len(out.scheduled_new_reqs) == 1 and out.scheduled_cached_reqs.num_reqs == 1
    assert len(s.waiting) == 0 and len(s.running) == 2
    s.update_from_output(out, {"0": 100, "1": 100})

    out = s.schedule()  # low needs 32 tokens (2 blocks), high 33 (3 blocks): 5 > 4, low is preempted
    assert len(out.scheduled_new_reqs) == 0
    assert out.scheduled_cached_reqs.req_ids == ["1"]
    assert s.requests["0"].status == RequestStatus.PREEMPTED
    assert len(s.waiting) == 1 and len(s.running) == 1
    s.update_from_output(out, {"0": [], "1": [100]})  # vLLM's runner output lists low with no sample
    s.finish_requests("1", RequestStatus.FINISHED_STOPPED)

    out = s.schedule()  # low resumes
    assert len(s.waiting) == 0 and len(s.running) == 1
    assert len(out.scheduled_new_reqs) == 0 and out.scheduled_cached_reqs.num_reqs == 1
    assert out.scheduled_cached_reqs.req_ids == ["0"] and out.scheduled_cached_reqs.resumed_req_ids == {"0"}
    assert len(low.all_token_ids) == 32 and low.all_token_ids[31] == 100
    assert out.num_computed_tokens["0"] + out.num_scheduled_tokens["0"] == 32
    assert "1" in out.finished_req_ids


# ===================================================================================================
# tests/v1/core/test_prefix_caching.py  (one KV cache group, sha256 block hashes)
# ===================================================================================================
def make_manager(num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_caching=enable_caching, hash_fn="sha256")


def make_request(request_id: str, prompt_token_ids: list[int], **kwargs) -> Request:
    return Request(request_id, prompt_token_ids, max_tokens=17, **kwargs)


def test_prefill():
    # vLLM: test_prefill
    m = make_manager(11)
    common = [i for i in range(3) for _ in range(16)]  # 3 full blocks
    all_ids = common + [3] * 7
    req0 = make_request("0", all_ids)
    hits, n = m.get_computed_blocks(req0)
    assert len(req0.block_hashes) == 3 and hits == [] and n == 0
    blocks = m.allocate_slots(req0, 55, hits)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    parent = None
    for block_id in (1, 2, 3):  # full blocks: hashed (chained), held once
        expected = hash_block_tokens(sha256_hash, parent, tuple(all_ids[(block_id - 1) * 16 : block_id * 16]))
        assert m.block_pool.blocks[block_id].block_hash == expected
        assert m.block_pool.blocks[block_id].ref_cnt == 1
        parent = expected
    assert m.block_pool.blocks[4].block_hash is None and m.block_pool.blocks[4].ref_cnt == 1  # partial block

    # A hit on the common prefix while its blocks are still in use.
    req1 = make_request("1", common + [3] * 5)
    hits, n = m.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3 and [b.block_id for b in hits] == [1, 2, 3] and n == 48
    blocks = m.allocate_slots(req1, 53 - 48, hits)
    assert [b.block_id for b in blocks] == [5]
    assert all(b.ref_cnt == 2 for b in hits)
    assert m.block_pool.free_block_queue.num_free_blocks == 5

    m.free(req0)
    m.free(req1)
    assert m.block_pool.free_block_queue.num_free_blocks == 10
    # [partial blocks without hashes, req1's then req0's, at the head] [never used] [common prefix, reversed]
    assert free_queue_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A hit on the common prefix while its blocks are free: the partial block 5 is reused first.
    req2 = make_request("2", common + [3] * 6)
    hits, n = m.get_computed_blocks(req2)
    assert [b.block_id for b in hits] == [1, 2, 3] and n == 48
    blocks = m.allocate_slots(req2, 54 - 48, hits)
    assert [b.block_id for b in blocks] == [5]
    assert m.block_pool.free_block_queue.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in m.block_pool.free_block_queue.get_all_free_blocks())
    m.free(req2)

    # A miss that takes every block: the allocation order is the eviction order.
    req3 = make_request("3", [99] * (16 * 10))
    hits, n = m.get_computed_blocks(req3)
    assert hits == [] and n == 0
    blocks = m.allocate_slots(req3, 16 * 10, hits)
    assert [b.block_id for b in blocks] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    q = m.block_pool.free_block_queue
    assert q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head


def test_decode():
    # vLLM: test_decode
    m = make_manager(11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common + [3] * 7)
    hits, _ = m.get_computed_blocks(req0)
    assert [b.block_id for b in m.allocate_slots(req0, 55, hits)] == [1, 2, 3, 4]
    # Append slots without allocating a new block.
    req0.num_computed_tokens = 55
    for _ in range(4):
        req0.append_output_token_ids(8)
    assert m.allocate_slots(req0, 4) == []
    assert m.req_to_blocks["0"][-1].block_hash is None
    # Append slots with a new block: 9 tokens fill the 4th block, 10 more go into a 5th.
    req0.num_computed_tokens = 59
    for _ in range(9 + 10):
        req0.append_output_token_ids(7)
    new_blocks = m.allocate_slots(req0, 19)
    assert len(new_blocks) == 1
    assert m.req_to_blocks["0"][-2].block_hash is not None
    assert m.req_to_blocks["0"][-1].block_hash is None


def test_evict():
    # vLLM: test_evict
    m = make_manager(11)
    last_token_id = 5 * 16 + 7
    req0 = make_request("0", list(range(last_token_id)))
    hits, n = m.get_computed_blocks(req0)
    assert hits == [] and n == 0
    assert len(m.allocate_slots(req0, 5 * 16 + 7, hits)) == 6  # 5 full + 1 partial
    req1 = make_request("1", list(range(last_token_id, last_token_id + 3 * 16)))
    hits, n = m.get_computed_blocks(req1)
    assert hits == [] and n == 0
    assert len(m.allocate_slots(req1, 3 * 16, hits)) == 3  # 3 full blocks
    assert m.block_pool.free_block_queue.num_free_blocks == 1  # 10 - (6 + 3)

    m.free(req0)  # partial block (no hash) to the head, the others to the tail (LRU)
    assert free_queue_ids(m) == [6, 10, 5, 4, 3, 2, 1]
    m.free(req1)
    assert m.block_pool.free_block_queue.num_free_blocks == 10
    assert free_queue_ids(m) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    # Touch the first 2 blocks.
    req2 = make_request("2", list(range(2 * 16 + 3)))
    hits, n = m.get_computed_blocks(req2)
    assert [b.block_id for b in hits] == [1, 2] and n == 2 * 16
    assert [b.block_id for b in m.allocate_slots(req2, 3, hits)] == [6]
    assert m.block_pool.free_block_queue.num_free_blocks == 7


def test_hash_block_correct_reuse():
    # vLLM: test_hash_block_correct_reuse -- a reused cached block loses its old hash.
    m = make_manager(2)  # one usable block
    req = make_request("0", list(range(16)))
    hits, _ = m.get_computed_blocks(req)
    assert len(m.allocate_slots(req, 16, hits)) == 1
    m.free(req)
    req = make_request("1", list(range(15)))
    hits, n = m.get_computed_blocks(req)
    assert hits == [] and n == 0
    (block,) = m.allocate_slots(req, 15, hits)
    assert m.block_pool.blocks[block.block_id].block_hash is None
    assert m.block_pool.cached_block_hash_to_block == {}


def test_computed_blocks_not_evicted():
    # vLLM: test_computed_blocks_not_evicted -- the hit is taken out of the queue before new blocks are popped.
    m = make_manager(3)
    req0 = make_request("0", list(range(16)))
    hits, _ = m.get_computed_blocks(req0)
    assert [b.block_id for b in m.allocate_slots(req0, 16, hits)] == [1]
    req1 = make_request("1", list(range(16, 32)))
    hits, _ = m.get_computed_blocks(req1)
    assert [b.block_id for b in m.allocate_slots(req1, 16, hits)] == [2]
    m.free(req0)
    m.free(req1)
    req2 = make_request("2", list(range(32)))
    hits, n = m.get_computed_blocks(req2)
    assert [b.block_id for b in hits] == [1] and n == 16
    assert [b.block_id for b in m.allocate_slots(req2, 16, hits)] == [2]


def test_basic_prefix_caching_disabled():
    # vLLM: test_basic_prefix_caching_disabled
    m = make_manager(5, block_size=4, enable_caching=False)
    req1 = make_request("1", list(range(10)))
    hits, n = m.get_computed_blocks(req1)
    assert hits == [] and n == 0
    assert len(m.allocate_slots(req1, 10, hits)) == 3
    m.free(req1)
    req2 = make_request("2", list(range(16)))  # shares a prefix, but nothing is cached
    hits, n = m.get_computed_blocks(req2)
    assert hits == [] and n == 0
    assert len(m.allocate_slots(req2, 16, hits)) == 4
    req3 = make_request("3", list(range(4)))
    hits, n = m.get_computed_blocks(req3)
    assert hits == [] and n == 0
    assert m.allocate_slots(req3, 4, hits) is None  # the pool is full


def test_cache_blocks():
    # vLLM: test_cache_blocks -- BlockPool.cache_full_blocks on its own, from the start and from the middle.
    block_size = 4
    pool = BlockPool(5)
    req = make_request("0", list(range(14)))  # blocks [0..3] [4..7] [8..11] [12, 13]
    blocks = [KVCacheBlock(i) for i in range(2)]
    pool.cache_full_blocks(req, blocks, num_cached_blocks=0, num_full_blocks=2, block_size=block_size)
    assert len(pool.cached_block_hash_to_block) == 2
    assert all(b.block_hash is not None for b in blocks)
    blocks += [KVCacheBlock(2)]
    pool.cache_full_blocks(req, blocks, num_cached_blocks=2, num_full_blocks=3, block_size=block_size)
    assert len(pool.cached_block_hash_to_block) == 3
    assert blocks[0].block_hash is not None and len(req.block_hashes) == 3


def test_cache_key_salting():
    # vLLM: test_cache_key_salting -- the salt enters the first block's hash only; chaining carries it on.
    m = make_manager(11)
    common = [i for i in range(3) for _ in range(16)]
    token_ids = common + [3] * 11
    req0 = make_request("0", token_ids, cache_salt="salt1")
    hits, n = m.get_computed_blocks(req0)
    assert hits == [] and n == 0
    h = req0.block_hashes
    assert len(h) == 3
    unsalted = make_request("x", token_ids)
    update_block_hashes(unsalted, 16, sha256_hash)
    assert h[0] != unsalted.block_hashes[0]  # the salt is in block 0's extra keys
    assert h[1] == sha256_hash((h[0], tuple(token_ids[16:32]), None))  # no extra keys after block 0
    assert h[2] == sha256_hash((h[1], tuple(token_ids[32:48]), None))
    assert [b.block_id for b in m.allocate_slots(req0, 59, hits)] == [1, 2, 3, 4]
    req0.num_computed_tokens = 59
    for _ in range(5):
        req0.append_output_token_ids(8)
    assert m.allocate_slots(req0, 5) == []
    assert len(h) == 4 and h[3] == sha256_hash((h[2], tuple(token_ids[48:] + [8] * 5), None))

    # Same salt: a 3-block hit. Another salt: no hit at all, though the tokens are the same.
    req1 = make_request("1", common + [4] * 11, cache_salt="salt1")
    hits, n = m.get_computed_blocks(req1)
    assert len(hits) == 3 and n == 48
    req2 = make_request("2", common + [4] * 11, cache_salt="salt2")
    hits, n = m.get_computed_blocks(req2)
    assert hits == [] and n == 0
    assert len(req2.block_hashes) == 3 and req2.block_hashes[0] != h[0]
    assert req2.block_hashes[1] == sha256_hash((req2.block_hashes[0], tuple(common[16:32]), None))


def test_prefill_not_enough_free_blocks_with_computed_blocks():
    # vLLM: test_prefill_not_enough_free_blocks_with_computed_blocks -- a refused allocation touches nothing.
    m = make_manager(11)
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common)
    hits, _ = m.get_computed_blocks(req0)
    m.allocate_slots(req0, 48, hits)
    part0 = m.req_to_blocks["0"]

    req1 = make_request("1", common * 2)
    hits, n = m.get_computed_blocks(req1)
    assert hits == part0 and n == 48
    m.allocate_slots(req1, 48, hits)
    part1 = list(m.req_to_blocks["1"])
    m.free(req1)
    assert {b.ref_cnt for b in part1[:3]} == {1} and {b.ref_cnt for b in part1[3:]} == {0}

    req2 = make_request("2", [7] * 32)
    hits, n = m.get_computed_blocks(req2)
    assert hits == [] and n == 0
    m.allocate_slots(req2, 32, hits)
    assert m.block_pool.free_block_queue.num_free_blocks == 5

    # req3 = req1 + 3 blocks: 6 blocks hit, but 3 of them sit in the free queue, leaving 2 for 3 new ones.
    req3 = make_request("3", common * 3)
    hits, n = m.get_computed_blocks(req3)
    assert hits == part1 and n == 96
    before = free_queue_ids(m)
    assert m.allocate_slots(req3, 48, hits) is None
    assert {b.ref_cnt for b in part1[:3]} == {1} and {b.ref_cnt for b in part1[3:]} == {0}
    assert free_queue_ids(m) == before and "3" not in m.req_to_blocks


def test_manager_reset_prefix_cache():
    # vLLM: test_reset_prefix_cache
    m = make_manager(11)
    full = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", full + [3] * 7)
    assert [b.block_id for b in m.allocate_slots(req0, 55)] == [1, 2, 3, 4]
    req1 = make_request("1", full + [4] * 7)
    hits, _ = m.get_computed_blocks(req1)
    assert len(req1.block_hashes) == 3 and len(hits) == 3
    assert [b.block_id for b in m.allocate_slots(req1, 7, hits)] == [5]
    assert not m.reset_prefix_cache()
    assert m.block_pool.cached_block_hash_to_block
    m.free(req0)
    m.free(req1)
    assert m.reset_prefix_cache()
    assert not m.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    assert m.make_prefix_cache_stats().reset


def test_freed_cached_blocks_are_evicted_when_reallocated():
    # vLLM: test_block_removed_event_group_idx -- allocate all 4 blocks, cache 2, free all, take all 4 again:
    # the 2 cached ones are evicted (vLLM emits 2 BlockRemoved events; we count evictions).
    pool = BlockPool(5)
    req = make_request("r", list(range(8)))
    all_blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, all_blocks, 0, 2, block_size=4, hash_fn=sha256_hash)
    pool.free_blocks(all_blocks)
    # uncached blocks 3, 4 to the head in the order given; cached 1, 2 to the tail in the order given
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 4, 1, 2]
    assert pool.num_evictions == 0
    pool.get_new_blocks(4)
    assert pool.num_evictions == 2 and pool.cached_block_hash_to_block == {}


# ===================================================================================================
# tests/v1/core/test_kv_cache_utils.py
# ===================================================================================================
def test_kv_cache_block():
    # vLLM: test_kv_cache_block, test_kv_cache_block_uses_slots
    block = KVCacheBlock(block_id=0)
    assert block.block_id == 0 and block.ref_cnt == 0 and block.block_hash is None
    block.ref_cnt += 1
    assert block.ref_cnt == 1
    block.ref_cnt -= 1
    assert block.ref_cnt == 0
    block.block_hash = b"abc"
    assert block.block_hash == b"abc"
    block.reset_hash()
    assert block.block_hash is None
    assert not hasattr(block, "__dict__")
    with pytest.raises(AttributeError):
        block.unexpected_field = True  # type: ignore[attr-defined]


def test_free_kv_cache_block_queue_operations():
    # vLLM: test_free_kv_cache_block_queue_initialization, test_free_kv_cache_block_queue_operations
    (single,) = blocks = [KVCacheBlock(0)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 1
    assert q.fake_free_list_head.next_free_block is single and q.fake_free_list_tail.prev_free_block is single

    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.fake_free_list_head.next_free_block is blocks[0] and q.fake_free_list_tail.prev_free_block is blocks[4]
    assert q.popleft() is blocks[0]
    assert q.num_free_blocks == 4 and q.fake_free_list_head.next_free_block is blocks[1]
    q.remove(blocks[2])
    assert q.num_free_blocks == 3
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    q.append(blocks[2])
    assert q.num_free_blocks == 4 and q.fake_free_list_tail.prev_free_block is blocks[2]
    assert blocks[2].prev_free_block is blocks[4] and blocks[2].next_free_block is q.fake_free_list_tail
    for _ in range(4):
        q.popleft()
    assert q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    # vLLM's message is exactly "No free blocks available"; ours starts with it (docs/design.md: a ValueError).
    with pytest.raises(ValueError, match="^No free blocks available"):
        q.popleft()


def test_free_kv_cache_block_queue_append_n_popleft_n_and_order():
    # vLLM: test_free_kv_cache_block_queue_append_n, _popleft_n, _get_all_free_blocks (and prepend_n, which
    # docs/design.md names appendleft_n).
    q = FreeKVCacheBlockQueue([])
    blocks = [KVCacheBlock(i) for i in range(6)]
    q.append_n([])
    assert q.num_free_blocks == 0 and q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    q.append_n(blocks[0:1])
    q.append_n(blocks[4:6])
    q.append_n(blocks[1:4])
    assert [b.block_id for b in q.get_all_free_blocks()] == [0, 4, 5, 1, 2, 3]
    assert blocks[5].next_free_block is blocks[1] and blocks[1].prev_free_block is blocks[5]
    assert q.fake_free_list_tail.prev_free_block is blocks[3]

    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[0:1])
    q.appendleft_n([])
    q.appendleft_n(blocks[4:6])
    q.appendleft_n(blocks[1:3])
    assert [q.popleft().block_id for _ in range(5)] == [1, 2, 4, 5, 0]

    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue([blocks[1], blocks[3], blocks[5], blocks[4], blocks[0], blocks[2]])
    assert q.popleft_n(0) == [] and q.num_free_blocks == 6
    assert q.popleft_n(1) == [blocks[1]]
    assert q.popleft_n(2) == [blocks[3], blocks[5]]
    out = q.popleft_n(3)
    assert out == [blocks[4], blocks[0], blocks[2]] and q.num_free_blocks == 0
    assert all(b.prev_free_block is None and b.next_free_block is None for b in blocks)

    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.get_all_free_blocks() == blocks
    q.popleft()
    assert q.get_all_free_blocks() == blocks[1:]
    q.remove(blocks[2])
    assert q.get_all_free_blocks() == blocks[1:2] + blocks[3:]
    q.append(blocks[2])
    assert q.get_all_free_blocks() == blocks[1:2] + blocks[3:] + [blocks[2]]


def test_hash_block_tokens_and_request_block_hashes():
    # vLLM: test_hash_block_tokens, test_hash_request_tokens_no_mm_inputs
    parent, tokens, extra = b"123", (1, 2, 3), ("key1", "key2")
    assert hash_block_tokens(sha256_hash, parent, tokens, extra) == sha256_hash((parent, tokens, extra))
    assert hash_block_tokens(sha256_hash, None, tokens) == sha256_hash((NONE_HASH, tokens, None))

    req = make_request("0", list(range(6)))
    update_block_hashes(req, 3, sha256_hash)
    assert len(req.block_hashes) == 2
    assert req.block_hashes[0] == sha256_hash((NONE_HASH, (0, 1, 2), None))
    assert req.block_hashes[1] == sha256_hash((req.block_hashes[0], (3, 4, 5), None))
    # The hash is the same in every process: sha256 of a canonical encoding.
    assert sha256_hash((NONE_HASH, (0, 1, 2), None)) == sha256_hash((NONE_HASH, (0, 1, 2), None))
    # Outputs extend the chain; a partial block is never hashed.
    req.append_output_token_ids([6, 7])
    update_block_hashes(req, 3, sha256_hash)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids(8)
    update_block_hashes(req, 3, sha256_hash)
    assert req.block_hashes[2] == sha256_hash((req.block_hashes[1], (6, 7, 8), None))
