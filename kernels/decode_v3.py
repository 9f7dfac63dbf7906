"""Decode version 3: tiles that span several KV blocks, each token finding its own block.

Versions 1 and 2 take one KV block (16 tokens) per loop iteration. A 16 x 128 fp16 tile is 4 KiB:
too little work per iteration to hide memory latency, and the loop bookkeeping is paid every 16 tokens.
Here one iteration covers ``TILE_N`` tokens (64 by default, four 16-token blocks). The gather moves from
"one block id per iteration" to "one block id per token": token ``t`` of the tile reads
``block_tables[b, t // block_size]`` and its slot ``t % block_size`` -- a vector load of block ids that
the hardware coalesces (neighbouring tokens share an id). It also frees the tile size from the block size:
any ``block_size`` works, even one that is not a power of two.

Everything else is version 2: one program per (sequence, KV head), the group's queries packed into a
``[BLOCK_G, D]`` tile, ``tl.dot`` for scores and for ``P·V``, an online softmax with ``exp2``.

The loop lives in ``_attend_tiles`` so that version 4 (split-K) can run it over a slice of the tiles.

Mirrors: vLLM's ``kernel_unified_attention`` (vLLM 0.26: vllm/v1/attention/ops/triton_unified_attention.py), whose
tiles are independent of the KV block size in the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, dot_precision, next_pow2

TILE_TOKENS = 64  # tokens per loop iteration (a power of two >= 16); the dispatcher tunes it per shape
NUM_WARPS = 4  # launch defaults when this version is launched on its own (see dispatch.py for the tuned ones)
NUM_STAGES = 2


@triton.jit
def _attend_tiles(
    q,  # [BLOCK_G, BLOCK_D] the group's query rows, input dtype
    k_cache_ptr,
    v_cache_ptr,
    table_row,  # pointer to block_tables[b, 0]
    kv_head,
    seq_len,
    tile_lo,  # first tile (of TILE_N tokens) to visit
    tile_hi,  # one past the last tile
    qk_scale,
    stride_kb, stride_kt, stride_kh,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    window_lo=0,  # the first visible position under a sliding window (seq_len - W, at least 0)
    SLIDING_WINDOW: tl.constexpr = 0,  # 0: full attention; W > 0: positions below window_lo are masked
):
    """Online softmax over tiles ``[tile_lo, tile_hi)``; returns the unnormalised ``(acc, m, l)``.

    ``acc[r] / l[r]`` is row r's attention output over the visited tokens, and ``m[r] + log2(l[r])`` its
    log-sum-exp in log2 units. With no tile visited: ``acc = 0``, ``l = 0``, ``m = -inf``. With a sliding
    window, positions below ``window_lo`` are masked: they are never loaded, so their blocks may be the null
    block (vLLM frees them, ``SlidingWindowManager.remove_skipped_blocks``).
    """
    offs_t = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_lo, tile_hi):
        token = tile * TILE_N + offs_t  # [TILE_N] logical positions
        valid = token < seq_len
        if SLIDING_WINDOW > 0:
            valid = valid & (token >= window_lo)
        # One block-table lookup per token: neighbours share a block, so these loads coalesce.
        physical = tl.load(table_row + token // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = (token % BLOCK_SIZE).to(tl.int64)
        kv_offs = physical[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        # An fp8 cache is widened to the query's dtype here (exact); its scales are folded into qk_scale and
        # v_scale by the caller. For a cache in the query's dtype the .to() is a no-op.
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [TILE_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, TILE_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_decode_v3_kernel(
    out_ptr,  # [B, Hq, D]
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    qk_scale,  # softmax scale * log2(e) * k_scale
    v_scale,  # 1.0, or the fp8 cache's value scale (applied once, to the output)
    stride_qb, stride_qh,
    stride_ob, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
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
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_heads = kv_head * GROUP + offs_g

    seq_len = tl.load(seq_lens_ptr + b)
    window_lo = 0  # the first visible position: 0, or seq_len - W under a sliding window (a static branch)
    if SLIDING_WINDOW > 0:
        window_lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask, other=0.0)
    acc, m_i, l_i = _attend_tiles(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b.to(tl.int64) * stride_bt, kv_head, seq_len,
        window_lo // TILE_N, tl.cdiv(seq_len, TILE_N), qk_scale, stride_kb, stride_kt, stride_kh,
        BLOCK_G, BLOCK_SIZE, TILE_N, HEAD_DIM, BLOCK_D, DOT_PRECISION, window_lo, SLIDING_WINDOW,
    )
    out = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def launch_decode_v3(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tile_tokens: int = TILE_TOKENS,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> None:
    """Launch version 3 on validated inputs: grid ``(B, Hkv)``, ``tile_tokens`` tokens per iteration.

    ``tile_tokens``, ``num_warps`` and ``num_stages`` change speed, not results (see ``dispatch``).
    ``k_scale``/``v_scale``: the per-tensor scales of an fp8 cache (``stored = value / scale``).
    ``sliding_window = W``: each query sees its sequence's last ``W`` tokens, and the tiles wholly before
    them are skipped (vLLM 0.26's ``kernel_unified_attention`` takes it as ``SLIDING_WINDOW``)."""
    batch, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    _paged_decode_v3_kernel[(batch, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens,
        scale * LOG2E * k_scale,
        v_scale,
        *query.stride()[:2],  # (batch, head); head_dim's stride is 1
        *out.stride()[:2],
        *key_cache.stride()[:3],  # (block, token, kv head)
        block_tables.stride(0),
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
