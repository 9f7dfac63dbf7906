"""Decode version 4: split-K (flash-decoding) -- the context split across programs, then a reduce.

Versions 2 and 3 launch ``B * Hkv`` programs. At batch 1 with 8 KV heads that is 8 programs on a GPU
with 132 multiprocessors: 124 of them idle while 8 walk a 32k-token context alone. Split-K cuts each
sequence's tiles into ``num_splits`` contiguous slices and gives each slice its own program, grid
``(B, Hkv, num_splits)``. Each program runs version 3's loop over its slice and writes

- a partial output ``o_s = acc_s / l_s`` (fp32, normalised over its slice), and
- its log-sum-exp ``lse_s = ln(sum over its slice of exp(score))`` (fp32, natural log),

and a second, tiny kernel merges the slices of each (sequence, query head):

    out = sum_s exp(lse_s - M) * o_s  /  sum_s exp(lse_s - M),      M = max_s lse_s

which is exactly softmax attention over the whole context (subtracting ``M`` keeps ``exp`` in range).
A slice past a short sequence's end visits no tile and writes ``lse = -inf``, weight 0.

The extra traffic is ``B * Hq * num_splits * (D + 1) * 4`` bytes written and read back, small next to
the KV cache (``2 * B * L * Hkv * D * 2`` bytes) as long as each slice covers a tile or more. How many
slices to cut is the dispatcher's choice (``pagedkv.kernels.dispatch.choose_num_splits``: enough for
about two programs per SM, never an empty slice), measured on a GPU rather than guessed here.

Mirrors: vLLM's ``paged_attention_v2_kernel`` + ``paged_attention_v2_reduce_kernel``
(csrc/attention/attention_kernels.cuh), and the two stages of
vllm/v1/attention/ops/triton_decode_attention.py (vLLM 0.26) (``_fwd_grouped_kernel_stage1`` / ``_fwd_kernel_stage2``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LN2, LOG2E, dot_precision, next_pow2
from .decode_v3 import NUM_STAGES, NUM_WARPS, TILE_TOKENS, _attend_tiles

_LN2 = tl.constexpr(LN2)  # globals a kernel reads must be constexpr
_LOG2E = tl.constexpr(LOG2E)

@triton.jit
def _paged_decode_split_kernel(
    o_part_ptr,  # [B, Hq, S, D] fp32: each slice's normalised output
    lse_ptr,  # [B, Hq, S] fp32: each slice's natural-log log-sum-exp (-inf for an empty slice)
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # 1.0, or the fp8 cache's value scale
    stride_qb, stride_qh,
    stride_pb, stride_ph, stride_ps,  # o_part strides (D stride 1)
    stride_lb, stride_lh,  # lse strides (split stride 1)
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: full attention; W: the query sees its last W tokens
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    row_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_heads = kv_head * GROUP + offs_g

    seq_len = tl.load(seq_lens_ptr + b)
    window_lo = 0  # the first visible position: 0, or seq_len - W under a sliding window (a static branch)
    if SLIDING_WINDOW > 0:
        window_lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    first_tile = window_lo // TILE_N  # a sliding window's tiles wholly behind it are never visited
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)  # split evenly, by the visible length
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask, other=0.0)
    acc, m_i, l_i = _attend_tiles(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b.to(tl.int64) * stride_bt, kv_head, seq_len,
        tile_lo, tile_hi, qk_scale, stride_kb, stride_kt, stride_kh,
        BLOCK_G, BLOCK_SIZE, TILE_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, window_lo, SLIDING_WINDOW,
    )
    nonempty = l_i > 0.0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None] * v_scale  # an empty slice writes zeros, not 0/0
    # m_i + log2(l_i) is the log-sum-exp in log2 units (scores were pre-scaled by log2(e)); store natural log.
    lse = tl.where(nonempty, (m_i + tl.log2(tl.where(nonempty, l_i, 1.0))) * _LN2, float("-inf"))

    row = b.to(tl.int64) * stride_pb + q_heads * stride_ph + split * stride_ps  # [BLOCK_G]
    tl.store(o_part_ptr + row[:, None] + offs_d[None, :], o, mask=row_mask)
    tl.store(lse_ptr + b.to(tl.int64) * stride_lb + q_heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr,  # [B, Hq, D]
    o_part_ptr,  # [B, Hq, S, D] fp32
    lse_ptr,  # [B, Hq, S] fp32
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=s_mask,
                  other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lse, axis=0)  # finite: slice 0 always holds the sequence's first visible tile
    w = tl.exp2((lse - lse_max) * _LOG2E)  # [BLOCK_S]; 0 for empty and padding slices
    part_offs = b.to(tl.int64) * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(o_part_ptr + part_offs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    o_offs = b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def launch_decode_v4(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    tile_tokens: int = TILE_TOKENS,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch split-K on validated inputs; returns the intermediates ``(o_part [B,Hq,S,D], lse [B,Hq,S])``.

    Two launches: the split kernel, grid ``(B, Hkv, num_splits)``, then the reduce, grid ``(B, Hq)``.
    ``tile_tokens``, ``num_warps`` and ``num_stages`` are launch choices (see ``dispatch``), not semantics.
    ``k_scale``/``v_scale``: the per-tensor scales of an fp8 cache (``stored = value / scale``).
    ``sliding_window = W``: each query sees its last ``W`` tokens; the slices split only the visible tiles.
    """
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    o_part = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=query.device)
    o_part_strides = o_part.stride()[:3]  # (batch, head, split); head_dim's is 1
    lse_strides = lse.stride()[:2]  # (batch, head); split's is 1
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        o_part, lse, query, key_cache, value_cache, block_tables, seq_lens,
        scale * LOG2E * k_scale,
        v_scale,
        *query.stride()[:2],
        *o_part_strides,
        *lse_strides,
        *key_cache.stride()[:3],
        block_tables.stride(0),
        NUM_SPLITS=num_splits,
        GROUP=group,
        BLOCK_G=max(16, next_pow2(group)),
        BLOCK_SIZE=block_size,
        TILE_N=tile_tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PRECISION=dot_precision(query.dtype),
        SLIDING_WINDOW=sliding_window or 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _paged_decode_reduce_kernel[(batch, num_q_heads)](
        out, o_part, lse,
        *out.stride()[:2],
        *o_part_strides,
        *lse_strides,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_pow2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_D=next_pow2(head_dim),
    )
    return o_part, lse
