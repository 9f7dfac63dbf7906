"""What sizing reads of a model: the shape numbers of its transformers config (``vllm/config/model.py``'s
``ModelConfig`` in vLLM 0.26) and what they imply on paper -- parameter count and peak activation bytes."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.utils import check_int, is_real

__all__ = ["ModelShape", "derived_max_model_len", "estimate_peak_activation", "get_and_verify_max_len", "model_shape",
           "num_parameters", "weights_bytes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer's config that sizing needs."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype: torch.dtype  # the config's dtype ("auto" resolves to it)
    max_position_embeddings: int | None


def _config_get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _config_dtype(config: Any) -> torch.dtype:
    value = _config_get(config, "dtype")
    if value is None and (isinstance(config, Mapping) or not hasattr(type(config), "torch_dtype")):
        value = _config_get(config, "torch_dtype")  # transformers 4's name (5 keeps it as a deprecated alias)
    if value is None:
        return torch.float32  # what transformers builds from a config that names no dtype
    dtype = value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the config's dtype {value!r} is not a torch dtype")
    if not dtype.is_floating_point:  # a model's weights and KV cache are floats (vLLM: "Unknown dtype")
        raise ValueError(f"the config's dtype {value!r} is not a floating-point dtype (float32, float16, bfloat16)")
    return dtype



def _text_config(config: Any) -> Any:
    """The language model's part of a config (vLLM's ``hf_text_config``): a multimodal config keeps its numbers in
    ``text_config``; a ``SimpleNamespace`` is read as its dict."""
    if isinstance(config, SimpleNamespace):
        config = vars(config)
    text = _config_get(config, "text_config")
    return text if text is not None and _config_get(config, "num_hidden_layers") is None else config


def model_shape(config: Any) -> ModelShape:
    """Read a transformers config (or any object or dict with the same attribute names) into a ModelShape.

    Follows vLLM 0.26's ``ModelConfig`` (``vllm/config/model.py``): ``num_key_value_heads`` defaults to
    ``num_attention_heads`` (multi-head attention), and an explicit ``head_dim`` wins over
    ``hidden_size // num_attention_heads`` (``get_head_size``) -- Qwen3-0.6B has 16 heads of 128 on a hidden size
    of 1024. Raises ``ValueError`` naming the first missing or invalid field.
    """
    if isinstance(config, ModelShape):
        return config
    config = _text_config(config)
    num_layers = check_int(_config_get(config, "num_hidden_layers"), "config.num_hidden_layers", 1)
    num_heads = check_int(_config_get(config, "num_attention_heads"), "config.num_attention_heads", 1)
    hidden = check_int(_config_get(config, "hidden_size"), "config.hidden_size", 1)
    kv = _config_get(config, "num_key_value_heads")
    num_kv_heads = num_heads if kv is None else check_int(kv, "config.num_key_value_heads", 1)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config.num_attention_heads ({num_heads}) must be a multiple of config.num_key_value_heads "
            f"({num_kv_heads})"
        )
    head_dim = _config_get(config, "head_dim")
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {num_heads}; set head_dim")
        head_dim = hidden // num_heads
    head_dim = check_int(head_dim, "config.head_dim", 1)
    # The optional numbers: None (or absent) takes the default; anything else must be a whole count, not a
    # negative, a float truncated by int() or a string (vLLM 0.26 reads them from a validated HF config).
    intermediate = _config_get(config, "intermediate_size")
    intermediate = 4 * hidden if intermediate is None else check_int(intermediate, "config.intermediate_size", 1)
    vocab = _config_get(config, "vocab_size")
    vocab = 0 if vocab is None else check_int(vocab, "config.vocab_size", 0)
    max_pos = _config_get(config, "max_position_embeddings")
    max_pos = None if max_pos is None else check_int(max_pos, "config.max_position_embeddings", 1)
    return ModelShape(
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(_config_get(config, "tie_word_embeddings", False)),
        dtype=_config_dtype(config),
        max_position_embeddings=max_pos,
    )


#: The config keys that can hold a model's length, in vLLM 0.26's order; the smallest present wins
#: (``ModelArchConfigConvertorBase.derive_max_model_len_and_key``,
#: ``vllm/transformers_utils/model_arch_config_convertor.py``).
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")

#: vLLM 0.26's length for a config that names none of :data:`MAX_LEN_KEYS` (``_get_and_verify_max_len``).
DEFAULT_MAX_LEN = 2048


def _rope_parameters(config: Any) -> dict[str, Mapping] | None:
    """The config's RoPE parameters as ``{layer type: parameters}`` (transformers 5's ``rope_parameters``, or 4's
    ``rope_scaling``), ``None`` without them; vLLM's ``is_rope_parameters_nested`` decides the nesting."""
    rope = _config_get(config, "rope_parameters")
    if rope is None:
        rope = _config_get(config, "rope_scaling")
    if not isinstance(rope, Mapping) or not rope:
        return None
    if all(isinstance(v, Mapping) for v in rope.values()):
        return dict(rope)
    return {"": rope}


