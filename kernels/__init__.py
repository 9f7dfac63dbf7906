"""Triton kernels for the paged KV cache, imported as ``pagedkv.kernels`` (never as a top-level ``kernels``).

Public API (see docs/design.md):

    paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale=None, ...)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, ...)
    compute_slot_mappings(block_tables, idx_mapping, query_start_loc, positions, block_size)  # Model Runner V2

KV layout: two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (fp16, bf16, fp32, or fp8 e4m3 with
per-tensor scales). This is the lab's choice, for clarity: vLLM 0.26's FlashAttention backend keeps one tensor per
layer with K and V packed in the last dimension, logical shape ``(num_blocks, num_kv_heads, block_size,
2 * head_size)`` and a physical order from ``get_kv_cache_stride_order``
(vllm/v1/attention/backends/flash_attn.py).

CPU-only machines: Triton compiles for GPUs. Without one, its interpreter (``TRITON_INTERPRET=1``)
runs the same kernel source with NumPy, on CPU tensors, in fp32 and fp16 (it has no bfloat16). Triton
decides interpreter-or-compiler when a kernel is *defined* (``@triton.jit`` reads the setting), so
importing this package on a machine where ``torch.cuda.is_available()`` is False and where
``TRITON_INTERPRET`` is unset sets ``TRITON_INTERPRET=1`` before our kernels are defined. Set
``TRITON_INTERPRET=0`` yourself to opt out (then CPU tensors are refused with a ValueError).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

from ._common import interpreter_on as _interpreter_on  # noqa: E402

if _interpreter_on():
    from ._interpreter import install as _install_interpreter_shortcut  # noqa: E402

    _install_interpreter_shortcut()  # device-function calls skip a repeated patch (kernels/_interpreter.py)

from .cache import reshape_and_cache  # noqa: E402
from .decode import (  # noqa: E402
    DECODE_VERSIONS,
    choose_num_splits,
    decode_config,
    paged_attention_decode,
    paged_attention_decode_v1,
    paged_attention_decode_v2,
    paged_attention_decode_v3,
    paged_attention_decode_v4,
)
from .dispatch import DecodeConfig, choose_decode_config  # noqa: E402
from .prefill import paged_prefill_attention  # noqa: E402
from .slot_mapping import compute_slot_mappings  # noqa: E402

__all__ = [
    "DECODE_VERSIONS",
    "DecodeConfig",
    "choose_decode_config",
    "choose_num_splits",
    "compute_slot_mappings",
    "decode_config",
    "paged_attention_decode",
    "paged_attention_decode_v1",
    "paged_attention_decode_v2",
    "paged_attention_decode_v3",
    "paged_attention_decode_v4",
    "paged_prefill_attention",
    "reshape_and_cache",
]
