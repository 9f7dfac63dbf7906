"""The simulator: the fake model, the cost model, the contiguous baseline, the engine loop and the targets."""

from __future__ import annotations

import math

import pytest

from pagedkv import KVCacheManager, Request
from pagedkv.scheduler import Scheduler
from pagedkv.sim import (
    H100_SXM,
    LLAMA2_7B,
    ContiguousKVCacheManager,
    CostModel,
    FakeModel,
    SimModelRunner,
    WorkloadSpec,
    clone_requests,
    make_requests,
    run_to_completion,
    sample_lengths,
)
from pagedkv.sim.targets import format_table, main, measure


def test_fake_model_is_a_pure_function_of_the_tokens():
    m = FakeModel(vocab_size=100, seed=3)
    assert m.next_token([1, 2, 3]) == m.next_token([1, 2, 3])
    assert m.next_token([1, 2, 3]) != m.next_token([1, 2, 4]) or m.next_token([1, 2]) != m.next_token([2, 1])
    out = m.generate([5, 6], 10)
    assert len(out) == 10 and all(0 <= t < 100 for t in out)
    assert out[1] == m.next_token([5, 6, out[0]])
    state = m.extend_state(m.initial_state(), [5, 6])
    assert m.token_from_state(state) == out[0]
    assert FakeModel(seed=4).generate([5, 6], 5) != FakeModel(seed=3).generate([5, 6], 5)


def test_fake_model_eos():
    m = FakeModel(vocab_size=50, eos_token_id=0, eos_probability=0.3)
    outs = [m.generate([i], 40) for i in range(20)]
    assert any(o[-1] == 0 and len(o) < 40 for o in outs)
    assert all(0 not in o[:-1] for o in outs)
    with pytest.raises(ValueError):
        FakeModel(eos_probability=0.5)


def test_cost_model_decode_is_memory_bound_and_prefill_compute_bound():
    cm = CostModel()
    assert LLAMA2_7B.kv_bytes_per_token == 512 * 1024
    d1 = cm.decode_step(1, 512)
    d64 = cm.decode_step(64, 512)
    assert d1.bound == "memory" and d64.bound == "memory"
    assert d64.time_s < 3 * d1.time_s  # 64x the tokens for well under 3x the time
    assert cm.decode_throughput(64, 512) > 20 * cm.decode_throughput(1, 512)
    p = cm.prefill_cost(2048)
    assert p.bound == "compute"
    # weights: 13.48 GB at 80% of 3.35 TB/s is about 5 ms, plus 1 ms overhead
    assert d1.time_s == pytest.approx(1e-3 + (13.48e9 + 514 * 512 * 1024) / (3.35e12 * 0.8), rel=0.01)
    assert cm.recompute_seconds(4096) > cm.swap_seconds(4096) > 0
    assert cm.chunks_cost([]).time_s == 0.0


def test_num_gpu_blocks_formula():
    cm = CostModel()
    # vLLM 0.26: ceil(total x 0.92) minus weights, activation peak and non-torch memory; no CUDA-graph estimate
    # for a dense model (Model Runner V2's profile_cudagraph_memory() returns 0)
    budget = math.ceil(0.92 * 80 * 2**30) - cm.model.weight_bytes - 1.5e9 - 0.3e9
    assert cm.num_gpu_blocks() == int(budget // (16 * 512 * 1024))
    assert cm.num_gpu_blocks(cudagraph_bytes=0.5e9) == int((budget - 0.5e9) // (16 * 512 * 1024))
    with pytest.raises(ValueError):
        cm.num_gpu_blocks(gpu_memory_utilization=0.1)
    assert H100_SXM.hbm_bandwidth == 3.35e12


def test_workload_lengths():
    spec = WorkloadSpec(num_requests=2000, max_len=2048)
    prompts, outputs = sample_lengths(spec)
    assert all(p + o <= 2048 and o >= 1 for p, o in zip(prompts, outputs, strict=True))
    assert 120 < sum(prompts) / 2000 < 200 and 250 < sum(outputs) / 2000 < 400  # ShareGPT: 161 in, 338 out
    reqs = make_requests(spec)
    assert [r.request_id for r in reqs[:2]] == ["r0", "r1"]
    assert [r.num_prompt_tokens for r in reqs] == prompts and [r.max_tokens for r in reqs] == outputs
    copies = clone_requests(reqs[:3])
    assert [c.prompt_token_ids for c in copies] == [r.prompt_token_ids for r in reqs[:3]]
    assert copies[0] is not reqs[0]
    shared = make_requests(WorkloadSpec(num_requests=3, shared_prefix_len=32))
    assert shared[0].prompt_token_ids[:32] == shared[1].prompt_token_ids[:32]


def test_contiguous_manager_reserves_max_len_runs():
    m = ContiguousKVCacheManager(num_blocks=17, block_size=4, max_len=16)  # 16 usable blocks, 4 per request
    assert m.max_num_requests == 4
    reqs = [Request(f"r{i}", [1] * 5, max_tokens=3) for i in range(5)]
    runs = [m.allocate_slots(r, 5) for r in reqs[:4]]
    assert [[b.block_id for b in run] for run in runs] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12],
                                                           [13, 14, 15, 16]]
    assert m.allocate_slots(reqs[4], 5) is None
    reqs[0].num_computed_tokens = 5
    assert m.allocate_slots(reqs[0], 11) == []
    with pytest.raises(ValueError, match="max_len"):
        m.allocate_slots(reqs[0], 12)
    m.free(reqs[1])
    assert [b.block_id for b in m.allocate_slots(reqs[4], 5)] == [5, 6, 7, 8]
    assert m.get_num_free_blocks() == 0
    with pytest.raises(ValueError):
        m.fork(reqs[0], Request("c", [1] * 5))