def _rope_type(params: Mapping) -> str:
    return params.get("rope_type", params.get("type", "default"))  # "type": transformers 4's older name


def derived_max_model_len(config: Any) -> tuple[float, str | None]:
    """The longest request the model's config allows, and the key it came from, as vLLM 0.26 derives it before
    it looks at ``max_model_len``: the smallest of :data:`MAX_LEN_KEYS` present in the (text) config
    (``model_max_length`` wins when set, Command-R's rule; none present: :data:`DEFAULT_MAX_LEN`, with vLLM's
    warning), then scaled by the RoPE scaling factor of any RoPE type but ``su``, ``longrope`` and ``llama3`` (whose
    max_position_embeddings already counts it), a YaRN config counting from its
    ``original_max_position_embeddings``; Gemma 3's length is already scaled and is kept. So a Llama config of
    256 positions with ``rope_scaling={"rope_type": "linear", "factor": 2.0}`` allows 512. Mirrors
    ``_get_and_verify_max_len`` (``vllm/config/model.py``; its sliding-window cap applies only under
    ``disable_sliding_window``, which the lab does not have, and the tokenizer's ``model_max_length`` only to
    pooling models). Pure: changes nothing."""
    text = _text_config(config)
    derived, key = math.inf, None
    for name in MAX_LEN_KEYS:
        value = _config_get(text, name)
        if value is not None and value < derived:
            derived, key = value, name
    if model_max_length := _config_get(text, "model_max_length"):
        derived, key = model_max_length, "model_max_length"
    if derived == math.inf:
        logger.warning("The model's config.json does not contain any of the keys to determine the original maximum "
                       "length of the model. Assuming the model's maximum length is %d.", DEFAULT_MAX_LEN)
        derived = DEFAULT_MAX_LEN
    rope = _rope_parameters(text)
    if rope is not None and "gemma3" not in str(_config_get(text, "model_type", "")):
        factor = 1.0
        for params in rope.values():
            rope_type = _rope_type(params)
            if rope_type not in ("su", "longrope", "llama3"):
                factor = params.get("factor", factor)
                if rope_type == "yarn":
                    derived = params["original_max_position_embeddings"]
        derived *= 1.0 if factor is None else factor
    return derived, key


