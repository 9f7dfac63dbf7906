"""A third adversarial pass over the public API: each test pins one bug found there (it failed before its fix).

- ``pagedkv serve --port 70000`` (or a port in use, or an unknown host) loaded the model and then died with a
  traceback and status 1; vLLM binds the port before the engine is set up (``setup_server``). Now the port is
  bound first and a failure is one line and status 2. ``--port-file`` in a missing folder crashed the running
  server once it answered; now it is refused up front;
- ``LLM(kv_cache_memory_bytes=-1)`` (``--kv-cache-memory-bytes -1``) silently gave a 2-block pool, a float
  budget was silently ignored (the pool was profiled instead), and a budget too small for one ``max_model_len``
  request started anyway; vLLM 0.26 refuses both (``check_enough_kv_cache_memory``);
- ``parse_metrics`` dropped every metric whose name holds a digit (``vllm:e2e_request_latency_seconds_*``), every
  unlabelled sample and every ``+Inf`` value;
- ``poisson_arrivals(0, rate)`` raised ``IndexError``; a rate of 0 divided by zero, ``nan`` gave NaN arrival
  times and ``-inf`` a burst; ``sharegpt_like_requests`` failed with "math domain error" / "low >= high" on a bad
  ``max_model_len``, ``scale`` or ``vocab_size``;
- ``AsyncLLM.generate`` before ``start()`` raised ``AssertionError`` after queueing the request (vLLM starts its
  loop on first use); after ``shutdown()`` it queued the request and waited forever; ``abort("id")`` read the id
  as its characters and aborted nothing (vLLM takes ``str | Iterable[str]``).
"""

from __future__ import annotations

import asyncio
import math
import socket

import pytest

from pagedkv.benchmarks.serve import parse_metrics, poisson_arrivals, sharegpt_like_requests
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints import api_server
from pagedkv.entrypoints.cli_args import make_arg_parser
from pagedkv.entrypoints.tiny import tiny_model


def _no_engine(args):
    raise AssertionError("the engine was built before the port was checked")


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_refuses_a_port_out_of_range_before_loading_the_model(monkeypatch, capsys, port):
    monkeypatch.setattr(api_server, "build_engine", _no_engine)
    assert api_server.run_server(make_arg_parser().parse_args(["tiny", "--port", port])) == 2
    err = capsys.readouterr().err
    assert "pagedkv serve: cannot listen on 127.0.0.1:" in err and "Traceback" not in err


def test_serve_refuses_a_port_in_use_with_status_2(monkeypatch, capsys):
    monkeypatch.setattr(api_server, "build_engine", _no_engine)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert api_server.run_server(make_arg_parser().parse_args(["tiny", "--port", str(port)])) == 2
    assert "Address already in use" in capsys.readouterr().err


def test_serve_refuses_a_port_file_in_a_missing_folder_up_front(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(api_server, "build_engine", _no_engine)
    args = make_arg_parser().parse_args(["tiny", "--port", "0", "--port-file", str(tmp_path / "no" / "port")])
    assert api_server.run_server(args) == 2
    assert "--port-file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


@pytest.mark.parametrize(("budget", "match"), [
    (-1, "No available memory for the cache blocks"),
    (100, r"To serve at least one request with the model's max seq len \(128\)"),
    (1.5e9, "kv_cache_memory_bytes must be an int"),
    ("1000000", "kv_cache_memory_bytes must be an int"),
])
def test_kv_cache_memory_bytes_that_cannot_hold_one_request_is_refused(model, budget, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, max_model_len=128, kv_cache_memory_bytes=budget)


def test_kv_cache_memory_bytes_still_sizes_the_pool(model):
    llm = LLM(model, max_model_len=128, kv_cache_memory_bytes=2**20)
    assert llm.num_gpu_blocks == 2**20 // llm._block_bytes()
    assert LLM(model, max_model_len=128, kv_cache_memory_bytes=100, num_gpu_blocks=10).num_gpu_blocks == 10


def test_parse_metrics_keeps_names_with_digits_unlabelled_samples_and_infinities():
    page = "\n".join([
        "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.",
        'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="tiny"} 3.0',
        'vllm:e2e_request_latency_seconds_count{model_name="tiny"} 3.0',
        'vllm:e2e_request_latency_seconds_sum{model_name="tiny"} 1.5',
        'vllm:request_success_total{finished_reason="length",model_name="tiny"} 2.0',
        'vllm:request_success_total{finished_reason="stop",model_name="tiny"} 1.0',
        "vllm:num_requests_running 4",
        'vllm:some_gauge{model_name="tiny"} +Inf',
        'vllm:with_timestamp{model_name="tiny"} 7 1712345678000',
    ])
    m = parse_metrics(page)
    assert m["vllm:e2e_request_latency_seconds_count"] == 3.0
    assert m["vllm:e2e_request_latency_seconds_sum"] == 1.5
    assert "vllm:e2e_request_latency_seconds_bucket" not in m
    assert m["vllm:request_success_total"] == 3.0
    assert m["vllm:num_requests_running"] == 4.0
    assert m["vllm:some_gauge"] == math.inf
    assert m["vllm:with_timestamp"] == 7.0


def test_poisson_arrivals_of_no_requests_and_bad_rates():
    assert poisson_arrivals(0, 2.0) == [] == poisson_arrivals(0, math.inf)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    assert len(poisson_arrivals(3, 2)) == 3
    for rate in (0, -1.0, math.nan, -math.inf, "2", True):
        with pytest.raises(ValueError, match="rate must be"):
            poisson_arrivals(3, rate)
    with pytest.raises(ValueError, match="n must be"):
        poisson_arrivals(-1, math.inf)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(n=-1), "n must be"),
    (dict(max_model_len=0), "max_model_len must be"),
    (dict(max_model_len=1), "max_model_len must be"),
    (dict(vocab_size=1), "vocab_size must be"),
    (dict(scale=0), "scale must be"),
    (dict(scale=math.nan), "scale must be"),
])
def test_sharegpt_like_requests_refuses_bad_figures_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sharegpt_like_requests(**{"n": 3, "max_model_len": 64, "vocab_size": 100, **kwargs})


