"""The scheduler: vLLM V1's rules (FCFS and priority, chunked prefill, preemption by recompute and by swap),
checked on shadow memory with a fake model whose outputs never depend on scheduling.

Cases are ported in spirit from vLLM's ``tests/v1/core/test_scheduler.py`` to this API.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import EventTrace, KVCacheManager, Request, RequestStatus
from pagedkv.sched_output import SchedulerOutput
from pagedkv.scheduler import Scheduler
from pagedkv.sim import FakeModel, SimModelRunner, run_to_completion
from pagedkv.sim.runner import KVCacheCorruptionError

MODEL = FakeModel(vocab_size=1000, seed=7)


def make_scheduler(
    num_blocks: int = 100,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    *,
    caching: bool = True,
    **kwargs,
) -> Scheduler:
    manager = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens, **kwargs)


def make_requests(n: int, num_tokens: int = 10, max_tokens: int = 16, *, same_prompt: bool = False, ids=None, **kw):
    ids = ids or [str(i) for i in range(n)]
    return [
        Request(ids[i], [0 if same_prompt else i + 1] * num_tokens, max_tokens=max_tokens, **kw) for i in range(n)
    ]


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def run_step(s: Scheduler, runner: SimModelRunner):
    """One engine step with the shadow-memory runner (which checks every request reads its own tokens)."""
    out = s.schedule()
    samples = runner.execute(out, s.requests)
    s.update_from_output(out, samples)
    return out


def reference(requests) -> dict[str, list[int]]:
    return {r.request_id: MODEL.generate(r.prompt_token_ids, r.max_tokens) for r in requests}


def serve(s: Scheduler, requests):
    runner = SimModelRunner.for_scheduler(s, MODEL)
    return run_to_completion(s, requests, runner=runner)


# ---------------------------------------------------------------------------------------------------
# Construction and add_request
# ---------------------------------------------------------------------------------------------------
def test_add_requests():
    s = make_scheduler()
    reqs = make_requests(10)
    for i, r in enumerate(reqs):
        s.add_request(r)
        assert r.request_id in s.requests
        assert len(s.waiting) == i + 1
    assert list(s.waiting) == reqs
    assert s.has_unfinished_requests() and s.get_num_unfinished_requests() == 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"policy": "lifo"},
        {"preemption_mode": "drop"},
        {"num_cpu_blocks": -1},
        {"max_num_seqs": 1.5},
    ],
)
def test_bad_constructor_args(kwargs):
    manager = KVCacheManager(10, 4)
    args = {"max_num_seqs": 4, "max_num_batched_tokens": 64, **kwargs}
    with pytest.raises(ValueError):
        Scheduler(manager, **args)
    with pytest.raises(ValueError):
        Scheduler("not a manager", 4, 64)  # type: ignore[arg-type]


def test_duplicate_and_bad_requests_refused_without_change():
    s = make_scheduler()
    (r,) = make_requests(1)
    s.add_request(r)
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(Request(r.request_id, [5, 6]))
    with pytest.raises(ValueError):
        s.add_request("r")  # type: ignore[arg-type]
    done = Request("done", [1, 2])
    done.num_computed_tokens = 1
    with pytest.raises(ValueError):
        s.add_request(done)
    assert list(s.waiting) == [r] and list(s.requests) == [r.request_id]


def test_impossible_request_refused_at_the_exact_boundary():
    # 9 blocks: block 0 is null, 8 usable blocks of 4 tokens = 32 tokens at most.
    s = make_scheduler(num_blocks=9, block_size=4)
    ok = Request("ok", [1] * 20, max_tokens=12)  # ceil(32 / 4) = 8 blocks: fits exactly
    too_big = Request("big", [1] * 20, max_tokens=13)  # ceil(33 / 4) = 9 > 8
    s.add_request(ok)
    with pytest.raises(ValueError, match="never fit"):
        s.add_request(too_big)
    assert "big" not in s.requests and len(s.waiting) == 1
    # and the request that fits exactly does run to the end alone
    res = serve(s, [])
    assert res.outputs == {}
    s2 = make_scheduler(num_blocks=9, block_size=4)
    res = serve(s2, [Request("ok", [1] * 20, max_tokens=12)])
    assert res.outputs["ok"] == MODEL.generate([1] * 20, 12)


# ---------------------------------------------------------------------------------------------------
# Basic scheduling and num_computed_tokens semantics
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [False, True])
def test_schedule_all_prompts(caching):
    s = make_scheduler(caching=caching)
    reqs = make_requests(10)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ids(reqs)
    assert all(out.num_scheduled_tokens[r.request_id] == len(r.prompt_token_ids) for r in reqs)
    assert out.total_num_scheduled_tokens == 100
    assert [d.req_id for d in out.scheduled_new_reqs] == ids(reqs)
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert not out.preempted_req_ids and not out.finished_req_ids
    assert len(s.waiting) == 0 and s.running == reqs
    for r in reqs:
        assert r.status == RequestStatus.RUNNING
        assert r.num_computed_tokens == r.num_tokens  # advanced by the scheduled count
        table = s.kv_cache_manager.get_block_ids(r.request_id)
        assert out.block_tables[r.request_id] == table
        assert out.slot_mapping[r.request_id] == [table[p // 16] * 16 + p % 16 for p in range(10)]
        assert out.num_computed_tokens[r.request_id] == 0
    assert out.flat_slot_mapping()[:10] == out.slot_mapping["0"]


def test_num_computed_tokens_set_to_hit_length_then_advanced():
    s = make_scheduler(block_size=4)
    a = Request("a", list(range(10)), max_tokens=3)
    s.add_request(a)
    out = s.schedule()
    s.update_from_output(out, {"a": 42})
    b = Request("b", list(range(10)) + [7, 7], max_tokens=3)  # shares the first 2 full blocks (8 tokens)
    s.add_request(b)
    out = s.schedule()
    assert out.num_computed_tokens["b"] == 8  # its hit length...
    assert out.num_scheduled_tokens["b"] == 4  # ...and only the rest is computed
    assert b.num_computed_tokens == 12  # hit + scheduled
    assert out.slot_mapping["b"] == [out.block_tables["b"][p // 4] * 4 + p % 4 for p in range(8, 12)]
    assert out.block_tables["b"][:2] == out.block_tables["a"][:2]
    assert s.kv_cache_manager.get_block_ids("b")[:2] == s.kv_cache_manager.get_block_ids("a")[:2]


def test_full_prompt_hit_still_computes_the_last_token():
    s = make_scheduler(block_size=4)
    a = Request("a", list(range(8)), max_tokens=2)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": 1})
    b = Request("b", list(range(8)), max_tokens=2)
    s.add_request(b)
    out = s.schedule()
    assert out.num_computed_tokens["b"] == 4 and out.num_scheduled_tokens["b"] == 4


def test_running_before_waiting_and_scheduling_order():
    s = make_scheduler(max_num_batched_tokens=100)
    a, b = make_requests(2, num_tokens=20, ids=["a", "b"])
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": 1})
    s.add_request(b)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b"]  # running first, then admitted
    assert out.num_scheduled_tokens == {"a": 1, "b": 20}
    assert out.scheduled_cached_reqs.req_ids == ["a"] and [d.req_id for d in out.scheduled_new_reqs] == ["b"]


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(max_num_batched_tokens=50)
    (r,) = make_requests(1, num_tokens=80)
    s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 50}
    assert out.partial_prefill_req_ids == {"0"}
    s.update_from_output(out, {"0": 999})  # a partial prefill's sample is discarded
    assert r.output_token_ids == [] and r.num_computed_tokens == 50
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 30} and out.num_computed_tokens == {"0": 50}
    assert not out.partial_prefill_req_ids
    s.update_from_output(out, {"0": 5})
    assert r.output_token_ids == [5]


def test_partial_prefill_needs_no_sample_but_a_finished_chunk_does():
    s = make_scheduler(max_num_batched_tokens=50)
    a, b = make_requests(2, num_tokens=40)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 40, "1": 10}
    with pytest.raises(ValueError, match="no sample"):
        s.update_from_output(out, {"1": 3})
    assert a.output_token_ids == [] and b.output_token_ids == []
    s.update_from_output(out, {"0": 3})  # "1" is a partial prefill: no sample needed
    assert a.output_token_ids == [3]


def test_concurrent_partial_requests_with_long_prefill_threshold():
    s = make_scheduler(num_blocks=200, max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    reqs = make_requests(3, num_tokens=800)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    s.update_from_output(out, {})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 400, "1": 400, "2": 224}
    s.update_from_output(out, {"0": 0, "1": 0})
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 352}


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=2)
    reqs = make_requests(4)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert ids(s.running) == ["0", "1"] and ids(s.waiting) == ["2", "3"]


def test_schedule_concurrent_batches():
    # The next step is scheduled before the previous one's samples arrive (pipeline parallelism).
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=1024)
    a, b = make_requests(2, num_tokens=512)
    s.add_request(a)
    out0 = s.schedule()
    assert out0.num_scheduled_tokens == {"0": 512}
    s.add_request(b)
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"1": 512}  # "0" has nothing new until its sample arrives
    s.update_from_output(out0, {"0": 0})
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"0": 1}
    s.update_from_output(out1, {"1": 0})
    assert b.output_token_ids == [0]


def test_fcfs_admission_stops_at_the_first_request_that_does_not_fit():
    # 7 usable blocks of 4 tokens. "big" needs 6 blocks, "small" 1; the running request holds 2.
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=1000)
    r = Request("running", [1] * 8, max_tokens=4)
    s.add_request(r)
    s.update_from_output(s.schedule(), {"running": 3})
    big = Request("big", [2] * 24, max_tokens=2)
    small = Request("small", [3] * 4, max_tokens=2)
    s.add_request(big)
    s.add_request(small)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"running": 1}  # small would fit, but FCFS does not skip big
    assert ids(s.waiting) == ["big", "small"]
    assert small.status == RequestStatus.WAITING and small.num_computed_tokens == 0


# ---------------------------------------------------------------------------------------------------
# Preemption (FCFS, recompute)
# ---------------------------------------------------------------------------------------------------
def test_preempt_during_execution():
    # 10 usable blocks; two 80-token requests take 5 each; the first's decode needs a sixth.
    s = make_scheduler(num_blocks=11, block_size=16, max_num_batched_tokens=100, caching=False)
    a, b = make_requests(2, num_tokens=80)
    s.add_request(a)
    out0 = s.schedule()
    assert len(out0.block_tables["0"]) == 5
    s.add_request(b)
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"1": 80} and len(out1.block_tables["1"]) == 5
    s.update_from_output(out0, {"0": 0})
    out2 = s.schedule()
    assert out2.num_scheduled_tokens == {"0": 1}
    assert out2.preempted_req_ids == ["1"] and out2.preempted_req_ids == {"1"}
    assert s.running == [a] and list(s.waiting) == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    s.update_from_output(out1, {"1": 42})  # the preempted request still keeps the sample it earned
    assert b.output_token_ids == [42]


def test_fcfs_preempts_the_newest_and_admits_nobody_in_that_step():
    # 6 usable blocks of 4. Three requests of 8 tokens take 2 blocks each; then each decode needs a 3rd block.
    s = make_scheduler(num_blocks=7, block_size=4, caching=False)
    reqs = make_requests(3, num_tokens=8, max_tokens=6, ids=["old", "mid", "new"])
    late = Request("late", [9], max_tokens=1)
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"old": 8, "mid": 8, "new": 8}
    s.update_from_output(out, {"old": 1, "mid": 1, "new": 1})
    s.add_request(late)
    out = s.schedule()
    assert list(out.preempted_req_ids) == ["new"]  # the newest running request, not the oldest
    assert out.num_scheduled_tokens == {"old": 1, "mid": 1}
    assert "late" not in out.num_scheduled_tokens  # no admission in a step that preempted
    assert ids(s.waiting) == ["new", "late"]  # the victim goes back to the head of the queue
    new = reqs[2]
    assert new.output_token_ids == [1] and new.num_computed_tokens == 0 and new.status == RequestStatus.PREEMPTED
    assert "new" not in s.kv_cache_manager.req_to_blocks


def test_the_newest_preempts_itself_when_it_cannot_grow():
    s = make_scheduler(num_blocks=5, block_size=4, caching=False)  # 4 usable blocks
    a = Request("a", [1] * 7, max_tokens=8)
    b = Request("b", [2] * 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": 1, "b": 1})
    out = s.schedule()
    # a's decode (position 7) fits its 2nd block; b's (position 8) needs a 3rd: b, the newest, is the victim.
    assert list(out.preempted_req_ids) == ["b"] and out.num_scheduled_tokens == {"a": 1}
    assert s.running == [a] and list(s.waiting) == [b]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_never_changes_outputs_nor_loses_a_request(mode, caching, policy):
    def workload():
        return [
            Request(f"r{i}", [(i * 7 + j) % 50 for j in range(5 + 3 * i)], max_tokens=12 + i, priority=i % 3)
            for i in range(8)
        ]

    big = make_scheduler(num_blocks=200, block_size=4, caching=caching, policy=policy)
    res_big = serve(big, workload())
    assert res_big.num_preemptions == 0
    small = make_scheduler(
        num_blocks=14, block_size=4, max_num_batched_tokens=16, caching=caching, policy=policy,
        preemption_mode=mode, num_cpu_blocks=6,
    )
    reqs = workload()
    res_small = serve(small, reqs)
    assert res_small.num_preemptions > 0
    if mode == "swap":
        assert res_small.num_swap_outs > 0
    assert res_small.outputs == res_big.outputs == reference(reqs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in reqs)
    assert not small.has_unfinished_requests() and not small.requests
    assert small.kv_cache_manager.get_num_free_blocks() == 13
    assert small.cpu_block_pool.get_num_free_blocks() == 6


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(0, 2)), min_size=1, max_size=10),
    num_blocks=st.integers(9, 30),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
    mode=st.sampled_from(["recompute", "swap"]),
    cpu=st.integers(0, 12),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    shared=st.integers(0, 12),
)
def test_random_workloads_match_the_reference(
    lens, num_blocks, block_size, budget, max_num_seqs, mode, cpu, caching, policy, shared
):
    usable = num_blocks - 1
    prefix = [3] * shared
    reqs = []
    for i, (p, m, prio) in enumerate(lens):
        prompt = prefix + [(i * 13 + j) % 97 for j in range(p)]
        cap = usable * block_size - len(prompt)
        if cap < 1:
            continue
        reqs.append(Request(f"q{i}", prompt, max_tokens=min(m, cap), priority=prio))
    s = make_scheduler(
        num_blocks, block_size, max_num_seqs, budget, caching=caching, policy=policy, preemption_mode=mode,
        num_cpu_blocks=cpu,
    )
    res = serve(s, reqs)  # the runner checks every step that each request reads back its own tokens
    assert res.outputs == reference(reqs)
    assert not s.requests and not s.swapped
    assert s.kv_cache_manager.get_num_free_blocks() == usable
    assert s.cpu_block_pool.get_num_free_blocks() == cpu
    assert res.max_concurrency <= max_num_seqs
    assert max((step.num_scheduled_tokens for step in res.steps), default=0) <= budget


# ---------------------------------------------------------------------------------------------------
# Swap
# ---------------------------------------------------------------------------------------------------
def _swap_setup(num_cpu_blocks: int):
    s = make_scheduler(num_blocks=7, block_size=4, caching=True, preemption_mode="swap",
                       num_cpu_blocks=num_cpu_blocks)
    runner = SimModelRunner.for_scheduler(s, MODEL)
    reqs = [Request(n, [k] * 8, max_tokens=6) for n, k in (("old", 1), ("mid", 2), ("new", 3))]
    for r in reqs:
        s.add_request(r)
    run_step(s, runner)  # prefill: 2 blocks each, all 6 used
    return s, runner, reqs


def test_swap_moves_the_front_blocks_to_cpu_and_keeps_computed_tokens():
    s, runner, (old, mid, new) = _swap_setup(num_cpu_blocks=4)
    table = s.kv_cache_manager.get_block_ids("new")
    out = s.schedule()
    assert list(out.preempted_req_ids) == ["new"]
    assert out.blocks_to_swap_out == [(table[0], 0), (table[1], 1)]  # ceil(8 / 4) = 2 front blocks
    assert new.num_computed_tokens == 8 and new.status == RequestStatus.PREEMPTED
    assert s.swapped == {"new": [0, 1]}
    assert s.snapshot()["cpu"] == {"num_blocks": 4, "block_tables": {"new": [0, 1]}, "free": [2, 3]}
    runner.execute(out, s.requests)
    assert runner.shadow.cpu[0] == [3, 3, 3, 3] and runner.shadow.cpu[1] == [3, 3, 3, 3]
    s.update_from_output(out, {"old": MODEL.next_token(old.all_token_ids), "mid": MODEL.next_token(mid.all_token_ids)})


def test_swap_brings_back_exactly_the_same_contents():
    s, runner, (old, mid, new) = _swap_setup(num_cpu_blocks=4)
    run_step(s, runner)  # "new" swapped out
    assert "new" in s.swapped
    s.finish_requests(["old"])  # make room: "new" comes back by swap-in alone
    gpu_before = [list(b) for b in runner.shadow.gpu]
    out = s.schedule()
    assert out.blocks_to_swap_in and [c for c, _ in out.blocks_to_swap_in] == [0, 1]
    assert out.num_computed_tokens["new"] == 8 and out.num_scheduled_tokens["new"] == 1  # no recomputation
    assert "new" in out.scheduled_cached_reqs.resumed_req_ids
    assert not s.swapped and s.cpu_block_pool.get_num_free_blocks() == 4  # CPU blocks released
    runner.execute(out, s.requests)  # verifies "new" reads back all 9 of its tokens
    for cpu, gpu in out.blocks_to_swap_in:
        assert runner.shadow.gpu[gpu] == runner.shadow.cpu[cpu] == [3, 3, 3, 3]
    assert runner.shadow.read(out.block_tables["new"], 9) == new.all_token_ids[:9]
    assert gpu_before != runner.shadow.gpu


def test_swap_in_takes_no_prefix_hits():
    s, runner, (old, mid, new) = _swap_setup(num_cpu_blocks=4)
    run_step(s, runner)
    s.finish_requests(["old"])
    stats_before = s.kv_cache_manager.prefix_cache_stats.requests
    out = s.schedule()
    assert out.blocks_to_swap_in
    assert s.kv_cache_manager.prefix_cache_stats.requests == stats_before  # no lookup for a swapped request


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_short():
    s, runner, (old, mid, new) = _swap_setup(num_cpu_blocks=1)  # 2 blocks needed, 1 free
    out = s.schedule()
    assert list(out.preempted_req_ids) == ["new"] and not out.blocks_to_swap_out
    assert new.num_computed_tokens == 0 and not s.swapped
    assert s.cpu_block_pool.get_num_free_blocks() == 1


def test_finishing_a_swapped_request_releases_its_cpu_blocks():
    s, runner, reqs = _swap_setup(num_cpu_blocks=4)
    run_step(s, runner)
    assert s.abort_requests("new") == ["new"]
    assert not s.swapped and s.cpu_block_pool.get_num_free_blocks() == 4
    assert reqs[2].status == RequestStatus.FINISHED_ABORTED and "new" not in s.requests


def test_swap_of_a_request_with_copy_on_write_in_the_same_step():
    """A priority victim that made a copy-on-write copy earlier in the same step is swapped out from the
    copy's source, since the swap-out runs before the copy."""
    s = make_scheduler(num_blocks=6, block_size=4, policy="priority", preemption_mode="swap", num_cpu_blocks=4)
    runner = SimModelRunner.for_scheduler(s, MODEL)
    p = Request("P", [1, 2, 3, 4, 5, 6], max_tokens=6, priority=5)
    s.add_request(p)
    o1 = s.schedule()  # P prefill: blocks a (full), b (2 of 4)
    runner.execute(o1, s.requests)
    c = Request("C", [1, 2, 3, 4, 5, 6], max_tokens=6, priority=0)
    s.fork(p, c)  # C shares a and b
    z = Request("Z", [7] * 8, max_tokens=4, priority=1)
    s.add_request(z)
    o2 = s.schedule()  # P and C wait for their samples; Z is admitted (2 blocks): 1 block left
    assert o2.num_scheduled_tokens == {"Z": 8}
    runner.execute(o2, s.requests)
    s.update_from_output(o1, {"P": 11})
    s.update_from_output(o2, {"Z": 12})
    c.append_output_token_ids(13)  # the child's own first sample
    o3 = s.schedule()
    # P writes position 6 into shared b: copy-on-write to the last free block; then Z needs a block: the
    # victim is P (worst priority), already scheduled: swapped out, its copy dropped.
    assert list(o3.preempted_req_ids) == ["P"]
    assert o3.num_scheduled_tokens == {"C": 1, "Z": 1}
    assert o3.blocks_to_copy == []
    a, b = o1.block_tables["P"]
    assert o3.blocks_to_swap_out == [(a, 0), (b, 1)]
    samples = runner.execute(o3, s.requests)
    s.update_from_output(o3, samples)
    s.finish_requests(["C", "Z"])
    o4 = s.schedule()
    assert o4.blocks_to_swap_in and o4.num_scheduled_tokens == {"P": 1}
    runner.execute(o4, s.requests)  # raises KVCacheCorruptionError if P's swapped KV were wrong
    assert runner.shadow.read(o4.block_tables["P"], 7) == [1, 2, 3, 4, 5, 6, 11]