def get_and_verify_max_len(config: Any, max_model_len: int | None) -> int:
    """The request length an engine serves: ``max_model_len`` when given and allowed, otherwise the config's
    :func:`derived_max_model_len` (``-1``, auto-fit, starts from it too; a LongRoPE model from its
    ``original_max_position_embeddings``). A length above the derived one is refused with vLLM 0.26's message
    unless the config's ``model_max_length`` allows it or ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` is set (then
    vLLM's warning is logged: positions past what the model was trained on give it garbage, not an error).
    Mirrors ``_get_and_verify_max_len`` (``vllm/config/model.py``) for a generative model. Pure."""
    derived, key = derived_max_model_len(config)
    text = _text_config(config)
    if max_model_len is None or max_model_len == -1:
        rope = _rope_parameters(text) or {}
        if any(_rope_type(p) == "longrope" for p in rope.values()):
            return int(_config_get(text, "original_max_position_embeddings", derived))
        return int(derived)
    if max_model_len > derived:
        model_max_length = _config_get(text, "model_max_length")
        if model_max_length is None or max_model_len > model_max_length:
            msg = (f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
                   f"({key}={derived} or model_max_length={model_max_length} in model's config.json).")
            warning = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with extreme caution. If the model uses relative "
                       "position encoding (RoPE), positions exceeding derived_max_model_len lead to nan. If the "
                       "model uses absolute position encoding, positions exceeding derived_max_model_len will "
                       "cause a CUDA array out-of-bounds error.")
            if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true"):
                logger.warning("%s %s", msg, warning)
            else:
                raise ValueError(f"{msg} To allow overriding this maximum, set the env var "
                                 f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. {warning}")
    return int(max_model_len)


def num_parameters(config: Any) -> int:
    """Parameters of a Llama-style decoder (Llama, Mistral, Qwen2/3): embeddings, per layer the q/k/v/o
    projections, a gated MLP (gate, up, down) and two RMSNorms, a final norm, and an LM head unless it is tied
    to the embeddings. Biases (Qwen2's q/k/v) and Qwen3's q/k norms are left out: they are < 0.1 %. No vLLM
    counterpart: vLLM measures the weights it loaded (``GPUModelRunner.model_memory_usage``)."""
    s = model_shape(config)
    q = s.num_attention_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    attention = s.hidden_size * (q + 2 * kv) + q * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    per_layer = attention + mlp + 2 * s.hidden_size
    embeddings = s.vocab_size * s.hidden_size
    lm_head = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
    return embeddings + s.num_layers * per_layer + s.hidden_size + lm_head


def weights_bytes(config: Any, weight_bits: float | None = None) -> int:
    """The weights' bytes, ``ceil(num_parameters * weight_bits / 8)``: ``weight_bits`` per parameter, by default the
    model dtype's (16 for bf16; 4 for a 4-bit quantisation). ``ValueError`` unless it is a finite number > 0."""
    bits = model_shape(config).dtype.itemsize * 8 if weight_bits is None else weight_bits
    if not is_real(bits) or not 0 < bits < math.inf:
        raise ValueError(f"weight_bits must be > 0, got {weight_bits!r}")
    return math.ceil(num_parameters(config) * bits / 8)


def estimate_peak_activation(
    config: Any, num_tokens: int, dtype: torch.dtype | None = None, num_logit_rows: int | None = None
) -> int:
    """An estimate of the peak activation bytes of one forward pass over ``num_tokens`` tokens -- what vLLM
    measures as the torch peak increase of its profile run. Layers run one after another and free their
    intermediates, so the peak is one layer's widest moment, not a sum over layers::

        num_tokens * dtype_bytes * (4 * hidden + max(3 * intermediate, 3 * q_width + 4 * kv_width))
        + num_logit_rows * vocab * 4        # float32 logits of the sampled positions

    (residual stream, its normed copy, the layer input and output; the MLP's gate, up and their product, or
    attention's q, k, v, their rotated copies and the output). ``num_logit_rows`` defaults to
    ``min(num_tokens, 256)``: vLLM's profile run makes ``min(num_tokens, max_num_reqs)`` dummy requests and
    computes logits for one token of each (Model Runner V2, ``vllm/v1/worker/gpu/model_runner.py``:
    ``GPUModelRunner._dummy_run`` and ``_dummy_sampler_run``; the V1 runner's ``gpu_model_runner.py`` does the
    same), and ``max_num_seqs`` defaults to 256. An estimate, not vLLM's number: on a GPU
    :func:`profile` measures it.
    """
    s = model_shape(config)
    num_tokens = check_int(num_tokens, "num_tokens", 1)
    dtype = s.dtype if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch dtype or None (the config's), got {dtype!r}")
    rows = min(num_tokens, 256) if num_logit_rows is None else check_int(num_logit_rows, "num_logit_rows", 0)
    q_width = s.num_attention_heads * s.head_dim
    kv_width = s.num_kv_heads * s.head_dim
    widest = max(3 * s.intermediate_size, 3 * q_width + 4 * kv_width)
    return num_tokens * dtype.itemsize * (4 * s.hidden_size + widest) + rows * s.vocab_size * 4

