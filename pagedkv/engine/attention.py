"""The attention backend glue: transformers' attention modules, reading and writing the paged KV cache.

transformers lets a model's attention be swapped by name: ``AttentionInterface.register("pagedkv", fn)``
and a model whose ``config._attn_implementation == "pagedkv"`` calls ``fn(module, query, key, value,
attention_mask, scaling=..., **kwargs)`` in every layer, after the projections and RoPE
(``transformers/modeling_utils.py``: ``AttentionInterface``; compare ``integrations/sdpa_attention.py``).
Whatever keyword arguments the caller gave the model's ``forward`` arrive in ``kwargs``: the model runner
passes one :class:`AttentionMetadata` per step as ``pagedkv_metadata``. So the model code stays
transformers' own: only attention changes.

Each call does two things for its layer (``module.layer_idx``):

1. writes the step's new K and V into the paged cache at ``slot_mapping`` (``reshape_and_cache``);
2. attends each new query to its request's tokens through the block table (the new ones included, causally).

Two backends do this: ``"torch"`` (PyTorch on any device; the CPU default, whose decode rows go through a small
compiled C kernel where the machine has a C compiler, :mod:`pagedkv.engine.cpu_kernel`) and ``"triton"`` (the
lab's kernels, CUDA only). Mirrors vLLM 0.26's ``Attention`` layer and ``FlashAttentionImpl.forward``
(``vllm/v1/attention/backends/flash_attn.py``), whose metadata comes from ``FlashAttentionMetadataBuilder``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from pagedkv.engine import cpu_kernel

ATTN_IMPLEMENTATION = "pagedkv"
METADATA_KWARG = "pagedkv_metadata"
BACKENDS = ("torch", "triton")


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once per step by the model runner.

    The step's ``T`` tokens are packed request after request (scheduling order); request ``b`` owns
    tokens ``query_start_loc[b]:query_start_loc[b+1]``, its KV fills ``seq_lens[b]`` slots after this step.
    Mirrors ``FlashAttentionMetadata`` (``vllm/v1/attention/backends/flash_attn.py``).
    """

    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (-1: padding, skipped)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens of each request
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key_cache, value_cache [N, bs, Hkv, D]
    backend: str = "torch"
    # The torch backend's split of the batch (host ints, built with the metadata): requests with one new
    # token are attended together in one batched call, the others one by one.
    decode_req_idx: torch.Tensor | None = None  # [Bd] int64: the requests with q_len == 1
    prefill_reqs: list[tuple[int, int, int, int]] = field(default_factory=list)  # (b, lo, hi, seq_len)
    decode_version: int | None = None  # the Triton decode kernel for decode-only steps (None: its choice)
    # The torch backend's decode groups, built once per step (None: one group of all of decode_req_idx)
    decode_groups: list[DecodeGroup] | None = None
    # The torch backend's decode rows read in place from the pool (None: through decode_groups' gathers)
    pool_decode: PoolDecode | None = None
    # The torch backend's rows through the compiled CPU kernel where it serves (pagedkv.engine.cpu_kernel): every
    # request of the step, decode rows and prefill chunks; False: PyTorch's own operations (the decode rows through
    # pool_decode or decode_groups, each prefill chunk gathered and attended alone)
    decode_kernel: bool = True
    kernel_req_idx: torch.Tensor | None = None  # [B] int64: the requests the kernel attends (None: all of them)
    # The KV cache group's window when it releases the blocks behind it (a SlidingWindowSpec group: those table
    # entries are the null block), else None: the layer's own window, if any, is then only a mask
    sliding_window: int | None = None
    # When a dict: every layer's attention call adds its host seconds to ``timings["attention_s"]`` (the runner's
    # time split; on a GPU the launches only, the device runs on)
    timings: dict[str, float] | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass
