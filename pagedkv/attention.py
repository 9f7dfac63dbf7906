"""Paged attention in plain PyTorch: the reference every Triton kernel in `pagedkv.kernels` is checked against.

The KV cache is a pool of fixed-size blocks, kept as two tensors (the lab's choice, for clarity):

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]

vLLM 0.26's FlashAttention backend keeps one tensor per layer instead, K and V packed in the last dimension:
logical shape ``(num_blocks, num_kv_heads, block_size, 2 * head_size)``
(``FlashAttentionBackend.get_kv_cache_shape``, vllm/v1/attention/backends/flash_attn.py), laid out in memory in
the order ``get_kv_cache_stride_order`` returns (``(0, 2, 1, 3)`` for the default NHD layout, so physically
``[num_blocks, block_size, num_kv_heads, 2 * head_size]``). Its forward pass splits it into two views,
``kv_cache.transpose(1, 2).split(head_size, dim=-1)``, each of this module's shape with a head stride of
``2 * head_size``; everything here (and every kernel in ``pagedkv.kernels``) accepts such views.

Sequence ``b`` owns the physical blocks ``block_tables[b, 0], block_tables[b, 1], ...`` in logical order;
its token ``t`` lives at ``key_cache[block_tables[b, t // block_size], t % block_size]``. The reference
does the obvious thing: gather each sequence's blocks back into a dense ``[seq_len, num_kv_heads,
head_dim]`` tensor, then run ordinary softmax attention. It is slow and simple on purpose, and it can
compute in float64 so a kernel's rounding error can be measured against something far more exact.

Mirrors: vLLM's test references ``ref_paged_attn`` (tests/kernels/attention/test_flash_attn.py) and
``ref_single_query_cached_kv_attention`` (tests/kernels/attention/test_attention.py).
"""

from __future__ import annotations

import math

import torch

from pagedkv.utils import check_int

__all__ = [
    "attention",
    "check_sliding_window",
    "gather_kv",
    "make_paged_kv",
    "ref_paged_attention_decode",
    "ref_paged_prefill_attention",
    "relative_error",
]


