"""``LLM.chat`` and ``LLM.get_tokenizer`` as vLLM 0.26's (``vllm/entrypoints/llm.py``): a conversation rendered by
the chat template, tokenized without special tokens, generated as ``generate`` does; the lab had neither. And the
text parts of OpenAI's content lists joined by newlines (vLLM's ``parse_chat_messages``), in ``LLM.chat`` and in
``pagedkv serve`` alike (the server had joined them with nothing)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine import LLM, SamplingParams
from pagedkv.entrypoints.chat_utils import parse_chat_messages
from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


class BOSTokenizer:
    """The tiny tokenizer, adding a BOS (id 1) unless told not to: where ``add_special_tokens`` shows."""

    def __init__(self):
        self.inner = tiny_tokenizer()
        self.chat_template = self.inner.chat_template
        self.eos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + self.inner(text)["input_ids"]}

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(tiny_model(), tokenizer=tiny_tokenizer(), num_gpu_blocks=64, block_size=8)


def test_chat_is_generate_on_the_rendered_conversation(llm):
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer
    text = tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>Be brief.\n<|user|>Hello, world!\n<|assistant|>"
    out = llm.chat(HI, GREEDY, use_tqdm=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    want = llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert len(out) == 1 and out[0].prompt == text and list(out[0].prompt_token_ids) == ids
    assert out[0].outputs[0].token_ids == want.outputs[0].token_ids and out[0].outputs[0].text == want.outputs[0].text
    # a list of conversations: one output each, in order; the template's own options pass through
    two = llm.chat([HI, HI[1:]], GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert [o.prompt for o in two] == [text.removesuffix("<|assistant|>"), "<|user|>Hello, world!\n"]


def test_chat_tokenizes_without_special_tokens_and_takes_a_template():
    llm = LLM(tiny_model(), tokenizer=BOSTokenizer(), num_gpu_blocks=64, block_size=8)
    out = llm.chat(HI, GREEDY, use_tqdm=False, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert out[0].prompt == "Be brief.Hello, world!"
    assert out[0].prompt_token_ids[0] != 1 and len(out[0].prompt_token_ids) == len(
        tiny_tokenizer()("Be brief.Hello, world!")["input_ids"])


def test_content_parts_are_joined_by_newlines_and_media_refused():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert parse_chat_messages([{"role": "user", "content": parts, "name": "ann", "extra": 1}]) == \
        [{"role": "user", "content": "one\ntwo", "name": "ann"}]
    assert parse_chat_messages([{"role": "assistant", "content": None}]) == [{"role": "assistant", "content": ""}]
    with pytest.raises(ValueError, match=r"messages\[0\]: only text content parts .* got 'image_url'"):
        parse_chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match=r"messages\[0\]: content part 1's 'text' must be a string, got None"):
        parse_chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}])


@pytest.mark.parametrize("messages, message", [
    ([], "messages must be a conversation"),
    ("hello", "messages must be a conversation"),
    ([{"content": "no role"}], r"messages\[0\] must be a dict with a string 'role'"),
    ([HI, []], r"conversation 1 must be a non-empty list"),
    ([HI, [{"role": "user", "content": 3}]], r"conversation 1\[0\]: content must be a string"),
])
def test_bad_conversations_are_refused_before_anything_runs(llm, messages, message):
    free = llm.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    next_id = llm._next_id
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert (llm.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(), llm._next_id) == (free, next_id)
    assert not llm.scheduler.requests


def test_the_server_joins_content_parts_as_vllm():
    from types import SimpleNamespace

    from pagedkv.entrypoints.api_server import OpenAIServing
    from pagedkv.entrypoints.protocol import ChatCompletionRequest

    tok = tiny_tokenizer()
    serving = OpenAIServing(SimpleNamespace(tokenizer=tok), ["m"], "m")
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    ids = serving.render_chat(ChatCompletionRequest(messages=[{"role": "user", "content": parts}]))
    assert tok.decode(ids) == "<|user|>one\ntwo\n<|assistant|>"
