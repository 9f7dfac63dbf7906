"""Sizing the pool: how many KV blocks fit on the device, computed the way vLLM 0.26 computes it.

vLLM 0.26 sizes its block pool once, at start-up, in three steps:

1. ``vllm/v1/worker/utils.py::request_memory``: the memory the engine may use is
   ``requested = math.ceil(total_memory * gpu_memory_utilization)`` (``CacheConfig.gpu_memory_utilization``
   defaults to 0.92, ``vllm/config/cache.py``).
2. ``vllm/v1/worker/gpu_worker.py::determine_available_memory`` runs a dummy forward pass of
   ``max_num_batched_tokens`` tokens inside ``vllm/utils/mem_utils.py::memory_profiling`` and subtracts
   everything that is not KV cache: the weights, the peak increase of torch's allocated bytes during the run
   (activations), the increase of memory that torch does not allocate (CUDA context, cuBLAS workspaces, NCCL)
   and, by default since v0.21 (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``), an estimate of the CUDA-graph
   pool measured by capturing graphs (``gpu_model_runner.py::profile_cudagraph_memory``)::

       available = requested - (non_torch + peak_activation + weights) - cudagraph

3. ``vllm/v1/core/kv_cache_utils.py::get_num_blocks`` (called by ``get_kv_cache_config_from_groups``) divides
   what is left by the bytes one block takes in one layer (``FullAttentionSpec.page_size_bytes``,
   ``vllm/v1/kv_cache_interface.py``: ``2 * block_size * num_kv_heads * head_size * dtype_size``) and by the
   number of layers, each layer having its own tensor of ``num_blocks`` pages::

       num_blocks = int(available // page_size // num_layers)

``num_gpu_blocks_override`` and ``kv_cache_memory_bytes`` (``vllm/config/cache.py``) skip the arithmetic; the
lab's engine takes ``num_gpu_blocks`` for the same purpose.

:func:`profile` does the whole thing for a loaded model: on a CUDA GPU it measures, as vLLM does; on a CPU
(a laptop) it computes the same breakdown analytically, labelled as such, against a small stated budget
(:data:`CPU_TOTAL_MEMORY`), because a CPU has no device memory of its own to profile.

The exercise set asks for ``kv_page_bytes``, ``num_gpu_blocks`` and a prediction like ``analytic_profile``; the
library's own callers use private twins (``_num_gpu_blocks``, ...), so that the public answers can be hidden
while one exercise is graded and :func:`profile` still works in the others. The grader hides an exercise's
twins with its answers (``pagedkv.grading.sandbox.with_private_twins``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import numbers
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "CPU_TOTAL_MEMORY",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "GiB",
    "KV_CACHE_DTYPES",
    "MemoryProfile",
    "MemoryProfilingResult",
    "MemorySnapshot",
    "ModelShape",
    "analytic_profile",
    "estimate_peak_activation",
    "format_gib",
    "kv_page_bytes",
    "max_concurrency",
    "memory_profiling",
    "model_shape",
    "num_gpu_blocks",
    "num_parameters",
    "profile",
    "request_memory",
    "resolve_kv_cache_dtype",
]

GiB = 1 << 30

#: ``CacheConfig.gpu_memory_utilization``'s default in vLLM 0.26 (``vllm/config/cache.py``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92

#: The "device memory" a CPU profile assumes when ``total_memory`` is not given: 512 MiB. A CPU has no
#: device memory to measure, and the KV cache lives in the same RAM as the notebook, the browser and the OS;
#: at 0.92 this leaves about 0.45 GiB of KV for a tiny model -- tens of thousands of blocks, far more than any
#: CPU lesson needs, and small enough that several kernels on an 8 GB laptop (or a busy CI box) stay within
#: memory. Pass ``total_memory`` to size for a real device instead.
CPU_TOTAL_MEMORY = 512 * (1 << 20)

#: The KV cache dtypes accepted by name: vLLM's ``CacheDType`` spellings (``vllm/config/cache.py``) for the
#: 16-bit and FP8 caches, plus float32 (the lab's CPU models run in float32). "fp8" means e4m3, as in vLLM.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def format_gib(b: int | float) -> str:
    """Bytes as GiB rounded to 2 places, exactly as vLLM 0.26 prints them (``vllm/utils/mem_utils.py::format_gib``)."""
    return f"{round(b / GiB, 2)}"


# --- model shapes --------------------------------------------------------------------------------------------


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
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise ValueError(f"the config's dtype {value!r} is not a torch dtype")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be an int > 0, got {value!r}")
    return int(value)


def model_shape(config: Any) -> ModelShape:
    """Read a transformers config (or any object or dict with the same attribute names) into a ModelShape.

    Follows vLLM 0.26's ``ModelConfig`` (``vllm/config/model.py``): ``num_key_value_heads`` defaults to
    ``num_attention_heads`` (multi-head attention), and an explicit ``head_dim`` wins over
    ``hidden_size // num_attention_heads`` (``get_head_size``) -- Qwen3-0.6B has 16 heads of 128 on a hidden size
    of 1024. Raises ``ValueError`` naming the first missing or invalid field.
    """
    if isinstance(config, ModelShape):
        return config
    if isinstance(config, SimpleNamespace):
        config = vars(config)
    text = _config_get(config, "text_config")
    if text is not None and _config_get(config, "num_hidden_layers") is None:
        config = text  # a multimodal config keeps the language model's numbers in text_config
    num_layers = _positive_int(_config_get(config, "num_hidden_layers"), "config.num_hidden_layers")
    num_heads = _positive_int(_config_get(config, "num_attention_heads"), "config.num_attention_heads")
    hidden = _positive_int(_config_get(config, "hidden_size"), "config.hidden_size")
    kv = _config_get(config, "num_key_value_heads")
    num_kv_heads = num_heads if kv is None else _positive_int(kv, "config.num_key_value_heads")
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
    head_dim = _positive_int(head_dim, "config.head_dim")
    intermediate = _config_get(config, "intermediate_size") or 4 * hidden
    vocab = _config_get(config, "vocab_size") or 0
    max_pos = _config_get(config, "max_position_embeddings")
    return ModelShape(
        num_layers=num_layers,
        num_attention_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(intermediate),
        vocab_size=int(vocab),
        tie_word_embeddings=bool(_config_get(config, "tie_word_embeddings", False)),
        dtype=_config_dtype(config),
        max_position_embeddings=None if max_pos is None else int(max_pos),
    )


def resolve_kv_cache_dtype(kv_cache_dtype: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype a KV cache of ``kv_cache_dtype`` stores, as ``vllm/utils/torch_utils.py::
    kv_cache_dtype_str_to_dtype`` resolves it: "auto" is the model's dtype; "fp8" is e4m3 (vLLM stores it as
    ``uint8``, one byte either way). Differs on purpose: vLLM serves a float32 config in bfloat16 under "auto"
    (``config/model.py::_resolve_auto_dtype``); the lab keeps the dtype the model actually runs in."""
    if isinstance(kv_cache_dtype, torch.dtype):
        if kv_cache_dtype.is_complex or kv_cache_dtype == torch.bool:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype} cannot hold keys and values")
        return kv_cache_dtype
    if kv_cache_dtype == "auto":
        return model_dtype
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    raise ValueError(
        f"unknown kv_cache_dtype {kv_cache_dtype!r}: use 'auto', 'fp16', 'bf16', 'fp32', 'fp8' (e4m3) or a torch dtype"
    )


