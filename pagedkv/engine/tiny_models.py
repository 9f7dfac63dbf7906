"""Tiny seeded models of every family the engine serves, built from a transformers config: no download.

What the tests and lessons 7-8 run on a laptop CPU: a few layers of hidden size 64, 4 query heads sharing 2 KV
heads (GQA), random weights from a seed, eager attention (transformers' plain reference) and no EOS token, so
every request runs to ``max_tokens``. Their tokens are gibberish; for checking that two ways of computing a
model agree token for token a random model is as good as a trained one.

The hybrid families keep their real layer patterns, with a short window so that prompts of a few dozen
tokens run far past it:

=================  ========================================  ==================================================
family             layers (S: sliding window, F: full)       as in
=================  ========================================  ==================================================
``llama``          F F                                       Llama 3
``qwen3``          F F                                       Qwen3 (q/k RMS norms per head)
``qwen2-sliding``  F S  (``max_window_layers=1``)            Qwen2 with ``use_sliding_window``
``qwen3-sliding``  F S  (``max_window_layers=1``)            Qwen3 with ``use_sliding_window``
``mistral``        S S  (every layer)                        Mistral 7B v0.1 (``sliding_window`` 4096)
``gemma3``         S S S S S F  (5 : 1)                      Gemma 3 (``sliding_window`` 512 or 1024)
``olmo3``          S S S F  (3 : 1)                          OLMo 3 (``sliding_window`` 4096)
=================  ========================================  ==================================================
"""

from __future__ import annotations

from typing import Any

import torch

#: The lesson 7 tiny model: 2 layers, hidden 64, GQA 4/2, no EOS token.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, eos_token_id=None, bos_token_id=None,
    pad_token_id=0,
)

#: The window of the tiny sliding-window families, in tokens.
TINY_WINDOW = 8

#: family -> (config class, model class, config fields beyond :data:`TINY_CONFIG`); ``"window"`` stands for the
#: family's ``sliding_window``.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(use_sliding_window=True, sliding_window="window", max_window_layers=1)),
    "qwen3-sliding": ("Qwen3Config", "Qwen3ForCausalLM",
                      dict(head_dim=16, use_sliding_window=True, sliding_window="window", max_window_layers=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window="window")),
    # Gemma 3 ties its embeddings and scales them by sqrt(hidden): at TINY_CONFIG's initializer range the input
    # embedding dominates every logit; 0.1 lets attention (and so the window) decide the tokens
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window="window",
                    initializer_range=0.1)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(num_hidden_layers=4, sliding_window="window")),
}


def seeded_tiny_model(config_cls: type, model_cls: type, seed: int = 0, **overrides: Any):
    """A ``model_cls`` of :data:`TINY_CONFIG` (and ``overrides``) with seeded random weights, eager attention
    and no EOS."""
    config = config_cls(**{**TINY_CONFIG, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_model(family: str = "llama", seed: int = 0, sliding_window: int = TINY_WINDOW, **overrides: Any):
    """The tiny model of ``family`` (a key of :data:`FAMILIES`), its sliding layers ``sliding_window`` tokens
    wide; ``overrides`` change any config field. ``ValueError`` for an unknown family."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}")
    config_name, model_name, extra = FAMILIES[family]
    fields = {k: sliding_window if v == "window" else v for k, v in extra.items()}
    return seeded_tiny_model(getattr(transformers, config_name), getattr(transformers, model_name), seed,
                             **{**fields, **overrides})