def test_engine_metrics_on_paging_and_reservation():
    reqs = make_requests(WorkloadSpec(num_requests=60, prompt_median=20, output_median=30, max_len=128))
    cm = CostModel(block_size=4)
    paged = Scheduler(KVCacheManager(101, 4, enable_caching=False), max_num_seqs=64, max_num_batched_tokens=512)
    resv = Scheduler(ContiguousKVCacheManager(101, 4, max_len=128), max_num_seqs=64, max_num_batched_tokens=512)
    rp = run_to_completion(paged, clone_requests(reqs), cost_model=cm,
                           runner=SimModelRunner.for_scheduler(paged), progress=False)
    rr = run_to_completion(resv, clone_requests(reqs), cost_model=cm, runner=SimModelRunner.for_scheduler(resv))
    model = FakeModel()
    assert rp.outputs == rr.outputs == {r.request_id: model.generate(r.prompt_token_ids, r.max_tokens) for r in reqs}
    assert rr.max_concurrency <= 3 and rr.num_preemptions == 0
    assert rp.saturated_concurrency > 1.5 * rr.saturated_concurrency
    assert rp.waste_percent < 10 < 50 < rr.waste_percent
    assert rp.num_generated_tokens == sum(r.max_tokens for r in reqs)
    assert rp.tokens_per_s > rr.tokens_per_s
    tl = rp.timeline()
    assert len(tl["t_s"]) == rp.num_steps and tl["running"].max() == rp.max_concurrency
    assert set(rp.finish_s) == {r.request_id for r in reqs}
    assert all(rp.first_token_s[r] <= rp.finish_s[r] for r in rp.finish_s)
    assert rp.summary()["steps"] == rp.num_steps


def test_engine_online_arrivals_and_errors():
    reqs = [Request(f"a{i}", [i + 1] * 8, max_tokens=4) for i in range(3)]
    s = Scheduler(KVCacheManager(50, 4), max_num_seqs=8, max_num_batched_tokens=64)
    res = run_to_completion(s, reqs, arrival_times=[0.0, 1.0, 5.0])
    assert res.arrival_s == {"a0": 0.0, "a1": 1.0, "a2": 5.0}
    assert res.finish_s["a2"] > 5.0 and res.sim_time_s > 5.0
    with pytest.raises(ValueError):
        run_to_completion(Scheduler(KVCacheManager(50, 4), 8, 64), [Request("x", [1])], arrival_times=[0.0, 1.0])
    with pytest.raises(ValueError, match="unique"):
        run_to_completion(Scheduler(KVCacheManager(50, 4), 8, 64), [Request("x", [1]), Request("x", [2])])


@pytest.mark.slow
def test_targets_met_on_a_small_workload(capsys):
    report = measure(300)
    assert report.checks() == {k: True for k in report.checks()}
    assert report.paged.waste_percent < 4 and 60 <= report.reserved.waste_percent <= 80
    assert report.concurrency_ratio >= 3
    table = format_table(report)
    assert "KV memory waste" in table and "[PASS] concurrency >= 3x" in table
    assert main(["--num-requests", "300"]) == 0
    assert "max-length reservation" in capsys.readouterr().out
