"""The lab's Llama decoder's elementwise steps, compiled for a CPU: RMSNorm with the residual add fused in,
SiLU-and-multiply, the rotary embedding in place; and the greedy sampler's argmax.

Each replaces a handful of PyTorch operations (:func:`pagedkv.engine.llama.rms_norm` is six: add, pow, mean, add,
rsqrt, two multiplies; :func:`~pagedkv.engine.llama.apply_rotary` six and a concatenation) by one pass over the
rows, with no temporaries. At a decode step's 64 rows of 256 values each PyTorch operation costs more in dispatch
than in arithmetic, and at a prefill step's 2,048 rows every temporary is a fresh multi-megabyte tensor. vLLM 0.26's
CPU backend has Inductor compile the same three from PyTorch into fused C++ loops (by default:
``vllm/platforms/cpu.py``: ``CpuPlatform.check_and_update_config``); with custom ops on, only the rotary embedding
calls a C++ kernel (``RotaryEmbedding.forward_cpu`` in ``vllm/model_executor/layers/rotary_embedding/base.py``,
``vllm/_custom_ops.py``: ``rotary_embedding``; ``csrc/cpu/pos_encoding.cpp``), while ``SiluAndMul.forward_cpu``
(``vllm/model_executor/layers/activation.py``) keeps PyTorch except on POWER and RMSNorm's C++ kernel serves
CUDA-alike platforms only (``vllm/kernels/vllm_c.py``: ``fused_add_rms_norm``). The lab's are
``cpu_layernorm.c``, ``cpu_activation.c`` and ``cpu_pos_encoding.c``, built with the attention kernel into one
library (:mod:`pagedkv.engine.cpu_kernel`).

They compute the same formulas in float32 as transformers' modules, but not bit for bit: a sum of squares added
in another order, an ``exp`` of ~1 ulp (``cpu_vec.h``), a product and a sum fused into one rounding. The
greedy tokens are tested against ``generate`` (as with the fused q/k/v product, logits move in their last bits
only). :func:`serves` says when the decoder uses them (float32 on a CPU with the library built); otherwise it keeps
the PyTorch versions, which are transformers' own arithmetic.
"""

from __future__ import annotations

import torch

from pagedkv.engine import cpu_kernel


def serves(x: torch.Tensor) -> bool:
    """Whether the compiled ops serve activations like ``x``: float32 on a CPU, the library built."""
    return cpu_kernel.serves(x.device, x.dtype)


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{name}: a float32 CPU tensor [rows, n] with its last dimension contiguous, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")


def fused_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` with the sum written into ``residual``; without ``residual``,
    ``(norm(x), x)``. ``x``, ``residual [T, H]``, ``weight [H]``. The norm goes into ``out`` when given, else, with a
    residual, over ``x`` (the caller's layer output, no longer needed), so nothing is allocated; without one, into
    a new tensor (``x`` is then the residual stream). The same arguments and contract as
    :func:`pagedkv.engine.llama.rms_norm`. Mirrors vLLM's ``fused_add_rms_norm`` / ``rms_norm`` (which take
    ``(input, residual, weight, epsilon)``)."""
    _rows(x, "fused_add_rms_norm")
    rows, hidden = x.shape
    if weight.shape != (hidden,) or not weight.is_contiguous() or weight.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm: weight [{hidden}] contiguous in {x.dtype}")
    if out is not None:
        _rows(out, "fused_add_rms_norm")
        if out.shape != x.shape or (residual is None and out.data_ptr() == x.data_ptr()):
            raise ValueError("fused_add_rms_norm: out the shape of x, and not x itself when x is the residual")
    if residual is None:
        out = torch.empty_like(x) if out is None else out
        res_ptr, res_stride, residual = None, 0, x
    else:
        _rows(residual, "fused_add_rms_norm")
        if residual.shape != x.shape:
            raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} against x {tuple(x.shape)}")
        out = x if out is None else out
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
    cpu_kernel.load().fused_add_rms_norm_f32(x.data_ptr(), x.stride(0), res_ptr, res_stride, weight.data_ptr(),
                                             eps, out.data_ptr(), out.stride(0), rows, hidden)
    return out, residual


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) · up`` of ``x = [gate | up]``, ``[T, 2I]`` -> ``[T, I]`` (into ``out`` when given, else a new
    tensor). Mirrors vLLM's ``silu_and_mul``; :func:`pagedkv.engine.llama.silu_and_mul` in PyTorch."""
    _rows(x, "silu_and_mul")
    rows, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = x.new_empty(rows, inter)
    else:
        _rows(out, "silu_and_mul")
        if out.shape != (rows, inter):
            raise ValueError(f"silu_and_mul: out [{rows}, {inter}], got {tuple(out.shape)}")
    cpu_kernel.load().silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, inter)
    return out


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, D]`` in place (neox style, transformers' ``rotate_half``) with ``cos``/``sin [T, D]``
    (transformers' layout: ``cat(freqs, freqs)``, only the first ``D/2`` read); returns ``x``. The q and k heads
    of a step are rotated in one call, in the q/k/v product's own output. Mirrors vLLM's ``rotary_embedding``
    (``is_neox=True``); :func:`pagedkv.engine.llama.apply_rotary` in PyTorch."""
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.dtype != torch.float32 or x.device.type != "cpu" or d % 2:
        raise ValueError("rotary_embedding: a float32 CPU tensor [T, heads, D], D even and contiguous")
    for c in (cos, sin):
        _rows(c, "rotary_embedding")
        if c.shape != (t, d):
            raise ValueError(f"rotary_embedding: cos/sin [{t}, {d}], got {tuple(c.shape)}")
    if cos.stride(0) != sin.stride(0):
        raise ValueError("rotary_embedding: cos and sin with the same row stride")
    cpu_kernel.load().rotary_embedding_f32(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                           cos.stride(0), t, heads, d)
    return x


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token, ``logits [S, V]`` -> ``[S]`` int64: the lowest index of the row's maximum (a row
    with a NaN: its first NaN), as ``logits.max(dim=-1).indices``. Mirrors the ``argmax`` of vLLM's
    ``Sampler.greedy_sample``; ``cpu_sampler.c``: one pass, eight lanes, no index tensor of PyTorch's reduction."""
    _rows(logits, "argmax")
    out = torch.empty(logits.shape[0], dtype=torch.long)
    cpu_kernel.load().argmax_rows_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                     out.data_ptr())
    return out
