"""Decode version 1: one program per (sequence, query head), walking the block table with an online softmax.

The simplest paged-attention kernel that is correct. Program ``(b, h)`` owns one output row
``out[b, h, :]``. It loads its query vector once, then visits sequence ``b``'s logical blocks in order;
for logical block ``j`` it reads the physical block id from the block table and loads that block's
``block_size`` keys and values for KV head ``h // group`` -- the *gather*. Scores never leave
registers: a running max ``m``, a running denominator ``l`` and a running weighted sum ``acc`` are
rescaled whenever a larger score shows up (the online softmax of FlashAttention), so the kernel reads
every cached byte exactly once and never materialises the ``seq_len``-long score vector.

Its weakness is traffic: with grouped-query attention the ``group`` query heads that share a KV head
each read that head's K and V separately (``group`` times the bytes), and the dot products are
element-wise multiply-and-sum, not tensor-core matrix multiplies. Version 2 fixes both.

Mirrors: vLLM's first CUDA kernel ``paged_attention_v1_kernel`` (csrc/attention/attention_kernels.cuh),
one thread block per (head, sequence).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, next_pow2


@triton.jit
def _paged_decode_v1_kernel(
    out_ptr,  # [B, Hq, D] output
    q_ptr,  # [B, Hq, D] query
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D] (same strides as k_cache)
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e): scores come out in log2 units, ready for exp2
    stride_qb, stride_qh,  # query strides (head_dim stride is 1)
    stride_ob, stride_oh,  # out strides
    stride_kb, stride_kt, stride_kh,  # cache strides: block, token-in-block, kv head
    stride_bt,  # block_tables row stride
    GROUP: tl.constexpr,  # query heads per KV head (Hq // Hkv)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
):
    b = tl.program_id(0)  # sequence
    h = tl.program_id(1)  # query head
    kv_head = h // GROUP  # GQA: query heads [g*GROUP, (g+1)*GROUP) share KV head g

    offs_n = tl.arange(0, BLOCK_N)  # token slot inside a block
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + b)
    # int64 from here on: block_id * stride_kb overflows int32 once the cache passes 2**31 elements (4 GiB fp16).
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)

    m_i = float("-inf")  # running max of the scores (log2 units)
    l_i = 0.0  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_D], tl.float32)  # running sum of exp2(score - m_i) * v

    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    num_logical_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    for j in range(0, num_logical_blocks):
        # The gather: logical block j of this sequence lives in physical block `physical`.
        physical = tl.load(table_row + j).to(tl.int64)
        token = j * BLOCK_SIZE + offs_n  # logical position of each slot
        valid = (offs_n < BLOCK_SIZE) & (token < seq_len)  # ragged last block: slots past seq_len are junk
        kv_offs = physical * stride_kb + offs_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.sum(k * q[None, :], axis=1) * qk_scale  # [BLOCK_N] scores, log2 units
        s = tl.where(valid, s, float("-inf"))

        # Online softmax: rescale what was accumulated under the old max, then add this block.
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf), 1 when the max did not move
        p = tl.exp2(s - m_new)  # [BLOCK_N]; exactly 0 at masked slots
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new

    out = acc / l_i
    o_offs = b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def launch_decode_v1(
    out: torch.Tensor,  # [B, Hq, D]
    query: torch.Tensor,  # [B, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Launch version 1 on inputs already validated: grid ``(B, Hq)``, one program per output row."""
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    _paged_decode_v1_kernel[(batch, num_q_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        BLOCK_SIZE=block_size,
        BLOCK_N=next_pow2(block_size),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
    )