def kv_page_bytes(config: Any, block_size: int = 16, kv_cache_dtype: str | torch.dtype = "auto") -> int:
    """Bytes one block takes in ONE layer: ``2 * block_size * num_kv_heads * head_dim * dtype_bytes``.

    The 2 is one page of keys and one of values. Only the KV heads count (grouped-query attention shares each
    among ``num_attention_heads // num_kv_heads`` query heads). Mirrors
    ``vllm/v1/kv_cache_interface.py::AttentionSpec.real_page_size_bytes`` (what ``FullAttentionSpec.page_size_bytes``
    returns when nothing pads it). Reads ``config`` only; raises ``ValueError`` on a bad block size or dtype.
    """
    block_size = _positive_int(block_size, "block_size")
    shape = model_shape(config)
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, shape.dtype)
    return 2 * block_size * shape.num_kv_heads * shape.head_dim * dtype.itemsize


# --- the arithmetic ------------------------------------------------------------------------------------------


def _memory_figure(value: Any, name: str) -> int:
    """A byte count: an int >= 0, or a float holding a whole number (``80e9``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name} must be a whole number of bytes, got {value!r}")
    return int(value)


def _check_utilization(utilization: Any) -> float:
    if isinstance(utilization, bool) or not isinstance(utilization, numbers.Real) or not 0 < utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1] (vLLM's CacheConfig: gt=0, le=1), got {utilization!r}"
        )
    return float(utilization)


def request_memory(total: int, utilization: float) -> int:
    """The bytes the engine may use: ``math.ceil(total * utilization)``, as
    ``vllm/v1/worker/utils.py::request_memory`` computes it (float product, then ceil)."""
    return _request_memory(total, utilization)


def _request_memory(total: int, utilization: float) -> int:
    total = _memory_figure(total, "total")
    if total == 0:
        raise ValueError("total memory must be > 0 bytes")
    return math.ceil(total * _check_utilization(utilization))


def num_gpu_blocks(
    total: int,
    utilization: float,
    weights: int,
    peak_activation: int,
    non_torch: int,
    cudagraph: int,
    page_bytes: int,
    num_layers: int,
) -> int:
    """The number of KV blocks vLLM 0.26 allocates, from its profile's figures (all in bytes).

    ``requested = ceil(total * utilization)`` (``worker/utils.py::request_memory``);
    ``available = requested - (non_torch + peak_activation + weights) - cudagraph``
    (``gpu_worker.py::determine_available_memory``); ``int(available // page_bytes // num_layers)``
    (``core/kv_cache_utils.py::get_num_blocks``), where ``page_bytes`` is one block in one layer
    (:func:`kv_page_bytes`). Pure: changes nothing. Raises ``ValueError`` for a utilization outside (0, 1], a
    negative figure, and when nothing is left for the cache (vLLM's
    ``kv_cache_utils.py::_check_enough_kv_cache_memory`` refuses ``available <= 0``), saying by how much the
    non-KV memory exceeds the budget and what to lower.
    """
    return _num_gpu_blocks(total, utilization, weights, peak_activation, non_torch, cudagraph, page_bytes, num_layers)


def _num_gpu_blocks(
    total: int,
    utilization: float,
    weights: int,
    peak_activation: int,
    non_torch: int,
    cudagraph: int,
    page_bytes: int,
    num_layers: int,
) -> int:
    """The implementation of :func:`num_gpu_blocks` (the library calls this one)."""
    utilization = _check_utilization(utilization)
    requested = _request_memory(total, utilization)
    weights = _memory_figure(weights, "weights")
    peak_activation = _memory_figure(peak_activation, "peak_activation")
    non_torch = _memory_figure(non_torch, "non_torch")
    cudagraph = _memory_figure(cudagraph, "cudagraph")
    page_bytes = _positive_int(page_bytes, "page_bytes")
    num_layers = _positive_int(num_layers, "num_layers")
    non_kv = non_torch + peak_activation + weights
    available = requested - non_kv - cudagraph
    if available <= 0:
        raise ValueError(
            f"no memory left for the KV cache: weights {format_gib(weights)} GiB + peak activations "
            f"{format_gib(peak_activation)} GiB + non-torch {format_gib(non_torch)} GiB + CUDA graphs "
            f"{format_gib(cudagraph)} GiB = {format_gib(non_kv + cudagraph)} GiB, which exceeds the requested "
            f"{format_gib(requested)} GiB (= ceil({total} * {utilization})) by {format_gib(-available)} GiB "
            f"({-available} bytes). Raise gpu_memory_utilization, lower max_num_batched_tokens (activations), "
            "quantise the weights, or turn CUDA graphs off."
        )
    return int(available // page_bytes // num_layers)


def max_concurrency(num_blocks: int, block_size: int, num_tokens: int) -> float:
    """How many requests of ``num_tokens`` tokens the pool holds at once: ``num_blocks / cdiv(num_tokens,
    block_size)``, as ``vllm/v1/core/kv_cache_utils.py::get_max_concurrency_for_kv_cache_config`` computes it
    for one full-attention group (its per-layer factors cancel). Like vLLM, counts every block, the null
    block included."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, numbers.Integral) or num_blocks < 0:
        raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
    block_size = _positive_int(block_size, "block_size")
    num_tokens = _positive_int(num_tokens, "num_tokens")
    return num_blocks / -(-num_tokens // block_size)


# --- parameters and activations, analytically ----------------------------------------------------------------


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
    ``min(num_tokens, 256)``: vLLM's profile samples one token per request (``gpu_model_runner.py::
    _dummy_sampler_run``) and ``max_num_seqs`` defaults to 256. An estimate, not vLLM's number: on a GPU
    :func:`profile` measures it.
    """
    s = model_shape(config)
    num_tokens = _positive_int(num_tokens, "num_tokens")
    dtype = s.dtype if dtype is None else dtype
    rows = min(num_tokens, 256) if num_logit_rows is None else num_logit_rows
    q_width = s.num_attention_heads * s.head_dim
    kv_width = s.num_kv_heads * s.head_dim
    widest = max(3 * s.intermediate_size, 3 * q_width + 4 * kv_width)
    return num_tokens * dtype.itemsize * (4 * s.hidden_size + widest) + rows * s.vocab_size * 4


# --- the result ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryProfile:
    """Where the device's memory goes, and how many KV blocks are left: the figures vLLM 0.26 logs at start-up.

    ``method`` is "measured" (a profile run on a CUDA GPU) or "analytic" (computed; a CPU has no device memory
    to measure). All figures in bytes. ``page_size_bytes`` is one block in one layer.
    """

    method: str
    device: str
    total_memory: int
    gpu_memory_utilization: float
    requested_memory: int
    weights_memory: int
    peak_activation_memory: int
    non_torch_memory: int
    cudagraph_memory: int
    page_size_bytes: int
    num_layers: int
    block_size: int
    kv_cache_dtype: torch.dtype
    max_num_batched_tokens: int
    max_model_len: int
    num_gpu_blocks: int
    notes: tuple[str, ...] = field(default=())

    @property
    def non_kv_cache_memory(self) -> int:
        """``non_torch + peak_activation + weights`` (``MemoryProfilingResult.non_kv_cache_memory``)."""
        return self.non_torch_memory + self.peak_activation_memory + self.weights_memory

    @property
    def available_kv_cache_memory(self) -> int:
        """``requested - non_kv - cudagraph`` (``Worker.available_kv_cache_memory_bytes``)."""
        return self.requested_memory - self.non_kv_cache_memory - self.cudagraph_memory

    @property
    def kv_cache_memory(self) -> int:
        """The bytes the cache actually takes: whole blocks in every layer (the rest of the available bytes is
        the remainder of the division, left unused)."""
        return self.num_gpu_blocks * self.page_size_bytes * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers (``page_size_bytes * num_layers / block_size``)."""
        return self.page_size_bytes * self.num_layers // self.block_size

    def max_concurrency(self, num_tokens: int | None = None) -> float:
        """Requests of ``num_tokens`` tokens (default ``max_model_len``) the pool holds at once (vLLM's
        "Maximum concurrency"; see :func:`max_concurrency`)."""
        return max_concurrency(self.num_gpu_blocks, self.block_size, num_tokens or self.max_model_len)

    def kv_cache_size_tokens(self, num_tokens: int | None = None) -> int:
        """vLLM's "GPU KV cache size" in tokens: ``int(max_concurrency * max_model_len)``
        (``kv_cache_utils.py::get_kv_cache_capacity``)."""
        num_tokens = num_tokens or self.max_model_len
        return int(self.max_concurrency(num_tokens) * num_tokens)

    def breakdown(self) -> dict[str, int]:
        """The requested memory split into its parts, in bytes, for a stacked bar (they sum to
        ``requested_memory``). The lab's own view: vLLM logs the same figures as lines (``MemoryProfilingResult``)."""
        return {
            "weights": self.weights_memory,
            "peak activations": self.peak_activation_memory,
            "non-torch": self.non_torch_memory,
            "CUDA graphs": self.cudagraph_memory,
            "KV cache": self.kv_cache_memory,
            "unused remainder": self.available_kv_cache_memory - self.kv_cache_memory,
        }

    def __str__(self) -> str:
        L = self.max_model_len
        label = "measured" if self.method == "measured" else f"analytic estimate on {self.device}, not measured"
        lines = [
            f"Memory profiling ({label}): total memory {format_gib(self.total_memory)} GiB, requested memory "
            f"{format_gib(self.requested_memory)} GiB (gpu_memory_utilization={self.gpu_memory_utilization}), "
            f"dummy batch of {self.max_num_batched_tokens:,} tokens.",
            f"Total non KV cache memory: {format_gib(self.non_kv_cache_memory)}GiB; torch peak memory increase: "
            f"{format_gib(self.peak_activation_memory)}GiB; non-torch forward increase memory: "
            f"{format_gib(self.non_torch_memory)}GiB; weights memory: {format_gib(self.weights_memory)}GiB.",
            f"Estimated CUDA graph memory: {self.cudagraph_memory / GiB:.2f} GiB total",
            f"Available KV cache memory: {format_gib(self.available_kv_cache_memory)} GiB",
            f"KV cache: {self.page_size_bytes:,} bytes per block per layer ({self.block_size} tokens, "
            f"{str(self.kv_cache_dtype).removeprefix('torch.')}) x {self.num_layers} layers",
            f"GPU KV cache size: {self.kv_cache_size_tokens():,} tokens",
            f"Maximum concurrency for {L:,} tokens per request: {self.max_concurrency():.2f}x",
            f"# GPU blocks: {self.num_gpu_blocks}, concurrency for {L}-token requests: {self.max_concurrency():.2f}x",
        ]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)


