"""Repetition, frequency and presence penalties, as vLLM 0.26 applies them (``vllm/sampling_params.py`` for the
ranges; Model Runner V2's ``vllm/v1/worker/gpu/sample/penalties.py`` for the rule and the counts).

Greedy decoding with ``repetition_penalty`` is checked token for token against transformers' own
``generate(repetition_penalty=...)``; the frequency and presence penalties against a float64 greedy loop over the
same model that applies vLLM's rule from scratch. Both under chunked prefill, recompute preemption (a resumed
request's counts are rebuilt from its prompt and outputs) and both schedulers.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import NEAR_TIE, make_prompts, one_thread  # noqa: F401 (one_thread: an autouse fixture)

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.penalties import PenaltiesState

MAX_NEW = 16
CONFIGS = {
    "roomy": dict(num_gpu_blocks=200, block_size=8),
    "chunked": dict(num_gpu_blocks=200, block_size=8, max_num_batched_tokens=16),
    "recompute": dict(num_gpu_blocks=14, block_size=8, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(n=8, lo=3, hi=40, seed=5)


def reference_greedy(model, prompt: list[int], rep: float, freq: float, pres: float) -> list[tuple[int, float]]:
    """Greedy decoding of ``prompt`` with vLLM's penalties applied in float64 to the model's full-sequence
    logits; each step's token and the gap between its two best penalised logits."""
    ids = list(prompt)
    out = []
    for _ in range(MAX_NEW):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()  # [V]
        counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long), minlength=logits.numel())
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        logits = torch.where(seen & (logits > 0), logits / rep, torch.where(seen, logits * rep, logits))
        logits = logits - freq * counts - pres * (counts > 0)
        top2 = torch.topk(logits, 2).values
        token = int(logits.argmax())
        out.append((token, float(top2[0] - top2[1])))
        ids.append(token)
    return out


def assert_matches(got: list[int], want: list[tuple[int, float]], label: str) -> bool:
    """Token identity, except after a near-tie of the reference's penalised logits; True if it held all the way."""
    for j, (token, gap) in enumerate(want):
        if got[j] != token:
            assert gap < NEAR_TIE, f"{label}: token {j} is {got[j]}, the reference says {token} (gap {gap:.3g})"
            return False
    assert len(got) == len(want), label
    return True


# ---------------------------------------------------------------------------------------------------------
# The parameters
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5."),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3."),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be in \[-2, 2\], got nan."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number, got inf."),
    (dict(presence_penalty="1"), "presence_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"),
])
def test_bad_values_refused_in_vllms_words(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_resumed_request_is_counted_from_its_prompt_and_outputs():
    """``bincount``: the first ``prompt_len`` tokens are the prompt (a mask), the rest outputs (counts)."""
    state = PenaltiesState("cpu")
    state.add_request("a", [1, 2, 2, 5, 5, 5, 1], 3, SamplingParams(frequency_penalty=0.5))
    state.add_request("b", [1, 2], 2, SamplingParams())  # no penalty: nothing kept
    logits = torch.zeros(2, 10)
    logits[0] = torch.arange(10) - 4.0  # [-4 .. 5]
    state.apply(logits, ["a", "b"], [SamplingParams(frequency_penalty=0.5, repetition_penalty=2.0), None])
    assert state.prompt_mask["a"].nonzero().flatten().tolist() == [1, 2]  # counted as wide as the logits
    assert state.output_counts["a"].tolist() == [0, 1, 0, 0, 0, 3, 0, 0, 0, 0]
    assert "b" not in state.output_counts
    assert logits[0].tolist() == [-4, -3 * 2 - 0.5, -2 * 2, -1, 0, 1 / 2 - 1.5, 2, 3, 4, 5]
    assert logits[1].tolist() == [0.0] * 10
    state.update(["a", "b"], torch.tensor([9, 9]))
    assert state.output_counts["a"][9] == 1


# ---------------------------------------------------------------------------------------------------------
# Token identity
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_repetition_penalty_greedy_matches_hf(llama, prompts, config, async_scheduling):
    hf = [llama.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                         max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, repetition_penalty=1.5,
                         do_sample=False)[0, len(p):].tolist() for p in prompts]
    llm = LLM(llama, async_scheduling=async_scheduling, **CONFIGS[config])
    plain = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0), use_tqdm=False)
    assert sum(o.outputs[0].token_ids != h for o, h in zip(plain, hf, strict=True)) >= len(prompts) // 2
    preemptions = llm.scheduler.num_preemptions
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.5),
                        use_tqdm=False)
    if config == "recompute":
        assert llm.scheduler.num_preemptions > preemptions
    assert [o.outputs[0].token_ids for o in outs] == hf


@pytest.mark.parametrize("config", ["roomy", "recompute"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_frequency_and_presence_penalties_match_a_float64_reference(llama, prompts, config, async_scheduling):
    """Each prompt its own mix (a negative frequency penalty rewards repeats): the rule, the counts and the mask
    are the request's own in a batch, and survive preemption."""
    mixes = [(1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.2, 0.8, 0.5), (1.0, -0.4, 0.0)]
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=r, frequency_penalty=f,
                             presence_penalty=p) for r, f, p in (mixes[i % 4] for i in range(len(prompts)))]
    llm = LLM(llama, async_scheduling=async_scheduling, **CONFIGS[config])
    outs = llm.generate(prompts, params, use_tqdm=False)
    if config == "recompute":
        assert llm.scheduler.num_preemptions > 0
    held = 0
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        sp = params[i]
        want = reference_greedy(llama, p, sp.repetition_penalty, sp.frequency_penalty, sp.presence_penalty)
        held += assert_matches(out.outputs[0].token_ids, want, f"prompt {i}")
    assert held >= len(prompts) - 1


def test_seeded_sampling_with_penalties_unchanged_by_preemption(llama, prompts):
    """Sampled rows are penalised too, with counts kept on the device; a preempted request's rebuilt counts give
    the same samples as the uninterrupted run."""
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=7 + i, frequency_penalty=1.0,
                             presence_penalty=0.5, repetition_penalty=1.3) for i in range(len(prompts))]
    roomy = LLM(llama, **CONFIGS["roomy"]).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(llama, **CONFIGS["recompute"])
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in roomy] == [o.outputs[0].token_ids for o in tight]
    unpenalised = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, seed=7 + i) for i in range(len(prompts))]
    plain = LLM(llama, **CONFIGS["roomy"]).generate(prompts, unpenalised, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in roomy] != [o.outputs[0].token_ids for o in plain]
