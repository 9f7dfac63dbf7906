"""``logit_bias`` and ``allowed_token_ids`` as vLLM 0.26 applies them: first of all, before the penalties and the
temperature (Model Runner V2's ``_bias_kernel``, ``vllm/v1/worker/gpu/sample/logit_bias.py``), checked against the
model by ``SamplingParams.verify`` (``vllm/sampling_params.py``).

Greedy decoding is checked against a float64 loop over the same model that applies vLLM's order from scratch; the
order matters: a bias added before a repetition penalty is divided by it.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import NEAR_TIE, make_prompts, one_thread  # noqa: F401 (one_thread: an autouse fixture)

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.exceptions import InvalidRequestError

MAX_NEW = 10
ALLOWED = list(range(0, 512, 3))  # a third of the vocabulary


def bias_for(prompt: list[int]) -> dict[int, float]:
    """+10 on the prompt's own tokens, which the repetition penalty also hits: in vLLM's order a token's bias is
    divided by the penalty with its logit (on this model, 5 of the 6 prompts' answers change if the penalty came
    first); -100 on token 9."""
    return {t: 10.0 for t in prompt} | {9: -100.0}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=6, lo=3, hi=40, seed=21)


def reference_greedy(model, prompt: list[int], bias: dict[int, float], rep: float) -> list[tuple[int, float]]:
    """Greedy decoding with vLLM's order in float64: allowed tokens, then the biases, then the repetition
    penalty; each step's token and the gap between its two best logits."""
    ids, out = list(prompt), []
    for _ in range(MAX_NEW):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()  # [V]
        allowed = torch.full_like(logits, float("-inf"))
        allowed[ALLOWED] = logits[ALLOWED]
        logits = allowed
        for t, b in bias.items():
            logits[t] += b
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(ids)] = True
        logits = torch.where(seen & (logits > 0), logits / rep, torch.where(seen, logits * rep, logits))
        top2 = torch.topk(logits, 2).values
        out.append((int(logits.argmax()), float(top2[0] - top2[1])))
        ids.append(out[-1][0])
    return out


@pytest.mark.parametrize(("kwargs", "message", "param"), [
    (dict(logit_bias={"a": 1.0}), "logit_bias must be a dict of token id", "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias must be a dict", "logit_bias"),
    (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids must be a list of token ids", "allowed_token_ids"),
    (dict(temperature=-1.0), "temperature must be non-negative", "temperature"),
    (dict(top_k=-3), "top_k must be 0", None),  # a plain ValueError in vLLM: no param
])
def test_bad_values_name_their_field_where_vllm_does(kwargs, message, param):
    with pytest.raises(ValueError, match=message) as info:
        SamplingParams(**kwargs)
    assert getattr(info.value, "parameter", None) == param


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(logit_bias={600: 1.0, 5: 1.0}), r"token_id\(s\) \[600\] in logit_bias contain out-of-vocab token ids. "
                                          "Vocabulary size: 512"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(allowed_token_ids=[3, 512]), "allowed_token_ids contains out-of-vocab token id!"),
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "out-of-vocab"),
])
def test_the_model_checks_refuse_before_anything_is_queued(llama, prompts, kwargs, message):
    llm = LLM(llama, num_gpu_blocks=60, block_size=8)
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(prompts[0], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert not llm.engine_core.requests and llm.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 59
    with pytest.raises(InvalidRequestError, match="Too many allowed token IDs: 1025. The max size is 1024."):
        SamplingParams(allowed_token_ids=list(range(1025))).verify(2048, 20)


@pytest.mark.parametrize("kwargs", [
    dict(num_gpu_blocks=200, block_size=8),
    dict(num_gpu_blocks=14, block_size=8, max_num_batched_tokens=32),  # chunked prefill and recompute
], ids=["roomy", "tight"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_with_allowed_tokens_biases_and_a_penalty_matches_a_float64_reference(
        llama, prompts, kwargs, async_scheduling):
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, allowed_token_ids=ALLOWED, logit_bias=bias_for(p),
                             repetition_penalty=2.0) for p in prompts]
    llm = LLM(llama, async_scheduling=async_scheduling, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if kwargs["num_gpu_blocks"] < 100:
        assert llm.scheduler.num_preemptions > 0
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        got = out.outputs[0].token_ids
        assert set(got) <= set(ALLOWED) and 9 not in got
        for j, (token, gap) in enumerate(reference_greedy(llama, p, bias_for(p), 2.0)):
            if got[j] != token:
                assert gap < NEAR_TIE, f"prompt {i}: token {j} is {got[j]}, the reference says {token} (gap {gap})"
                break


def test_sampled_rows_keep_to_the_allowed_tokens(llama, prompts):
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=1.5, seed=i, allowed_token_ids=[5, 17, 200])
              for i in range(len(prompts))]
    outs = LLM(llama, num_gpu_blocks=100, block_size=8).generate(prompts, params, use_tqdm=False)
    tokens = {t for o in outs for t in o.outputs[0].token_ids}
    assert tokens <= {5, 17, 200} and len(tokens) > 1