class DecodeGroup:
    """Decode requests of similar length, attended together in one call by the torch backend."""

    tokens: torch.Tensor  # [Bg] int64: the packed index of each request's one new token
    block_ids: torch.Tensor  # [Bg·W] int64: W block ids per request from its first gathered block (null-padded)
    width: int  # W: blocks gathered per request (enough for the group's longest)
    visible: torch.Tensor  # [Bg, 1, 1, W·bs] bool: the slots the request's query sees
    seq_lens: torch.Tensor | None = None  # [Bg] int64: each request's seq_len
    start: torch.Tensor | None = None  # [Bg] int64: the position of each request's first gathered slot (0, or
    # under the window the group was built for, the start of the block holding seq_len - W)
    sliding_window: int | None = None  # the window ``visible`` applies (None: full attention)

    def to(self, device: torch.device | str) -> DecodeGroup:
        """The same group with its tensors on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return DecodeGroup(self.tokens.to(device), self.block_ids.to(device), self.width, self.visible.to(device),
                           move(self.seq_lens), move(self.start), self.sliding_window)

    def visible_in_window(self, sliding_window: int | None) -> torch.Tensor:
        """The slots seen under ``sliding_window``: ``visible`` when it is the window the group was built for,
        else ``visible`` narrowed to each request's last ``W`` positions: ``[Bg, 1, 1, W·bs]`` bool."""
        if sliding_window == self.sliding_window:
            return self.visible
        if self.sliding_window is not None or self.seq_lens is None or self.start is None:
            raise ValueError(f"decode group built for window {self.sliding_window}, attended with {sliding_window}")
        pos = self.start[:, None] + torch.arange(self.visible.shape[-1], device=self.visible.device)  # [Bg, W·bs]
        return self.visible & (pos >= (self.seq_lens - sliding_window)[:, None])[:, None, None, :]