def _check_enough_kv_cache_memory(available: int, page_bytes: int, num_layers: int, block_size: int, max_len: int):
    """vLLM 0.26's ``kv_cache_utils.py::check_enough_kv_cache_memory`` for one full-attention group: one request
    of ``max_model_len`` tokens must fit (``cdiv(max_model_len, block_size) * page_size`` per layer)."""
    needed = -(-max_len // block_size) * page_bytes * num_layers
    if needed > available:
        max_fit = available // (page_bytes * num_layers) * block_size
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_len}), {format_gib(needed)} GiB "
            f"KV cache is needed, which is larger than the available KV cache memory ({format_gib(available)} "
            f"GiB). Based on the available memory, the estimated maximum model length is {max_fit}. Lower "
            "max_model_len, or raise gpu_memory_utilization / total_memory."
        )


def analytic_profile(
    config: Any,
    max_num_batched_tokens: int,
    *,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    total_memory: int = CPU_TOTAL_MEMORY,
    weights_memory: int | None = None,
    weight_bits: float | None = None,
    peak_activation_memory: int | None = None,
    non_torch_memory: int = 0,
    cudagraph_memory: int = 0,
    max_model_len: int | None = None,
    device: str = "cpu",
    notes: tuple[str, ...] = (),
) -> MemoryProfile:
    """vLLM's start-up breakdown computed on paper for a model ``config``, every term given or estimated.

    ``weights_memory`` defaults to :func:`num_parameters` at ``weight_bits`` bits each (default: the config's
    dtype; 4 for 4-bit quantised weights, ignoring the quantisation scales); ``peak_activation_memory`` to
    :func:`estimate_peak_activation` at ``max_num_batched_tokens``; non-torch and CUDA-graph memory to 0 (a CPU
    has neither; pass figures from a vLLM log to model a GPU). ``max_model_len`` defaults to the config's
    ``max_position_embeddings``. Then the same arithmetic as :func:`num_gpu_blocks`, and vLLM's check that one
    ``max_model_len`` request fits. Returns a new MemoryProfile; changes nothing.
    """
    return _analytic_profile(
        config,
        max_num_batched_tokens,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=gpu_memory_utilization,
        total_memory=total_memory,
        weights_memory=weights_memory,
        weight_bits=weight_bits,
        peak_activation_memory=peak_activation_memory,
        non_torch_memory=non_torch_memory,
        cudagraph_memory=cudagraph_memory,
        max_model_len=max_model_len,
        device=device,
        notes=notes,
    )


