"""Paged prefill: many new tokens per sequence attending causally to a cached prefix and to themselves.

Decode has one query per sequence. A chunked prefill, or a prompt whose first blocks hit the prefix
cache, has ``q_len`` new tokens per sequence on top of ``seq_len - q_len`` cached ones. As in vLLM V1
the new tokens' K/V are written to the cache first (``reshape_and_cache``), so every key is read through
the block table, and new token ``i`` (position ``seq_len - q_len + i``) sees keys ``0 .. seq_len - q_len + i``.

The queries of all sequences are packed into one ``[T, Hq, D]`` tensor; ``query_start_loc[b]`` says where
sequence ``b``'s begin (vLLM's ``query_start_loc``, flash-attn's ``cu_seqlens_q``). Program
``(b, g, i)`` takes ``BLOCK_Q`` consecutive new tokens of sequence ``b`` and all ``group`` query heads of
KV head ``g`` -- ``BLOCK_Q * group`` rows, packed the way decode version 2 packs a group -- and walks the
key tiles up to its last query's position (tiles wholly in the future are never loaded), masking
per row with ``key_pos <= query_pos``.

Mirrors: ``kernel_unified_attention`` (vLLM 0.26, vllm/v1/attention/ops/triton_unified_attention.py), which
handles prefill, chunked prefill and decode in one kernel this way; and ``context_attention_fwd``
(vllm/v1/attention/ops/prefix_prefill.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.attention import check_sliding_window
from pagedkv.utils import cdiv, check_int

from ._common import (
    LOG2E,
    check_block_tables,
    check_fp8_supported,
    check_out,
    check_out_overlap,
    check_query_and_cache,
    check_table_shapes,
    contiguous_index,
    contiguous_rows,
    dot_precision,
    is_fp8,
    next_pow2,
    resolve_kv_scale,
    resolve_scale,
)

BLOCK_M = 64  # query rows (tokens x group heads) per program
TILE_TOKENS = 32  # keys per loop iteration


@triton.jit
def _paged_prefill_kernel(
    out_ptr,  # [T, Hq, D]
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32: prefix + new tokens
    query_start_loc_ptr,  # [B + 1] int32
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # 1.0, or the fp8 cache's value scale
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # new tokens per program
    BLOCK_M: tl.constexpr,  # rows: a power of two >= BLOCK_Q * GROUP
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: full attention; W: a query at p sees keys p - W + 1 .. p
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_begin = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + b)
    prefix_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, TILE_N)
    d_mask = offs_d < HEAD_DIM
    q_idx = q_block * BLOCK_Q + offs_m // GROUP  # which new token each row is
    q_head = kv_head * GROUP + offs_m % GROUP  # which query head each row is
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = prefix_len + q_idx  # the row's position in the sequence

    row_offs = (q_begin + q_idx).to(tl.int64) * stride_qt + q_head * stride_qh
    q = tl.load(q_ptr + row_offs[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys beyond the last query of this program are in every row's future: stop before them.
    last_pos = tl.minimum(prefix_len + q_block * BLOCK_Q + BLOCK_Q, seq_len)
    num_tiles = tl.where(q_block * BLOCK_Q < q_len, tl.cdiv(last_pos, TILE_N), 0)
    # Under a sliding window, keys before the first query's window are behind every row: start after them
    # (their blocks may be the null block: vLLM's SlidingWindowManager.remove_skipped_blocks frees them).
    first_tile = 0
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(prefix_len + q_block * BLOCK_Q - SLIDING_WINDOW + 1, 0) // TILE_N
    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tile in range(first_tile, num_tiles):
        k_pos = tile * TILE_N + offs_t
        k_valid = k_pos < seq_len
        physical = tl.load(table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
        slot = (k_pos % BLOCK_SIZE).to(tl.int64)
        kv_offs = physical[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [TILE_N, BLOCK_D]; fp8 widened
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        visible = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])  # causal, per row
        if SLIDING_WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)  # inside the row's window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no 0 * inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale
    o_offs = (q_begin + q_idx).to(tl.int64) * stride_ot + q_head * stride_oh
    tl.store(out_ptr + o_offs[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_mask[None, :])


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]: new tokens of all sequences, packed
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: already holds the new tokens
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32: query[qsl[b]:qsl[b+1]] are sequence b's new tokens
    scale: float | None = None,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged cache; returns ``out [T, Hq, D]``.

    See the module docstring for the semantics (the same as ``pagedkv.attention.ref_paged_prefill_attention``).
    ``max_query_len`` (the longest ``q_len``) sizes the grid; without it ``query_start_loc`` is read back
    to the host. Nothing but ``out`` is written. Raises ValueError on bad shapes, dtypes or devices, a
    ``query_start_loc`` that does not start at 0, end at T and never decrease, a sequence with more new
    tokens than ``seq_len``, and the block-table problems ``paged_attention_decode`` refuses.
    An fp8 cache (``torch.float8_e4m3fn``) is read with its per-tensor ``k_scale``/``v_scale``.
    ``sliding_window = W``: new token ``i`` (position ``p``) sees only keys ``p - W + 1 .. p``; key tiles behind
    every query's window are skipped, so their block-table entries may be the null block.

    Mirrors: vLLM 0.26's ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py) on a batch
    with prefills, and ``context_attention_fwd`` (vllm/v1/attention/ops/prefix_prefill.py).
    """
    sliding_window = check_sliding_window(sliding_window)
    num_tokens, num_q_heads, head_dim, num_blocks, block_size, num_kv_heads = check_query_and_cache(
        query,
        key_cache,
        value_cache,
        {"block_tables": block_tables, "seq_lens": seq_lens, "query_start_loc": query_start_loc},
        "num_tokens",
    )
    # Shapes and dtypes need no host read: checked with validate=False too (as paged_attention_decode does), so
    # a 1-D or too-short block table is refused instead of read past its end.
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_table_shapes(block_tables, seq_lens, batch, "seq_lens")
    if max_query_len is not None:
        # A packed batch of T tokens in B sequences has its longest query in cdiv(T, B)..T (0 when T == 0): a
        # smaller value would leave rows of ``out`` unwritten. vLLM 0.26's ``unified_attention`` trusts its
        # ``max_seqlen_q``; the lab refuses what it can check without reading query_start_loc.
        least = cdiv(num_tokens, batch) if batch and num_tokens else 0
        max_query_len = check_int(max_query_len, "max_query_len", least, num_tokens,
                                  why=f"the longest sequence's new tokens, for {num_tokens} tokens in {batch} "
                                  "sequences")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (batch + 1,):
        raise ValueError(
            f"query_start_loc must be int32 of shape [batch + 1] = [{batch + 1}]; got {query_start_loc.dtype} "
            f"of shape {tuple(query_start_loc.shape)}"
        )
    if validate or max_query_len is None:
        qsl = query_start_loc.cpu().long()
        q_lens = qsl[1:] - qsl[:-1]
        if int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens or bool((q_lens < 0).any()):
            raise ValueError(
                f"query_start_loc must start at 0, never decrease and end at num_tokens={num_tokens}; "
                f"got {qsl.tolist()}"
            )
        max_query_len = int(q_lens.max()) if batch else 0
        if validate:
            check_block_tables(block_tables, seq_lens, batch, num_blocks, block_size, min_len=0,
                               batch_of="seq_lens")
            lens = seq_lens.cpu().long()
            if bool((q_lens > lens).any()):
                i = int((q_lens > lens).nonzero()[0, 0])
                raise ValueError(f"sequence {i} has {int(q_lens[i])} new tokens but seq_lens[{i}] = {int(lens[i])}")
    if is_fp8(key_cache.dtype):
        check_fp8_supported(query.device)
    k_scale = resolve_kv_scale("k_scale", k_scale, key_cache.dtype)
    v_scale = resolve_kv_scale("v_scale", v_scale, key_cache.dtype)
    scale = resolve_scale(scale, head_dim)
    if out is not None:
        check_out_overlap(out, query, {"key_cache": key_cache, "value_cache": value_cache,
                                       "block_tables": block_tables, "seq_lens": seq_lens,
                                       "query_start_loc": query_start_loc})
    out = check_out(out, query)
    if num_tokens == 0 or max_query_len == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    seq_lens = contiguous_index(seq_lens)  # read at ptr + b
    query_start_loc = contiguous_index(query_start_loc)  # read at ptr + b and ptr + b + 1
    block_tables = contiguous_rows(block_tables)  # read at ptr + b * stride_bt + j
    group = num_q_heads // num_kv_heads
    block_m = max(BLOCK_M, next_pow2(group))
    block_q = block_m // group
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_prefill_kernel[grid](
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * LOG2E * k_scale,
        v_scale,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_TOKENS,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PRECISION=dot_precision(query.dtype),
        SLIDING_WINDOW=sliding_window or 0,
        num_warps=4,
    )
    return out