def make_decode_groups(
    decode_req_idx: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: list[int],
    block_size: int,
    max_groups: int = 4,
    min_group: int = 8,
    sliding_window: int | None = None,
) -> list[DecodeGroup]:
    """Split the decode requests, sorted by length, into up to ``max_groups`` groups of at least ``min_group``:
    each group is gathered only as wide as its own longest request, so short requests do not pay for the
    longest one's padding. Built once per step on the host; every layer of a KV cache group reuses it.

    Under a ``sliding_window`` of ``W`` each request is gathered from the block holding position
    ``seq_len - W`` on (the ones before are the null block once released), so a sliding layer's decode reads
    at most ``cdiv(W, bs) + 1`` blocks per request however long the request has grown."""
    order = sorted(decode_req_idx, key=lambda b: seq_lens[b])
    n_groups = max(1, min(max_groups, len(order) // min_group))
    groups = []
    for g in range(n_groups):
        members = order[g * len(order) // n_groups : (g + 1) * len(order) // n_groups]
        if not members:
            continue
        lens = torch.tensor([seq_lens[b] for b in members])  # [Bg]
        first = torch.zeros_like(lens) if sliding_window is None else (lens - sliding_window).clamp(min=0) // block_size
        width = int((-(-lens // block_size) - first).max())
        cols = first[:, None] + torch.arange(width)[None, :]  # [Bg, W] the logical blocks gathered
        rows = block_tables[torch.tensor(members)]  # [Bg, max_blocks]
        inside = cols < rows.shape[1]
        block_ids = torch.where(inside, rows.gather(1, cols.clamp(max=rows.shape[1] - 1).long()), 0)
        start = first * block_size  # [Bg]
        pos = start[:, None] + torch.arange(width * block_size)[None, :]  # [Bg, W·bs]
        visible = pos < lens[:, None]
        if sliding_window is not None:
            visible &= pos >= (lens - sliding_window)[:, None]
        tokens = torch.tensor([query_start_loc[b] for b in members])  # [Bg]
        groups.append(DecodeGroup(tokens, block_ids.long().reshape(-1), width, visible[:, None, None, :], lens,
                                  start, sliding_window))
    return groups


@dataclass
class PoolDecode:
    """A step's decode rows attended to in place, reading the pool's blocks ``lo .. hi-1`` where they lie.

    Every block in that range belongs to at most one decode row (``owner``; ``Bd``: none) at column ``col`` of
    its table. A layer multiplies the queries with every block of the range in one batched product, spreads the
    scores into a ``[Bd, Hq, W·bs]`` row per request for the softmax, and multiplies back: K and V are read
    once, not copied out first. Built once per step by :func:`make_pool_decode`; every layer reuses it."""

    tokens: torch.Tensor  # [Bd] int64: the packed index of each decode row's one new token
    lo: int
    hi: int  # the pool's blocks lo .. hi-1 (a slice: no copy)
    owner: torch.Tensor  # [hi - lo] int64: the decode row that owns the block (Bd: none)
    col: torch.Tensor  # [hi - lo] int64: the block's column in its row's table (0 for none)
    width: int  # W: blocks of the longest decode row
    mask: torch.Tensor  # [Bd, 1, W·bs] float: 0 where the row's query sees the slot, -inf elsewhere

    def to(self, device: torch.device | str) -> PoolDecode:
        """The same step with its tensors on ``device``."""
        return PoolDecode(self.tokens.to(device), self.lo, self.hi, self.owner.to(device), self.col.to(device),
                          self.width, self.mask.to(device))


def make_pool_decode(
    decode_req_idx: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [B, max_blocks] int32 (host)
    query_start_loc: list[int],
    block_size: int,
    dtype: torch.dtype = torch.float32,
    max_spread: float = 2.0,
) -> PoolDecode | None:
    """The :class:`PoolDecode` of a step's decode rows, or ``None`` where reading in place does not pay or does
    not apply: no decode row, a block in two rows' tables (a shared prefix: one block, two queries), or the
    rows' blocks spread over more than ``max_spread`` times their number of pool blocks (the range would read
    mostly other requests' blocks)."""
    if not decode_req_idx:
        return None
    rows_idx = torch.tensor(decode_req_idx)
    lens = torch.tensor([seq_lens[b] for b in decode_req_idx])  # [Bd]
    nblk = -(-lens // block_size)  # [Bd]
    width = int(nblk.max())
    if width > block_tables.shape[1]:
        return None
    rows = block_tables[rows_idx, :width].long()  # [Bd, W]
    cols = torch.arange(width)
    used = cols[None, :] < nblk[:, None]  # [Bd, W]
    ids = rows[used]  # [P] every block a decode row reads
    lo, hi = int(ids.min()), int(ids.max()) + 1
    if hi - lo > max_spread * ids.numel() or int(torch.bincount(ids - lo).max()) > 1:
        return None
    bd = len(decode_req_idx)
    owner = torch.full((hi - lo,), bd, dtype=torch.long)
    owner[ids - lo] = torch.arange(bd)[:, None].expand(bd, width)[used]
    col = torch.zeros(hi - lo, dtype=torch.long)
    col[ids - lo] = cols[None, :].expand(bd, width)[used]
    slots = torch.arange(width * block_size)
    mask = torch.zeros(bd, 1, width * block_size, dtype=dtype)
    mask.masked_fill_((slots[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    tokens = torch.tensor([query_start_loc[b] for b in decode_req_idx])
    return PoolDecode(tokens, lo, hi, owner, col, width, mask)


def pool_decode_attention(
    query: torch.Tensor,  # [Bd, Hq, D]: the decode rows' queries
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]
    value_cache: torch.Tensor,
    pd: PoolDecode,
    scale: float,
) -> torch.Tensor:
    """Decode attention read in place from the pool; returns ``[Bd, Hq, D]``.

    A block ``[bs, Hkv·D]`` is contiguous in the pool, so all blocks ``lo .. hi-1`` are one batch of matrices for
    ``torch.bmm`` without a copy. Grouped-query heads share the product through a block-diagonal query: query
    head ``h·G + g`` holds its ``D`` values in KV head ``h``'s columns and zeros elsewhere (``[Hq, Hkv·D]``), so
    one product ``[Hq, Hkv·D] x [Hkv·D, bs]`` gives every head's scores over the block (``Hkv`` times the
    multiply-adds, which are not what decode attention waits for: the bytes of K and V are). The same for
    ``P·V``, whose block-diagonal part is kept. Each block is multiplied with its owner's query (a block owned by
    none, with zeros, and dropped). The softmax runs per request over its blocks, laid side by side."""
    bd, hq, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    g = hq // hkv
    n, w = pd.hi - pd.lo, pd.width
    qd = query.new_zeros(bd + 1, hkv, g, hkv, d)  # row bd: the zero query of unowned blocks
    qd[:bd].diagonal(dim1=1, dim2=3).copy_(query.view(bd, hkv, g, d).permute(0, 2, 3, 1))
    q_blk = qd.view(bd + 1, hq, hkv * d).index_select(0, pd.owner)  # [n, Hq, Hkv·D]
    k = key_cache[pd.lo : pd.hi].view(n, bs, hkv * d)  # [n, bs, Hkv·D], in place
    scores = torch.bmm(q_blk.float(), k.float().transpose(1, 2))  # [n, Hq, bs]
    rows = scores.new_zeros(bd + 1, hq, w, bs)  # row bd: where unowned blocks' scores go
    rows[pd.owner, :, pd.col] = scores
    probs = torch.softmax(rows[:bd].view(bd, hq, w * bs).mul_(scale).add_(pd.mask), dim=-1)  # [Bd, Hq, W·bs]
    p_blk = probs.view(bd, hq, w, bs)[pd.owner.clamp(max=bd - 1), :, pd.col]  # [n, Hq, bs]
    v = value_cache[pd.lo : pd.hi].view(n, bs, hkv * d)
    out_blk = torch.bmm(p_blk, v.float())  # [n, Hq, Hkv·D]
    out = out_blk.new_zeros(bd + 1, hq, hkv * d).index_add_(0, pd.owner, out_blk)[:bd]  # summed over blocks
    out = out.view(bd, hkv, g, hkv, d).diagonal(dim1=1, dim2=3)  # [Bd, G, D, Hkv]: each head's own KV head
    return out.permute(0, 3, 1, 2).reshape(bd, hq, d).to(query.dtype)


def write_kv_torch(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D] (written)
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """``reshape_and_cache`` on the torch backend: token t's K/V to flat slot ``slot_mapping[t]``; -1 slots skipped.
    In one compiled call where the CPU kernels serve (``cpu_cache.c``, :mod:`pagedkv.engine.cpu_kernel`: float32
    on a CPU, contiguous caches, ``D`` contiguous in ``key`` and ``value``), else two ``index_copy_``."""
    hkv, d = key_cache.shape[2], key_cache.shape[3]
    t = slot_mapping.shape[0]
    if (cpu_kernel.usable(key, key_cache) and value_cache.is_contiguous() and value.dtype == key.dtype
            and key.shape == value.shape == (t, hkv, d) and key.stride(-1) == 1 and value.stride(-1) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        bad = cpu_kernel.load().reshape_and_cache_f32(
            key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
            key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), t, hkv, d,
            key_cache.shape[0] * key_cache.shape[1])
        if bad:
            raise IndexError(f"write_kv_torch: token {bad - 1}'s slot {int(slot_mapping[bad - 1])} is outside the "
                             f"pool's {key_cache.shape[0] * key_cache.shape[1]} slots")
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    key_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _attend(
    q: torch.Tensor,  # [B, Lq, Hq, D]
    k: torch.Tensor,  # [B, Lk, Hkv, D]
    v: torch.Tensor,  # [B, Lk, Hkv, D]
    visible: torch.Tensor,  # [B, Lq, Lk] bool
    scale: float,
) -> torch.Tensor:
    """Softmax attention with grouped-query heads, computed in float32; returns ``[B, Lq, Hq, D]``.

    The ``G = Hq / Hkv`` query heads that share a KV head are laid along the query axis (``[B, Hkv, G·Lq, D]``),
    so one ``scaled_dot_product_attention`` call serves them without repeating K and V."""
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    lk = visible.shape[-1]
    qf = q.float().reshape(b, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)  # [B, Hkv, G·Lq, D]
    mask = visible[:, None].expand(b, g, lq, lk).reshape(b, 1, g * lq, lk)  # row g·Lq + i: query i
    out = torch.nn.functional.scaled_dot_product_attention(
        qf, k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=mask, scale=scale
    )  # [B, Hkv, G·Lq, D]
    return out.reshape(b, hkv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, hq, d).to(q.dtype)


def _gather_blocks(
    cache: torch.Tensor,  # [N, bs, Hkv, D]
    table: torch.Tensor,  # [..., W] int64 block ids
) -> torch.Tensor:
    """The blocks of ``table`` copied out of the pool, ``[..., W, bs, Hkv, D]`` (``cache[table]``; ``index_select``
    on the flattened ids is about 4x faster on a CPU than advanced indexing)."""
    return torch.index_select(cache, 0, table.reshape(-1)).view(*table.shape, *cache.shape[1:])


def torch_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [N, bs, Hkv, D]: already holds this step's K
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]: written and returned (None: a new tensor)
) -> torch.Tensor:
    """Paged attention on the torch backend for a mixed step; returns ``[T, Hq, D]``.

    Where the compiled CPU kernel serves (:mod:`pagedkv.engine.cpu_kernel`: float32 on a CPU, a C compiler on the
    machine; any block table, any window), it attends every request of the step, decode rows and prefill chunks,
    in one call. Otherwise, in PyTorch: decode requests (one new token) are read in place from the pool when the
    step's metadata allows it
    (``pool_decode``, :func:`pool_decode_attention`: no block shared between two decode rows, full attention);
    otherwise they are done in a few groups of similar length: a group's blocks are gathered through the block
    table into a padded ``[Bg, max_blocks·bs, Hkv, D]`` tensor and masked at ``seq_len``.
    Each prefill chunk is done alone, its keys gathered the same way, with a causal mask offset by its cached
    prefix. Under a ``sliding_window`` of ``W`` a query at position ``p`` sees keys ``p - W + 1 .. p`` only, and
    a prefill chunk gathers no block wholly behind its first query's window (such blocks may be the null block).
    The same arithmetic as ``pagedkv.attention.ref_paged_prefill_attention``, batched.
    """
    out = torch.empty_like(query) if out is None else out
    bs = key_cache.shape[1]
    hq, hkv, d = query.shape[1], key_cache.shape[2], key_cache.shape[3]
    groups = meta.decode_groups
    pd = meta.pool_decode
    if meta.decode_kernel and cpu_kernel.usable(query, key_cache):  # every row, compiled
        reqs = meta.kernel_req_idx
        if reqs is None:
            reqs = torch.arange(meta.num_reqs)
        cpu_kernel.decode_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, reqs, out, scale, sliding_window)
        return out
    if pd is not None and sliding_window is None:  # the decode rows, in place
        q = query.index_select(0, pd.tokens)  # [Bd, Hq, D]
        out.index_copy_(0, pd.tokens, pool_decode_attention(q, key_cache, value_cache, pd, scale))
        groups = []
    elif groups is None and meta.decode_req_idx is not None and meta.decode_req_idx.numel():
        groups = make_decode_groups(meta.decode_req_idx.tolist(), meta.seq_lens.tolist(), meta.block_tables.cpu(),
                                    meta.query_start_loc.tolist(), bs, max_groups=1,
                                    sliding_window=meta.sliding_window)
        groups = [g.to(query.device) for g in groups]
    for grp in groups or []:
        n, length = grp.tokens.numel(), grp.width * bs
        k = _gather_blocks(key_cache, grp.block_ids).view(n, length, hkv, d).transpose(1, 2)  # [Bg, Hkv, L, D]
        v = _gather_blocks(value_cache, grp.block_ids).view(n, length, hkv, d).transpose(1, 2)
        # query head h·G + i reads KV head h (transformers' repeat_kv order): a view, no copy of K or V
        q = query.index_select(0, grp.tokens).view(n, hkv, hq // hkv, d)  # [Bg, Hkv, G, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=grp.visible_in_window(sliding_window),
            scale=scale)  # [Bg, Hkv, G, D]
        out.index_copy_(0, grp.tokens, o.reshape(n, hq, d).to(out.dtype))
    for b, lo, hi, seq_len in meta.prefill_reqs:
        nblk = -(-seq_len // bs)
        first_q = seq_len - (hi - lo)
        # under a window, the blocks wholly behind the first query's window are not gathered
        first_blk = 0 if sliding_window is None else max(0, first_q - sliding_window + 1) // bs
        start = first_blk * bs  # the position of the first gathered key
        table = meta.block_tables[b, first_blk:nblk].long()
        k = _gather_blocks(key_cache, table).reshape(1, -1, hkv, d)[:, : seq_len - start]  # [1, L, Hkv, D]
        v = _gather_blocks(value_cache, table).reshape(1, -1, hkv, d)[:, : seq_len - start]
        q_pos = torch.arange(first_q, seq_len, device=query.device)
        k_pos = torch.arange(start, seq_len, device=query.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # [Lq, L] causal
        if sliding_window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
        out[lo:hi] = _attend(query[None, lo:hi], k, v, visible[None], scale)[0]
    return out


def triton_paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged attention with the lab's Triton kernels (CUDA): ``paged_attention_decode`` for a decode-only
    step (the one a CUDA graph replays), ``paged_prefill_attention`` for a mixed one (a decode is a chunk of
    one token). ``validate=False``: no host synchronisation, so the call can be captured in a graph."""
    from pagedkv.kernels import paged_attention_decode, paged_prefill_attention

    if meta.is_decode_only:
        return paged_attention_decode(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
            version=meta.decode_version, validate=False, sliding_window=sliding_window,
        )
    return paged_prefill_attention(
        query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        max_query_len=meta.max_query_len, validate=False, sliding_window=sliding_window,
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D] (transformers' layout: batch 1, all the step's tokens)
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``"pagedkv"`` in transformers' ``AttentionInterface``.

    Writes the layer's new K/V into its paged cache, then attends; returns ``([1, T, Hq, D], None)`` as
    transformers' attention functions do. ``pagedkv_metadata`` is one :class:`AttentionMetadata`, or with
    several KV cache groups a dict from layer index to its group's (vLLM's ``attn_metadata[layer_name]``); the
    layer's ``sliding_window`` is the one transformers passes, and must be its group's when that group
    releases blocks. Without ``pagedkv_metadata`` in ``kwargs`` (the model called by
    anything but the engine, e.g. ``model.generate``) it falls back to transformers' SDPA, so a model set to
    ``"pagedkv"`` still works everywhere. Mirrors ``FlashAttentionImpl.forward``.
    """
    meta: AttentionMetadata | Mapping[int, AttentionMetadata] | None = kwargs.get(METADATA_KWARG)
    if meta is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"the pagedkv attention takes one packed sequence (batch 1), got batch {query.shape[0]}")
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    # the layer's window, as transformers passes it (Mistral, Qwen2/3, Gemma 3, OLMo 3: None on full layers)
    out = paged_attention(q, k, v, module.layer_idx, meta, scale, kwargs.get("sliding_window"))
    return out[None], None  # [1, T, Hq, D]


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    layer_idx: int,
    meta: AttentionMetadata | Mapping[int, AttentionMetadata],
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]: where the result goes (None: a new tensor)
) -> torch.Tensor:
    """One layer's attention over the paged cache, on the step's flattened tokens: writes the new K/V into layer
    ``layer_idx``'s cache at ``slot_mapping``, then attends; returns ``[T, Hq, D]`` (``out`` when given: the lab's
    decoder passes a buffer it reuses every layer and step). ``meta`` is one
    :class:`AttentionMetadata`, or with several KV cache groups a dict from layer index to its group's (vLLM's
    ``attn_metadata[layer_name]``); ``sliding_window`` is the layer's own, and must be its group's when that group
    releases blocks. What both model paths call: transformers' modules through :func:`paged_attention_forward`,
    the lab's Llama decoder (:mod:`pagedkv.engine.llama`) directly. Mirrors ``FlashAttentionImpl.forward``
    (``do_kv_cache_update`` then the attention)."""
    if isinstance(meta, Mapping):  # several KV cache groups: this layer's group's metadata
        meta = meta[layer_idx]
    t0 = time.perf_counter()
    key_cache, value_cache = meta.kv_caches[layer_idx]
    if meta.sliding_window is not None and sliding_window != meta.sliding_window:
        # the group released the blocks behind its window: a layer that reads further back would read null blocks
        raise ValueError(f"layer {layer_idx}: attends with sliding_window={sliding_window}, but its KV "
                         f"cache group keeps only a {meta.sliding_window}-token window")
    if meta.backend == "triton":
        from pagedkv.kernels import reshape_and_cache

        reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, validate=False)
        result = triton_paged_attention(query, key_cache, value_cache, meta, scale, sliding_window)
        out = result if out is None else out.copy_(result)
    else:
        write_kv_torch(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch_paged_attention(query, key_cache, value_cache, meta, scale, sliding_window, out)
    if meta.timings is not None:
        meta.timings["attention_s"] = meta.timings.get("attention_s", 0.0) + time.perf_counter() - t0
    return out


def register_pagedkv_attention() -> None:
    """Register :func:`paged_attention_forward` as ``"pagedkv"`` in transformers' ``AttentionInterface``
    (idempotent). No mask function is registered for it, so transformers builds no attention mask
    (``masking_utils._preprocess_mask_arguments`` exits early): the block tables and ``seq_lens`` are the mask.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