def _analytic_profile(
    config: Any,
    max_num_batched_tokens: int,
    *,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    total_memory: int = CPU_TOTAL_MEMORY,
    weights_memory: int | None = None,
    weight_bits: float | None = None,
    peak_activation_memory: int | None = None,
    non_torch_memory: int = 0,
    cudagraph_memory: int = 0,
    max_model_len: int | None = None,
    device: str = "cpu",
    notes: tuple[str, ...] = (),
) -> MemoryProfile:
    """The implementation of :func:`analytic_profile` (the library calls this one)."""
    shape = model_shape(config)
    block_size = _positive_int(block_size, "block_size")
    max_num_batched_tokens = _positive_int(max_num_batched_tokens, "max_num_batched_tokens")
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, shape.dtype)
    utilization = _check_utilization(gpu_memory_utilization)
    if weights_memory is None:
        bits = shape.dtype.itemsize * 8 if weight_bits is None else weight_bits
        if isinstance(bits, bool) or not isinstance(bits, numbers.Real) or bits <= 0:
            raise ValueError(f"weight_bits must be > 0, got {weight_bits!r}")
        weights_memory = math.ceil(num_parameters(config) * bits / 8)
    if peak_activation_memory is None:
        peak_activation_memory = estimate_peak_activation(config, max_num_batched_tokens)
    if max_model_len is None:
        max_model_len = shape.max_position_embeddings or 2048
    max_model_len = _positive_int(max_model_len, "max_model_len")
    page = 2 * block_size * shape.num_kv_heads * shape.head_dim * kv_dtype.itemsize
    blocks = _num_gpu_blocks(
        total_memory,
        utilization,
        weights_memory,
        peak_activation_memory,
        non_torch_memory,
        cudagraph_memory,
        page,
        shape.num_layers,
    )
    requested = _request_memory(total_memory, utilization)
    available = requested - non_torch_memory - peak_activation_memory - weights_memory - cudagraph_memory
    _check_enough_kv_cache_memory(available, page, shape.num_layers, block_size, max_model_len)
    return MemoryProfile(
        method="analytic",
        device=device,
        total_memory=int(total_memory),
        gpu_memory_utilization=utilization,
        requested_memory=requested,
        weights_memory=int(weights_memory),
        peak_activation_memory=int(peak_activation_memory),
        non_torch_memory=int(non_torch_memory),
        cudagraph_memory=int(cudagraph_memory),
        page_size_bytes=page,
        num_layers=shape.num_layers,
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_gpu_blocks=blocks,
        notes=tuple(notes),
    )


