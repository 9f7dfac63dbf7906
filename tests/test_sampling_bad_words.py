"""``SamplingParams.bad_words`` as vLLM 0.26 applies them: each word encoded with and without a leading space
(``SamplingParams.update_from_tokenizer``), and in Model Runner V2's sampler (``BadWordsState``,
``_bad_words_kernel`` in ``vllm/v1/worker/gpu/sample/bad_words.py``) a word's last token masked whenever the
output so far ends with its other tokens; after the penalties, before the temperature.

The greedy tokens are checked against a plain loop over transformers' logits that applies the same rule
(the output only, never the prompt), across async and sync scheduling and preemption.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import one_thread  # noqa: F401 (an autouse fixture)

from pagedkv.engine import LLM, SamplingParams
from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer

MAX_NEW = 12


@pytest.fixture(scope="module")
def model_and_tok():
    return tiny_model(0), tiny_tokenizer()


def reference(model, prompt: list[int], words: list[list[int]], n: int) -> list[int]:
    """Greedy tokens with vLLM's rule: before each token, a word's last token is masked when the output ends with
    the word's other tokens (a one-token word: always)."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        for w in words:
            prefix = w[:-1]
            if len(prefix) <= len(out) and out[len(out) - len(prefix):] == prefix:
                logits[w[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def clean_pair(tok, tokens: list[int]) -> tuple[int, str]:
    """The last position ``i`` of ``tokens`` whose pair ``tokens[i], tokens[i + 1]`` is the encoding of its text
    (no leading space added), and that text: a two-token word the output would say at ``i``."""
    for i in range(len(tokens) - 2, 1, -1):
        text = tok.decode(tokens[i : i + 2])
        if text.isprintable() and tok.encode(text.lstrip(), add_special_tokens=False) == tokens[i : i + 2]:
            return i, text
    raise AssertionError([tok.decode([t]) for t in tokens])


def clean_token(tok, tokens: list[int]) -> tuple[int, str]:
    """The first position past 2 whose token alone is the encoding of its text, and that text."""
    for i in range(3, len(tokens)):
        text = tok.decode(tokens[i : i + 1])
        alone = tok.encode(text.lstrip(), add_special_tokens=False)
        if text.strip() and text.isprintable() and alone == tokens[i : i + 1]:
            return i, text
    raise AssertionError([tok.decode([t]) for t in tokens])


def test_bad_words_refused_in_vllms_words(model_and_tok):
    model, tok = model_and_tok
    with pytest.raises(ValueError, match=r"bad_words cannot contain an empty string. Got bad_words=\['a', ''\]"):
        SamplingParams(bad_words=["a", ""])
    with pytest.raises(ValueError, match="bad_words must be a list of strings"):
        SamplingParams(bad_words="word")
    assert SamplingParams().bad_words == [] and SamplingParams().bad_words_token_ids is None
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        LLM(model, num_gpu_blocks=60, block_size=8).generate([5, 6], SamplingParams(bad_words=["a"]),
                                                              use_tqdm=False)
    llm = LLM(model, tokenizer=tok, num_gpu_blocks=60, block_size=8)
    with pytest.raises(ValueError, match="bad_words: '  ' is no tokens once its leading spaces are stripped"):
        llm.generate([5, 6], SamplingParams(bad_words=["ok", "  "]), use_tqdm=False)
    with pytest.raises(ValueError, match="Too many bad words: 258. The max number is 128."):
        llm.generate([5, 6], SamplingParams(bad_words=[f"w{i}" for i in range(129)]), use_tqdm=False)
    assert not llm.engine_core.requests
    small = LLM(tiny_model(0, vocab_size=300), tokenizer=tok, num_gpu_blocks=60, block_size=8)  # 512 token ids
    word = next(w for w in ("ox", "zebra", "quartz") if max(tok.encode(w, add_special_tokens=False)) >= 300)
    with pytest.raises(ValueError, match=r"bad_words encode to token ids \[.*\], outside the model's vocabulary "
                                         "of 300 tokens"):
        small.generate([5, 6], SamplingParams(bad_words=[word]), use_tqdm=False)
    assert not small.engine_core.requests
    assert small.generate([5, 6], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_each_word_is_encoded_with_and_without_a_leading_space(model_and_tok):
    """vLLM's rule: the word as given (leading spaces stripped), then with one leading space when that gives
    other tokens of the same count."""
    _, tok = model_and_tok
    sp = SamplingParams(bad_words=["  cat", "the"])
    sp.update_from_tokenizer(tok)
    want = []
    for word in ("cat", "the"):
        plain, spaced = tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)
        want.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            want.append(spaced)
    assert sp.bad_words_token_ids == want and len(want) > 2


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_are_the_reference_loops(model_and_tok, async_scheduling):
    """A two-token word the unbanned output says at ``i``: the output is the same up to ``i``, then its second token
    is masked (the first is not); a one-token word is masked from the start; a request without bad words in the
    same batch is unchanged. Each equals the reference loop's."""
    model, tok = model_and_tok
    prompt = tok("the block pool hands out")["input_ids"]
    llm = LLM(model, tokenizer=tok, num_gpu_blocks=60, block_size=8, async_scheduling=async_scheduling)
    base = llm.generate([prompt], SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)[0]
    base_ids = base.outputs[0].token_ids
    (i, two), (j, one) = clean_pair(tok, base_ids), clean_token(tok, base_ids)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, bad_words=[two]),
              SamplingParams(max_tokens=MAX_NEW, temperature=0, bad_words=[one]),
              SamplingParams(max_tokens=MAX_NEW, temperature=0)]
    got = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3, params, use_tqdm=False)]
    assert got[0][: i + 1] == base_ids[: i + 1] and got[0][i + 1] != base_ids[i + 1]
    assert got[1][:j] == base_ids[:j] and got[1][j] != base_ids[j] and base_ids[j] not in got[1]
    assert got[2] == base_ids
    for sp, out in zip(params[:2], got, strict=False):
        checked = sp.verified()
        llm.verify_sampling_params(checked)
        assert out == reference(model, prompt, checked.bad_words_token_ids, MAX_NEW)