def gather_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] (one row of block_tables)
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather one sequence's scattered blocks into dense K and V, each ``[seq_len, Hkv, D]``.

    Nothing is modified. This is what "the kernel gathers scattered blocks" means, written as two
    indexing operations instead of pointer arithmetic. Raises ValueError, as the kernels do, for a ``seq_len``
    outside ``0 .. len(block_table) * block_size`` or a used entry outside the cache's block ids (torch would
    read a negative id from the end of the cache).
    """
    block_size = key_cache.shape[1]
    if isinstance(seq_len, torch.Tensor) and seq_len.dim() == 0 and not seq_len.is_floating_point():
        seq_len = int(seq_len)  # seq_lens[b] of an int tensor works as well as seq_lens.tolist()[b]
    seq_len = check_int(seq_len, "seq_len", 0, block_table.shape[0] * block_size,
                        why=f"the table has {block_table.shape[0]} blocks of {block_size} tokens")
    num_used = -(-seq_len // block_size)  # ceil: the blocks that hold this sequence's tokens
    ids = block_table[:num_used].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= key_cache.shape[0]):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"block_table holds block id {bad}, outside the cache's 0..{key_cache.shape[0] - 1}")
    k = key_cache[ids].reshape(num_used * block_size, *key_cache.shape[2:])[:seq_len]
    v = value_cache[ids].reshape(num_used * block_size, *value_cache.shape[2:])[:seq_len]
    return k, v


def attention(
    q: torch.Tensor,  # [Lq, Hq, D]
    k: torch.Tensor,  # [Lk, Hkv, D]
    v: torch.Tensor,  # [Lk, Hkv, D]
    scale: float,
    causal_offset: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense softmax attention with grouped-query heads; returns ``[Lq, Hq, D]`` in ``q``'s dtype.

    Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (vLLM's and Hugging Face's mapping). With
    ``causal_offset = c``, query ``i`` sits at position ``c + i`` and sees keys ``0 .. c + i`` only.
    With ``sliding_window = W`` as well, it sees only the last ``W`` of those, keys ``c + i - W + 1 .. c + i``
    (itself included): vLLM 0.26 passes FlashAttention ``window_size = (W - 1, 0)``
    (``FlashAttentionImpl.__init__``, vllm/v1/attention/backends/flash_attn.py) and transformers masks
    ``kv_idx > q_idx - W`` (``sliding_window_overlay``, transformers/masking_utils.py).
    """
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)  # [Lk, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Lq, Lk]
    if sliding_window is not None and causal_offset is None:
        raise ValueError("a sliding window needs the queries' positions: pass causal_offset")
    if causal_offset is not None:
        q_pos = causal_offset + torch.arange(q.shape[0], device=q.device)
        k_pos = torch.arange(k.shape[0], device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]  # [Lq, Lk]: the future
        if sliding_window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window  # behind the window
        scores = scores.masked_fill(hidden[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _compute_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_sliding_window(sliding_window: int | None) -> int | None:
    """``sliding_window`` as a Python int (``None`` stays ``None``: full attention); ``ValueError`` unless it is
    ``None`` or an int >= 1."""
    if sliding_window is None:
        return None
    return check_int(sliding_window, "sliding_window", 1, why="or None for full attention")


def ref_paged_attention_decode(
    query: torch.Tensor,  # [B, Hq, D]: one new token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: tokens in the cache for each sequence, the new one included
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode attention by gather-then-attend: ``out[b, h] = softmax(q·Kᵀ·scale)·V`` over b's cached tokens.

    Returns ``[B, Hq, D]``. Computes in ``compute_dtype`` (float32 for half inputs unless asked; pass
    ``torch.float64`` for the exact reference the tests use) and returns in that dtype, so no rounding is
    added on the way out. With ``sliding_window = W`` the query (at position ``seq_len - 1``) sees only the
    last ``W`` tokens; the blocks wholly before them are never read, so their table entries may be the null
    block. Nothing is modified.
    """
    sliding_window = check_sliding_window(sliding_window)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    cdt = _compute_dtype(query.dtype, compute_dtype)
    out = torch.empty(query.shape, dtype=cdt, device=query.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_kv(key_cache, value_cache, block_tables[b], seq_len)
        offset = None if sliding_window is None else seq_len - 1
        out[b] = attention(query[b : b + 1].to(cdt), k.to(cdt), v.to(cdt), scale, offset, sliding_window)[0]
    return out


def ref_paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]: the new tokens of all sequences, packed
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]: already holds the new tokens' K/V
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: cached prefix + new tokens
    query_start_loc: torch.Tensor,  # [B + 1] int32: sequence b's queries are query[qsl[b]:qsl[b+1]]
    scale: float | None = None,
    compute_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Chunked-prefill attention over a paged cache; returns ``[T, Hq, D]``.

    Sequence ``b`` has ``q_len = qsl[b+1] - qsl[b]`` new tokens, the last ``q_len`` of its ``seq_len``
    cached tokens (their K/V were written by ``reshape_and_cache`` first, as in vLLM V1). New token ``i``
    sits at position ``seq_len - q_len + i`` and attends causally: to the cached prefix and to the new
    tokens up to and including itself. Decode is the case ``q_len == 1``. With ``sliding_window = W``
    it sees only the last ``W`` of those (see :func:`attention`). Nothing is modified.
    """
    sliding_window = check_sliding_window(sliding_window)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    cdt = _compute_dtype(query.dtype, compute_dtype)
    out = torch.empty(query.shape, dtype=cdt, device=query.device)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[b], seq_len)
        out[lo:hi] = attention(query[lo:hi].to(cdt), k.to(cdt), v.to(cdt), scale, causal_offset=seq_len - (hi - lo),
                               sliding_window=sliding_window)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|``, in float64: the error measure every kernel test uses.

    A NaN anywhere in ``out`` (an element the kernel never wrote, when ``out`` was poisoned) gives ``inf``.
    """
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out64).all():
        return math.inf
    return (out64 - ref64).abs().max().item() / max(ref64.abs().max().item(), 1e-30)


def make_paged_kv(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    extra_blocks: int = 3,
    max_blocks: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random paged KV cache for a batch of sequences, with shuffled block tables.

    Returns ``(key_cache, value_cache, block_tables, seq_lens)``. Every sequence gets
    ``ceil(len / block_size)`` distinct physical blocks drawn at random from the pool (so logically
    adjacent blocks are physically scattered); ``extra_blocks`` unused blocks and the unused slots of
    each last block are filled with huge values, so a kernel that reads past a sequence's end gives a
    visibly wrong answer. Unused block-table entries point at a random valid block, as a stale table
    would. Block 0 is kept unused, like vLLM's null block.
    """
    if not seq_lens:
        raise ValueError("seq_lens is empty")
    needs = [-(-n // block_size) for n in seq_lens]
    width = max(needs) if max_blocks is None else max_blocks
    if width < max(needs):
        raise ValueError(f"max_blocks={max_blocks} is less than the {max(needs)} blocks the longest sequence needs")
    num_blocks = 1 + sum(needs) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    gen_device = "cpu"  # generate on the CPU so a given seed gives the same cache everywhere
    key_cache = torch.full(shape, 1.0e4, dtype=torch.float32, device=gen_device)
    value_cache = torch.full(shape, -1.0e4, dtype=torch.float32, device=gen_device)
    perm = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    tables = torch.empty(len(seq_lens), width, dtype=torch.int32)
    cursor = 0
    for b, (n, need) in enumerate(zip(seq_lens, needs, strict=True)):
        ids = perm[cursor : cursor + need]
        cursor += need
        for j, blk in enumerate(ids):
            used = min(block_size, n - j * block_size)
            key_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=generator)
            value_cache[blk, :used] = torch.randn(used, num_kv_heads, head_dim, generator=generator)
        tables[b, :need] = torch.tensor(ids, dtype=torch.int32)
        if width > need:
            tables[b, need:] = torch.randint(1, num_blocks, (width - need,), generator=generator, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (
        key_cache.to(dtype=dtype, device=device),
        value_cache.to(dtype=dtype, device=device),
        tables.to(device),
        lens.to(device),
    )