# --- measuring on a CUDA GPU (vllm/utils/mem_utils.py) -------------------------------------------------------


@dataclass
class MemorySnapshot:
    """Device memory at one moment, as ``vllm/utils/mem_utils.py::MemorySnapshot`` measures it: torch's peak
    allocated bytes, free and total from ``mem_get_info``, and what the process holds outside torch's pool
    (``non_torch = (total - free) - torch.cuda.memory_reserved()``, which also counts other processes)."""

    torch_peak: int = 0
    free_memory: int = 0
    total_memory: int = 0
    cuda_memory: int = 0
    torch_memory: int = 0
    non_torch_memory: int = 0
    timestamp: float = 0.0

    @classmethod
    def measure(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        cuda_memory = total - free
        torch_memory = torch.cuda.memory_reserved(device)
        return cls(
            torch_peak=torch.cuda.memory_stats(device).get("allocated_bytes.all.peak", 0),
            free_memory=free,
            total_memory=total,
            cuda_memory=cuda_memory,
            torch_memory=torch_memory,
            non_torch_memory=cuda_memory - torch_memory,
            timestamp=time.time(),
        )

    def __sub__(self, other: MemorySnapshot) -> MemorySnapshot:
        return MemorySnapshot(
            *(
                getattr(self, f) - getattr(other, f)
                for f in (
                    "torch_peak",
                    "free_memory",
                    "total_memory",
                    "cuda_memory",
                    "torch_memory",
                    "non_torch_memory",
                    "timestamp",
                )
            )
        )


@dataclass
class MemoryProfilingResult:
    """``vllm/utils/mem_utils.py::MemoryProfilingResult``: the figures of one profile run, in bytes."""

    baseline: MemorySnapshot
    weights_memory: int = 0
    torch_peak_increase: int = 0
    non_torch_increase: int = 0
    before_profile: MemorySnapshot | None = None
    after_profile: MemorySnapshot | None = None
    profile_time: float = 0.0

    @property
    def non_kv_cache_memory(self) -> int:
        return self.non_torch_increase + self.torch_peak_increase + self.weights_memory


@contextlib.contextmanager
def memory_profiling(
    baseline: MemorySnapshot, device: torch.device, weights_memory: int = 0
) -> Generator[MemoryProfilingResult, None, None]:
    """Measure the memory of the code run inside, as ``vllm/utils/mem_utils.py::memory_profiling`` does: reset
    torch's peak counter, snapshot, run, free the cache, snapshot again; the torch peak increase is the
    activations' peak, the non-torch increase since ``baseline`` is the CUDA context's growth (cuBLAS, NCCL,
    attention workspaces). Needs CUDA."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    result = MemoryProfilingResult(baseline=baseline, weights_memory=weights_memory)
    result.before_profile = MemorySnapshot.measure(device)
    yield result
    gc.collect()
    torch.cuda.empty_cache()
    result.after_profile = MemorySnapshot.measure(device)
    diff = result.after_profile - result.before_profile
    result.torch_peak_increase = diff.torch_peak
    result.non_torch_increase = (result.after_profile - baseline).non_torch_memory
    result.profile_time = diff.timestamp


# --- profile(): the engine's entry point ---------------------------------------------------------------------


def _find_hf_model(obj: Any) -> torch.nn.Module:
    """The transformers model inside ``obj``: the model itself, or an engine's ``model_runner.model`` / ``model``."""
    if isinstance(obj, torch.nn.Module):
        return obj
    for path in (("model_runner", "model"), ("model",), ("llm_engine", "model_runner", "model")):
        cur = obj
        for name in path:
            cur = getattr(cur, name, None)
        if isinstance(cur, torch.nn.Module):
            return cur
    raise ValueError(
        f"profile() needs a transformers model or an engine holding one (.model_runner.model or .model), "
        f"got {type(obj).__name__}"
    )


def _module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each tensor's storage counted once, so tied weights once):
    vLLM measures ``model_memory_usage`` as the memory loading took, which is the same for a loaded model."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _hf_dummy_run(model: torch.nn.Module, num_tokens: int, num_logit_rows: int, device: torch.device) -> None:
    """One forward pass over ``num_tokens`` tokens without a KV cache, logits for the last ``num_logit_rows``
    positions only (vLLM computes logits for one sampled position per request, never for all tokens)."""
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)  # ids: [1, T]
    with torch.inference_mode():
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        hidden = decoder(input_ids=ids, use_cache=False)[0]  # hidden: [1, T, H]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            head(hidden[:, -num_logit_rows:]).float()  # logits: [1, rows, V], float32 as the sampler upcasts
    torch.cuda.synchronize(device)


