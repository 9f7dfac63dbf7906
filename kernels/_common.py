"""Input checks and small helpers shared by the kernels' Python launchers.

Every launcher validates before it launches: a kernel handed a wrong shape does not raise, it reads
the wrong memory. So shapes, dtypes, devices and the block tables are checked here, each failure a
ValueError that says what was wrong; nothing is written before the checks pass.
"""

from __future__ import annotations

import functools
import math
import numbers
import os

import torch

LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E), and exp2 is the cheaper instruction
LN2 = 0.6931471805599453  # ln(2): converts a log2-domain log-sum-exp back to natural log

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn  # the KV cache's fp8 format: e4m3, finite max 448 (Triton's float8e4nv)
FP8_MAX = 448.0
_CACHE_DTYPES = (*_FLOAT_DTYPES, FP8_DTYPE)


def interpreter_on() -> bool:
    """True when Triton runs kernels in its NumPy interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the fp8 KV-cache dtype (``torch.float8_e4m3fn``)."""
    return dtype == FP8_DTYPE


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (``tl.arange`` sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 ("ieee") for fp32 inputs, the default otherwise.

    On a GPU, fp32 ``tl.dot`` defaults to TF32 (10 mantissa bits), which would miss the fp32 tolerance.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}: all tensors must share a device")


def check_runnable(device: torch.device) -> None:
    """CPU tensors need the interpreter; CUDA tensors need a CUDA build of torch (checked by torch)."""
    if device.type == "cpu" and not interpreter_on():
        raise ValueError(
            "CPU tensors can only run in Triton's interpreter: set TRITON_INTERPRET=1 before importing "
            "pagedkv.kernels (it is set for you when no CUDA GPU is present), or move the tensors to CUDA"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensors are on {device}; these kernels run on CUDA (or on CPU in the interpreter)")


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; expected float16, bfloat16 or float32")
    if t.dtype == torch.bfloat16 and interpreter_on():
        raise ValueError(
            f"{name} is bfloat16, which Triton's interpreter does not support: use float16 or float32 on CPU"
        )


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Both caches ``[num_blocks, block_size, Hkv, D]``, same shape and dtype (a float or fp8 e4m3),
    head_dim contiguous."""
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim]; got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} differs from key_cache shape {tuple(key_cache.shape)}"
        )
    if value_cache.stride() != key_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}")
    if not is_fp8(key_cache.dtype):
        check_float_dtype("key_cache", key_cache)
    if key_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache must be contiguous along head_dim (stride(-1) == 1)")
    if min(key_cache.shape) < 1:
        raise ValueError(f"key_cache has an empty dimension: shape {tuple(key_cache.shape)}")


def check_query_and_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tensors: dict[str, torch.Tensor],
    query_layout: str,
) -> tuple[int, int, int, int, int, int]:
    """The checks every attention entry point makes on its query, its KV cache and the index ``tensors``
    (same device, a runnable device, matching dtypes and head dims, Hq a multiple of Hkv).

    ``query_layout`` names the query's first axis in the error (``"batch"``, ``"num_tokens"``). Returns
    ``(rows, num_q_heads, head_dim, num_blocks, block_size, num_kv_heads)``.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [{query_layout}, num_q_heads, head_dim]; got shape {tuple(query.shape)}")
    check_float_dtype("query", query)
    check_kv_cache(key_cache, value_cache)
    device = query.device
    for name, t in {"key_cache": key_cache, "value_cache": value_cache, **tensors}.items():
        check_device(name, t, device)
    check_runnable(device)
    if key_cache.dtype != query.dtype and not is_fp8(key_cache.dtype):
        raise ValueError(
            f"query is {query.dtype} but the KV cache is {key_cache.dtype}; they must match (or the cache is "
            "float8_e4m3fn, read with k_scale/v_scale)"
        )
    rows, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's head_dim {cache_head_dim}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads}) "
            "for grouped-query attention"
        )
    return rows, num_q_heads, head_dim, num_blocks, block_size, num_kv_heads


def check_table_shapes(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    batch: int,
    batch_of: str = "query",
) -> None:
    """Dtypes, ranks and batch sizes of the block tables and sequence lengths (no host read); raises ValueError.
    ``batch_of``: what gave ``batch`` (decode: the query's rows; prefill, whose query is packed tokens:
    ``"seq_lens"``)."""
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be a 2-D int32 tensor [batch, max_blocks]; got {block_tables.dtype} "
            f"of shape {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError(
            f"seq_lens must be a 1-D int32 tensor [batch]; got {seq_lens.dtype} of shape {tuple(seq_lens.shape)}"
        )
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"batch sizes disagree: query has {batch} sequences, block_tables {block_tables.shape[0]}, "
            f"seq_lens {seq_lens.shape[0]}" if batch_of == "query" else
            f"block_tables has {block_tables.shape[0]} rows for the {batch} sequences of {batch_of} (one row each)"
        )


