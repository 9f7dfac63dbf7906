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
import sys

if __name__ == "kernels":
    # Python was started in the repository root (``python -m ...`` or an xdist worker puts it on sys.path), so
    # this folder was found as a top-level ``kernels``. That name is Hugging Face's package, which transformers
    # imports; load it in this module's place and define nothing here (this folder is ``pagedkv.kernels`` only).
    import importlib.machinery
    import importlib.util

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # real paths: a symlinked checkout too
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    )
    if _spec is None or _spec.loader is None:
        raise ModuleNotFoundError(
            "No module named 'kernels' (the repository's kernels/ folder is pagedkv.kernels)", name="kernels"
        )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds once this file ends
    _spec.loader.exec_module(_module)
else:
    import torch

    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"

    from ._common import interpreter_on as _interpreter_on

    if _interpreter_on():
        from ._interpreter import install as _install_interpreter_shortcut

        _install_interpreter_shortcut()  # device-function calls skip a repeated patch (kernels/_interpreter.py)

    from .cache import reshape_and_cache
    from .decode import (
        DECODE_VERSIONS,
        choose_num_splits,
        decode_config,
        paged_attention_decode,
        paged_attention_decode_v1,
        paged_attention_decode_v2,
        paged_attention_decode_v3,
        paged_attention_decode_v4,
    )
    from .dispatch import DecodeConfig, choose_decode_config
    from .prefill import paged_prefill_attention
    from .slot_mapping import compute_slot_mappings

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
