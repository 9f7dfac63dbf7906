"""The lab's own Llama-family decoder (``pagedkv.engine.llama``) against transformers' modules: the same pieces
bit for bit, the same greedy tokens end to end, and the fall-back to transformers for every other model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import one_thread  # noqa: F401 (an autouse fixture: one torch thread)

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.llama import ARCHITECTURES, LlamaDecoder, apply_rotary, rms_norm, unsupported_reason
from pagedkv.engine.model_runner import TransformersDecoder, make_decoder
from pagedkv.engine.tiny_models import tiny_model


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 9), heads=st.integers(1, 4), half=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_rotary_and_norm_are_transformers_bit_for_bit(t, heads, half, seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(seed)
    d = 2 * half
    x = torch.randn(t, heads, d, generator=g)
    freqs = torch.rand(t, half, generator=g) * 10
    emb = torch.cat((freqs, freqs), dim=-1)  # transformers' layout: cos and sin of cat(freqs, freqs)
    cos, sin = emb.cos(), emb.sin()
    want, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary(x, cos, sin), want[0].transpose(0, 1))
    h = torch.randn(t, d, generator=g)
    norm = LlamaRMSNorm(d, eps=1e-5)
    norm.weight.data = torch.randn(d, generator=g)
    residual = torch.randn(t, d, generator=g)
    got, summed = rms_norm(h, norm.weight, 1e-5, residual.clone())
    assert torch.equal(summed, residual + h) and torch.equal(got, norm(residual + h))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2-sliding"])
def test_lab_decoder_and_transformers_give_hfs_tokens(family):
    """Both ``model_impl``s on the same prompts: greedy tokens equal to ``generate``'s (fused q/k/v and gate/up
    products change the last bits of the logits at most; no token here is that close)."""
    model = tiny_model(family, seed=3)
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(5)]  # some past the window
    want = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        want.append(out[0, len(p):].tolist())
    for impl in ("lab", "transformers"):
        llm = LLM(model, num_gpu_blocks=60, block_size=8, max_num_batched_tokens=24, model_impl=impl)
        expected = LlamaDecoder if impl == "lab" else TransformersDecoder
        assert isinstance(llm.runner.decoder, expected)
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, impl


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "olmo3"])
def test_other_families_run_transformers_modules(family):
    model = tiny_model(family)
    assert unsupported_reason(model) is not None
    assert isinstance(make_decoder(model), TransformersDecoder)
    with pytest.raises(ValueError, match="cannot run this model"):
        make_decoder(model, "lab")


def test_covered_families_and_bad_choices():
    for family in ("llama", "mistral", "qwen2-sliding"):
        model = tiny_model(family)
        assert type(model).__name__ in ARCHITECTURES and isinstance(make_decoder(model), LlamaDecoder)
    model = tiny_model("llama")
    model.model.layers[0].mlp.down_proj = torch.nn.Sequential(model.model.layers[0].mlp.down_proj)
    assert "nn.Linear" in unsupported_reason(model)  # a wrapped layer: not the lab's to run
    with pytest.raises(ValueError, match="model_impl must be one of"):
        make_decoder(model, "vllm")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        LLM(tiny_model("llama"), num_gpu_blocks=8, model_impl="fast")


def test_an_attention_plugged_in_as_pagedkv_is_the_one_called():
    """Exercise 07 registers the learner's attention under ``"pagedkv"`` (``plugged``): the engine then runs
    transformers' modules, which call it, not the lab's decoder, which would call the library's."""
    from pagedkv.engine.attention import paged_attention_forward
    from pagedkv.grading.lessons.l07_serving_engine import plugged, tiny_llama

    model = tiny_llama(1)
    prompts = [[5, 9, 14, 3], [7, 7, 2, 11, 30, 4]]
    llm = LLM(model, num_gpu_blocks=12, block_size=4, max_num_batched_tokens=8)
    assert isinstance(llm.runner.decoder, LlamaDecoder)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    calls = []

    def counted(layer, query, key, value, attention_mask, scaling=None, **kwargs):
        calls.append(layer.layer_idx)
        return paged_attention_forward(layer, query, key, value, attention_mask, scaling=scaling, **kwargs)

    with plugged(attention=counted):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls and got == want

    def wrong(layer, query, key, value, attention_mask, scaling=None, **kwargs):
        return torch.zeros_like(query).transpose(1, 2), None  # attends to nothing

    with plugged(attention=wrong):
        bad = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert bad != want
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want  # restored
