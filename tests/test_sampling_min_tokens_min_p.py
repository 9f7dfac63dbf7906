"""``min_tokens`` and ``min_p``, as vLLM 0.26 (``vllm/sampling_params.py``; Model Runner V2's sampler:
``vllm/v1/worker/gpu/sample/logit_bias.py`` masks the stop tokens, ``min_p.py`` cuts after the temperature;
``check_stop`` in ``vllm/v1/core/sched/utils.py`` and the detokenizer's ``stop_check_offset`` wait for them).

Greedy ``min_tokens`` is checked token for token against transformers' ``min_new_tokens``, under chunked prefill,
recompute preemption and both schedulers; ``min_p`` against the sampling rule itself.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import MAX_NEW, VOCAB, make_prompts, one_thread  # noqa: F401 (one_thread: autouse)

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.output_processor import RequestState
from pagedkv.engine.sampler import Sampler, make_generator

MIN = 4  # min_tokens in the identity tests


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=8, seed=3)


def _stop_after(tokens: list[int], stop: set[int], min_tokens: int) -> list[int]:
    """HF's tokens up to the first of ``stop`` among the tokens after the first ``min_tokens`` (its padding cut)."""
    for j in range(min_tokens, len(tokens)):
        if tokens[j] in stop:
            return tokens[: j + 1]
    return tokens


def _hf(model, prompt: list[int], stop: set[int], min_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, min_new_tokens=min_new,
                         eos_token_id=sorted(stop), pad_token_id=min(stop), do_sample=False)
    return _stop_after(out[0, len(prompt):].tolist(), stop, min_new)


def _stop_set(residue: int) -> set[int]:
    """A fifth of the vocabulary (102 ids: vLLM's runner masks at most 128 stop ids for ``min_tokens``), so that
    a stop token comes soon in ten random-model tokens."""
    return {t for t in range(VOCAB) if t % 5 == residue}


# ---------------------------------------------------------------------------------------------------------
# The parameters
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(max_tokens=3, min_tokens=4), "min_tokens must be less than or equal to max_tokens=3, got 4."),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5."),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1."),
    (dict(min_p="0.1"), "min_p"),
])
def test_bad_values_refused_in_vllms_words(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_field_set_after_construction_is_checked_and_changes_nothing(llama, prompts):
    llm = LLM(llama, num_gpu_blocks=60, block_size=8)
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    sp.min_tokens = 5
    with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens=4, got 5."):
        llm.generate(prompts[0], sp, use_tqdm=False)
    assert not llm.engine_core.requests and llm.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 59
    assert llm.generate(prompts[0], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)[0].outputs


def test_greedy_resets_min_p_and_the_engine_adds_its_eos_ids():
    assert SamplingParams(temperature=0.0, min_p=0.5).min_p == 0.0  # as top_k and top_p
    sp = SamplingParams(stop_token_ids=[7], min_tokens=2)
    assert sp.all_stop_token_ids == {7}
    sp.update_from_generation_config({"eos_token_id": [3, 9]}, 2)
    assert sp.all_stop_token_ids == {2, 3, 7, 9}
    sp.update_from_generation_config({"eos_token_id": 4})
    assert sp.all_stop_token_ids == {2, 3, 4, 7, 9} and sp.stop_token_ids == [7]


# ---------------------------------------------------------------------------------------------------------
# min_tokens: token-identical to transformers' min_new_tokens
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(num_gpu_blocks=200, block_size=8),
    dict(num_gpu_blocks=200, block_size=8, max_num_batched_tokens=16),  # chunked prefill
], ids=["roomy", "chunked"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_min_tokens_greedy_matches_hf_min_new_tokens(llama, prompts, kwargs, async_scheduling, how):
    """Each prompt stops on a fifth of the vocabulary (the model's EOS ids, or its ``stop_token_ids``), masked for
    the first ``MIN`` tokens."""
    stops = [_stop_set(0 if how == "eos" else i % 5) for i in range(len(prompts))]
    want = [_hf(llama, p, s, MIN) for p, s in zip(prompts, stops, strict=True)]
    plain = [_hf(llama, p, s, 0) for p, s in zip(prompts, stops, strict=True)]
    assert sum(len(w) < MAX_NEW for w in want) >= 3  # some stop early...
    assert sum(len(p) <= MIN for p in plain) >= 2  # ...and without min_tokens some would stop sooner
    if how == "eos":
        llama.generation_config.eos_token_id = sorted(stops[0])
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=MIN)
    else:
        params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=MIN, stop_token_ids=sorted(s))
                  for s in stops]
    try:
        llm = LLM(llama, async_scheduling=async_scheduling, **kwargs)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llama.generation_config.eos_token_id = None
    for i, (out, w) in enumerate(zip(outs, want, strict=True)):
        got = out.outputs[0]
        assert got.token_ids == w, f"prompt {i}: {got.token_ids}, HF {w}"
        assert got.finish_reason == ("stop" if w[-1] in stops[i] else "length")


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_min_tokens_counts_from_the_original_prompt_across_preemption(llama, prompts, async_scheduling):
    """A pool of 12 blocks preempts requests while their stop tokens are still masked (``min_tokens`` 7 of 10). A
    resumed request comes back with its outputs as its prefill; the mask must still end 7 tokens after the
    original prompt (vLLM's runner keeps ``prompt_len``), so the answers are transformers' own."""
    stop = _stop_set(0) | _stop_set(1)
    want = [_hf(llama, p, stop, 7) for p in prompts]
    assert sum(len(w) < MAX_NEW for w in want) >= 3
    llm = LLM(llama, num_gpu_blocks=12, block_size=8, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=7, stop_token_ids=sorted(stop))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want


