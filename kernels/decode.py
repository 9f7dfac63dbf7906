"""``paged_attention_decode``: validate, then dispatch to one of the four decode kernels.

The four versions (each in its own module, each runnable on its own):

1. ``decode_v1``: one program per (sequence, query head), one KV block per iteration, online softmax.
2. ``decode_v2``: one program per (sequence, KV head); the group's query heads as one tile, ``tl.dot``.
3. ``decode_v3``: as 2, but each iteration covers a tile of several blocks (one block-table lookup per token).
4. ``decode_v4``: split-K (flash-decoding): slices of the context in parallel, fp32 partials + LSE, a reduce.

``version=None`` launches what ``dispatch.choose_decode_config`` picks for the shape: version 4 with
enough slices for about two programs per SM when ``B * Hkv`` programs are too few, else version 3; tile
size, warps and pipeline stages from the same rule (derived from a CUDA-graph sweep on an H200; see
``dispatch``). An explicit ``version`` launches that version with its own defaults (what the lesson builds).

Host cost: a decode step calls this once per layer, so the Python around the launch matters when the GPU
part takes microseconds. Everything that depends only on shapes, strides, dtypes and devices (the checks,
the launch configuration) is computed once per distinct call signature and kept in a small plan cache;
a repeated call with ``validate=False`` does one dictionary lookup, allocates ``out`` (unless given) and,
for split-K, its two fp32 intermediates, and launches.

Mirrors: vLLM 0.26's ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py), which picks
its 2-D kernel or its segmented 3-D kernel (split-K, with ``reduce_segments``) from the batch and lengths,
and the older ``paged_attention_v1``/``v2`` split in vllm/v1/attention/ops/paged_attn.py.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pagedkv.attention import check_sliding_window
from pagedkv.utils import check_int

from ._common import (
    check_block_tables,
    check_fp8_supported,
    check_out,
    check_out_overlap,
    check_query_and_cache,
    check_table_shapes,
    contiguous_index,
    contiguous_rows,
    is_fp8,
    resolve_kv_scale,
    resolve_scale,
)
from .decode_v1 import launch_decode_v1
from .decode_v2 import launch_decode_v2
from .decode_v3 import TILE_TOKENS, launch_decode_v3
from .decode_v4 import launch_decode_v4
from .dispatch import (
    DEFAULT_NUM_SMS,
    MAX_SPLITS,
    DecodeConfig,
    choose_decode_config,
    choose_num_splits,
    fit_tile_tokens,
)

DECODE_VERSIONS = (1, 2, 3, 4)
FP8_VERSIONS = (3, 4)  # the versions that read an fp8 cache (1 and 2 stay as the lesson writes them)
WINDOW_VERSIONS = (3, 4)  # the versions that take a sliding window (likewise)
_MAX_PLANS = 256  # distinct call signatures remembered; the cache is cleared when it fills


@functools.lru_cache(maxsize=16)
def _num_sms_cached(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


@functools.lru_cache(maxsize=16)
def max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (CUDA: the opt-in limit per block), unbounded elsewhere."""
    if device.type != "cuda":
        return 1 << 30
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0)
               or 48 * 1024)


def _fit(config: DecodeConfig, head_dim: int, element_size: int, device: torch.device) -> DecodeConfig:
    """``config`` with its tile shrunk to the device's shared memory (:func:`fit_tile_tokens`)."""
    tile = fit_tile_tokens(config.tile_tokens, head_dim, element_size, max_shared_memory(device))
    return config if tile == config.tile_tokens else config._replace(tile_tokens=tile)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (CUDA), or ``DEFAULT_NUM_SMS`` (an H100's/H200's 132) elsewhere. Cached."""
    return _num_sms_cached(device)


class _Plan(NamedTuple):
    """What one call signature needs beyond its tensors' values."""

    batch: int
    num_kv_heads: int
    max_len_bound: int  # block_tables.shape[1] * block_size: the split rule's length without validation
    scale: float
    sms: int
    element_size: int  # the KV cache's bytes per element (the tile rule depends on it)
    copy_query: bool  # query's head_dim is strided: copy it first
    fixed: DecodeConfig | None  # None: chosen per call from the validated max length


