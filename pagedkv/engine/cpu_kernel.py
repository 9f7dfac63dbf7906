"""The torch backend's compiled decode attention on a CPU: ``cpu_decode_attention.c``, built on first use.

vLLM's CPU backend does its attention in C++ (``CPUAttentionBackendImpl.forward`` in
``vllm/v1/attention/backends/cpu_attn.py`` calls ``ops.cpu_attention_with_kv_cache``, ``vllm/_custom_ops.py``):
decode attention reads each K and V vector of a request's context once, a few multiply-adds per byte, so it is
bound by how fast the machine reads memory, and PyTorch's batched products of tiny matrices stay well above that.
The lab's kernel is one small C file, compiled here with the machine's C compiler (``cc``, or ``$CC``) into a
shared library under ``~/.cache/pagedkv/cpu_kernels/`` (``PAGEDKV_KERNEL_CACHE``), loaded with ``ctypes``: no
torch headers, about a second to build. Where there is no compiler, the build fails, or ``PAGEDKV_CPU_KERNEL=0``,
:func:`load` returns ``None`` and the engine keeps its PyTorch decode (``pool_decode_attention`` and the gathered
groups in :mod:`pagedkv.engine.attention`), with the same tokens.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
FLAGS = (["-O3", "-march=native"], ["-O3"])  # -march=native first; a compiler without it, the plain build
ENV_SWITCH = "PAGEDKV_CPU_KERNEL"  # "0": never use the compiled kernel


def cache_dir() -> Path:
    env = os.environ.get("PAGEDKV_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv" / "cpu_kernels"


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (a library built on another CPU may use
    instructions this one lacks, so each CPU gets its own)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL | None:
    """The compiled kernel (built into :func:`cache_dir` the first time on this CPU), or ``None`` when it is
    switched off, there is no C compiler, or the build fails. Built into a temporary file and renamed, so
    processes building at once do not read each other's half-written library."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + cc.encode() + _cpu_id().encode() + platform.machine().encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"cpu_decode_attention-{key}.so"
    if not lib_path.exists() and not _build(cc, lib_path):
        return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError:
        return None
    fn = lib.decode_attention_f32
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                   ctypes.c_float, i64]
    fn.restype = i64
    return lib


def serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the kernel serves a model on ``device`` in ``dtype``: float32 on the CPU, the kernel built."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and load() is not None


def _build(cc: str, lib_path: Path) -> bool:
    """Compile :data:`SOURCE` into ``lib_path`` (each of :data:`FLAGS` in turn until one builds); ``False`` when
    none does or the folder cannot be written."""
    try:
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        for flags in FLAGS:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
            os.close(fd)
            try:
                built = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-lm"],
                                       capture_output=True, timeout=120).returncode == 0
                if built:
                    os.replace(tmp, lib_path)
                    return True
            except subprocess.SubprocessError:
                pass
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except OSError:
        return False
    return False


def usable(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` serves this layer: :func:`serves`, the same dtype in the pool, a
    contiguous pool."""
    return serves(query.device, query.dtype) and key_cache.dtype == query.dtype and key_cache.is_contiguous()


def decode_attention(
    query: torch.Tensor,  # [T, Hq, D] float32 (any token and head strides; D contiguous)
    key_cache: torch.Tensor,  # [N, bs, Hkv, D] float32, contiguous
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    decode_req_idx: torch.Tensor,  # [Bd] int64: the requests with one new token
    out: torch.Tensor,  # [T, Hq, D] float32 (written at the decode rows' tokens)
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Decode attention of the requests in ``decode_req_idx`` (one new token each, at ``query_start_loc[b]``)
    over their blocks, written into ``out``; the other rows of ``out`` are untouched. Softmax in float32, two
    passes over each row's keys (scores and their maximum, then ``P·V``). Under a ``sliding_window`` of ``W``
    a row sees its last ``W`` positions. ``ValueError`` for a block id outside the pool (the rows before it
    written, nothing read through it). Needs :func:`usable`."""
    lib = load()
    if lib is None:
        raise RuntimeError("the compiled CPU decode attention is not available (see pagedkv.engine.cpu_kernel)")
    hq, d = query.shape[1], query.shape[2]
    n, bs, hkv = key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]
    if query.stride(2) != 1 or out.stride(2) != 1 or not value_cache.is_contiguous() or hq % hkv:
        raise ValueError("decode_attention needs D contiguous in query and out, contiguous caches, Hq % Hkv == 0")
    ints = []
    for t, dtype in ((block_tables, torch.int32), (seq_lens, torch.int32), (query_start_loc, torch.int32),
                     (decode_req_idx, torch.int64)):
        ints.append(t if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
                    else t.to("cpu", dtype).contiguous())
    tables, lens, qsl, rows = ints
    status = lib.decode_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), n,
        tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), qsl.data_ptr(), rows.data_ptr(),
        rows.numel(), out.data_ptr(), out.stride(0), out.stride(1), hq, hkv, d, bs, scale, sliding_window or 0)
    if status < 0:
        raise MemoryError("decode_attention: out of memory for its scratch rows")
    if status:
        b = int(rows[status - 1])
        raise ValueError(f"decode_attention: request {b}'s block table is shorter than its seq_len or names a "
                         f"block outside the pool of {n}")
