"""``reshape_and_cache``: write the new tokens' keys and values into their slots of the paged cache.

The scheduler hands the model runner a *slot mapping*: for every token of the step, the flat slot
``block_id * block_size + offset`` where its K/V must live (see ``KVCacheManager``). This kernel is the
scatter that follows: program ``(t, h)`` copies ``key[t, h, :]`` and ``value[t, h, :]`` to
``key_cache[slot // block_size, slot % block_size, h, :]`` and the same in ``value_cache``.
A slot of -1 means "do not store" (vLLM uses it for padding tokens) and is skipped.

**FP8 KV cache.** When the caches are ``torch.float8_e4m3fn`` (1 byte per element, finite range ±448),
each value is stored as ``value / scale``, clamped to ±448 and rounded to e4m3, with one scale per tensor
(``k_scale`` for keys, ``v_scale`` for values); the attention kernels multiply the scales back in. Half
the bytes of an fp16 cache: twice the tokens in the same memory, half the bytes a decode step reads.

Mirrors: ``reshape_and_cache_flash`` (csrc/cache_kernels.cu) and its Triton port
``triton_reshape_and_cache_flash`` (vLLM 0.26: vllm/v1/attention/ops/triton_reshape_and_cache_flash.py),
whose ``k_scale``/``v_scale`` are the same per-tensor scales (``kv_cache_dtype="fp8"``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    check_device,
    check_float_dtype,
    check_fp8_supported,
    check_kv_cache,
    check_runnable,
    contiguous_index,
    interpreter_on,
    is_fp8,
    next_pow2,
    resolve_kv_scale,
)

FP8_MAX = tl.constexpr(448.0)  # largest finite float8 e4m3 (e4m3fn) value; a kernel's globals must be constexpr


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_mapping_ptr,  # [T] int32 or int64; -1 = skip
    k_scale,  # fp8 cache: store key / k_scale (1.0 otherwise)
    v_scale,
    stride_kt, stride_kh,  # key strides (D stride 1)
    stride_vt, stride_vh,  # value strides
    stride_cb, stride_ct, stride_ch,  # cache strides
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,  # the caches are float8 e4m3: scale, clamp to the finite range, round
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
        if FP8:
            k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
            v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]  (written)
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]  (written)
    slot_mapping: torch.Tensor,  # [T] int32/int64: block_id * block_size + offset, or -1 to skip
    *,
    validate: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store token t's key and value at ``slot_mapping[t]`` of the caches, in place; -1 slots are skipped.

    With ``float8_e4m3fn`` caches the stored values are ``key / k_scale`` and ``value / v_scale`` (clamped to
    ±448, rounded to e4m3); the attention kernels must be given the same scales.

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
    fp8 = is_fp8(key_cache.dtype)
    if value.dtype != key.dtype or (key.dtype != key_cache.dtype and not fp8):
        raise ValueError(f"key/value are {key.dtype}/{value.dtype} but the cache is {key_cache.dtype}; they must match")
    if fp8:
        check_fp8_supported(key.device)
    k_scale = resolve_kv_scale("k_scale", k_scale, key_cache.dtype)
    v_scale = resolve_kv_scale("v_scale", v_scale, key_cache.dtype)
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
    if key_cache.data_ptr() == value_cache.data_ptr() and key_cache.numel():
        # Same strides (checked above) and the same first element: one tensor, so every value would overwrite its
        # key. (vLLM's packed layout splits one tensor into two views that start head_size apart: accepted.)
        raise ValueError("key_cache and value_cache are the same memory: pass two caches (or two views of a "
                         "packed cache)")
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
    if fp8 and interpreter_on():
        _write_fp8_with_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, key_cache, value_cache, slot_mapping,
        k_scale, v_scale,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
        FP8=fp8,
    )


def _write_fp8_with_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """The fp8 write in PyTorch, for Triton's interpreter only.

    The interpreter (Triton 3.x) rounds float32 -> float8e4nv wrongly: a value that rounds up into the next
    power of two drops to the lower one (125.98 -> 64, not 128), ties round away from even and subnormals
    flush to zero. A GPU converts in hardware, correctly. Reading fp8 back is exact in both, so on a CPU
    the cache is written here with the same formula (scale, clamp to +-448, round to nearest even).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = (key[keep].float() / k_scale).clamp(-448.0, 448.0).to(key_cache.dtype)
    value_cache[blocks, offsets] = (value[keep].float() / v_scale).clamp(-448.0, 448.0).to(value_cache.dtype)