def check_block_tables(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    batch: int,
    num_blocks: int,
    block_size: int,
    min_len: int = 1,
    batch_of: str = "query",
) -> int:
    """Check the block tables against the sequence lengths; return the longest sequence length.

    Reads ``seq_lens`` and the used part of ``block_tables`` back to the host (one synchronisation), so the
    fast paths can skip it with ``validate=False`` once the inputs are known to be good.
    """
    check_table_shapes(block_tables, seq_lens, batch, batch_of)
    lens = seq_lens.cpu().long()
    if batch == 0:
        return 0
    if int(lens.min()) < min_len:
        bad = int(torch.argmin(lens))
        raise ValueError(f"seq_lens[{bad}] = {int(lens[bad])}; every sequence needs at least {min_len} cached token(s)")
    needed = (lens + block_size - 1) // block_size  # [B] blocks each sequence uses
    width = block_tables.shape[1]
    if int(needed.max()) > width:
        bad = int(torch.argmax(needed))
        raise ValueError(
            f"block table too short: seq_lens[{bad}] = {int(lens[bad])} needs {int(needed[bad])} blocks of "
            f"{block_size} tokens, but block_tables has only {width} columns"
        )
    used = torch.arange(width)[None, :] < needed[:, None]  # [B, max_blocks]
    ids = block_tables.cpu()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(
            f"block_tables holds block id {int(ids.min()) if int(ids.min()) < 0 else int(ids.max())}, "
            f"outside the cache's 0..{num_blocks - 1}"
        )
    return int(lens.max())


def contiguous_index(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its elements sit one after another in memory, else a contiguous copy.

    The kernels read integer inputs (``seq_lens``, ``slot_mapping``, ``query_start_loc``, the columns of
    ``block_tables``) at ``ptr + i``: a strided view such as ``seq_lens[::2]`` would be read as if it
    were packed, silently giving wrong lengths or slots (or reading past the tensor). Copying the rare
    strided input costs one small launch; the common contiguous case costs one attribute check.
    """
    return t if t.is_contiguous() else t.contiguous()


def contiguous_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D ``t`` whose last dimension is packed (``stride(-1) == 1``); the row stride is passed to the
    kernel, so a row view like ``block_tables[::2]`` is used as it is and only a column view is copied."""
    return t if t.dim() != 2 or t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``scale`` as a float (``1/sqrt(head_dim)`` for None): a positive finite real number, never a bool or a
    string (``float("0.5")`` would otherwise turn a string into a scale). vLLM 0.26's ``AttentionImpl`` takes
    ``scale: float`` (vllm/v1/attention/backend.py)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, (bool, str, bytes)) or not isinstance(scale, (numbers.Real, torch.Tensor)):
        raise ValueError(f"scale must be a positive finite number or None; got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number; got {scale}")
    return scale


@functools.lru_cache(maxsize=16)
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_fp8_supported(device: torch.device) -> None:
    """An fp8 e4m3 cache needs a GPU that converts it: compute capability 8.9+ (Ada, Hopper and newer).

    Triton compiles ``float8e4nv`` only there (an A100, 8.0, offers fp8e5 and fp8e4b15 instead). The
    interpreter reads it on any CPU.
    """
    if device.type == "cuda" and _cuda_capability(device) < (8, 9):
        major, minor = _cuda_capability(device)
        raise ValueError(f"an fp8 (e4m3) KV cache needs a GPU of compute capability 8.9 or newer; {device} is "
                         f"{major}.{minor}: use a 16-bit cache there")


def resolve_kv_scale(name: str, value: float, cache_dtype: torch.dtype) -> float:
    """A per-tensor fp8 scale (``stored = value / scale``): a positive finite number; 1.0 unless fp8."""
    if isinstance(value, torch.Tensor) or isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a Python float (a tensor would need a device sync); got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number; got {value}")
    if value != 1.0 and not is_fp8(cache_dtype):
        raise ValueError(f"{name}={value} applies to a float8_e4m3fn cache only; this cache is {cache_dtype}")
    return value


def check_out(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Return ``out`` (checked to match ``like`` in shape, dtype, device, packed along head_dim, no element
    aliasing another) or a fresh packed tensor of ``like``'s shape. Fresh means ``torch.empty(shape)``, never
    ``empty_like``: that keeps ``like``'s strides, and a query strided along head_dim would give an ``out``
    the kernels write as if it were packed."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out must be {tuple(like.shape)} {like.dtype} on {like.device}; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous along head_dim (stride(-1) == 1); got strides {out.stride()}")
    if any(s == 0 and n > 1 for s, n in zip(out.stride(), out.shape, strict=True)):
        raise ValueError(f"out has a stride of 0 (an expanded view, elements aliasing each other): {out.stride()}")
    return out


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses of ``t``'s elements (empty for an empty tensor)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0) * t.element_size()
    return (start, start + last + t.element_size())


def check_out_overlap(out: torch.Tensor, query: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
    """Refuse an ``out`` whose memory overlaps an input: programs would read what others already wrote (a
    partly shifted query) or write into the cache they read. ``out`` may be ``query`` itself (each program reads
    its rows of the query before it writes the same rows of ``out``). The lab's own check: vLLM 0.26's
    ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py) trusts the ``out`` its caller
    allocated. Compares byte ranges, so views that interleave without sharing an element are refused too."""
    lo, hi = _byte_span(out)
    if hi == lo:
        return
    same_as_query = (out.data_ptr() == query.data_ptr() and out.shape == query.shape
                     and out.stride() == query.stride())
    for name, t in {"query": query, **inputs}.items():
        if name == "query" and same_as_query:
            continue
        t_lo, t_hi = _byte_span(t)
        if t_hi > t_lo and t_lo < hi and lo < t_hi:
            raise ValueError(f"out overlaps {name} in memory: give a separate tensor (or the query itself, "
                             "for an in-place result)")