def _hf_cudagraph_memory(model: torch.nn.Module, batch_sizes: tuple[int, ...], device: torch.device) -> int:
    """Capture decode graphs (one token per sequence, no KV cache) for ``batch_sizes``, largest first, and
    estimate the graph pool as ``gpu_model_runner.py::profile_cudagraph_memory`` does: the first capture's
    memory plus (n - 1) times the second's (at least 1 MiB each). Graphs are discarded afterwards."""
    sizes = sorted(set(batch_sizes), reverse=True)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in sizes):
        raise ValueError(f"cudagraph_batch_sizes must be ints > 0, got {batch_sizes!r}")
    pool = torch.cuda.graph_pool_handle()
    samples: list[int] = []
    graphs = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    try:
        _capture_decode_graphs(decoder, sizes[:2], pool, samples, graphs, device)
    finally:  # the graphs are only measured: free them whatever happened
        graphs.clear()
        gc.collect()
        torch.cuda.empty_cache()
    per_graph = max(samples[1] if len(samples) > 1 else 0, 1 << 20)
    return int(samples[0] + per_graph * (len(sizes) - 1))


def _capture_decode_graphs(decoder, sizes, pool, samples: list[int], graphs: list, device: torch.device) -> None:
    """Capture one decode graph per batch size in ``sizes``, recording the free memory each one took."""
    with torch.inference_mode():
        for b in sizes:
            ids = torch.zeros((b, 1), dtype=torch.long, device=device)  # ids: [B, 1]
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                decoder(input_ids=ids, use_cache=False)  # warm-up outside the graph
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            before = torch.cuda.mem_get_info(device)[0]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                decoder(input_ids=ids, use_cache=False)
            torch.cuda.synchronize(device)
            samples.append(before - torch.cuda.mem_get_info(device)[0])
            graphs.append(graph)


