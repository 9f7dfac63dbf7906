"""The torch backend's compiled CPU ops: small C files beside this module, built on first use into one library.

vLLM's CPU backend does its attention in C++ (``CPUAttentionBackendImpl.forward`` in
``vllm/v1/attention/backends/cpu_attn.py`` calls ``ops.cpu_attention_with_kv_cache``, ``vllm/_custom_ops.py``:
``cpu_attention_with_kv_cache``): decode attention reads each K and V vector of a request's context once, a few
multiply-adds per byte, so it is bound by how fast the machine reads memory, and PyTorch's batched products of tiny
matrices stay well above that. Its cache write is C++ too (``ops.cpu_attn_reshape_and_cache``); its norms,
activation and rotary embedding are PyTorch code that Inductor compiles into fused C++ loops (by default:
``vllm/platforms/cpu.py``: ``CpuPlatform.check_and_update_config``; with custom ops on, only the rotary embedding
calls C++ outside POWER, ``RotaryEmbedding.forward_cpu`` in ``vllm/model_executor/layers/rotary_embedding/base.py``):
at a decode step's sizes each PyTorch operation costs more in dispatch and temporaries than in arithmetic. The lab's
counterparts are :data:`SOURCES` (``cpu_vec.h`` holds what they share), compiled here with the machine's C
compiler (``cc``, or ``$CC``) into one shared library under
``~/.cache/pagedkv/cpu_kernels/`` (``PAGEDKV_KERNEL_CACHE``), loaded with ``ctypes``: no torch headers, a few
seconds to build, once per CPU. Where there is no compiler, the build fails, or ``PAGEDKV_CPU_KERNEL=0``,
:func:`load` returns ``None`` and the engine keeps its PyTorch paths (``pool_decode_attention``, the gathered
groups and the prefill chunks of :mod:`pagedkv.engine.attention`; the norms, rotary, activation and argmax of
:mod:`pagedkv.engine.llama` and :mod:`pagedkv.engine.sampler`), with the same tokens. :func:`decode_attention` is
the attention, :func:`pagedkv.engine.attention.write_kv_torch` calls the cache write, :mod:`pagedkv.engine.cpu_ops`
wraps the others.
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

HERE = Path(__file__).parent
SOURCES = tuple(HERE / f"cpu_{name}.c"
                for name in ("attention", "cache", "layernorm", "activation", "pos_encoding", "sampler"))
HEADERS = (HERE / "cpu_vec.h",)
FLAGS = (["-O3", "-march=native"], ["-O3"])  # -march=native first; a compiler without it, the plain build
ENV_SWITCH = "PAGEDKV_CPU_KERNEL"  # "0": never use the compiled ops

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
#: Each compiled function's argument types (the C signatures in :data:`SOURCES`) and return type.
SIGNATURES = {
    "paged_attention_f32": ([_PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64,
                             _I64, _I64, _I64, _I64, _I64, _F32, _I64], _I64),
    "reshape_and_cache_f32": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64], _I64),
    "fused_add_rms_norm_f32": ([_PTR, _I64, _PTR, _I64, _PTR, _F32, _PTR, _I64, _I64, _I64], None),
    "silu_and_mul_f32": ([_PTR, _I64, _PTR, _I64, _I64, _I64], None),
    "rotary_embedding_f32": ([_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64], None),
    "argmax_rows_f32": ([_PTR, _I64, _I64, _I64, _PTR], None),
}


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
    """The compiled library (built into :func:`cache_dir` the first time on this CPU), or ``None`` when it is
    switched off, there is no C compiler, or the build fails. Built into a temporary file and renamed, so
    processes building at once do not read each other's half-written library."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        return None
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(source + cc.encode() + _cpu_id().encode() + platform.machine().encode()).hexdigest()[:16]
    lib_path = cache_dir() / f"cpu_ops-{key}.so"
    if not lib_path.exists() and not _build(cc, lib_path):
        return None
    try:
        lib = ctypes.CDLL(str(lib_path))
    except OSError:
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def serves(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the kernel serves a model on ``device`` in ``dtype``: float32 on the CPU, the kernel built. ``False``
    too while :func:`load` is hidden (grading an exercise that writes attention stubs it to raise
    ``RuntimeError``): the engine then takes its PyTorch paths, as on a machine without a compiler."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    try:
        return load() is not None
    except RuntimeError:
        return False


def _build(cc: str, lib_path: Path) -> bool:
    """Compile :data:`SOURCES` into ``lib_path`` (each of :data:`FLAGS` in turn until one builds); ``False`` when
    none does or the folder cannot be written."""
    try:
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        for flags in FLAGS:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib_path.parent)
            os.close(fd)
            try:
                built = subprocess.run([cc, *flags, "-shared", "-fPIC", "-I", str(HERE), "-o", tmp,
                                        *map(str, SOURCES), "-lm"],
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
    key_cache: torch.Tensor,  # [N, bs, Hkv, D] float32, contiguous: already holds this step's K
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    req_idx: torch.Tensor,  # [R] int64: the requests to attend
    out: torch.Tensor,  # [T, Hq, D] float32 (written at the listed requests' tokens)
    scale: float,
    sliding_window: int | None = None,
) -> None:
    """Paged attention of the requests in ``req_idx`` over their blocks, written into ``out``; the other rows of
    ``out`` are untouched. A request's ``q`` query tokens (``query_start_loc[b]`` on) are the last ``q`` of its
    ``seq_lens[b]`` positions, each attending causally to the keys up to its own: a decode row (``q = 1``) sees its
    whole context, a prefill chunk's rows their prefix (named for the decode rows it first served; since the
    prefill chunks run here too, one kernel serves a mixed step, as vLLM's ``cpu_attention_with_kv_cache`` does).
    Softmax in float32, three passes over each row's keys (scores and their maximum, the exponentials, ``P·V``).
    Under a ``sliding_window`` of ``W`` the query at position ``p`` sees positions ``p - W + 1 .. p``.
    ``ValueError`` for a block id outside the pool or a table shorter than its ``seq_len`` (the requests before
    it written, nothing read through it). Needs :func:`usable`."""
    lib = load()
    if lib is None:
        raise RuntimeError("the compiled CPU attention is not available (see pagedkv.engine.cpu_kernel)")
    hq, d = query.shape[1], query.shape[2]
    n, bs, hkv = key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]
    if query.stride(2) != 1 or out.stride(2) != 1 or not value_cache.is_contiguous() or hq % hkv:
        raise ValueError("decode_attention needs D contiguous in query and out, contiguous caches, Hq % Hkv == 0")
    ints = []
    for t, dtype in ((block_tables, torch.int32), (seq_lens, torch.int32), (query_start_loc, torch.int32),
                     (req_idx, torch.int64)):
        ints.append(t if t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
                    else t.to("cpu", dtype).contiguous())
    tables, lens, qsl, rows = ints
    status = lib.paged_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1), key_cache.data_ptr(), value_cache.data_ptr(), n,
        tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(), qsl.data_ptr(), rows.data_ptr(),
        rows.numel(), out.data_ptr(), out.stride(0), out.stride(1), hq, hkv, d, bs, scale, sliding_window or 0)
    if status < 0:
        raise MemoryError("decode_attention: out of memory for its scratch rows")
    if status:
        b = int(rows[status - 1])
        raise ValueError(f"decode_attention: request {b}'s block table is shorter than its seq_len, names a block "
                         f"outside the pool of {n}, or it has more query tokens than positions")
