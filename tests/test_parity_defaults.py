"""Defaults and valid edge input, compared with vLLM 0.26: what the engine and the server do when a field is left
out. Each test cites the vLLM symbol whose behaviour it pins; tiny seeded models, no downloads."""

from __future__ import annotations

import pytest

from pagedkv.engine import LLM, SamplingParams

PROMPT = list(range(1, 41))  # 40 tokens: two full blocks of 16 and 8 more


class _Tokenizer:
    """A tokenizer whose EOS id is chosen by the test (no vocabulary: the prompts are token ids)."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id

    def decode(self, ids, **kw) -> str:
        return " ".join(map(str, ids))


def test_sampling_params_stop_token_ids_default_is_an_empty_list():
    """vLLM normalises ``stop_token_ids=None`` to ``[]`` as ``stop`` to ``[]`` (``vllm/sampling_params.py``:
    ``SamplingParams.__post_init__``)."""
    p = SamplingParams()
    assert p.stop_token_ids == [] and p.stop == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert p.verified().stop_token_ids == []


def test_the_tokenizers_eos_stops_generation(llama):
    """The tokenizer's EOS ends a request (``"stop"``, ``stop_reason`` None, its text left out) even when the model's
    generation config names no EOS: vLLM's input processor gives every request the tokenizer's EOS
    (``vllm/v1/engine/input_processor.py``: ``InputProcessor.process_inputs``, ``SamplingParams.
    update_from_generation_config`` in ``vllm/sampling_params.py``) and ``check_stop`` (``vllm/v1/core/sched/utils.py``)
    stops on it unless ``ignore_eos``."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    llm = LLM(llama, num_gpu_blocks=64, block_size=16)
    ref = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    eos = ref[3]
    first = ref.index(eos)
    llm.tokenizer = _Tokenizer(eos)
    out = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.text == " ".join(map(str, ref[:first]))  # the EOS is no part of the text
    ignored = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_the_tiny_tokenizer_declares_no_eos():
    """``pagedkv serve tiny`` promises completions that run to ``max_tokens``; since the engine now stops on the
    tokenizer's EOS as vLLM does (``vllm/renderers/base.py``: ``BaseRenderer.get_eos_token_id``), the tiny tokenizer
    declares none. ``<|endoftext|>`` stays special: skipped in decoded text."""
    from pagedkv.entrypoints.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    assert tok.eos_token_id is None
    end = tok.convert_tokens_to_ids("<|endoftext|>")
    assert end in tok.all_special_ids and tok.decode([end], skip_special_tokens=True) == ""


