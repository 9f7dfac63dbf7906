"""Lesson 10: the engine under tensor parallelism, on 2 CPU processes (gloo, loopback, a free port each).

The sharded layers are checked in one process (a rank's partial result, summed or concatenated over the ranks,
is the full layer's); the engine end to end with 2 worker processes: greedy tokens identical to
``tensor_parallel_size=1`` (exactly: no tolerance) and to HF ``generate`` (as lesson 7's tests: exact except after
an HF near-tie below ``NEAR_TIE``, reported), under chunked prefill, recompute and swap preemption and prefix
caching; every rank holds the same block count; and no worker process outlives its engine, whatever ends it
(a failing test, ``SIGKILL``, a worker's error or death; Ctrl-C interrupts the engine only).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_engine import assert_matches_hf, hf_greedy, make_prompts, tiny_model
from torch import nn

from pagedkv.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_head_shard,
    num_kv_heads_per_rank,
)
from pagedkv.distributed.shard import check_shardable, shard_model
from pagedkv.engine import LLM, SamplingParams
from pagedkv.sizing.parallel import (
    DEEPSEEK_V3,
    LLAMA_3_1_70B,
    QWEN2_5_1_5B,
    kv_page_bytes_per_rank,
    rank_sizing,
    unify_num_blocks,
)

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------------------
# The layers, one process: each rank's share recombines into the full layer
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_then_row_parallel_is_the_full_mlp(tp):
    torch.manual_seed(0)
    up, down = nn.Linear(8, 16, bias=True).double(), nn.Linear(16, 8, bias=True).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    want = down(torch.relu(up(x)))
    per = 16 // tp
    partials = []
    for rank in range(tp):
        rows = range(rank * per, (rank + 1) * per)
        col, row = ColumnParallelLinear(up, rows), RowParallelLinear(down, rows, rank)
        assert col.weight.shape == (per, 8) and row.weight.shape == (8, per)
        assert (row.bias is not None) == (rank == 0)  # the bias is added once
        partials.append(row.forward_partial(torch.relu(col(x))))
    torch.testing.assert_close(sum(partials), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("vocab, tp", [(10, 2), (11, 4), (7, 8)])
def test_vocab_parallel_embedding_and_head(vocab, tp):
    torch.manual_seed(1)
    weight = torch.randn(vocab, 6, dtype=torch.float64)
    ids = torch.arange(vocab).repeat(2)
    hidden = torch.randn(3, 6, dtype=torch.float64)
    embeds = [VocabParallelEmbedding(weight, tp, r) for r in range(tp)]
    torch.testing.assert_close(sum(e.forward_partial(ids) for e in embeds), weight[ids], rtol=0, atol=0)
    heads = [ParallelLMHead(weight, tp, r) for r in range(tp)]
    assert len({h.weight.shape for h in heads}) == 1  # equal shares, padded: what all-gather needs
    logits = torch.cat([h.compute_logits_partial(hidden) for h in heads], dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, hidden @ weight.T)
    tied = ParallelLMHead.tied_to(embeds[0])
    assert tied.weight is embeds[0].weight


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 4))
def test_every_query_head_finds_its_kv_head_on_its_rank(num_kv_heads, tp, groups):
    """GQA: query head h reads KV head h // G. Whatever the split, the KV heads a rank holds are exactly those its
    query heads read, and there are max(1, Hkv // tp) of them (replicated when tp > Hkv)."""
    hq = num_kv_heads * groups
    if hq % tp or (tp < num_kv_heads and num_kv_heads % tp) or (tp >= num_kv_heads and tp % num_kv_heads):
        with pytest.raises(ValueError):
            if hq % tp:
                raise ValueError  # the query heads do not split (check_shardable refuses it)
            num_kv_heads_per_rank(num_kv_heads, tp)
        return
    per_q = hq // tp
    holders: dict[int, int] = {}
    for rank in range(tp):
        shard = kv_head_shard(num_kv_heads, tp, rank)
        assert len(shard) == num_kv_heads_per_rank(num_kv_heads, tp) == max(1, num_kv_heads // tp)
        needed = {h // groups for h in range(rank * per_q, (rank + 1) * per_q)}
        assert needed == set(shard)
        for h in shard:
            holders[h] = holders.get(h, 0) + 1
    assert sorted(holders) == list(range(num_kv_heads))
    assert set(holders.values()) == {max(1, tp // num_kv_heads)}


def test_bad_splits_are_refused_before_anything_changes():
    model = tiny_model("llama")  # 4 query heads, 2 KV heads, intermediate 128
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for tp, what in ((3, "num_attention_heads"), (0, "tensor_parallel_size"), (8, "num_attention_heads")):
        with pytest.raises(ValueError, match=what):
            shard_model(model, tp, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_model(model, 2, 2)
    with pytest.raises(ValueError, match=r"rank must be an int in 0\.\.1, got True"):  # a bool is no rank
        kv_head_shard(2, 2, True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    check_shardable(model.config, 4)  # 4 ranks: one query head each, the 2 KV heads replicated twice


def test_shard_describes_one_rank():
    model = shard_model(tiny_model("qwen2"), 2, 1)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (2 * 16, 64) and attn.k_proj.weight.shape == (16, 64)
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None  # Qwen2: q/k/v biases only
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (2, 1, 16)


# ---------------------------------------------------------------------------------------------------------
# Sizing per rank (lesson 5's arithmetic on one rank's shard)
# ---------------------------------------------------------------------------------------------------------
def test_per_rank_pages_llama_70b():
    """8 KV heads: each doubling of tp halves a rank's page until one head per rank."""
    rows = {tp: rank_sizing(LLAMA_3_1_70B, tp, total_memory=80 * GiB, max_model_len=8192) for tp in (1, 2, 4, 8)}
    assert [rows[tp].kv_heads_per_rank for tp in rows] == [8, 4, 2, 1]
    assert [rows[tp].page_bytes for tp in rows] == [2 * 16 * h * 128 * 2 for h in (8, 4, 2, 1)]
    assert not rows[1].fits  # 141 GB of bf16 weights on an 80 GiB GPU
    assert 0 < rows[2].num_blocks < rows[4].num_blocks < rows[8].num_blocks
    assert rows[8].weights_memory < rows[4].weights_memory < rows[2].weights_memory
    # blocks more than double from tp 2 to 4: the page halves AND the weights leave more room
    assert rows[4].num_blocks > 2 * rows[2].num_blocks


def test_two_kv_heads_at_tp4_are_replicated():
    tp2 = rank_sizing(QWEN2_5_1_5B, 2, total_memory=80 * GiB, max_model_len=8192)
    tp4 = rank_sizing(QWEN2_5_1_5B, 4, total_memory=80 * GiB, max_model_len=8192)
    assert (tp2.kv_heads_per_rank, tp4.kv_heads_per_rank) == (1, 1)
    assert (tp2.kv_head_replicas, tp4.kv_head_replicas) == (1, 2)
    assert tp4.page_bytes == tp2.page_bytes  # the page stops shrinking: each head now lives on two ranks
    assert tp4.num_blocks < 1.1 * tp2.num_blocks  # only the freed weight memory helps


def test_mla_latent_is_replicated_on_every_rank():
    pages = {tp: kv_page_bytes_per_rank(DEEPSEEK_V3, tp) for tp in (1, 2, 4, 8)}
    assert set(pages.values()) == {16 * (512 + 64) * 2}  # 18,432 bytes: one 576-wide latent, no K/V pair
    row = rank_sizing(DEEPSEEK_V3, 8, total_memory=141 * 10**9, weights_memory=671 * 10**9 // 8,
                      peak_activation_memory=2 * GiB, max_model_len=8192)
    assert (row.kv_heads_per_rank, row.kv_head_replicas) == (1, 8) and row.fits
    with pytest.raises(ValueError, match="weights_memory"):
        rank_sizing(DEEPSEEK_V3, 8, total_memory=141 * 10**9)


def test_unify_num_blocks_is_the_minimum():
    assert unify_num_blocks([900, 850, 901]) == 850
    for bad in ([], [3, -1], [2.5]):
        with pytest.raises(ValueError):
            unify_num_blocks(bad)


# ---------------------------------------------------------------------------------------------------------
# The engine on 2 worker processes
# ---------------------------------------------------------------------------------------------------------
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def shared_prefix_prompts():
    """16 prompts, half of them sharing a 24-token prefix (prefix-cache hits), up to 84 tokens (chunked at 16)."""
    prefix = make_prompts(1, lo=24, hi=24, seed=9)[0]
    return make_prompts(8, seed=1) + make_prompts(8, seed=2, prefix=prefix)


SCENARIOS = {
    # a small pool (preemption), 16 tokens a step (chunked prefill), prefix caching on
    "recompute": (dict(num_gpu_blocks=24, block_size=8, max_num_batched_tokens=16), "llama", {}),
    # swap preemption, a Qwen2 (q/k/v biases) with ONE KV head (replicated on both ranks) and tied embeddings
    "swap": (dict(num_gpu_blocks=24, block_size=8, max_num_batched_tokens=16, preemption_mode="swap"), "qwen2",
             dict(num_key_value_heads=1, tie_word_embeddings=True)),
}


def scenario_model(arch: str, overrides: dict):
    if not overrides:
        return tiny_model(arch, seed=5)
    import transformers

    from pagedkv.grading.lessons.l07_serving_engine import TINY_CONFIG

    cfg = transformers.Qwen2Config(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(5)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.slow
@pytest.mark.parametrize("label", list(SCENARIOS))
def test_tp2_matches_tp1_and_hf(label):
    kwargs, arch, overrides = SCENARIOS[label]
    model = scenario_model(arch, overrides)
    prompts = shared_prefix_prompts()
    single = LLM(model, **kwargs)
    want = single.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(model, tensor_parallel_size=2, **kwargs) as llm:
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        shapes = llm.executor.kv_cache_shapes
        sched = llm.scheduler
        assert sched.num_preemptions > 0, "the pool was meant to be too small for the batch"
        if label == "swap":
            assert sched.num_swap_outs > 0
        assert sum(o.num_cached_tokens for o in got) > 0, "the shared prefix was meant to hit the prefix cache"
        assert llm.stats["steps"] > sum(map(len, prompts)) / 16  # chunked
        assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == llm.num_gpu_blocks - 1
        heads = max(1, model.config.num_key_value_heads // 2)
        assert shapes == [(24, 8, heads, 16)] * 2  # every rank: the same blocks, its share of the KV heads
        pids = [p.pid for p in llm.executor.procs]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]  # exact, tp 1 vs 2
    assert_matches_hf(got, hf_greedy(model, prompts, max_new=MAX_NEW), f"tp=2 {label}")
    assert not any(_alive(p) for p in pids), "a worker outlived the engine's shutdown"


@pytest.mark.slow
def test_tp2_samples_as_tp1_with_penalties_min_tokens_and_logprobs():
    """Each rank's LM head holds half the vocabulary, the gathered logits all of it: the penalties' counts (built
    as wide as the logits), the min-tokens mask and the logprobs, sample and prompt (each rank gathers the prompt
    rows' logits too), are the one-process engine's. The counts were sized from the rank's own head once:
    IndexError in every worker."""
    model = tiny_model("llama")
    prompts = make_prompts(n=4, seed=3)
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, repetition_penalty=1.3, min_tokens=3,
                             stop_token_ids=list(range(0, 512, 5))),
              SamplingParams(max_tokens=6, temperature=0.8, seed=4, logprobs=1, frequency_penalty=0.5, min_p=0.05,
                             prompt_logprobs=3)] * 2
    want = LLM(model, num_gpu_blocks=60, block_size=8).generate(prompts, params, use_tqdm=False)
    with LLM(model, num_gpu_blocks=60, block_size=8, tensor_parallel_size=2) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [list(r) for r in a.outputs[0].logprobs] == [list(r) for r in b.outputs[0].logprobs]
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
        assert [list(r) if r else r for r in a.prompt_logprobs or []] == [list(r) if r else r
                                                                         for r in b.prompt_logprobs or []]
    assert got[1].prompt_logprobs is not None and len(got[1].prompt_logprobs) == len(prompts[1])


@pytest.mark.slow
def test_pool_is_the_minimum_over_ranks():
    model = tiny_model("llama", seed=5)
    block = 2 * 8 * 1 * 16 * 4 * 2  # 2 (K, V) · 8 tokens · 1 KV head per rank · 16 · fp32 · 2 layers
    with LLM(model, tensor_parallel_size=2, block_size=8, kv_cache_memory_bytes=[100 * block, 60 * block + 5]) as llm:
        assert llm.executor.num_blocks_per_rank == [100, 60]
        # vLLM's CPU defaults grow with the workers (EngineArgs.get_batch_defaults): 256 and 4,096 per rank
        assert (llm.max_num_seqs, llm.max_num_batched_tokens) == (512, 8192)
        assert llm.num_gpu_blocks == 60
        assert [s[0] for s in llm.executor.kv_cache_shapes] == [60, 60]
        assert llm.executor.collective_rpc("kv_cache_shape") == [(60, 8, 1, 16)] * 2
        norm = "model.norm.weight"
        a, b = llm.executor.collective_rpc("check_replicated", (norm,))
        assert a == b == float(model.get_parameter(norm).detach().double().sum())


def test_tp_refuses_a_model_that_does_not_split():
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(tiny_model("llama"), tensor_parallel_size=3, num_gpu_blocks=10)  # refused before any process starts


# ---------------------------------------------------------------------------------------------------------
# No orphans, ever
# ---------------------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


ENGINE = """
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises, even where the tests were started by a
# shell in the background, which ignores SIGINT for its children (Python then never installs its handler)
from pagedkv.engine import LLM, SamplingParams
from pagedkv.grading.lessons.l07_serving_engine import tiny_llama
"""


def _run(script: str, tmp_path, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(ENGINE) + textwrap.dedent(script))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                          cwd=tmp_path, **popen)


def _pids(out: str) -> list[int]:
    line = next(ln for ln in out.splitlines() if ln.startswith("PIDS "))
    return [int(p) for p in line.split()[1:]]


@pytest.mark.slow
def test_no_orphan_after_a_failing_test(tmp_path):
    """A test that fails while its engine is alive: pytest reports it and exits; the workers go with it."""
    (tmp_path / "test_fails.py").write_text(textwrap.dedent(ENGINE) + textwrap.dedent("""
        def test_fails():
            llm = LLM(tiny_llama(), tensor_parallel_size=2, num_gpu_blocks=16, block_size=8)
            print("PIDS", *[p.pid for p in llm.executor.procs], flush=True)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
            assert False, "this test fails on purpose"
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-s", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(tmp_path / "test_fails.py")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 1 and "this test fails on purpose" in proc.stdout, proc.stdout + proc.stderr
    assert _wait_gone(_pids(proc.stdout)) == []


@pytest.mark.slow
def test_no_orphan_when_the_engine_process_is_killed(tmp_path):
    """SIGKILL runs no cleanup at all: the workers see their death pipe close and exit."""
    proc = _run("""
        print("SCRIPT BODY", flush=True)  # the script has no __main__ guard: the fork server must not re-run it
        llm = LLM(tiny_llama(), tensor_parallel_size=2, num_gpu_blocks=16, block_size=8)
        print("PIDS", *[p.pid for p in llm.executor.procs], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """, tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.count("SCRIPT BODY") == 1, proc.stdout
    assert _wait_gone(_pids(proc.stdout)) == []


@pytest.mark.slow
def test_ctrl_c_and_a_dead_worker(tmp_path):
    """Ctrl-C sent to the whole process group (as Jupyter's interrupt does) interrupts the engine, not its workers;
    the engine stays usable and exact. Then a worker is killed: the next step raises, and no worker is left."""
    proc = _run("""
        from pagedkv.engine.multiproc_executor import WorkerError
        llm = LLM(tiny_llama(), tensor_parallel_size=2, num_gpu_blocks=64, block_size=8)
        pids = [p.pid for p in llm.executor.procs]
        print("PIDS", *pids, flush=True)
        prompts = [[1 + i, 2, 3, 4] for i in range(8)]
        params = SamplingParams(max_tokens=40, temperature=0.0)
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        interrupted = 0
        for attempt in range(50):
            import threading
            threading.Timer(0.05 + 0.01 * attempt, os.killpg, (0, signal.SIGINT)).start()
            try:
                while True:
                    llm.generate(prompts, params, use_tqdm=False)
            except KeyboardInterrupt:
                interrupted += 1
                if interrupted == 3:
                    break
        assert interrupted == 3 and all(p.is_alive() for p in llm.executor.procs)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == want, "tokens changed after a Ctrl-C"
        print("CTRL-C OK", flush=True)
        os.kill(pids[1], signal.SIGKILL)
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except WorkerError as e:
            print("RAISED", str(e).splitlines()[0], flush=True)
        assert not any(p.is_alive() for p in llm.executor.procs)
        print("DONE", flush=True)
    """, tmp_path, start_new_session=True)
    assert "CTRL-C OK" in proc.stdout and "RAISED worker rank 1" in proc.stdout and "DONE" in proc.stdout, \
        proc.stdout + proc.stderr
    assert _wait_gone(_pids(proc.stdout)) == []


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
def test_ctrl_c_while_a_reply_is_read_leaves_the_pipe_at_a_message_boundary(tmp_path):
    """A Ctrl-C that lands while the engine reads a worker's reply (the reply's first bytes have arrived, the
    rest is on its way) is raised only once the whole reply is read: the next request's reply is read intact.
    Otherwise the rest of the interrupted reply would be read as the next message's length, and the read would
    block (``test_ctrl_c_and_a_dead_worker`` hangs so when one of its interrupts falls there)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, os, pickle, signal, struct, threading, time
        from pagedkv.engine.multiproc_executor import MultiprocExecutor

        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in ENGINE

        class Proc:  # a worker that never ends: its sentinel never becomes ready
            def __init__(self):
                self.sentinel, self._w = os.pipe()
                self.pid, self.exitcode = 0, None

        reader, writer = mp.Pipe(duplex=False)
        exe = object.__new__(MultiprocExecutor)  # one rank whose replies this script writes itself
        exe.world_size, exe.conns, exe.procs, exe.dead = 1, [reader], [Proc()], None
        exe._awaited, exe._stash = {5, 6}, {}
        first = pickle.dumps((5, "ok", "x" * 200_000))
        data = struct.pack("!i", len(first)) + first  # multiprocessing.connection's framing: length, then bytes

        def write(part):
            while part:
                part = part[os.write(writer.fileno(), part):]

        def send():  # the reply's first 1000 bytes, Ctrl-C while the engine waits for the rest, the rest, the next
            write(memoryview(data)[:1000])
            time.sleep(0.3)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            time.sleep(0.2)
            write(memoryview(data)[1000:])
            writer.send_bytes(pickle.dumps((6, "ok", "the next reply")))

        threading.Thread(target=send, daemon=True).start()
        try:
            exe._gather(5)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        signal.alarm(10)  # a desynchronised pipe would block this read (or fail to unpickle it)
        print("NEXT", exe._gather(6), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "INTERRUPTED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "NEXT ['the next reply']" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.slow
def test_a_worker_error_stops_every_worker():
    """A rank that raises while the other waits in a collective: the engine stops both and raises its traceback."""
    from pagedkv.engine.multiproc_executor import WorkerError
    from pagedkv.scheduler import Scheduler  # noqa: F401  (the output below comes from the real scheduler)

    llm = LLM(tiny_model("llama"), tensor_parallel_size=2, num_gpu_blocks=16, block_size=8)
    try:
        llm.scheduler.add_request(__import__("pagedkv").Request("x", [1, 2, 3], 2))
        so = llm.scheduler.schedule()
        with pytest.raises(WorkerError, match="rank 1"):
            llm.executor.collective_rpc("execute_model", per_rank_args=[(so,), (None,)])  # rank 1 raises
        assert _wait_gone([p.pid for p in llm.executor.procs], timeout=15) == []
        with pytest.raises(WorkerError, match="create a new LLM"):
            llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is used on Linux (elsewhere: spawn)")
def test_workers_come_from_one_fork_server():
    """Every worker is forked from multiprocessing's fork server (which imported torch and transformers once),
    never from the engine's own process, and one fork server serves every engine of the process."""
    parents = []
    for _ in range(2):
        with LLM(tiny_model("llama"), tensor_parallel_size=2, num_gpu_blocks=16, block_size=8) as llm:
            parents += [_ppid(p.pid) for p in llm.executor.procs]
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(set(parents)) == 1 and os.getpid() not in parents, (os.getpid(), parents)