#: The decode batch sizes a CUDA-graph estimate captures by default: vLLM 0.26's default
#: ``cudagraph_capture_sizes`` for ``max_num_seqs=256`` (``vllm/config/vllm.py``, ``VllmConfig._set_cudagraph_sizes``):
#: 1, 2, 4, multiples of 8 below 256, then multiples of 16 up to ``min(2 * max_num_seqs, 512)``.
DEFAULT_CUDAGRAPH_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


def profile(
    model_or_llm: Any,
    max_num_batched_tokens: int,
    *,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    device: str | torch.device | None = None,
    total_memory: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    cuda_graphs: bool = False,
    cudagraph_batch_sizes: tuple[int, ...] = DEFAULT_CUDAGRAPH_BATCH_SIZES,
    dummy_run: Callable[[int], None] | None = None,
    cudagraph_memory: Callable[[], int] | None = None,
) -> MemoryProfile:
    """Size the KV pool for a loaded model (or an engine holding one): vLLM 0.26's
    ``gpu_worker.py::determine_available_memory`` followed by ``kv_cache_utils.py::get_num_blocks``.

    On a CUDA device: snapshot, then inside :func:`memory_profiling` a dummy batch of ``max_num_batched_tokens``
    tokens (``dummy_run(num_tokens)`` when the engine gives one, else one forward of the transformers model
    with logits for ``min(max_num_seqs, tokens)`` rows), the torch peak taken before any CUDA-graph capture;
    with ``cuda_graphs`` the graph pool is measured by capturing decode graphs of ``cudagraph_batch_sizes``
    (or by ``cudagraph_memory()``, an engine's own capture returning bytes, vLLM's
    ``GPUModelRunner.profile_cudagraph_memory``); ``total_memory`` defaults to
    ``mem_get_info``'s total. The lab profiles a model that is already loaded, so its baseline is the moment
    profiling starts (vLLM's is the worker's start, before loading) and the weights are the bytes of the
    parameters and buffers.

    On a CPU: the same breakdown computed (:func:`analytic_profile`): weights counted from the model's
    tensors, activations estimated, no non-torch or CUDA-graph memory, against ``total_memory`` (default
    :data:`CPU_TOTAL_MEMORY`, 512 MiB), and labelled "analytic".

    Changes nothing in the model or the engine (the dummy run writes no KV cache). Raises ``ValueError``,
    before running anything, for a bad utilization, block size, dtype or token count, and when the non-KV
    memory leaves nothing for the cache or one ``max_model_len`` request does not fit.
    """
    utilization = _check_utilization(gpu_memory_utilization)
    block_size = _positive_int(block_size, "block_size")
    max_num_batched_tokens = _positive_int(max_num_batched_tokens, "max_num_batched_tokens")
    max_num_seqs = _positive_int(max_num_seqs, "max_num_seqs")
    if cuda_graphs and cudagraph_memory is None:
        sizes = tuple(cudagraph_batch_sizes)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in sizes):
            raise ValueError(f"cudagraph_batch_sizes must be ints > 0, got {cudagraph_batch_sizes!r}")
    if total_memory is not None:
        total_memory = _memory_figure(total_memory, "total_memory")
        if total_memory == 0:
            raise ValueError("total_memory must be > 0 bytes")
    model = _find_hf_model(model_or_llm)
    config = model.config
    model_dtype = _model_dtype(model)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device(device)
    weights = _module_bytes(model)

    if device.type != "cuda":
        shape = model_shape(config)
        rows = min(max_num_seqs, max_num_batched_tokens)
        activations = estimate_peak_activation(config, max_num_batched_tokens, model_dtype, rows)
        return _analytic_profile(
            dataclasses.replace(shape, dtype=model_dtype),  # "auto" means the dtype the model runs in
            max_num_batched_tokens,
            block_size=block_size,
            kv_cache_dtype=kv_dtype,
            gpu_memory_utilization=utilization,
            total_memory=CPU_TOTAL_MEMORY if total_memory is None else total_memory,
            weights_memory=weights,
            peak_activation_memory=activations,
            max_model_len=max_model_len,
            device=str(device),
            notes=(
                "a CPU has no device memory to profile: weights are the model's tensors, activations an estimate, "
                "non-torch and CUDA-graph memory 0, and the total a stated budget (pass total_memory to change it)",
            ),
        )
    return _profile_cuda(
        model,
        config,
        device,
        max_num_batched_tokens,
        block_size,
        kv_dtype,
        utilization,
        total_memory,
        max_model_len,
        max_num_seqs,
        cuda_graphs,
        cudagraph_batch_sizes,
        dummy_run,
        cudagraph_memory,
        weights,
    )