# ---------------------------------------------------------------------------------------------------
# Priority
# ---------------------------------------------------------------------------------------------------
def _prio_requests(priorities, arrivals, num_tokens=10, ids_=None):
    ids_ = ids_ or [str(i) for i in range(len(priorities))]
    return [
        Request(ids_[i], [i + 1] * num_tokens, max_tokens=16, priority=p, arrival_time=a)
        for i, (p, a) in enumerate(zip(priorities, arrivals, strict=True))
    ]


@pytest.mark.parametrize(
    ("priorities", "arrivals", "expected"),
    [
        ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),
        ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),
        ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),
    ],
)
def test_priority_admission_order(priorities, arrivals, expected):
    s = make_scheduler(policy="priority")
    for r in _prio_requests(priorities, arrivals):
        s.add_request(r)
    assert ids(s.waiting) == expected
    out = s.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == expected
    assert list(out.num_scheduled_tokens) == expected


def test_priority_waiting_queue_order_with_limited_slots():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    for r in _prio_requests([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0]):
        s.add_request(r)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["3"]
    assert ids(s.waiting) == ["1", "2", "0"] and [r.priority for r in s.waiting] == [1, 2, 3]
    assert s.waiting[0].request_id == "1"


def test_priority_preemption_and_resumption_when_out_of_kv():
    # 4 usable blocks of 16. low: 30 tokens (2 blocks); high: 32 tokens (2 blocks).
    s = make_scheduler(num_blocks=5, block_size=16, max_num_seqs=2, max_num_batched_tokens=200, policy="priority")
    low = Request("low", [0] * 30, max_tokens=16, priority=1, arrival_time=0.0)
    s.add_request(low)
    out = s.schedule()
    s.update_from_output(out, {"low": 100})
    high = Request("high", [1] * 32, max_tokens=16, priority=0, arrival_time=1.0)
    s.add_request(high)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"low": 1, "high": 32}
    assert s.kv_cache_manager.get_num_free_blocks() == 0
    s.update_from_output(out, {"low": 100, "high": 100})
    out = s.schedule()
    # low (position 31) fits in its 2nd block and is scheduled first; high (position 32) needs a 3rd block:
    # the victim is low (worst priority), already scheduled this step, so its token returns to the budget.
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.total_num_scheduled_tokens == 1
    assert list(out.preempted_req_ids) == ["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert ids(s.waiting) == ["low"] and ids(s.running) == ["high"]
    assert out.scheduled_cached_reqs.req_ids == ["high"]
    s.update_from_output(out, {"high": 100})
    s.finish_requests("high", RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert out.scheduled_cached_reqs.req_ids == ["low"] and out.scheduled_cached_reqs.resumed_req_ids == {"low"}
    # 30 prompt + 2 output tokens to recompute (less any prefix-cache hit on its first block)
    assert out.num_computed_tokens["low"] + out.num_scheduled_tokens["low"] == 32
    assert low.all_token_ids[30:] == [100, 100]


def test_priority_victim_is_worst_priority_then_latest_arrival():
    s = make_scheduler(num_blocks=7, block_size=4, policy="priority", caching=False)
    reqs = [
        Request("a", [1] * 8, max_tokens=6, priority=1, arrival_time=0.0),
        Request("b", [2] * 8, max_tokens=6, priority=2, arrival_time=1.0),
        Request("c", [3] * 8, max_tokens=6, priority=2, arrival_time=0.5),
    ]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "c", "b"]
    s.update_from_output(out, {"a": 1, "b": 1, "c": 1})
    out = s.schedule()
    assert list(out.preempted_req_ids) == ["b"]  # priority 2, arrived last


def test_finish_requests_in_priority_heap_order():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    reqs = _prio_requests(priorities, [float(i) for i in range(8)])
    for r in reqs:
        s.add_request(r)
    seen = []
    while s.waiting:
        out = s.schedule()
        (rid,) = out.num_scheduled_tokens
        seen.append(reqs[int(rid)].priority)
        s.update_from_output(out, {rid: 100})
        s.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
    assert seen == sorted(priorities)


# ---------------------------------------------------------------------------------------------------
# update_from_output
# ---------------------------------------------------------------------------------------------------
def test_stop_on_max_tokens_and_eos():
    s = make_scheduler()
    a = Request("a", [1, 2], max_tokens=2)
    b = Request("b", [3, 4], max_tokens=10, eos_token_id=99)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": 5, "b": 6})
    blocks_before = s.kv_cache_manager.get_num_free_blocks()
    out = s.schedule()
    s.update_from_output(out, {"a": 7, "b": 99})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [5, 7]
    assert b.status == RequestStatus.FINISHED_STOPPED and b.output_token_ids == [6, 99]
    assert s.running == [] and s.finished_req_ids == {"a", "b"}
    assert s.kv_cache_manager.get_num_free_blocks() == blocks_before + 2
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and s.finished_req_ids == set()
    assert not s.has_unfinished_requests()


def test_update_from_output_validates_before_changing_anything():
    s = make_scheduler()
    a, b = make_requests(2, num_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    for bad in ({"0": 1, "zz": 2}, {"0": 1, "1": -3}, {"0": 1, "1": "x"}, {"0": 1, "1": True}, {"0": 1},
                {"0": [1, 2], "1": 3}):
        with pytest.raises(ValueError):
            s.update_from_output(out, bad)
        assert a.output_token_ids == [] and b.output_token_ids == []
    with pytest.raises(ValueError):
        s.update_from_output("out", {})  # type: ignore[arg-type]
    s.update_from_output(out, {"0": [1], "1": 2})
    assert a.output_token_ids == [1] and b.output_token_ids == [2]
    with pytest.raises(ValueError, match="already"):
        s.update_from_output(out, {"0": 1, "1": 2})
    assert a.output_token_ids == [1]


def test_hand_built_output_is_accepted():
    s = make_scheduler()
    (a,) = make_requests(1, num_tokens=4)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"0": 1})
    s.schedule()  # a is scheduled for 1 token
    s.update_from_output(SchedulerOutput(num_scheduled_tokens={"0": 1}), {"0": 9})
    assert a.output_token_ids == [1, 9]


