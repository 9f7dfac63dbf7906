"""Decode version 2: GQA packing -- one program per (sequence, KV head), the group's queries as one tile.

With grouped-query attention, ``group = Hq // Hkv`` query heads read the same K and V. Version 1 gave
each of them its own program, so each KV block was fetched ``group`` times. Here program ``(b, g)``
loads the ``group`` query rows that map to KV head ``g`` -- query heads ``g*group .. g*group+group-1`` --
as one ``[BLOCK_G, D]`` tile, reads every KV block of the sequence *once*, and computes all the group's
scores with one matrix multiply ``tl.dot(q, kᵀ)``: ``[BLOCK_G, D] x [D, BLOCK_N]``. The softmax
statistics become per-row vectors; the update is the same as version 1, row by row.

``tl.dot`` runs on tensor cores; on a GPU Triton asks only its inner dimension to be at least 16 for 16-bit
inputs (``min_dot_size`` in ``triton/backends/nvidia/compiler.py``) and pads a small M or N itself. The
kernel pads on purpose all the same, to shapes it controls: the query tile to ``BLOCK_G = max(16,
next_pow2(group))`` rows (padding rows read zeros and are never stored) and a block to
``BLOCK_N = max(16, block_size)`` slots (masked). Decode is memory-bound: the wasted multiply-adds on
padding cost nothing measurable; the KV bytes saved are what matter.

Mirrors: vLLM's Triton decode kernel for grouped heads, ``_fwd_grouped_kernel_stage1``
(vLLM 0.26: vllm/v1/attention/ops/triton_decode_attention.py), which packs a KV head's query heads the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, dot_precision, next_pow2


@triton.jit
def _paged_decode_v2_kernel(
    out_ptr,  # [B, Hq, D]
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (rows of the query tile)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # BLOCK_SIZE padded to a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs so a GPU does not round them to TF32
):
    b = tl.program_id(0)  # sequence
    kv_head = tl.program_id(1)  # KV head: this program serves its whole query group

    offs_g = tl.arange(0, BLOCK_G)  # row of the query tile = position inside the group
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g  # the query heads that read this KV head

    seq_len = tl.load(seq_lens_ptr + b)
    q_offs = b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        physical = tl.load(table_row + j).to(tl.int64)
        token = j * BLOCK_SIZE + offs_n
        valid = (offs_n < BLOCK_SIZE) & (token < seq_len)
        kv_offs = physical * stride_kb + offs_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = b.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def launch_decode_v2(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Launch version 2 on validated inputs: grid ``(B, Hkv)``, one program per KV head's query group."""
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    _paged_decode_v2_kernel[(batch, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_SIZE=block_size,
        BLOCK_N=max(16, next_pow2(block_size)),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PRECISION=dot_precision(query.dtype),
    )