def test_a_resumed_request_matches_against_its_outputs_so_far():
    """A request the runner takes again after a preemption brings its outputs in its prefill (after its prompt):
    a word whose first token ended the output before the preemption is matched at once; the prompt never counts."""
    from pagedkv.engine.bad_words import BadWordsState

    sp = SamplingParams(bad_words=["x"])
    sp._bad_words_token_ids = [[7, 9], [3]]
    state = BadWordsState("cpu")
    state.add_request("r", [7, 1, 2, 7], 2, sp)  # prompt [7, 1], outputs [2, 7]
    logits = torch.zeros(2, 12)
    state.apply(logits, ["r", "r"], [2, 0])  # row 0: after two outputs ending in 7; row 1: no output yet
    assert logits[0, 9] == float("-inf") and logits[0, 3] == float("-inf")
    assert logits[1, 9] == 0 and logits[1, 3] == float("-inf")  # the prompt's 7 does not count
    state.update(["r"], torch.tensor([5]))
    logits = torch.zeros(1, 12)
    state.apply(logits, ["r"], [3])
    assert logits[0, 9] == 0 and logits[0, 3] == float("-inf")


def test_bad_words_survive_preemption(model_and_tok):
    """A tight pool preempts and recomputes: each request's tokens as in the reference loop."""
    model, tok = model_and_tok
    prompts = [tok(t)["input_ids"] for t in ("the block pool hands out", "a scheduler admits", "every request")]
    roomy = LLM(model, tokenizer=tok, num_gpu_blocks=60, block_size=8)
    bases = roomy.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0,
                             bad_words=[clean_pair(tok, b.outputs[0].token_ids)[1]]) for b in bases]
    tight = LLM(model, tokenizer=tok, num_gpu_blocks=7, block_size=8)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    for p, sp, out in zip(prompts, params, got, strict=True):
        checked = sp.verified()
        tight.verify_sampling_params(checked)
        assert out.outputs[0].token_ids == reference(model, p, checked.bad_words_token_ids, MAX_NEW)
