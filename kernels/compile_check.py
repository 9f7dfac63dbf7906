"""Compile every kernel for an NVIDIA GPU on a machine that has none: ``python -m pagedkv.kernels.compile_check``.

The interpreter runs kernels as Python, so it accepts code the real compiler refuses (a ``tl.dot`` on a
tile smaller than 16, a loop variable that changes type, a global that is not ``constexpr``). This
script runs each launcher with the launch intercepted, turns the recorded arguments into a kernel
signature, and compiles it with ``triton.compile`` for a chosen target (default sm_90, Hopper) all the
way to a cubin with the ``ptxas`` shipped in Triton's wheel. No GPU is touched. It prints each
kernel's shared-memory use and exits non-zero if any compile fails.

It needs the real compiler, so it re-runs itself with ``TRITON_INTERPRET=0`` when started under the
interpreter (kernels are fixed as interpreted or compiled when they are defined).

    python -m pagedkv.kernels.compile_check [--arch 90] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _collect_launches(dtypes, configs, fp8: bool = True):
    """Run every launcher on small CPU tensors with ``JITFunction.run`` replaced by a recorder."""
    import torch
    from triton.runtime.jit import JITFunction

    from pagedkv.attention import make_paged_kv

    from . import _common, cache, decode_v1, decode_v2, decode_v3, decode_v4, dispatch, prefill

    calls = []

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    JITFunction.run = record
    _common.check_runnable = cache.check_runnable = lambda device: None  # CPU tensors, compiled kernels
    for dtype in dtypes:
        for group, head_dim in configs:
            kc, vc, bt, sl = make_paged_kv([5, 300], 2, head_dim, 16)
            kc, vc = kc.to(dtype), vc.to(dtype)
            q = torch.randn(2, 2 * group, head_dim).to(dtype)
            out = torch.empty_like(q)
            args = (out, q, kc, vc, bt, sl, 0.1)
            decode_v1.launch_decode_v1(*args)
            decode_v2.launch_decode_v2(*args)
            decode_v3.launch_decode_v3(*args)
            decode_v4.launch_decode_v4(*args, num_splits=5)
            for cfg in dispatch.reachable_configs()[:3]:  # the tuned tiles and stages (v3 64/128, v4 128)
                tuned = dict(tile_tokens=cfg.tile_tokens, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                if cfg.version == 3:
                    decode_v3.launch_decode_v3(*args, **tuned)
                else:
                    decode_v4.launch_decode_v4(*args, num_splits=cfg.num_splits, **tuned)
            if dtype != torch.float32 and fp8:  # an fp8 cache read by a 16-bit query, and written from one
                kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
                args8 = (out, q, kc8, vc8, bt, sl, 0.1)
                decode_v3.launch_decode_v3(*args8, tile_tokens=128, num_stages=3, k_scale=0.5, v_scale=0.5)
                decode_v4.launch_decode_v4(*args8, num_splits=4, tile_tokens=128, num_stages=3, k_scale=0.5,
                                           v_scale=0.5)
                prefill.paged_prefill_attention(torch.randn(10, 2 * group, head_dim).to(dtype), kc8, vc8, bt, sl,
                                                torch.tensor([0, 3, 10], dtype=torch.int32), validate=False,
                                                max_query_len=7, k_scale=0.5, v_scale=0.5)
                kv = torch.randn(3, 2, head_dim).to(dtype)
                cache.reshape_and_cache(kv, kv.clone(), kc8, vc8, torch.tensor([1, -1, 40]), k_scale=0.5,
                                        v_scale=0.5)
            qsl = torch.tensor([0, 3, 10], dtype=torch.int32)
            prefill.paged_prefill_attention(torch.randn(10, 2 * group, head_dim).to(dtype), kc, vc, bt, sl, qsl,
                                            validate=False, max_query_len=7)
            # a sliding window (a constexpr: its own specialisation of each kernel that takes one)
            decode_v3.launch_decode_v3(*args, sliding_window=100)
            decode_v4.launch_decode_v4(*args, num_splits=5, sliding_window=100)
            prefill.paged_prefill_attention(torch.randn(10, 2 * group, head_dim).to(dtype), kc, vc, bt, sl, qsl,
                                            validate=False, max_query_len=7, sliding_window=100)
            kv = torch.randn(3, 2, head_dim).to(dtype)
            cache.reshape_and_cache(kv, kv.clone(), kc, vc, torch.tensor([1, -1, 40]))
    return calls


def _signature(fn, args, kwargs):
    import torch

    ptr = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
           torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv"}
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(fn.arg_names, args, strict=False))
    bound.update(kwargs)
    sig, consts = {}, {}
    for param, name in zip(fn.params, fn.arg_names, strict=True):
        value = bound[name]
        if param.is_constexpr:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = ptr[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    return sig, consts, options


def compile_all(arch: int = 90, quick: bool = False) -> int:
    """Compile each distinct launch for ``sm_<arch>``; return the number of failures."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    dtypes = [torch.float16, torch.bfloat16] if quick else [torch.float16, torch.bfloat16, torch.float32]
    configs = [(4, 128)] if quick else [(4, 128), (1, 64), (8, 128)]
    target = GPUTarget("cuda", arch, 32)
    seen, failures = set(), 0
    # float8e4nv (the fp8 KV cache) compiles for compute capability 8.9+ only; the kernels refuse it below that.
    for fn, args, kwargs in _collect_launches(dtypes, configs, fp8=arch >= 89):
        sig, consts, options = _signature(fn, args, dict(kwargs))
        key = (fn.__name__, tuple(sorted(sig.items())), tuple(sorted((k, repr(v)) for k, v in consts.items())))
        if key in seen:
            continue
        seen.add(key)
        dtype = next((v for k, v in sig.items() if k in ("q_ptr", "key_ptr", "out_ptr")), "?")
        shape = {k: consts[k] for k in ("GROUP", "HEAD_DIM") if k in consts}
        t0 = time.perf_counter()
        try:
            kernel = triton.compile(triton.compiler.ASTSource(fn, sig, consts), target=target, options=options)
            print(f"ok    {fn.__name__:30s} {dtype:6s} {shape}  shared={kernel.metadata.shared} B  "
                  f"({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - report every failure, then exit non-zero
            failures += 1
            print(f"FAIL  {fn.__name__:30s} {dtype:6s} {shape}\n{exc}")
    print(f"sm_{arch}: compiled {len(seen)} kernel specialisations, {failures} failed")
    return failures


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m pagedkv.kernels.compile_check", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80 Ampere, 90 Hopper)")
    parser.add_argument("--quick", action="store_true", help="fp16 and bf16, one shape")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("0", ""):
        env = dict(os.environ, TRITON_INTERPRET="0")
        os.execve(sys.executable, [sys.executable, "-m", "pagedkv.kernels.compile_check", *argv], env)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return 1 if compile_all(args.arch, args.quick) else 0


if __name__ == "__main__":
    sys.exit(main())