def test_samples_for_requests_aborted_meanwhile_are_ignored():
    s = make_scheduler()
    a, b = make_requests(2, num_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.finish_requests("0")
    s.update_from_output(out, {"0": 1, "1": 2})
    assert a.output_token_ids == [] and b.output_token_ids == [2]


# ---------------------------------------------------------------------------------------------------
# finish_requests, reset, snapshot, trace, fork
# ---------------------------------------------------------------------------------------------------
def test_finish_requests_everywhere():
    s = make_scheduler(max_num_seqs=2)
    reqs = make_requests(4)
    for r in reqs:
        s.add_request(r)
    s.schedule()
    free = s.kv_cache_manager.get_num_free_blocks()
    assert s.finish_requests(["0", "3", "nope"]) == ["0", "3"]
    assert ids(s.running) == ["1"] and ids(s.waiting) == ["2"]
    assert s.kv_cache_manager.get_num_free_blocks() == free + 1
    assert reqs[0].status == reqs[3].status == RequestStatus.FINISHED_ABORTED
    with pytest.raises(ValueError):
        s.finish_requests("1", RequestStatus.RUNNING)
    assert s.finish_requests(None, RequestStatus.FINISHED_STOPPED) == ["1", "2"]
    assert not s.has_unfinished_requests() and s.get_num_unfinished_requests() == 0


def test_reset_prefix_cache():
    s = make_scheduler()
    reqs = make_requests(10)
    for r in reqs:
        s.add_request(r)
    s.schedule()
    assert not s.reset_prefix_cache()
    assert s.reset_prefix_cache(reset_running_requests=True)
    assert s.running == [] and list(s.waiting) == reqs


def test_snapshot_shape():
    s = make_scheduler(num_blocks=10, block_size=4, num_cpu_blocks=3)
    a, b = make_requests(2, num_tokens=5)
    s.add_request(a)
    s.add_request(b)
    snap0 = s.snapshot()
    assert snap0["waiting"] == ["0", "1"] and snap0["running"] == [] and snap0["step"] == 0
    assert snap0["cpu"] == {"num_blocks": 3, "block_tables": {}, "free": [0, 1, 2]}
    s.schedule()
    snap = s.snapshot()
    assert snap["running"] == ["0", "1"] and snap["waiting"] == [] and snap["step"] == 1
    m = s.kv_cache_manager
    assert snap["block_tables"] == {"0": m.get_block_ids("0"), "1": m.get_block_ids("1")}
    for key in ("block_size", "num_blocks", "blocks", "free_queue", "num_tokens"):
        assert key in snap


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_trace_events_and_consistent_snapshots(mode):
    s, runner, _ = _swap_setup(num_cpu_blocks=4 if mode == "swap" else 0)
    trace = EventTrace()
    frames = []
    trace.subscribe(lambda e: frames.append((e, s.snapshot())))
    s.set_trace(trace)
    assert s.kv_cache_manager.trace is trace
    run_step(s, runner)  # "new" is preempted
    kinds = [e.kind for e, _ in frames]
    assert "preempt" in kinds and kinds[-1] == "schedule"
    preempt, snap = next((e, sn) for e, sn in frames if e.kind == "preempt")
    assert preempt.request_id == "new" and preempt.data["mode"] == mode
    assert "new" in snap["waiting"] and "new" not in snap["running"] and "new" not in snap["block_tables"]
    if mode == "swap":
        i = kinds.index("swap_out")
        assert i < kinds.index("free") < kinds.index("preempt")
        assert snap["cpu"]["block_tables"] == {"new": [0, 1]}
    s.finish_requests(["old"])
    run_step(s, runner)
    kinds = [e.kind for e, _ in frames]
    assert "finish" in kinds and "admit" in kinds
    if mode == "swap":
        swap_in, snap = next((e, sn) for e, sn in frames if e.kind == "swap_in")
        assert snap["cpu"]["block_tables"] == {} and kinds.index("swap_in") < kinds.index("admit")
    admit, snap = next((e, sn) for e, sn in frames if e.kind == "admit")
    assert admit.request_id == "new" and "new" in snap["running"] and "new" in snap["block_tables"]
    s.set_trace(None)
    assert s.kv_cache_manager.trace is None


def test_fork_shares_blocks_and_copies_on_write():
    s = make_scheduler(num_blocks=20, block_size=4)
    runner = SimModelRunner.for_scheduler(s, MODEL)
    p = Request("p", [1, 2, 3, 4, 5, 6], max_tokens=4)
    s.add_request(p)
    run_step(s, runner)  # p: 6 computed, 7 tokens
    c = Request("c", [1, 2, 3, 4, 5, 6], max_tokens=4)
    with pytest.raises(ValueError):
        s.fork(c, Request("x", [1]))  # the parent must be running
    s.fork(p, c)
    assert s.running == [p, c] and c.status == RequestStatus.RUNNING and c.num_computed_tokens == 6
    assert s.kv_cache_manager.get_block_ids("c") == s.kv_cache_manager.get_block_ids("p")
    with pytest.raises(ValueError, match="duplicate"):
        s.fork(p, Request("c", [1, 2, 3, 4, 5, 6]))
    c.append_output_token_ids(77)  # its own first sample
    shared_last = s.kv_cache_manager.get_block_ids("p")[1]
    out = run_step(s, runner)  # both write position 6 into the shared partial block
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == shared_last
    while s.has_unfinished_requests():
        run_step(s, runner)
    assert p.output_token_ids == MODEL.generate(p.prompt_token_ids, 4)
    assert c.output_token_ids[0] == 77
    assert s.kv_cache_manager.get_num_free_blocks() == 19


def test_fork_refused_when_max_num_seqs_run():
    s = make_scheduler(max_num_seqs=1)
    (p,) = make_requests(1, num_tokens=4)
    s.add_request(p)
    s.schedule()
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.fork(p, Request("c", p.prompt_token_ids))
    assert "c" not in s.requests and s.running == [p]


def test_corruption_is_detected_by_the_runner():
    s = make_scheduler(num_blocks=10, block_size=4)
    runner = SimModelRunner.for_scheduler(s, MODEL)
    (a,) = make_requests(1, num_tokens=6)
    s.add_request(a)
    run_step(s, runner)
    table = s.kv_cache_manager.get_block_ids("0")
    runner.shadow.gpu[table[0]][1] = 12345  # a stray write
    out = s.schedule()
    with pytest.raises(KVCacheCorruptionError, match="position 1"):
        runner.execute(out, s.requests)


def test_preempted_ids_compare_as_list_or_set():
    s = make_scheduler(num_blocks=7, block_size=4, caching=False)
    for r in make_requests(3, num_tokens=8, max_tokens=6):
        s.add_request(r)
    s.update_from_output(s.schedule(), {"0": 1, "1": 1, "2": 1})
    out = s.schedule()
    assert out.preempted_req_ids == ["2"] and out.preempted_req_ids == {"2"} and "2" in out.preempted_req_ids
    assert out.preempted_req_ids != {"1"}


def test_blocks_needed_formula():
    s = make_scheduler(num_blocks=10, block_size=4)
    r = Request("r", [1] * 5, max_tokens=6)
    assert s.max_blocks_needed(r) == math.ceil(11 / 4)


def test_a_request_swapped_out_before_its_last_sample_arrives_finishes_cleanly():
    # test_preempt_during_execution with swap: "1" is swapped out before the sample of its prefill arrives,
    # and that sample is its last one (max_tokens=1): it finishes while waiting on the CPU.
    s = make_scheduler(num_blocks=11, block_size=16, max_num_batched_tokens=100, caching=False,
                       preemption_mode="swap", num_cpu_blocks=8)
    a = Request("0", [0] * 80, max_tokens=4)
    b = Request("1", [1] * 80, max_tokens=1)
    s.add_request(a)
    out0 = s.schedule()
    s.add_request(b)
    out1 = s.schedule()
    s.update_from_output(out0, {"0": 0})
    out2 = s.schedule()
    assert list(out2.preempted_req_ids) == ["1"] and len(out2.blocks_to_swap_out) == 5
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 80 and "1" in s.swapped
    s.update_from_output(out1, {"1": 42})
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.output_token_ids == [42]
    assert not s.swapped and s.cpu_block_pool.get_num_free_blocks() == 8
    assert list(s.waiting) == [] and s.running == [a] and "1" in s.finished_req_ids and "1" not in s.requests


@pytest.mark.parametrize("bad", [2**61 - 1, 1.5, True, -3])
def test_update_from_output_refuses_a_bad_sample_before_changing_anything(bad):
    s = make_scheduler(num_blocks=10, block_size=4)
    a, b = Request("a", [1, 2, 3]), Request("b", [4, 5])
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    with pytest.raises(ValueError):
        s.update_from_output(out, {"a": 7, "b": bad})
    assert a.output_token_ids == [] and b.output_token_ids == []
    s.update_from_output(out, {"a": 7, "b": 8})
    assert a.output_token_ids == [7] and b.output_token_ids == [8]


def _run_one_step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, {r: 1 for r in out.num_scheduled_tokens if r not in out.partial_prefill_req_ids})
    return out


