"""Prompt logprobs as vLLM 0.26 computes them (``SamplingParams.prompt_logprobs``; Model Runner V2's
``PromptLogprobsWorker``, ``vllm/v1/worker/gpu/sample/prompt_logprob.py``; the record of
``LogprobsProcessor._update_prompt_logprobs``, ``vllm/v1/engine/logprobs.py``).

Each prompt position's record is checked against the float64 log-softmax of transformers' own logits over the
prompt: the prompt token first with its rank, then the ``prompt_logprobs`` likeliest with ranks 1, 2, ...; the
first prompt token's entry is ``None``. A prompt prefilled in chunks, a prompt whose blocks are in the prefix cache
(such a request reads none of them: ``skip_reading_prefix_cache``), a request preempted in or after its prompt,
and async scheduling all give the same records.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import make_prompts, one_thread  # noqa: F401 (one_thread: an autouse fixture)
from test_logprobs import check_record, check_refused_past_max_logprobs

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.logprobs import convert_ids_list_to_tokens
from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=5, lo=2, hi=45, seed=5) + [[7]]  # a one-token prompt has nothing to predict


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    """transformers' raw logits, float64, at each prompt position but the last: ``[len(prompt) - 1, V]``."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, :-1].double()


def check_prompt_record(model, prompt: list[int], record: list, num: int) -> None:
    assert len(record) == len(prompt) and record[0] is None
    logits = prompt_logits(model, prompt)
    for pos in range(1, len(prompt)):
        check_record(record[pos], prompt[pos], logits[pos - 1], num)


def test_prompt_logprobs_refused_in_vllms_words(llama, prompts):
    with pytest.raises(ValueError, match="prompt_logprobs must be non-negative or -1, got -3."):
        SamplingParams(prompt_logprobs=-3)
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 1  # vLLM's normalisation
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache
    assert not SamplingParams().skip_reading_prefix_cache
    check_refused_past_max_logprobs(llama, prompts[0], "prompt_logprobs", "prompt")


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_prompt_logprobs_are_transformers_logits_over_the_prompt(llama, prompts, async_scheduling):
    """Chunked prefill (16 tokens a step: the longer prompts take several chunks, kept until the last), each
    request its own ``prompt_logprobs`` (0 to 4, and none); greedy outputs and their sample logprobs unchanged."""
    nums = [0, 3, None, 4, 1, 2]
    params = [SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=n, logprobs=1) for n in nums]
    llm = LLM(llama, num_gpu_blocks=100, block_size=8, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM(llama, num_gpu_blocks=100, block_size=8).generate(
        prompts, SamplingParams(max_tokens=4, temperature=0.0, logprobs=1), use_tqdm=False)
    assert max(map(len, prompts)) > 16
    for p, n, out, want in zip(prompts, nums, outs, plain, strict=True):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert [list(r) for r in out.outputs[0].logprobs] == [list(r) for r in want.outputs[0].logprobs]
        if n is None:
            assert out.prompt_logprobs is None
        else:
            check_prompt_record(llama, p, out.prompt_logprobs, n)
    assert outs[-1].prompt_logprobs == [None]  # the one-token prompt


def test_a_cached_prompt_is_computed_again_for_its_logprobs(llama, prompts):
    """A request that asks for prompt logprobs reads nothing from the prefix cache (vLLM's
    ``skip_reading_prefix_cache``: a cached position has no logits), and is counted as no query; the next request
    without them hits the blocks as before."""
    llm = LLM(llama, num_gpu_blocks=100, block_size=8, enable_prefix_caching=True)
    p = prompts[3]
    llm.generate(p, SamplingParams(max_tokens=2), use_tqdm=False)
    stats = llm.scheduler.kv_cache_manager.make_prefix_cache_stats()
    again = llm.generate(p, SamplingParams(max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_prompt_record(llama, p, again.prompt_logprobs, 2)
    stats = llm.scheduler.kv_cache_manager.make_prefix_cache_stats()
    assert stats.queries == 0 and stats.hits == 0
    hit = llm.generate(p, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert hit.num_cached_tokens == (len(p) - 1) // 8 * 8 > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_survive_preemption(llama, prompts, mode):
    """A tight pool preempts requests in their prompt and after it (the record went out with the first token):
    recomputed, a prompt's chunks so far are computed again and its record starts again; swapped out and in (the
    lab's swap), it goes on from its chunks so far. Each record whole, once; n=2 gives it once."""
    params = [SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=2) for _ in prompts]
    tight_llm = LLM(llama, num_gpu_blocks=9, block_size=8, max_num_batched_tokens=5, preemption_mode=mode)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.scheduler.num_preemptions > 0
    for p, out in zip(prompts, tight, strict=True):
        check_prompt_record(llama, p, out.prompt_logprobs, 2)
    two = LLM(llama, num_gpu_blocks=60, block_size=8).generate(
        prompts[1], SamplingParams(max_tokens=3, temperature=0.8, seed=1, n=2, prompt_logprobs=1), use_tqdm=False)
    check_prompt_record(llama, prompts[1], two[0].prompt_logprobs, 1)


def test_prompt_logprobs_text_is_each_token_decoded():
    """With a tokenizer each entry carries its token's text (decoded alone with its leading space, as vLLM's
    ``convert_ids_list_to_tokens``), the alternatives' too: the prompt tokens' texts make the prompt's."""
    model, tok = tiny_model(0), tiny_tokenizer()
    ids = tok("the cat sat on the mat")["input_ids"]
    out = LLM(model, tokenizer=tok, num_gpu_blocks=60, block_size=8).generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    check_prompt_record(model, ids, out.prompt_logprobs, 1)
    for record in out.prompt_logprobs[1:]:  # an alternative that is part of a character reads "" (vLLM's repair)
        alone = convert_ids_list_to_tokens(tok, list(record))
        assert [lp.decoded_token for lp in record.values()] == [t if not t.endswith("\ufffd") else "" for t in alone]
    assert "".join(next(iter(r.values())).decoded_token for r in out.prompt_logprobs[1:]) == tok.decode(ids[1:])