def test_min_tokens_masks_eos_even_with_ignore_eos(llama, prompts):
    """vLLM's ``_all_stop_token_ids`` holds the EOS ids whether or not ``ignore_eos``: the first ``min_tokens``
    tokens are never one, and after them an EOS does not stop the completion."""
    eos = _stop_set(0)
    llama.generation_config.eos_token_id = sorted(eos)
    try:
        llm = LLM(llama, num_gpu_blocks=200, block_size=8)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, min_tokens=MIN,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llama.generation_config.eos_token_id = None
    for p, out in zip(prompts, outs, strict=True):
        got = out.outputs[0]
        assert not eos & set(got.token_ids[:MIN]) and got.finish_reason == "length" and len(got.token_ids) == MAX_NEW
        assert got.token_ids[:MIN] == _hf(llama, p, eos, MIN)[:MIN]
    assert any(eos & set(o.outputs[0].token_ids[MIN:]) for o in outs)  # an EOS after them did not stop one


def test_min_tokens_beyond_the_room_ends_at_max_model_len(llama):
    llm = LLM(llama, num_gpu_blocks=60, block_size=8, max_model_len=32)
    out = llm.generate([[5] * 28], SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0),
                       use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (4, "length")


def test_async_min_tokens_beyond_the_room_ends_at_max_model_len(llama):
    """``AsyncLLM.generate`` with ``max_tokens=None`` (the room left) and a larger ``min_tokens``: the same end as
    ``LLM.generate``'s, not a refusal inside the engine loop."""
    import asyncio

    from pagedkv.engine.async_llm import AsyncLLM

    engine = AsyncLLM(LLM(llama, num_gpu_blocks=60, block_size=8, max_model_len=32), "tiny")

    async def main():
        await engine.start()
        try:
            sp = SamplingParams(max_tokens=None, min_tokens=10, temperature=0.0)
            return [d async for d in engine.generate([5] * 28, sp)]
        finally:
            await engine.shutdown()

    deltas = asyncio.run(asyncio.wait_for(main(), 60))
    assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------------
# min_tokens and stop strings: not looked for in the first min_tokens tokens' text
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("min_tokens", "stop", "text"), [
    (0, "ab", "x"), (1, "ab", "x"), (2, "ab", "xaby"), (4, "ab", None), (2, "by", "xa"), (3, "by", None)])
@pytest.mark.parametrize("per_token", [True, False], ids=["per token", "all at once"])
def test_stop_strings_wait_for_min_tokens(min_tokens, stop, text, per_token):
    """The tiny tokenizer spells ``"xabyab"`` as x | ab | y | ab. vLLM's detokenizer (``IncrementalDetokenizer.
    update``) moves the stop-check offset past each of the first ``min_tokens`` tokens' text and searches only once
    there are more, from ``len(stop) - 1`` characters before the new text. So with ``min_tokens=2`` the first "ab"
    is not seen and the second is; "by", begun inside the first two tokens and ended by the third, is seen; with
    ``min_tokens=3`` it is not (no new character ends it). ``None``: no stop, the whole text."""
    from pagedkv.entrypoints.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok("xabyab", add_special_tokens=False)["input_ids"]
    assert [tok.decode([t]) for t in ids] == ["x", "ab", "y", "ab"]
    state = RequestState("r", 0, [1], SamplingParams(min_tokens=min_tokens, stop=[stop]), [stop], False, tok)
    for chunk in ([[t] for t in ids] if per_token else [ids]):
        state.add_tokens(chunk, None, None, 0.0)
        if state.finished:
            break
    assert state.text == (text or "xabyab")
    assert (state.finish_reason, state.stop_reason) == ((None, None) if text is None else ("stop", stop))


# ---------------------------------------------------------------------------------------------------------
# min_p
# ---------------------------------------------------------------------------------------------------------
def test_min_p_cuts_after_the_temperature():
    """Sampled with the same noise as the rule itself: scale by the temperature, drop what is below ``min_p``
    times the likeliest token's probability (``max + log(min_p)`` in logits), softmax, ``argmax(probs / q)``."""
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    for temperature, min_p in ((1.0, 0.1), (0.5, 0.1), (1.5, 0.3), (1.0, 1.0)):
        params = [SamplingParams(temperature=temperature, min_p=min_p)] * 6
        for seed in range(5):
            got = Sampler().sample(logits.clone(), params, [make_generator(seed + i) for i in range(6)])
            scaled = (logits.double() / temperature)
            probs = scaled.softmax(-1)
            keep = probs >= min_p * probs.max(-1, keepdim=True).values
            want = []
            for i in range(6):
                p = torch.where(keep[i], probs[i], 0.0).float()
                q = torch.empty(40).exponential_(generator=make_generator(seed + i))
                want.append(int((p / p.sum() / q).argmax()))
            assert got.tolist() == want, (temperature, min_p, seed)
            assert all(keep[i, t] for i, t in enumerate(got.tolist()))
    assert Sampler().sample(logits.clone(), [SamplingParams(min_p=1.0)] * 6, [make_generator(1)] * 6).tolist() \
        == logits.argmax(-1).tolist()  # only the likeliest is left