@pytest.mark.parametrize("gate", [True, False])
def test_admission_gate_waits_until_the_whole_prompt_fits(gate):
    """vLLM 0.26's ``scheduler_reserve_full_isl`` (the default): a 16-token prompt needs 4 blocks; its first
    4-token chunk would fit in the 2 blocks free, but it is not admitted until the whole prompt fits.
    ``False`` admits it on the first chunk (the behaviour before the gate)."""
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=20, scheduler_reserve_full_isl=gate)
    assert Scheduler.__init__.__kwdefaults__["scheduler_reserve_full_isl"] is True
    s.add_request(Request("run", list(range(16)), max_tokens=5))  # 4 blocks, then a 5th to decode
    _run_one_step(s)
    s.add_request(Request("long", [7] * 16, max_tokens=1))
    s.max_num_batched_tokens = 5  # one decode token + a 4-token chunk
    out = _run_one_step(s)
    assert s.kv_cache_manager.get_num_free_blocks() == (2 if gate else 1)
    assert list(out.num_scheduled_tokens) == (["run"] if gate else ["run", "long"])


def test_admission_gate_counts_prefix_hits_held_by_others_as_already_there():
    """The whole sequence must fit *after* its hits: blocks another request holds cost nothing; cached blocks
    sitting in the free queue count against the free blocks (touching them takes them out)."""
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    shared = list(range(12))
    s.add_request(Request("owner", shared + [50], max_tokens=3))
    _run_one_step(s)  # owner holds 4 blocks; 2 free
    s.add_request(Request("reader", shared + [60, 61, 62, 63, 64], max_tokens=1))  # 17 tokens: 5 blocks
    out = _run_one_step(s)
    assert "reader" in out.num_scheduled_tokens  # 3 hits held by owner + 2 new blocks = fits in 2 free
    assert out.num_computed_tokens["reader"] == 12