def test_parallel_sampling_reports_the_last_finished_childs_cached_tokens(llama):
    """With ``n > 1`` the ``RequestOutput`` is made when the last child finishes, with that child's
    ``num_cached_tokens`` (``vllm/v1/engine/output_processor.py``: ``RequestState.make_request_output``,
    ``ParentRequest.get_outputs`` in ``vllm/v1/engine/parallel_sampling.py``): children 1.. hit the prompt's full
    blocks that child 0 allocated in the same step, so a 40-token prompt reports 32, not child 0's 0."""
    llm = LLM(llama, num_gpu_blocks=64, block_size=16)
    (out,) = llm.generate([PROMPT], SamplingParams(n=3, max_tokens=4, seed=1), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.num_cached_tokens == 32
    single = llm.generate([list(range(100, 140))], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert single[0].num_cached_tokens == 0


# ---------------------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv():
    from test_serve import serving

    with serving("--enable-prompt-tokens-details") as s:
        yield s


def test_models_card_carries_a_permission(srv):
    """``/v1/models``: each card has vLLM's ``permission`` list, one ``ModelPermission`` (``vllm/entrypoints/openai/
    models/serving.py``: ``OpenAIModelRegistry.show_available_models``; ``vllm/entrypoints/openai/engine/protocol.py``:
    ``ModelPermission``)."""
    (card,) = srv.client.get("/v1/models").json()["data"]
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert (perm["allow_sampling"], perm["allow_logprobs"], perm["organization"]) == (True, True, "*")
    assert card["max_model_len"] == srv.llm.max_model_len and card["root"] == "tiny"


def test_completion_usage_cached_tokens_are_the_last_prompts(srv):
    """A non-streamed completion of several prompts reports the *last* prompt's cached tokens
    (``vllm/entrypoints/openai/completion/serving.py``: ``OpenAIServingCompletion.
    request_output_to_completion_response``, ``last_final_res.num_cached_tokens``): two equal 40-token prompts
    in one request, the second hits the first's two full blocks."""
    prompt = list(range(300, 340))
    r = srv.client.post("/v1/completions", json={"prompt": [prompt, prompt], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    # vLLM's PromptTokenUsageInfo, dumped whole (created_cache_tokens: chat's only; no multimodal input)
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32, "created_cache_tokens": None,
                                                          "multimodal_tokens": None}
    other = list(range(400, 440))
    r = srv.client.post("/v1/completions", json={"prompt": other, "max_tokens": 2, "n": 2, "seed": 3})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the last child's


def test_generate_without_params_takes_the_models_generation_config(llama):
    """``LLM.generate(prompts)`` with no ``SamplingParams`` uses ``get_default_sampling_params()``: vLLM's neutral
    defaults overridden by the generation config's temperature, top_k, top_p and ``max_new_tokens``
    (``vllm/entrypoints/llm.py``: ``LLM.get_default_sampling_params``; ``vllm/config/model.py``:
    ``ModelConfig.get_diff_sampling_param``), unless ``generation_config="vllm"``. The lab used plain
    ``SamplingParams()`` whatever the model's config said."""
    import copy

    model = copy.deepcopy(llama)
    model.generation_config.temperature, model.generation_config.max_new_tokens = 0.0, 5
    llm = LLM(model, num_gpu_blocks=64, block_size=16)
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)[0].outputs[0]
    assert llm.get_default_sampling_params().max_tokens == 5
    assert llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    assert llm.default_sampling_params == {"temperature": 0.0, "max_tokens": 5}
    neutral = LLM(model, num_gpu_blocks=64, block_size=16, generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    assert len(neutral.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match="generation_config must be 'auto'"):
        LLM(model, num_gpu_blocks=64, block_size=16, generation_config="model")
    model.generation_config.repetition_penalty, model.generation_config.min_p = 1.1, 0.05
    params = LLM(model, num_gpu_blocks=64, block_size=16).get_default_sampling_params()
    assert (params.temperature, params.max_tokens, params.repetition_penalty) == (0.0, 5, 1.1)
    assert params.min_p == 0.0  # greedy: min_p means nothing (vLLM resets it)


def test_the_server_fills_omitted_sampling_fields_from_the_generation_config():
    """A request that leaves out temperature, top_p or top_k gets the engine's defaults
    (``vllm/entrypoints/openai/completion/protocol.py``: ``CompletionRequest.to_sampling_params`` with the
    serving class's ``default_sampling_params``): here a generation config at temperature 0 makes it greedy."""
    from test_serve import completion, serving

    with serving() as s:
        s.llm.model.generation_config.temperature = 0.0
        omitted = completion(s, prompt=[9, 8, 7], max_tokens=8, return_token_ids=True)["choices"][0]["token_ids"]
        greedy = completion(s, prompt=[9, 8, 7], max_tokens=8, temperature=0,
                            return_token_ids=True)["choices"][0]["token_ids"]
        assert omitted == greedy


def test_a_chat_without_max_tokens_stops_at_the_generation_configs_max_new_tokens():
    """Chat's ``max_tokens`` left out is the room the context leaves, at most the generation config's
    ``max_new_tokens`` (``vllm/entrypoints/serve/utils/api_utils.py``: ``get_max_tokens`` with the serving class's
    ``default_sampling_params``)."""
    from test_serve import serving

    with serving() as s:
        s.llm.model.generation_config.max_new_tokens = 3
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]}
        r = s.client.post("/v1/chat/completions", json=body).json()
        assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length", r
        r = s.client.post("/v1/chat/completions", json={**body, "max_tokens": 5}).json()
        assert r["usage"]["completion_tokens"] == 5, r  # a request's own max_tokens wins


def test_version_endpoint(srv):
    """``GET /version`` answers ``{"version": ...}`` (``vllm/entrypoints/serve/instrumentator/basic.py``:
    ``show_version``), the lab's package version in place of vLLM's; it was a 404."""
    from importlib.metadata import version

    r = srv.client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": version("pagedkv-lab")}


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace decoder: "▁" is a space, and the text's first one is dropped)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "▁the": 5, "a": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_a_completion_is_decoded_as_it_continues_its_prompt():
    """vLLM's FastIncrementalDetokenizer (vllm/v1/engine/detokenizer.py) steps a DecodeStream primed with the
    prompt's ids: after the prompt "Hello", the tokens "▁world ▁the" read " world the", the space kept. The lab
    decoded the completion alone, "world the", in LLM.generate's text and in every streamed delta."""
    from pagedkv.engine.output_processor import RequestState, decode_output

    tok = _metaspace_tokenizer()
    assert tok.decode([4, 5]) == "world the"  # alone, the first space goes
    assert decode_output(tok, [4, 5], "length", False, [1, 3]) == " world the"
    assert decode_output(tok, [4, 5, 2], "stop", False, [1, 3]) == " world the"  # the stop token's text skipped
    state = RequestState("r", 0, [1, 3], SamplingParams(), [], False, tok)
    deltas = [state.add_tokens([t], None, None, 0.0) for t in (4, 5)]
    assert [d.text for d in deltas] == [" world", " the"] and state.text == " world the"


def test_a_character_cut_by_max_tokens_is_left_out_of_the_text():
    """A completion that ends inside a character (its last byte token not generated) has no U+FFFD at its end:
    vLLM's DecodeStream gives no text for an incomplete character."""
    from pagedkv.engine.output_processor import decode_output
    from pagedkv.entrypoints.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok("a中")["input_ids"]
    assert len(ids) > 2 and tok.decode(ids[:-1]).endswith("\ufffd")  # "中" is three byte tokens here
    assert decode_output(tok, ids[:-1], "length", False, [tok("x")["input_ids"][0]]) == "a"
    assert decode_output(tok, ids, "length", False, []) == "a中"