def _signature(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def _explicit_config(version: int, num_splits: int | None, batch: int, hkv: int, max_len: int, sms: int):
    """An explicitly asked-for version, launched with the version's own (lesson) defaults."""
    if version == 4:
        splits = num_splits or choose_num_splits(batch, hkv, max_len, sms, tile_tokens=TILE_TOKENS)
        return DecodeConfig(4, TILE_TOKENS, 4, 2, splits)
    return DecodeConfig(version, TILE_TOKENS, 4, 2, 1)


_PLANS: dict[tuple, _Plan] = {}


def _make_plan(query, key_cache, value_cache, block_tables, seq_lens, scale, version, num_splits, out,
               k_scale, v_scale, validate, sliding_window=None) -> _Plan:
    """Every check that depends only on shapes, dtypes, strides and devices; raises ValueError."""
    if sliding_window is not None and version not in (None, *WINDOW_VERSIONS):
        raise ValueError(f"a sliding window is taken by versions {WINDOW_VERSIONS} (and the default dispatch); "
                         f"got version={version}")
    batch, _, head_dim, _, block_size, num_kv_heads = check_query_and_cache(
        query, key_cache, value_cache, {"block_tables": block_tables, "seq_lens": seq_lens}, "batch"
    )
    check_table_shapes(block_tables, seq_lens, batch)
    if out is not None:
        check_out(out, query)
    if is_fp8(key_cache.dtype) and version not in (None, *FP8_VERSIONS):
        raise ValueError(f"an fp8 KV cache is read by versions {FP8_VERSIONS} (and the default dispatch); "
                         f"got version={version}")
    if is_fp8(key_cache.dtype):
        check_fp8_supported(query.device)
    resolve_kv_scale("k_scale", k_scale, key_cache.dtype)
    resolve_kv_scale("v_scale", v_scale, key_cache.dtype)
    sms = num_sms(query.device)
    bound = visible_length(max(1, block_tables.shape[1] * block_size), sliding_window)
    fixed = None
    if not validate or version is not None:  # the configuration does not depend on the lengths' values
        fixed = (choose_decode_config(max(batch, 1), num_kv_heads, bound, sms, key_cache.element_size())
                 if version is None
                 else _explicit_config(version, num_splits, max(batch, 1), num_kv_heads, bound, sms))
        if fixed.version == 4 and num_splits is not None:
            fixed = fixed._replace(num_splits=num_splits)
        fixed = _fit(fixed, head_dim, key_cache.element_size(), query.device)
    return _Plan(batch, num_kv_heads, bound, resolve_scale(scale, head_dim), sms, key_cache.element_size(),
                 query.stride(-1) != 1, fixed)


def visible_length(seq_len: int, sliding_window: int | None) -> int:
    """The tokens one decode query reads: ``seq_len``, or at most the window's ``W``. The dispatch sizes its
    split-K slices by it: a 32k-token sequence under a 4k window is a 4k-token decode."""
    return seq_len if sliding_window is None else min(seq_len, sliding_window)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest query over its paged KV cache; returns ``out [B, Hq, D]``.

    ``out[b, h] = softmax(query[b, h] · K_bᵀ · scale) · V_b`` where ``K_b``/``V_b`` are sequence b's first
    ``seq_lens[b]`` cached tokens of KV head ``h // (Hq // Hkv)``, found through ``block_tables[b]``.
    ``scale`` defaults to ``1/sqrt(D)``. Nothing but ``out`` is written.

    ``version`` picks a kernel (1-4, see the module docstring; None: the tuned choice for the shape).
    ``num_splits`` fixes version 4's slice count. ``out`` may be passed to reuse a buffer.
    ``validate=False`` skips the checks that read ``seq_lens`` and ``block_tables`` back to the host (a GPU
    synchronisation); shapes, dtypes and devices are always checked (once per call signature).
    An fp8 cache (``torch.float8_e4m3fn``, written by ``reshape_and_cache``) holds ``value / k_scale`` and
    ``value / v_scale``; pass the same scales here (versions 3, 4 and the default dispatch read it).
    ``sliding_window = W`` (versions 3, 4 and the default dispatch): the query, at position ``seq_len - 1``,
    sees only the last ``W`` tokens; the tiles wholly before them are skipped, so their block-table entries
    may be the null block (vLLM 0.26 passes ``window_size = (W - 1, 0)``; transformers masks
    ``kv_idx > q_idx - W``).

    Raises ValueError on a bad shape, dtype or device, ``Hq`` not a multiple of ``Hkv``, a sequence of
    length 0, a block table too short for its sequence or holding an id outside the cache.

    Mirrors: vLLM 0.26's ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py).
    """
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or version not in DECODE_VERSIONS):  # True == 1 and 4.0 == 4 are no versions
        raise ValueError(f"version must be one of {DECODE_VERSIONS} or None; got {version!r}")
    if num_splits is not None:
        check_int(num_splits, "num_splits", 1, 4 * MAX_SPLITS)
    if num_splits is not None and version not in (None, 4):
        raise ValueError(f"num_splits applies to version 4 (split-K) only; got version={version}")
    sliding_window = check_sliding_window(sliding_window)
    key = (_signature(query), _signature(key_cache), _signature(value_cache), _signature(block_tables),
           _signature(seq_lens), None if out is None else _signature(out), scale, version, num_splits,
           validate, k_scale, v_scale, sliding_window)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(query, key_cache, value_cache, block_tables, seq_lens, scale, version, num_splits, out,
                          k_scale, v_scale, validate, sliding_window)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    config = plan.fixed
    if validate:
        max_len = check_block_tables(block_tables, seq_lens, plan.batch, key_cache.shape[0], key_cache.shape[1])
        if config is None and plan.batch:
            config = choose_decode_config(plan.batch, plan.num_kv_heads, visible_length(max_len, sliding_window),
                                          plan.sms, plan.element_size)
            if num_splits is not None and config.version == 4:
                config = config._replace(num_splits=num_splits)
            config = _fit(config, query.shape[-1], plan.element_size, query.device)
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    else:
        check_out_overlap(out, query, {"key_cache": key_cache, "value_cache": value_cache,
                                       "block_tables": block_tables, "seq_lens": seq_lens})
    if plan.batch == 0:
        return out
    if plan.copy_query:
        query = query.contiguous()
    # The kernels read seq_lens[b] at ptr + b and block_tables[b, j] at ptr + b * stride_bt + j.
    seq_lens = contiguous_index(seq_lens)
    block_tables = contiguous_rows(block_tables)
    args = (out, query, key_cache, value_cache, block_tables, seq_lens, plan.scale)
    version = config.version
    if version == 1:
        launch_decode_v1(*args)
    elif version == 2:
        launch_decode_v2(*args)
    elif version == 3:
        launch_decode_v3(*args, tile_tokens=config.tile_tokens, num_warps=config.num_warps,
                         num_stages=config.num_stages, k_scale=k_scale, v_scale=v_scale,
                         sliding_window=sliding_window)
    else:
        launch_decode_v4(*args, num_splits=config.num_splits, tile_tokens=config.tile_tokens,
                         num_warps=config.num_warps, num_stages=config.num_stages,
                         k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window)
    return out


def decode_config(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int | None = None,
) -> DecodeConfig:
    """The configuration the default dispatch launches for these inputs (for the lesson and the benchmark)."""
    bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * key_cache.shape[1]
    config = choose_decode_config(query.shape[0], key_cache.shape[2], bound, num_sms(query.device),
                                  key_cache.element_size())
    return _fit(config, query.shape[-1], key_cache.element_size(), query.device)


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
    "WINDOW_VERSIONS",
    "choose_num_splits",
    "decode_config",
    "num_sms",
    "paged_attention_decode",
    "paged_attention_decode_v1",
    "paged_attention_decode_v2",
    "paged_attention_decode_v3",
    "paged_attention_decode_v4",
]
