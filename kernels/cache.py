"""``reshape_and_cache``: write the new tokens' keys and values into their slots of the paged cache.

The scheduler hands the model runner a *slot mapping*: for every token of the step, the flat slot
``block_id * block_size + offset`` where its K/V must live (see ``KVCacheManager``). This kernel is the
scatter that follows: program ``(t, h)`` copies ``key[t, h, :]`` and ``value[t, h, :]`` to
``key_cache[slot // block_size, slot % block_size, h, :]`` and the same in ``value_cache``.
A slot of -1 means "do not store" (vLLM uses it for padding tokens) and is skipped.

Mirrors: ``reshape_and_cache_flash`` (csrc/cache_kernels.cu) and its Triton port
``triton_reshape_and_cache_flash`` (vllm/attention/ops/triton_reshape_and_cache_flash.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    check_device,
    check_float_dtype,
    check_kv_cache,
    check_runnable,
    contiguous_index,
    next_pow2,
)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int32 or int64; -1 = skip
    stride_kt, stride_kh,  # key strides (D stride 1)
    stride_vt, stride_vh,  # value strides
    stride_cb, stride_ct, stride_ch,  # cache strides
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        dst = block * stride_cb + offset * stride_ct + h * stride_ch + offs_d
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + offs_d, mask=d_mask)  # [BLOCK_D]
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + offs_d, mask=d_mask)
        tl.store(k_cache_ptr + dst, k, mask=d_mask)
        tl.store(v_cache_ptr + dst, v, mask=d_mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]  (written)
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]  (written)
    slot_mapping: torch.Tensor,  # [T] int32/int64: block_id * block_size + offset, or -1 to skip
    *,
    validate: bool = True,
) -> None:
    """Store token t's key and value at ``slot_mapping[t]`` of the caches, in place; -1 slots are skipped.

    Only the addressed slots change. Raises ValueError (before writing anything) on mismatched shapes,
    dtypes or devices, a slot mapping that is not 1-D integer of length T, or (with ``validate``, which
    reads the mapping back to the host) a slot outside ``-1 .. num_blocks * block_size - 1`` or the same
    slot given twice (the order of two writes to one slot would be undefined).
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key and value must both be [num_tokens, num_kv_heads, head_dim]; got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    check_kv_cache(key_cache, value_cache)
    check_float_dtype("key", key)
    if key.dtype != key_cache.dtype or value.dtype != key_cache.dtype:
        raise ValueError(f"key/value are {key.dtype}/{value.dtype} but the cache is {key_cache.dtype}; they must match")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} "
            f"but the cache holds {tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}]; got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64; got {slot_mapping.dtype}")
    device = key.device
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):
        check_device(name, t, device)
    check_runnable(device)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_tokens = key.shape[0]
    if validate and num_tokens:
        slots = slot_mapping.cpu()
        bad = (slots < -1) | (slots >= num_blocks * block_size)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"slot_mapping[{i}] = {int(slots[i])} is outside -1..{num_blocks * block_size - 1} "
                f"({num_blocks} blocks of {block_size} slots)"
            )
        real = slots[slots >= 0]
        if real.numel() != torch.unique(real).numel():
            raise ValueError("slot_mapping gives the same slot to two tokens")
    if num_tokens == 0:
        return
    slot_mapping = contiguous_index(slot_mapping)  # the kernel reads slot t at ptr + t
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
    )
