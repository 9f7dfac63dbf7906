"""The page arithmetic: bytes per block, the memory the engine may use, and the blocks that fit -- the sizing
half of ``vllm/v1/core/kv_cache_utils.py`` in vLLM 0.26 (``get_num_blocks``, ``check_enough_kv_cache_memory``,
``get_max_concurrency_for_kv_cache_config``), with ``request_memory`` (``vllm/v1/worker/utils.py``) and the page
size (``vllm/v1/kv_cache_interface.py``). The block queue and the block hashes, the other half of vLLM's file,
are :mod:`pagedkv.kv_cache_utils`.

Lesson 5's exercises ask for ``kv_page_bytes`` and ``num_gpu_blocks``. Each is computed here and nowhere else: the
profile (:mod:`pagedkv.sizing.gpu_worker`) and the per-rank sizing (:mod:`pagedkv.sizing.parallel`) call them,
so the grader, which stubs an exercise's answer in the learner's copy of the library, closes every route to it
by stubbing the one function (``tests/test_grading_hidden.py`` walks the library for other copies)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from pagedkv.sizing.mem_utils import format_gib
from pagedkv.sizing.model import model_shape
from pagedkv.utils import cdiv, check_int, is_real

__all__ = [
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "KV_CACHE_DTYPES",
    "NoKVCacheMemoryError",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "kv_page_bytes",
    "max_concurrency",
    "num_gpu_blocks",
    "request_memory",
    "resolve_kv_cache_dtype",
]

#: ``CacheConfig.gpu_memory_utilization``'s default in vLLM 0.26 (``vllm/config/cache.py``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92

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
    block_size = check_int(block_size, "block_size", 1)
    shape = model_shape(config)
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, shape.dtype)
    return 2 * block_size * shape.num_kv_heads * shape.head_dim * dtype.itemsize



def _memory_figure(value: Any, name: str) -> int:
    """A byte count: an int >= 0, or a float holding a whole number (``80e9``)."""
    if not is_real(value):
        raise ValueError(f"{name} must be a number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{name} must be a whole number of bytes, got {value!r}")
    return int(value)


def _check_utilization(utilization: Any) -> float:
    if not is_real(utilization) or not 0 < utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1] (vLLM's CacheConfig: gt=0, le=1), got {utilization!r}"
        )
    return float(utilization)


def request_memory(total: int, utilization: float) -> int:
    """The bytes the engine may use: ``math.ceil(total * utilization)``, as
    ``vllm/v1/worker/utils.py::request_memory`` computes it (float product, then ceil)."""
    total = _memory_figure(total, "total")
    if total == 0:
        raise ValueError("total memory must be > 0 bytes")
    return math.ceil(total * _check_utilization(utilization))


class NoKVCacheMemoryError(ValueError):
    """:func:`num_gpu_blocks`'s refusal when the figures are sound but nothing is left for the KV cache: a model
    that does not fit (vLLM 0.26: "No available memory for the cache blocks"), not a bad argument."""


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
    (:func:`kv_page_bytes`). ``cudagraph`` is ``cudagraph_memory_estimate_applied``: 0 for a dense model on
    0.26, whose Model Runner V2 returns 0 from ``profile_cudagraph_memory``; the V1 runner's measured estimate
    for MoE and Mamba-hybrid models (:func:`pagedkv.sizing.cudagraph_memory_estimate_applied` decides).
    Pure: changes nothing. Raises ``ValueError`` for a utilization outside (0, 1], a negative figure, and when
    nothing is left for the cache (:class:`NoKVCacheMemoryError`; vLLM's
    ``kv_cache_utils.py::_check_enough_kv_cache_memory`` refuses ``available <= 0``), saying by how much the
    non-KV memory exceeds the budget and what to lower.
    """
    utilization = _check_utilization(utilization)
    requested = request_memory(total, utilization)
    weights = _memory_figure(weights, "weights")
    peak_activation = _memory_figure(peak_activation, "peak_activation")
    non_torch = _memory_figure(non_torch, "non_torch")
    cudagraph = _memory_figure(cudagraph, "cudagraph")
    page_bytes = check_int(page_bytes, "page_bytes", 1)
    num_layers = check_int(num_layers, "num_layers", 1)
    non_kv = non_torch + peak_activation + weights
    available = requested - non_kv - cudagraph
    if available <= 0:
        raise NoKVCacheMemoryError(
            f"no memory left for the KV cache: weights {format_gib(weights)} GiB + peak activations "
            f"{format_gib(peak_activation)} GiB + non-torch {format_gib(non_torch)} GiB + CUDA graphs "
            f"{format_gib(cudagraph)} GiB = {format_gib(non_kv + cudagraph)} GiB, which exceeds the requested "
            f"{format_gib(requested)} GiB (= ceil({total} * {utilization})) by {format_gib(-available)} GiB "
            f"({-available} bytes). Raise gpu_memory_utilization, lower max_num_batched_tokens (activations), "
            + ("quantise the weights, or turn CUDA graphs off." if cudagraph else "or quantise the weights.")
        )
    return int(available // page_bytes // num_layers)


def max_concurrency(num_blocks: int, block_size: int, num_tokens: int) -> float:
    """How many requests of ``num_tokens`` tokens the pool holds at once: ``num_blocks / cdiv(num_tokens,
    block_size)``, as ``vllm/v1/core/kv_cache_utils.py::get_max_concurrency_for_kv_cache_config`` computes it
    for one full-attention group (its per-layer factors cancel). Like vLLM, counts every block, the null
    block included."""
    num_blocks = check_int(num_blocks, "num_blocks", 0)
    block_size = check_int(block_size, "block_size", 1)
    num_tokens = check_int(num_tokens, "num_tokens", 1)
    return num_blocks / cdiv(num_tokens, block_size)



def check_enough_kv_cache_memory(available: int, page_bytes: int, num_layers: int, block_size: int, max_len: int):
    """vLLM 0.26's ``kv_cache_utils.py::check_enough_kv_cache_memory`` for one full-attention group: one request
    of ``max_model_len`` tokens must fit (``cdiv(max_model_len, block_size) * page_size`` per layer). As in
    ``_check_enough_kv_cache_memory``, ``available <= 0`` is its own error and the estimated maximum length is
    named only when it is above 0."""
    if not is_real(available) or math.isnan(available):
        raise ValueError(f"available must be a number of bytes, got {available!r}")
    page_bytes = check_int(page_bytes, "page_bytes", 1)
    num_layers = check_int(num_layers, "num_layers", 1)
    block_size = check_int(block_size, "block_size", 1)
    max_len = check_int(max_len, "max_len", 1)
    if available <= 0:
        raise ValueError(
            "No available memory for the cache blocks: the weights, activations and non-torch memory take all of "
            f"the requested memory ({format_gib(available)} GiB left). Raise gpu_memory_utilization / total_memory."
        )
    needed = cdiv(max_len, block_size) * page_bytes * num_layers
    if needed > available:
        max_fit = int(available // (page_bytes * num_layers)) * block_size
        estimate = (f"Based on the available memory, the estimated maximum model length is {max_fit}. "
                    if max_fit > 0 else "")
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_len}), {format_gib(needed)} GiB "
            f"KV cache is needed, which is larger than the available KV cache memory ({format_gib(available)} "
            f"GiB). {estimate}Lower max_model_len, or raise gpu_memory_utilization / total_memory."
        )


def estimate_max_model_len(usage_bytes: Callable[[int], int], available: int, original_max: int) -> int:
    """The longest request, at most ``original_max`` tokens, whose KV cache fits in ``available`` bytes:
    ``usage_bytes(n)`` is what one request of ``n`` tokens can hold (``cdiv(n, block_size)`` blocks of every layer
    for full attention; :func:`pagedkv.sizing.hybrid.max_memory_usage_bytes_from_groups` for a hybrid model).
    A binary search over ``1 .. original_max``; 0 when not even one token fits. What ``LLM(max_model_len=-1)``
    (``--max-model-len auto``) runs with. Mirrors ``_estimate_max_model_len_from_groups``, which
    ``_auto_fit_max_model_len`` calls (``vllm/v1/core/kv_cache_utils.py``). Pure."""
    if usage_bytes(1) > available:
        return 0
    result, left, right = 1, 1, original_max
    while left <= right:
        mid = (left + right) // 2
        if usage_bytes(mid) <= available:
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result
