"""``paged_attention_decode``: validate, then dispatch to one of the four decode kernels.

The four versions (each in its own module, each runnable on its own):

1. ``decode_v1``: one program per (sequence, query head), one KV block per iteration, online softmax.
2. ``decode_v2``: one program per (sequence, KV head); the group's query heads as one tile, ``tl.dot``.
3. ``decode_v3``: as 2, but each iteration covers a tile of several blocks (one block-table lookup per token).
4. ``decode_v4``: split-K (flash-decoding): slices of the context in parallel, fp32 partials + LSE, a reduce.

``version=None`` picks the best for the shape: version 4 when ``choose_num_splits`` says the GPU would
otherwise sit partly idle, else version 3 (version 4 with one slice is version 3 plus a pointless reduce).

Mirrors: vLLM's ``paged_attention`` dispatch in vllm/attention/ops/paged_attn.py, which picks
``paged_attention_v1`` or ``paged_attention_v2`` (split) from the batch, the heads and the length.
"""

from __future__ import annotations

import torch

from ._common import (
    check_block_tables,
    check_out,
    check_query_and_cache,
    contiguous_index,
    contiguous_rows,
    resolve_scale,
)
from .decode_v1 import launch_decode_v1
from .decode_v2 import launch_decode_v2
from .decode_v3 import TILE_TOKENS, launch_decode_v3
from .decode_v4 import DEFAULT_NUM_SMS, MAX_SPLITS, choose_num_splits, launch_decode_v4

DECODE_VERSIONS = (1, 2, 3, 4)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (CUDA), or ``DEFAULT_NUM_SMS`` (an H100's 132) elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


def _validate(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    check_values: bool,
) -> int:
    """All checks ``paged_attention_decode`` makes; returns the longest sequence length (or a bound)."""
    batch, _, _, num_blocks, block_size, _ = check_query_and_cache(
        query, key_cache, value_cache, {"block_tables": block_tables, "seq_lens": seq_lens}, "batch"
    )
    if check_values:
        return check_block_tables(block_tables, seq_lens, batch, num_blocks, block_size)
    # Cheap shape checks only; the longest possible length bounds the split heuristic.
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError("block_tables must be [batch, max_blocks] and seq_lens [batch]")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    return block_tables.shape[1] * block_size


def paged_attention_decode(
    query: torch.Tensor,  # [B, Hq, D]: the newest token of each sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32: physical block of each logical block
    seq_lens: torch.Tensor,  # [B] int32: cached tokens per sequence (the newest one included)
    scale: float | None = None,
    *,
    version: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of each sequence's newest query over its paged KV cache; returns ``out [B, Hq, D]``.

    ``out[b, h] = softmax(query[b, h] · K_bᵀ · scale) · V_b`` where ``K_b``/``V_b`` are sequence b's first
    ``seq_lens[b]`` cached tokens of KV head ``h // (Hq // Hkv)``, found through ``block_tables[b]``.
    ``scale`` defaults to ``1/sqrt(D)``. Nothing but ``out`` is written.

    ``version`` picks a kernel (1-4, see the module docstring; None: the best for the shape).
    ``num_splits`` fixes version 4's slice count (default: ``choose_num_splits``). ``out`` may be passed
    to reuse a buffer. ``validate=False`` skips the checks that read ``seq_lens`` and ``block_tables``
    back to the host (a GPU synchronisation); shapes, dtypes and devices are always checked.

    Raises ValueError on a bad shape, dtype or device, ``Hq`` not a multiple of ``Hkv``, a sequence of
    length 0, a block table too short for its sequence or holding an id outside the cache.
    """
    if version is not None and version not in DECODE_VERSIONS:
        raise ValueError(f"version must be one of {DECODE_VERSIONS} or None; got {version!r}")
    if num_splits is not None and not (isinstance(num_splits, int) and 1 <= num_splits <= 4 * MAX_SPLITS):
        raise ValueError(f"num_splits must be an int in 1..{4 * MAX_SPLITS}; got {num_splits!r}")
    if num_splits is not None and version not in (None, 4):
        raise ValueError(f"num_splits applies to version 4 (split-K) only; got version={version}")
    max_len = _validate(query, key_cache, value_cache, block_tables, seq_lens, validate)
    out = check_out(out, query)
    if query.shape[0] == 0:
        return out
    scale = resolve_scale(scale, query.shape[-1])
    if query.stride(-1) != 1:
        query = query.contiguous()
    # The kernels read seq_lens[b] at ptr + b and block_tables[b, j] at ptr + b * stride_bt + j.
    seq_lens = contiguous_index(seq_lens)
    block_tables = contiguous_rows(block_tables)

    splits = num_splits or choose_num_splits(query.shape[0], key_cache.shape[2], max_len, num_sms(query.device))
    if version is None:
        version = 4 if splits > 1 else 3
    args = (out, query, key_cache, value_cache, block_tables, seq_lens, scale)
    if version == 1:
        launch_decode_v1(*args)
    elif version == 2:
        launch_decode_v2(*args)
    elif version == 3:
        launch_decode_v3(*args)
    else:
        launch_decode_v4(*args, num_splits=splits)
    return out


def _versioned(v: int):
    def run(query, key_cache, value_cache, block_tables, seq_lens, scale=None, **kwargs):
        return paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, version=v, **kwargs)

    run.__name__ = f"paged_attention_decode_v{v}"
    run.__doc__ = f"``paged_attention_decode(..., version={v})``."
    return run


paged_attention_decode_v1 = _versioned(1)
paged_attention_decode_v2 = _versioned(2)
paged_attention_decode_v3 = _versioned(3)
paged_attention_decode_v4 = _versioned(4)

__all__ = [
    "DECODE_VERSIONS",
    "TILE_TOKENS",
    "choose_num_splits",
    "num_sms",
    "paged_attention_decode",
    "paged_attention_decode_v1",
    "paged_attention_decode_v2",
    "paged_attention_decode_v3",
    "paged_attention_decode_v4",
]
