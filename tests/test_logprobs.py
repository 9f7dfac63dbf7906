"""Sample logprobs as vLLM 0.26 returns them (``SamplingParams.logprobs``; ``vllm/logprobs.py`` for the record,
Model Runner V2's ``compute_topk_scores`` for the numbers, ``vllm/v1/engine/logprobs.py`` for the tokens' text).

The numbers are checked against the log-softmax, in float64, of transformers' own raw logits (``output_logits``,
before any processing: vLLM's default ``logprobs_mode="raw_logprobs"``) or of a teacher-forced forward over the
sampled tokens; the record's shape against vLLM's rules.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import make_prompts, one_thread  # noqa: F401 (one_thread: an autouse fixture)

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.logprobs import Logprob, SampleLogprobs

MAX_NEW = 8
TOL = 1e-4  # the engine's float32 forward and log-softmax against transformers' logits in float64


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=6, lo=3, hi=30, seed=11)


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's raw logits, float64, at each position that produced one of ``tokens``: ``[len(tokens), V]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def check_record(record: dict[int, Logprob], sampled: int, logits: torch.Tensor, num: int) -> None:
    """vLLM's record of one position: the sampled token first with its rank (the count of logits at least its
    own), then the top ``num`` with ranks 1..num, each with the float64 log-softmax's value."""
    logprobs = logits.log_softmax(-1)
    top = torch.topk(logits, num).indices.tolist() if num else []
    assert list(record) == [sampled] + [t for t in top if t != sampled]
    assert record[sampled].rank == int((logits >= logits[sampled]).sum())
    for r, t in enumerate(top, start=1):
        assert record[t].rank == r
    for t, lp in record.items():
        assert lp.logprob == pytest.approx(float(logprobs[t]), abs=TOL)


def check_refused_past_max_logprobs(model, prompt: list[int], field: str, kind: str) -> None:
    """``field`` (``logprobs`` or ``prompt_logprobs``) past ``max_logprobs`` (20), and -1 (the vocabulary, 512),
    are refused in vLLM's words (``kind``: "sample" or "prompt"), nothing queued."""
    llm = LLM(model, num_gpu_blocks=60, block_size=8)
    for asked, said in ((21, 21), (-1, 512)):
        with pytest.raises(ValueError, match=f"Requested {kind} logprobs of {said}, which is greater than max "
                                             "allowed: 20"):
            llm.generate(prompt, SamplingParams(max_tokens=2, **{field: asked}), use_tqdm=False)
    assert not llm.engine_core.requests


# ---------------------------------------------------------------------------------------------------------
# The parameters
# ---------------------------------------------------------------------------------------------------------
def test_logprobs_values_refused_in_vllms_words(llama, prompts):
    with pytest.raises(ValueError, match="logprobs must be non-negative or -1, got -2."):
        SamplingParams(logprobs=-2)
    assert SamplingParams(logprobs=True).logprobs == 1  # vLLM's normalisation
    check_refused_past_max_logprobs(llama, prompts[0], "logprobs", "sample")
    with pytest.raises(ValueError, match="Requested sample logprobs of 600, which is more than the vocabulary"):
        LLM(llama, num_gpu_blocks=60, block_size=8, max_logprobs=1000).generate(
            prompts[0], SamplingParams(max_tokens=2, logprobs=600), use_tqdm=False)  # (vLLM's worker fails)
    with pytest.raises(ValueError, match="max_logprobs must be an int >= -1"):
        LLM(llama, num_gpu_blocks=60, block_size=8, max_logprobs=-2)
    whole = LLM(llama, num_gpu_blocks=60, block_size=8, max_logprobs=-1).generate(
        prompts[0], SamplingParams(max_tokens=2, temperature=0.0, logprobs=-1), use_tqdm=False)[0].outputs[0]
    assert [len(r) for r in whole.logprobs] == [512, 512]
    assert sorted(lp.rank for lp in whole.logprobs[0].values()) == list(range(1, 513))


