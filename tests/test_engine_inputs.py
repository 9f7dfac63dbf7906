"""What ``LLM.generate`` accepts and refuses: every parameter checked when it is called, a failed call leaves the
engine as it was (no request left queued, no block held), and prompts of numpy integers are token ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.engine import LLM, SamplingParams
from pagedkv.grading.lessons.l07_serving_engine import tiny_llama

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPT = [5, 17, 42, 8, 99, 3]


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(tiny_llama(), num_gpu_blocks=40, block_size=8, max_model_len=64)


def engine_state(llm: LLM) -> tuple[int, int, int, list[str]]:
    """What a failed generate must leave unchanged: free blocks, waiting and running requests, request ids."""
    s = llm.scheduler
    return (s.kv_cache_manager.block_pool.get_num_free_blocks(), len(s.waiting), len(s.running), sorted(s.requests))


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, r"n must be at least 1, got 0\."),
    ("n", 2.0, "n must be an int, got 2.0"),
    ("temperature", float("inf"), r"temperature must be a finite number, got inf\."),
    ("temperature", 2.5, r"temperature must be in \[0, 2\], got 2\.5\."),
    ("top_k", -2, r"top_k must be 0 \(disable\), or at least 1, got -2\."),
    ("max_tokens", 0, r"max_tokens must be at least 1, got 0\."),
    ("max_tokens", -3, "max_tokens must be"),
    ("temperature", 7.0, "temperature must be"),
    ("top_k", -5, "top_k must be"),
    ("top_p", 0.0, "top_p must be"),
    ("seed", 2**70, "seed must be"),
    ("stop_token_ids", [1, -2], "stop_token_ids"),
    ("n", 2, "n must be 1 when using greedy sampling, got 2"),
    ("n", 16385, "n must be at most 16384, got 16385"),
])
def test_a_field_changed_after_construction_is_checked_by_generate(llm, field, value, message):
    """``sp.n = 0`` used to return no completions and leave request '0' queued holding blocks; the next generate
    raised ``KeyError: '0'``."""
    before = engine_state(llm)
    expected = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert engine_state(llm) == before
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, sp, use_tqdm=False)
    assert engine_state(llm) == before
    assert getattr(sp, field) == value  # the caller's object is not touched
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_changing_params_after_generate_changes_nothing_queued(llm):
    """The engine keeps checked copies: the object the caller passed is never read again."""
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    out = llm.generate([PROMPT, PROMPT[:3]], sp, use_tqdm=False)
    sp.max_tokens = 1
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]


def test_a_generate_that_fails_midway_leaves_the_engine_as_it_was(llm, monkeypatch):
    before = engine_state(llm)
    calls = {"n": 0}
    real_step = llm.engine_core.step_fn

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:  # with async scheduling, a step is in flight here: the abort drains it
            raise RuntimeError("interrupted")
        return real_step()

    monkeypatch.setattr(llm.engine_core, "step_fn", failing_step)
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.generate([PROMPT, PROMPT[::-1]], SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=2),
                     use_tqdm=False)
    monkeypatch.undo()
    assert engine_state(llm) == before


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 0.0, "n": 2}, "n must be 1 when using greedy sampling, got 2."),
    ({"n": 16385}, "n must be at most 16384, got 16385."),
])
def test_vllm_refuses_greedy_n_and_too_many_sequences(kwargs, message):
    """vLLM 0.26 refuses ``n > 1`` with temperature 0 (``SamplingParams._verify_greedy_sampling``) and ``n`` above
    ``VLLM_MAX_N_SEQUENCES`` = 16384 (``_verify_args``), with these messages; the lab ran both (``n=20000`` over
    HTTP ran 20,000 requests on a 64-block pool). At the largest ``n`` and any positive temperature it accepts."""
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        SamplingParams(**kwargs)
    assert SamplingParams(n=16384, temperature=0.5).n == 16384
    assert SamplingParams(n=1, temperature=0.0).is_greedy


@pytest.mark.parametrize("seed, n", [(2**70, 1), (2**64 - 1, 2), (2**64, 1), (-(2**63) - 1, 1)])
def test_a_seed_outside_torchs_range_is_refused_at_construction(seed, n):
    """``SamplingParams(seed=2**70)`` used to fail later inside torch ("Overflow when unpacking long long")."""
    with pytest.raises(ValueError, match=r"seed must be an int in -9223372036854775808\.\.\d+") as err:
        SamplingParams(seed=seed, n=n)
    assert str(2**64 - n) in str(err.value) and "seed + i" in str(err.value)


def test_seeds_at_the_ends_of_the_range_generate(llm):
    for seed, n in [(2**64 - 2, 2), (-(2**63), 1), (0, 3)]:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=2, seed=seed, n=n), use_tqdm=False)
        assert len(out[0].outputs) == n


@pytest.mark.parametrize("prompt", [
    [np.int64(t) for t in PROMPT],
    [np.int32(t) for t in PROMPT],
    np.array(PROMPT, dtype=np.int64),
    {"prompt_token_ids": [np.int16(t) for t in PROMPT]},
])
def test_prompts_of_numpy_integers_are_token_ids(llm, prompt):
    expected = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    got = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert len(got) == 1 and got[0].outputs[0].token_ids == expected.outputs[0].token_ids
    assert got[0].prompt_token_ids == PROMPT and all(type(t) is int for t in got[0].prompt_token_ids)
    batch = llm.generate([prompt, PROMPT], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [expected.outputs[0].token_ids] * 2


@pytest.mark.parametrize("prompts, where", [
    ([5, True, 7], r"prompt 0: element 1 is True \(bool\)"),
    ([[5, 6], [7, np.bool_(False), 9]], r"prompt 1: element 1 is .*False"),
    ([5, 6.0, 7], r"prompt 0: element 1 is 6\.0 \(float\)"),
    ([5, 6, "7"], r"prompt 0: element 2 is '7' \(str\)"),
    ({"prompt_token_ids": [1, 2, None]}, r"prompt 0: element 2 is None"),
])
def test_a_bad_token_is_named_by_its_position(llm, prompts, where):
    before = engine_state(llm)
    with pytest.raises(ValueError, match=where):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert engine_state(llm) == before


def test_the_engines_integer_arguments_take_numpy_ints_and_refuse_bools():
    """``LLM`` checks its integer arguments with the lab's one predicate (``pagedkv.utils.is_int``): a numpy int
    (what a sweep over ``np.arange`` passes) is an int and is stored as one; a bool is refused, before any work
    (``tensor_parallel_size=True`` used to equal 1 and start an engine)."""
    model = tiny_llama()
    llm = LLM(model, num_gpu_blocks=np.int64(40), block_size=np.int32(8), max_model_len=np.int64(64),
              max_num_seqs=np.uint8(4), seed=np.int64(0), tensor_parallel_size=np.int64(1))
    assert [type(v) for v in (llm.num_gpu_blocks, llm.block_size, llm.max_model_len, llm.max_num_seqs)] == [int] * 4
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for name, value, message in [("num_gpu_blocks", True, r"num_gpu_blocks must be an int >= 2 \(block 0"),
                                 ("block_size", True, r"block_size must be an int >= 1, got True"),
                                 ("max_model_len", np.bool_(True), r"max_model_len must be an int in 2\.\.\d+"),
                                 ("max_num_seqs", 2.0, r"max_num_seqs must be an int >= 1, got 2\.0"),
                                 ("tensor_parallel_size", True, r"tensor_parallel_size must be an int >= 1, got True")]:
        with pytest.raises(ValueError, match=message):
            LLM(model, **{"num_gpu_blocks": 40, "block_size": 8, "max_model_len": 64, name: value})


def test_stop_strings_in_generate_as_vllm():
    """``SamplingParams(stop=...)`` and ``include_stop_str_in_output`` are vLLM's (``vllm/sampling_params.py``);
    the lab's ``SamplingParams`` had neither (``TypeError``), so ``LLM.generate`` could not stop on text. Now a
    completion that shows a stop string finishes ``"stop"`` with the string as ``stop_reason``, its text cut
    before the string (or after it), its tokens up to the one that completed it, and the engine is left idle."""
    from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    llm = LLM(tiny_model(0), tokenizer=tok, num_gpu_blocks=40, block_size=8, max_model_len=64)
    before = engine_state(llm)
    greedy = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0]
    stop = greedy.text[4:7]
    for include in (False, True):
        sp = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], include_stop_str_in_output=include)
        out = llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0]
        end = greedy.text.index(stop) + (len(stop) if include else 0)
        assert (out.text, out.finish_reason, out.stop_reason) == (greedy.text[:end], "stop", stop)
        n = len(out.token_ids)
        assert out.token_ids == greedy.token_ids[:n] and n < 12
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
        assert engine_state(llm) == before
    both = llm.generate(["Hello", "Hello"], [SamplingParams(max_tokens=12, temperature=0.0, stop=stop),
                                             SamplingParams(max_tokens=12, temperature=0.0)], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in both] == ["stop", "length"]
    assert both[1].outputs[0].token_ids == greedy.token_ids
    for bad, message in (([""], "stop cannot contain an empty string"), ([3], "stop must be a string")):
        with pytest.raises(ValueError, match=message):
            SamplingParams(stop=bad)


def test_stop_strings_need_a_tokenizer(llm):
    before = engine_state(llm)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, stop="x"), use_tqdm=False)
    assert engine_state(llm) == before


def test_max_tokens_none_generates_up_to_max_model_len(llm):
    """vLLM 0.26's ``SamplingParams(max_tokens=None)`` means "until ``max_model_len``" (``InputProcessor.
    process_inputs`` sets ``max_model_len - prompt_len``); the lab refused ``None``."""
    before = engine_state(llm)
    out = llm.generate([PROMPT, PROMPT[:2]], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [64 - len(PROMPT), 62]
    assert {o.outputs[0].finish_reason for o in out} == {"length"}
    assert engine_state(llm) == before


@pytest.mark.parametrize("length, message", [
    (64, r"prompt 1: The decoder prompt \(length 64\) plus the number of requested output tokens \(at least 1\) is "
         r"longer than the maximum model length of 64\. Make sure that `max_model_len` is no smaller than the number "
         r"of text tokens \(prompt \+ requested output tokens\)\."),
    (65, r"prompt 1: The decoder prompt \(length 65\) is longer than the maximum model length of 64\. Make sure that "
         r"`max_model_len` is no smaller than the number of text tokens\."),
])
def test_a_prompt_with_no_room_is_refused_in_vllms_words(llm, length, message):
    """vLLM 0.26 refuses a prompt as long as ``max_model_len`` (no room for one new token) or longer, with two
    messages of its own (``InputProcessor._validate_prompt_len``); one shorter by one generates one token."""
    before = engine_state(llm)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, [1] * length], GREEDY, use_tqdm=False)
    assert engine_state(llm) == before
    out = llm.generate([[1] * 63], GREEDY, use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (1, "length")


def test_a_stop_tokens_text_is_not_in_the_output():
    """vLLM 0.26's detokenizer skips the text of the token that stopped a request (a stop token id or EOS) unless
    ``include_stop_str_in_output`` (``IncrementalDetokenizer.update(..., stop_terminated)``); its id stays in
    ``token_ids``. The lab's text ended with the stop token's text."""
    from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    llm = LLM(tiny_model(0), tokenizer=tok, num_gpu_blocks=40, block_size=8, max_model_len=64)
    ids = llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0].outputs[0].token_ids
    for include in (False, True):
        sp = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[ids[3]], include_stop_str_in_output=include)
        out = llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (ids[:4], "stop", ids[3])
        assert out.text == tok.decode(ids[:4] if include else ids[:3], skip_special_tokens=True)
    # vLLM's output fields a caller reads are there (the lab computes no logprobs: None, as vLLM without them)
    result = llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert (result.prompt_logprobs, result.outputs[0].logprobs, result.outputs[0].cumulative_logprob) == (None,) * 3


@pytest.mark.parametrize("include, held", [(False, 3), (True, 0)])
def test_stream_holds_back_a_possible_stop_string_only_when_it_would_be_cut(include, held):
    """A streamed completion holds back ``max(len(stop)) - 1`` characters (they might begin a stop string that
    would be cut away), as vLLM's ``output_text_buffer_length``; with ``include_stop_str_in_output`` vLLM holds
    back nothing (the cut falls after the string), and the lab held back all the same."""
    from pagedkv.engine.output_processor import RequestState
    from pagedkv.entrypoints.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok("PagedAttention stores the keys")["input_ids"]
    state = RequestState("r", 0, [1], SamplingParams(), ["zzzz"], include, tok)
    shown = "".join(state.add_tokens([t], None, None, 0.0).text for t in ids)
    text = tok.decode(ids, skip_special_tokens=True)
    assert shown == text[:len(text) - held]


def test_reset_prefix_cache_as_vllms_llm(llm):
    """``LLM.reset_prefix_cache`` (vLLM 0.26's; the lab's LLM had none): the cached prefix of one call is found by
    the next, and is gone after a reset; the tokens do not change. A bad argument changes nothing."""
    prompt = [PROMPT * 5]  # 30 tokens: three full blocks of 8
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 24
    with pytest.raises(ValueError, match="reset_running_requests must be a bool"):
        llm.reset_prefix_cache("yes")
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 24
    assert llm.reset_prefix_cache() is True
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def _generate_watching_the_order(llm: LLM, prompts, priority) -> tuple[list[str], list]:
    """``llm.generate(prompts, GREEDY, priority=priority)``'s outputs, and the request ids in the order the
    scheduler first gave each of them tokens."""
    order: list[str] = []
    schedule = llm.scheduler.schedule

    def spy(*args, **kwargs):
        out = schedule(*args, **kwargs)
        order.extend(rid for rid in out.num_scheduled_tokens if rid not in order)
        return out

    llm.scheduler.schedule = spy
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=priority)
    finally:
        del llm.scheduler.schedule
    return order, outs


def test_priority_scheduling_through_the_llm_as_vllms():
    """``LLM(scheduling_policy="priority")`` and ``generate(..., priority=[...])`` (vLLM 0.26's; the lab's LLM had
    neither, only the scheduler of lesson 4): one request at a time, the lowest priority value first; under
    ``"fcfs"`` the priorities are ignored, as in vLLM. Bad priorities are refused, nothing queued."""
    prompts = [[1, 2, 3, i + 4] for i in range(3)]
    for policy, want in (("priority", ["1", "2", "0"]), ("fcfs", ["0", "1", "2"])):
        llm = LLM(tiny_llama(), num_gpu_blocks=40, block_size=8, max_num_seqs=1, scheduling_policy=policy)
        order, outs = _generate_watching_the_order(llm, prompts, [2, 0, 1])
        assert order == want, (policy, order)
        assert [o.request_id for o in outs] == ["0", "1", "2"]  # the outputs stay in prompt order
        alone = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]
        assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    before = engine_state(llm)
    for bad, message in (([0, 1], r"The lengths of prompts \(3\) and priority \(2\) must be the same\."),
                         ([0, True, 1], r"priority\[1\] must be an int, got True"), ("012", "priority must be a list")):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, GREEDY, use_tqdm=False, priority=bad)
    assert engine_state(llm) == before
    with pytest.raises(ValueError, match="scheduling_policy must be 'fcfs' or 'priority', got 'lifo'"):
        LLM(tiny_llama(), num_gpu_blocks=40, block_size=8, scheduling_policy="lifo")


@pytest.mark.parametrize("params, message", [
    ([GREEDY], r"The lengths of prompts \(2\) and params \(1\) must be the same\."),
    ([GREEDY, {"temperature": 0}], r"sampling_params\[1\] must be a SamplingParams, got dict"),
    (0.5, "sampling_params must be a SamplingParams or a list of them, one per prompt; got float"),
])
def test_sampling_params_of_the_wrong_kind_or_count_are_refused(llm, params, message):
    """A list of the wrong length in vLLM's words (``_params_to_seq``); a float was a TypeError from ``list()``."""
    before = engine_state(llm)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert engine_state(llm) == before


def test_use_tqdm_takes_a_function_that_makes_the_bar_as_vllms(llm):
    """vLLM's ``use_tqdm`` is a bool or a callable that makes the bar (``functools.partial(tqdm, leave=False)``);
    the lab took a bool only. Anything else is refused, nothing queued."""
    made = []

    def make_bar(**kwargs):
        from tqdm import tqdm

        made.append(kwargs)
        return tqdm(disable=True, **kwargs)

    out = llm.generate([PROMPT, PROMPT[:3]], GREEDY, use_tqdm=make_bar)
    assert len(out) == 2 and made == [{"total": 2, "desc": "Processed prompts", "dynamic_ncols": True}]
    before = engine_state(llm)
    with pytest.raises(ValueError, match="use_tqdm must be a bool or a function"):
        llm.generate([PROMPT], GREEDY, use_tqdm="yes")
    assert engine_state(llm) == before