def _profile_cuda(
    model: torch.nn.Module,
    config: Any,
    device: torch.device,
    num_tokens: int,
    block_size: int,
    kv_dtype: torch.dtype,
    utilization: float,
    total_memory: int | None,
    max_model_len: int | None,
    max_num_seqs: int,
    cuda_graphs: bool,
    cudagraph_batch_sizes: tuple[int, ...],
    dummy_run: Callable[[int], None] | None,
    cudagraph_memory: Callable[[], int] | None,
    weights: int,
) -> MemoryProfile:
    """The measured path of :func:`profile` (needs CUDA)."""
    shape = model_shape(config)
    gc.collect()  # an engine the notebook dropped still holds its KV cache until collected: free it first
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    baseline = MemorySnapshot.measure(device)
    total = baseline.total_memory if total_memory is None else total_memory
    requested = _request_memory(total, utilization)
    # vLLM's request_memory refuses to start when free memory at start-up is below the request. vLLM profiles in
    # a fresh process; the lab profiles a model already loaded, so its stand-in for "free at start-up" is free
    # now plus this model's weights. Anything else this process holds (another engine's KV cache) is not free.
    startup_free = baseline.free_memory + weights
    if total_memory is None and startup_free < requested:
        raise ValueError(
            f"Free memory on device {device} ({format_gib(startup_free)}/{format_gib(total)} GiB) on startup is "
            f"less than desired GPU memory utilization ({utilization}, {format_gib(requested)} GiB). Decrease GPU "
            "memory utilization or reduce GPU memory used by other processes, or by other engines in this one "
            f"(`del` them; this process holds {format_gib(max(0, baseline.torch_memory - weights))} GiB besides the "
            "model's weights)."
        )
    run = dummy_run or (lambda n: _hf_dummy_run(model, n, min(max_num_seqs, n), device))
    cudagraph = 0
    with memory_profiling(baseline, device, weights_memory=weights) as result:
        run(num_tokens)
        torch.cuda.synchronize(device)
        profile_torch_peak = torch.cuda.memory_stats(device).get("allocated_bytes.all.peak", 0)
        if cuda_graphs:
            measure = cudagraph_memory or (lambda: _hf_cudagraph_memory(model, tuple(cudagraph_batch_sizes), device))
            cudagraph = int(measure())
    # the pre-capture torch peak, so graph capture is not counted twice (as determine_available_memory does)
    result.torch_peak_increase = profile_torch_peak - result.before_profile.torch_peak
    notes = [f"profile run took {result.profile_time:.2f} s"]
    if not cuda_graphs:
        notes.append("CUDA graphs off: no graph memory estimated")
    measured = _analytic_profile(
        shape,
        num_tokens,
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        gpu_memory_utilization=utilization,
        total_memory=total,
        weights_memory=weights,
        peak_activation_memory=max(result.torch_peak_increase, 0),
        non_torch_memory=max(result.non_torch_increase, 0),
        cudagraph_memory=cudagraph,
        max_model_len=max_model_len,
        device=f"{device} ({torch.cuda.get_device_name(device)})",
        notes=tuple(notes),
    )
    return dataclasses.replace(measured, method="measured")