# ---------------------------------------------------------------------------------------------------------
# The numbers
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_logprobs_are_transformers_raw_logits(llama, prompts, async_scheduling):
    """One batch, each prompt its own ``logprobs`` (0 to 5: the runner computes the batch's largest, each record
    keeps its own); a repetition penalty on some does not change them (raw logprobs)."""
    nums = [0, 1, 5, 2, 5, 3]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=n,
                             repetition_penalty=1.5 if i % 2 else 1.0) for i, n in enumerate(nums)]
    outs = LLM(llama, num_gpu_blocks=100, block_size=8, async_scheduling=async_scheduling).generate(
        prompts, params, use_tqdm=False)
    for p, sp, out in zip(prompts, params, outs, strict=True):
        ids = torch.tensor([p])
        hf = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                            repetition_penalty=sp.repetition_penalty, output_logits=True,
                            return_dict_in_generate=True)
        got = out.outputs[0]
        assert got.token_ids == hf.sequences[0, len(p):].tolist()
        assert len(got.logprobs) == MAX_NEW
        for j, record in enumerate(got.logprobs):
            check_record(record, got.token_ids[j], hf.logits[j][0].double(), sp.logprobs)
        assert got.cumulative_logprob == pytest.approx(sum(r[t].logprob for t, r in zip(got.token_ids,
                                                                                          got.logprobs, strict=True)))


def test_sampled_logprobs_and_ranks_survive_preemption(llama, prompts):
    """Sampled tokens (temperature 0.8, top-k 20: the logprobs are still the raw ones) have ranks past 1; a tight
    pool preempts and recomputes, and gives the same tokens and records."""
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.8, top_k=20, seed=3 + i, logprobs=2, n=2)
              for i in range(len(prompts))]
    roomy = LLM(llama, num_gpu_blocks=100, block_size=8).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(llama, num_gpu_blocks=8, block_size=8, max_num_batched_tokens=32)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.scheduler.num_preemptions > 0
    ranks = []
    for p, a, b in zip(prompts, roomy, tight, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert ca.token_ids == cb.token_ids
            for ra, rb in zip(ca.logprobs, cb.logprobs, strict=True):
                assert list(ra) == list(rb) and [lp.rank for lp in ra.values()] == [lp.rank for lp in rb.values()]
                assert [lp.logprob for lp in ra.values()] == pytest.approx([lp.logprob for lp in rb.values()],
                                                                          abs=TOL)
            logits = teacher_forced(llama, p, ca.token_ids)
            for j, record in enumerate(ca.logprobs):
                check_record(record, ca.token_ids[j], logits[j], 2)
                ranks.append(record[ca.token_ids[j]].rank)
    assert max(ranks) > 2  # some sampled tokens were outside the top two: a record of three entries


def test_no_logprobs_asked_none_given(llama, prompts):
    out = LLM(llama, num_gpu_blocks=60, block_size=8).generate(
        prompts[:2], [SamplingParams(max_tokens=3, logprobs=1), SamplingParams(max_tokens=3)], use_tqdm=False)
    assert len(out[0].outputs[0].logprobs) == 3 and out[0].outputs[0].cumulative_logprob is not None
    assert out[1].outputs[0].logprobs is None and out[1].outputs[0].cumulative_logprob is None


# ---------------------------------------------------------------------------------------------------------
# The tokens' text
# ---------------------------------------------------------------------------------------------------------
def test_decoded_tokens_and_a_character_split_over_tokens():
    """Each token is decoded alone; one that ends a character begun by the tokens sampled before it (alone: U+FFFD)
    reads as the whole character, and those before it as "" (``LogprobsProcessor._correct_decoded_token``)."""
    from pagedkv.entrypoints.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok("a中b", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5  # a, three bytes, b
    record = SampleLogprobs(1, tok)
    for t in ids:
        record.update([t, ids[0]], [-1.0, -0.5], 2)
    texts = [r[t].decoded_token for r, t in zip(record.logprobs, ids, strict=True)]
    assert texts == ["a", "", "", "中", "b"]
    assert [r[ids[0]].decoded_token for r in record.logprobs] == ["a"] * 5  # the alternative, decoded alone
    assert record.cumulative_logprob == -5.0 and [len(r) for r in record.logprobs] == [1, 2, 2, 2, 2]


def test_generate_with_a_tokenizer_decodes_each_token():
    from pagedkv.entrypoints.tiny import tiny_model as serve_model
    from pagedkv.entrypoints.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    llm = LLM(serve_model(0), tokenizer=tok, num_gpu_blocks=60, block_size=8, max_model_len=64)
    out = llm.generate("Hello", SamplingParams(max_tokens=5, temperature=0.0, logprobs=3), use_tqdm=False)
    records = out[0].outputs[0].logprobs
    assert len(records) == 5 and all(len(r) in (4, 3) for r in records)
    for record in records:
        for t, lp in record.items():
            if not tok.decode([t]).endswith("\ufffd"):  # (a split character's bytes: the test above)
                assert lp.decoded_token == tok.decode([t])