def test_sharegpt_like_requests_at_the_smallest_sizes_still_fit():
    for mml in (2, 3, 8):
        reqs = sharegpt_like_requests(5, mml, 2)
        assert all(len(r.prompt_token_ids) >= 1 and r.output_len >= 1 for r in reqs)
        assert all(len(r.prompt_token_ids) + r.output_len <= mml for r in reqs)
    assert sharegpt_like_requests(0, 64, 100) == []


@pytest.fixture(scope="module")
def small_llm(model):
    return LLM(model, num_gpu_blocks=40, block_size=8, max_model_len=64)


PROMPT = [5, 17, 42, 8, 99, 3]


def _state(llm, engine):
    s = llm.scheduler
    return (s.kv_cache_manager.block_pool.get_num_free_blocks(), len(s.waiting), len(s.running), sorted(s.requests),
            dict(engine._states), dict(engine._queues), list(engine._pending))


def test_async_llm_starts_its_loop_on_first_generate_and_refuses_after_shutdown(small_llm):
    from pagedkv.engine.async_llm import AsyncLLM, EngineDeadError

    engine = AsyncLLM(small_llm, "tiny")
    sp = SamplingParams(max_tokens=4, temperature=0.0)

    async def tokens():
        return [t for d in [d async for d in engine.generate(PROMPT, sp)] for t in d.token_ids]

    async def main():
        before = _state(small_llm, engine)
        got = await tokens()  # no start(): vLLM's generate starts the output handler itself
        assert len(got) == 4 and _state(small_llm, engine) == before
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await tokens()
        assert _state(small_llm, engine) == before  # nothing queued, nothing waiting forever

    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_llm_abort_takes_one_id_as_a_string(small_llm):
    from pagedkv.engine.async_llm import AsyncLLM

    engine = AsyncLLM(small_llm, "tiny")

    async def main():
        await engine.start()
        try:
            before = _state(small_llm, engine)
            gen = engine.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0), "one")
            await gen.__anext__()
            (rid,) = engine._states
            engine.abort(rid)  # one id: not its characters
            assert engine._states == {}
            await gen.aclose()
            await engine.call_between_steps(lambda: None)  # the abort reached the engine
            assert _state(small_llm, engine) == before  # its blocks are back in the pool
        finally:
            await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize(("call", "match"), [
    (lambda: _pc().time_lookup("sha256", block_size=0), "block_size must be an int >= 1"),  # was ZeroDivisionError
    (lambda: _pc().time_lookup("sha256", prompt_tokens=16.0), "prompt_tokens must be an int >= 17"),
    # was a bare KeyError
    (lambda: _pc().time_hashing("md5"), r"unknown hash function 'md5'; use one of \['builtin', 'sha256'\]"),
    (lambda: _pc().time_hashing("sha256", block_size=0), "block_size must be an int >= 1"),
    (lambda: _bp().measure_series("alloc", "x", [8], round_time=float("nan")), "round_time must be a finite"),
    (lambda: _bp().measure_series("alloc", "x", [8], round_time="a"), "round_time must be a finite"),
])  # fmt: skip
def test_the_cache_benchmarks_name_a_bad_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _pc():
    from pagedkv.benchmarks import prefix_cache

    return prefix_cache


def _bp():
    from pagedkv.benchmarks import block_pool

    return block_pool


def test_a_figure_left_out_is_fitted_to_the_other_as_vllm_does(model):
    """vLLM 0.26's ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``: a defaulted max_num_seqs is at
    most the token budget, a defaulted budget at most max_num_seqs whole sequences; both given with a budget below
    the sequences is ``SchedulerConfig``'s error. The lab kept 256 sequences beside a budget of 8."""
    small = LLM(model, num_gpu_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    assert (small.max_num_batched_tokens, small.max_num_seqs) == (8, 8)
    few = LLM(model, num_gpu_blocks=16, block_size=4, max_model_len=64, max_num_seqs=2)
    assert (few.max_num_batched_tokens, few.max_num_seqs) == (128, 2)  # min(2 x 64, 4,096)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be greater than or equal to "
                                         r"max_num_seqs \(16\)"):
        LLM(model, num_gpu_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=16)


def test_helpers_name_what_they_were_given():
    """``parse_metrics(None)`` failed on ``.splitlines``, ``aggregate([{}])`` with ``KeyError: 'mode'``,
    ``unify_num_blocks(None)`` with "'NoneType' object is not iterable"."""
    from pagedkv.benchmarks.serve import aggregate
    from pagedkv.sizing.parallel import unify_num_blocks

    with pytest.raises(TypeError, match=r"text of a /metrics page \(a str\), got NoneType"):
        parse_metrics(None)
    with pytest.raises(ValueError, match="run 1 is not a benchmark run .*no mode, request_rate, errors, timeseries"):
        aggregate([{"mode": "paged", "request_rate": 1.0, "errors": [], "timeseries": []}, {}])
    with pytest.raises(ValueError, match=r"run 0 .*no errors, timeseries"):
        aggregate([{"mode": "paged", "request_rate": 1.0}])
    assert aggregate([]) == []
    for bad in (None, 5, "12"):
        with pytest.raises(ValueError, match="give each rank's block count"):
            unify_num_blocks(bad)
    assert unify_num_blocks((3, 2)) == 2
