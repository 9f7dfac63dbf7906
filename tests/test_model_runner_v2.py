"""Model Runner V2's input preparation: device block tables updated from each step's new block ids, slot mappings
by the Triton kernel (the interpreter on a CPU) and by PyTorch, decode inputs from the runner's last samples,
all checked against the plain Python ``prepare_inputs`` on every step of real engine runs."""

from __future__ import annotations

import random

import pagedkv.kernels  # noqa: F401  (Triton's interpreter is chosen before anything else loads Triton)
import pytest
import torch
from pagedkv.kernels import compute_slot_mappings
from test_engine import hf_greedy, make_prompts, tiny_model

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.block_table import BlockTables
from pagedkv.engine.model_runner import prepare_inputs


def python_slots(table: list[list[int]], idx: list[int], qsl: list[int], positions: list[int], bs: int) -> list[int]:
    out = []
    for b, row in enumerate(idx):
        for t in range(qsl[b], qsl[b + 1]):
            p = positions[t]
            out.append(table[row][p // bs] * bs + p % bs)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_slot_mapping_kernel_and_torch_path_match_python(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    rows, width = 9, 12
    table = [[rng.randrange(0, 500) for _ in range(width)] for _ in range(rows)]
    idx = rng.sample(range(rows), rng.randint(1, rows))
    qsl, positions = [0], []
    for _ in idx:
        start, n = rng.randrange(0, width * bs - 1), 0
        n = rng.randint(1, width * bs - start)
        positions.extend(range(start, start + n))
        qsl.append(qsl[-1] + n)
    want = python_slots(table, idx, qsl, positions, bs)
    bt = torch.tensor(table, dtype=torch.int32)
    args = (torch.tensor(idx, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(positions, dtype=torch.long))
    assert compute_slot_mappings(bt, *args, block_size=bs).tolist() == want
    for impl in ("torch", "triton"):
        tables = BlockTables(bs, rows, width, "cpu", slot_mapping_impl=impl)
        for r in range(rows):
            tables.append_block_ids(r, table[r][:5], overwrite=True)
            tables.append_block_ids(r, table[r][5:], overwrite=False)  # appended, as a later step would
        assert tables.block_tables.tolist() == table
        assert tables.compute_slot_mappings(*args).tolist() == want


def test_slot_mapping_kernel_refuses_mixed_dtypes():
    with pytest.raises(ValueError, match="int32"):
        compute_slot_mappings(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.long), 4)


def test_append_past_the_table_is_refused_and_changes_nothing():
    tables = BlockTables(4, 2, 3, "cpu")
    tables.append_block_ids(0, [1, 2], overwrite=True)
    with pytest.raises(ValueError, match="exceed"):
        tables.append_block_ids(0, [3, 4], overwrite=False)
    assert tables.num_blocks[0] == 2 and tables.block_tables[0, :2].tolist() == [1, 2]


CASES = {
    "chunked+recompute": dict(num_gpu_blocks=12, block_size=4, max_num_batched_tokens=16),
    "swap": dict(num_gpu_blocks=12, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
    "prefix": dict(num_gpu_blocks=60, block_size=4, max_num_batched_tokens=32),
}


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_step_equals_python_prepare_inputs(case, async_scheduling):
    model = tiny_model()
    prompts = make_prompts(6, lo=10, hi=30, seed=4)
    if case == "prefix":
        prompts = [list(range(100, 120)) + p for p in prompts]
    refs = [t for t, _ in hf_greedy(model, prompts, max_new=8)]
    llm = LLM(model, async_scheduling=async_scheduling, **CASES[case])
    runner, sched = llm.runner, llm.scheduler
    device_prepare = runner.prepare_inputs
    checked = []

    def checked_prepare(so):
        batch = device_prepare(so)
        bs = runner.block_size
        got = batch.to_model_inputs(bs)
        assert got == runner.prepare_inputs_python(so).to_model_inputs(bs)
        if len(checked) < 4:  # the kernel, under the interpreter (slow: a few steps)
            runner.block_tables.slot_mapping_impl = "triton"
            try:
                assert device_prepare(so).slot_mapping.tolist() == got.slot_mapping
            finally:
                runner.block_tables.slot_mapping_impl = "torch"
        if not async_scheduling:  # every token is known to the scheduler: the plain function on its tokens
            token_ids = {r: sched.requests[r].all_token_ids for r in so.num_scheduled_tokens}
            assert got == prepare_inputs(so, token_ids, bs)
        assert got.slot_mapping == so.flat_slot_mapping()  # the scheduler's own slots agree
        checked.append(so.step)
        return batch

    runner.prepare_inputs = checked_prepare
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert len(checked) >= 8
    if case != "prefix":
        assert sched.num_preemptions > 0
        assert case != "swap" or sched.num_swap_outs > 0
    else:
        assert sum(o.num_cached_tokens for o in outs) > 0


def test_decode_inputs_come_from_the_runner_not_the_host():
    """With async scheduling the host does not know a decode's input when it schedules it: the runner reads its
    own last sample on the device. Corrupting the host's copy changes nothing; corrupting the device's does."""
    model = tiny_model()
    prompts = make_prompts(2, lo=5, hi=9, seed=1)
    refs = [t for t, _ in hf_greedy(model, prompts, max_new=5)]
    llm = LLM(model, num_gpu_blocks=30, block_size=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    runner = llm.runner
    execute = runner.execute_model

    def corrupt_then_execute(so):
        runner.last_sampled_tokens.fill_(0)
        return execute(so)

    runner.execute_model = corrupt_then_execute
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != refs


def _slot_args(**change):
    args = dict(block_tables=torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32),
                idx_mapping=torch.tensor([1, 0], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
                positions=torch.tensor([0, 5, 1]), block_size=4)
    args.update(change)
    return args


@pytest.mark.parametrize(("change", "match"), [
    (dict(block_size=0), "block_size must be an int >= 1"),
    (dict(block_size=True), "block_size must be an int >= 1"),
    (dict(positions=torch.tensor([0.0, 5.0, 1.0])), "positions must be a 1-D int32 or int64"),
    (dict(idx_mapping=torch.tensor([[1, 0]], dtype=torch.int32)), "idx_mapping must be a 1-D"),
    (dict(query_start_loc=torch.tensor([0, 2, 3], dtype=torch.float32)), "query_start_loc must be a 1-D"),
    (dict(out=torch.zeros(2, dtype=torch.int64)), "at least 3 elements"),
    (dict(out=torch.zeros(3, dtype=torch.int32)), "int64"),
    (dict(out=torch.zeros(6, dtype=torch.int64)[::2]), "packed"),
    (dict(query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32)), "rise from 0 to at most the 3"),
    (dict(query_start_loc=torch.tensor([0, 3, 2], dtype=torch.int32)), "rise from 0"),
    (dict(query_start_loc=torch.tensor([1, 2, 3], dtype=torch.int32)), "rise from 0"),
    (dict(idx_mapping=torch.tensor([2, 0], dtype=torch.int32)), "rows 0..1"),
    (dict(idx_mapping=torch.tensor([-1, 0], dtype=torch.int32)), "rows 0..1"),
    (dict(positions=torch.tensor([0, 12, 1])), r"positions must lie in 0\.\.11"),
    (dict(positions=torch.tensor([0, -1, 1])), r"positions must lie in 0\.\.11"),
])  # fmt: skip
def test_slot_mapping_kernel_refuses_bad_input_and_writes_nothing(change, match):
    """A short ``out`` used to corrupt the heap, block_size 0 to divide by zero inside the kernel, a float
    position to fail in the interpreter; a bad offset, row or position would be read out of bounds."""
    out = torch.full((3,), -7, dtype=torch.int64)
    args = _slot_args(**change)
    args.setdefault("out", out)
    before = args["out"].clone()
    with pytest.raises(ValueError, match=match):
        compute_slot_mappings(**args)
    assert torch.equal(args["out"], before)


def test_slot_mapping_kernel_positions_past_the_offsets_are_not_read():
    """Only the positions ``query_start_loc`` covers are checked and used (the rest of a persistent buffer)."""
    got = compute_slot_mappings(**_slot_args(positions=torch.tensor([0, 5, 1, 999])))
    assert got.shape == (4,) and got[:3].tolist() == [16, 21, 5]
