"""Benchmark of the paged-attention kernels: correctness first, then GPU time and host time, against a measured roof.

    python -m pagedkv.kernels.bench                # full sweep on a GPU (<= 8 min); tiny interpreter run on a CPU
    python -m pagedkv.kernels.bench --quick        # four decode shapes, two prefill shapes, fp8: <= 2 min on a GPU
    python -m pagedkv.kernels.bench --tiny         # tiny shapes in Triton's interpreter (what CI runs)
    python -m pagedkv.kernels.bench --out DIR      # where the JSON and the plots go

For every (dtype, batch, context) it

1. checks each implementation against a float64 reference on the first few sequences (a kernel that is
   fast and wrong is not reported as fast);
2. times each one twice on a GPU: **eagerly** (``triton.testing.do_bench``: host launch cost included,
   what a Python loop pays) and **in a CUDA graph** (``triton.testing.do_bench_cudagraph``: GPU time
   only, what a serving engine that captures decode in graphs pays, as vLLM does). Small shapes are
   host-bound eagerly: only the graph time says how fast the kernel is;
3. reports the bandwidth reached for the bytes a decode step must move -- K and V read, Q read, O written,
   block tables and lengths read, the same count for every implementation -- as a percentage of the
   **read bandwidth measured in the same run** (a streaming ``sum`` over 1 GiB): decode mostly reads,
   so a copy (which reads and writes) is the wrong yardstick.

Implementations: the four decode versions with the lesson's launch defaults (``v1``-``v4``), the tuned
default dispatch (``dispatch``), PyTorch SDPA on the same K/V laid out contiguously (``sdpa_contiguous``,
the no-paging ideal) and gather-then-SDPA (``gather_sdpa``, naive paging). Also timed: the paged prefill
kernel against SDPA causal on contiguous K/V for a mix of prompt lengths; an fp8 (e4m3) KV cache against
the 16-bit one (speed and error); and the dispatcher's host cost per call against SDPA's.

Without a GPU the kernels run in Triton's interpreter: NumPy executes each program of the grid one after
another. Those timings are labelled as such and say nothing about GPU speed; the tiny mode exists so CI
proves the script and every kernel still run. What a CPU *can* measure honestly is the Python part of the
dispatcher's host cost (the launch itself stubbed out), and the tiny mode reports it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.attention import ref_paged_attention_decode, ref_paged_prefill_attention, relative_error
from pagedkv.benchmarks.provenance import cpu_model, git_commit

from . import _common
from .cache import reshape_and_cache
from .decode import decode_config, num_sms, paged_attention_decode
from .prefill import paged_prefill_attention

FULL_SHAPES = sorted([(b, ctx) for b in (1, 8, 64, 256) for ctx in (512, 4096, 32768)] + [(32, 1024)])
QUICK_SHAPES = [(1, 512), (1, 32768), (8, 4096), (64, 4096)]
TINY_SHAPES = [(1, 200), (4, 64)]
PREFILL_FULL = [(1, 512), (1, 2048), (1, 8192), (8, 512), (4, 2048), (16, 1024)]  # (prompts, tokens each)
PREFILL_QUICK = [(1, 2048), (4, 1024)]
PREFILL_TINY = [(2, 40)]
FP8_FULL = [(1, 32768), (8, 4096), (64, 4096), (256, 4096)]
FP8_QUICK = [(8, 4096), (64, 4096)]
FP8_TINY = [(2, 100)]
IMPLS = ("v1", "v2", "v3", "v4", "dispatch", "sdpa_contiguous", "gather_sdpa")
QUICK_IMPLS = ("v3", "v4", "dispatch", "sdpa_contiguous", "gather_sdpa")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
CHECK_SEQS = 4  # sequences checked against the float64 reference per shape
# Published peak dense fp16/bf16 tensor throughput, for the roofline's compute roof (a spec, not measured).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}
INTERPRETER_LABEL = (
    "INTERPRETER TIMINGS (Triton's NumPy interpreter on the CPU, programs run one after another): "
    "they measure Python overhead and say nothing about GPU speed"
)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


def time_eager_ms(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median ms per call, host launch included: ``do_bench`` on a GPU (L2 flushed), wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()  # warm-up (the interpreter rewrites the kernel's AST on first call)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def time_graph_ms(fn: Callable[[], object], device: torch.device) -> float | None:
    """Median ms per call replayed from a CUDA graph (GPU time only); None without a GPU."""
    if device.type != "cuda":
        return None
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def read_bandwidth_gbps(device: torch.device) -> dict:
    """The read roof: a streaming ``sum`` over 1 GiB of fp32 (64 MiB on a CPU), in GB/s.

    Also the copy bandwidth (``dst.copy_(src)``, read + write counted) for comparison with older results.
    """
    n_bytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    times = [time_eager_ms(lambda: x.sum(), device, reps=5)]
    graph = time_graph_ms(lambda: x.sum(), device)
    if graph is not None:
        times.append(graph)
    read = n_bytes / (min(times) * 1e-3) / 1e9
    src = x.view(torch.uint8)
    dst = torch.empty_like(src)
    copy = 2 * n_bytes / (time_eager_ms(lambda: dst.copy_(src), device, reps=5) * 1e-3) / 1e9
    return {"read_GBps": read, "copy_GBps": copy, "read_bytes": n_bytes,
            "read_method": "torch.sum over a contiguous fp32 tensor (best of eager and CUDA graph)"}


def decode_bytes(batch: int, ctx: int, hq: int, hkv: int, d: int, elt: int, block_size: int, q_elt: int = 0) -> int:
    """Bytes one decode step must move: K+V read, Q read, O written, block tables + seq_lens read.

    ``elt`` is the cache's element size, ``q_elt`` the query's (default: the same).
    """
    q_elt = q_elt or elt
    kv = 2 * batch * ctx * hkv * d * elt
    qo = 2 * batch * hq * d * q_elt
    tables = batch * math.ceil(ctx / block_size) * 4 + batch * 4
    return kv + qo + tables


def decode_flops(batch: int, ctx: int, hq: int, d: int) -> int:
    """Multiply-adds x 2 of q·Kᵀ and p·V for every query head."""
    return 4 * batch * hq * ctx * d


def prefill_flops(batch: int, length: int, hq: int, d: int) -> int:
    """Causal attention over whole prompts: about half of the L x L score matrix, q·Kᵀ and P·V."""
    return 4 * batch * hq * d * length * (length + 1) // 2


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------


def _build(batch, ctx, hq, hkv, d, block_size, dtype, device, gen):
    """A paged cache of ``batch`` sequences of ``ctx`` tokens, blocks shuffled across the pool."""
    nblk = math.ceil(ctx / block_size)
    num_blocks = batch * nblk + 1  # + the null block 0, never used
    shape = (num_blocks, block_size, hkv, d)
    key_cache = torch.empty(shape, dtype=dtype, device=device).normal_(generator=gen)
    value_cache = torch.empty(shape, dtype=dtype, device=device).normal_(generator=gen)
    perm = torch.randperm(num_blocks - 1, device=device, generator=gen) + 1
    block_tables = perm.view(batch, nblk).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    query = torch.empty(batch, hq, d, dtype=dtype, device=device).normal_(generator=gen)
    return query, key_cache, value_cache, block_tables, seq_lens


def _dense_from_paged(key_cache, block_tables, ctx, chunk=16):
    """The same K laid out contiguously, ``[B, Hkv, ctx, D]``, built a few sequences at a time."""
    batch = block_tables.shape[0]
    _, bs, hkv, d = key_cache.shape
    dense = torch.empty(batch, hkv, ctx, d, dtype=key_cache.dtype, device=key_cache.device)
    for lo in range(0, batch, chunk):
        g = key_cache[block_tables[lo : lo + chunk].long()]  # [b, nblk, bs, Hkv, D]
        g = g.reshape(g.shape[0], -1, hkv, d)[:, :ctx]
        dense[lo : lo + chunk] = g.transpose(1, 2)
    return dense


def _sdpa_grouped(query, k, v, scale):
    """SDPA for decode with GQA: the group's query heads become ``group`` query rows of one KV head.

    query [B, Hq, D], k/v [B, Hkv, L, D] (any strides with D contiguous) -> [B, Hq, D]. Exact, and keeps
    every SDPA backend available (no K/V expansion to Hq heads).
    """
    batch, hq, d = query.shape
    hkv = k.shape[1]
    q = query.view(batch, hkv, hq // hkv, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.reshape(batch, hq, d)


def _gather_sdpa(query, key_cache, value_cache, block_tables, ctx, scale):
    """Naive paging: copy every sequence's blocks out into dense K/V, then SDPA."""
    batch = block_tables.shape[0]
    _, bs, hkv, d = key_cache.shape
    idx = block_tables.long()
    k = key_cache[idx].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
    v = value_cache[idx].view(batch, -1, hkv, d)[:, :ctx].transpose(1, 2)
    return _sdpa_grouped(query, k, v, scale)


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return 1 << 40


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------


def _bench_decode_shape(dname, batch, ctx, device, shape, impls, reps, read_bw, gen, log, min_splits):
    """Check, then time, every implementation at one (dtype, batch, context); returns (correctness, rows)."""
    hq, hkv, d, block_size = shape
    dtype = DTYPES[dname]
    elt = torch.tensor([], dtype=dtype).element_size()
    scale = d**-0.5
    query, kc, vc, bt, sl = _build(batch, ctx, hq, hkv, d, block_size, dtype, device, gen)
    nbytes = decode_bytes(batch, ctx, hq, hkv, d, elt, block_size)
    out = torch.empty_like(query)
    n_chk = min(batch, CHECK_SEQS)
    ref = ref_paged_attention_decode(query[:n_chk], kc, vc, bt[:n_chk], sl[:n_chk], compute_dtype=torch.float64)
    dense: dict[str, torch.Tensor] = {}
    cfg = decode_config(query, kc, bt, ctx)
    v4_splits = max(min_splits, cfg.num_splits if cfg.version == 4 else 1)

    def call(impl: str):
        # validate=False: the checks ran in the correctness step; timed calls must be graph-capturable.
        if impl == "dispatch":
            return paged_attention_decode(query, kc, vc, bt, sl, out=out, validate=False)
        if impl.startswith("v"):
            return paged_attention_decode(query, kc, vc, bt, sl, version=int(impl[1]), out=out, validate=False,
                                          num_splits=v4_splits if impl == "v4" else None)
        if impl == "sdpa_contiguous":
            return _sdpa_grouped(query, dense["k"], dense["v"], scale)
        return _gather_sdpa(query, kc, vc, bt, ctx, scale)

    correctness, rows = [], []
    for impl in impls:
        if impl == "sdpa_contiguous":
            dense["k"] = _dense_from_paged(kc, bt, ctx)  # the no-paging ideal: the same K/V, contiguous
            dense["v"] = _dense_from_paged(vc, bt, ctx)
        elif dense:
            dense.clear()  # free the contiguous copy before gather-then-SDPA makes its own
            _empty_cache(device)
        out.fill_(float("nan"))
        if impl.startswith("v") or impl == "dispatch":  # one validated call first
            paged_attention_decode(query, kc, vc, bt, sl, version=None if impl == "dispatch" else int(impl[1]),
                                   out=out, num_splits=v4_splits if impl == "v4" else None)
            got = out
        else:
            got = call(impl)
        err = relative_error(got[:n_chk], ref)
        correctness.append({"dtype": dname, "batch": batch, "context": ctx, "impl": impl, "max_rel_err": err})
        if not err < 3e-2:
            raise RuntimeError(f"{impl} is wrong at {dname} B={batch} L={ctx}: relative error {err:.3g}")
        eager = time_eager_ms(lambda impl=impl: call(impl), device, reps=reps)
        graph = time_graph_ms(lambda impl=impl: call(impl), device)
        best = graph if graph is not None else eager
        gbps = nbytes / (best * 1e-3) / 1e9
        row = {"dtype": dname, "batch": batch, "context": ctx, "impl": impl, "eager_ms": eager, "graph_ms": graph,
               "GBps": gbps, "pct_read_bw": 100 * gbps / read_bw, "bytes": nbytes,
               "flops": decode_flops(batch, ctx, hq, d), "max_rel_err": err,
               "config": list(cfg) if impl == "dispatch" else ([4, 64, 4, 2, v4_splits] if impl == "v4" else None)}
        rows.append(row)
        log(_fmt_row(row))
    dense.clear()
    return correctness, rows


def _fits(batch, ctx, shape, elt, device, factor=2.1) -> tuple[bool, str]:
    hq, hkv, d, block_size = shape
    cache_bytes = 2 * batch * math.ceil(ctx / block_size) * block_size * hkv * d * elt
    free = _free_bytes(device)
    if factor * cache_bytes > 0.92 * free:  # the paged cache + one dense copy must fit
        return False, f"needs ~{factor * cache_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    return True, ""


# --------------------------------------------------------------------------------------------------
# prefill, fp8, host cost
# --------------------------------------------------------------------------------------------------


def bench_prefill(cases, dname, device, shape, reps, gen, log) -> list[dict]:
    """Paged prefill (whole prompts through the block table) vs SDPA causal on the same K/V, contiguous."""
    rows = []
    for batch, length in cases:
        ok, reason = _fits(batch, length, shape, 2, device, factor=3)
        if not ok:
            log(f"skip prefill {dname} {batch}x{length}: {reason}")
            continue
        rows += _bench_prefill_case(batch, length, dname, device, shape, reps, gen, log)
        _empty_cache(device)
    return rows


def _bench_prefill_case(batch, length, dname, device, shape, reps, gen, log) -> list[dict]:
    hq, hkv, d, block_size = shape
    dtype = DTYPES[dname]
    rows = []
    _, kc, vc, bt, sl = _build(batch, length, hq, hkv, d, block_size, dtype, device, gen)
    q = torch.empty(batch * length, hq, d, dtype=dtype, device=device).normal_(generator=gen)
    qsl = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    k_dense, v_dense = _dense_from_paged(kc, bt, length), _dense_from_paged(vc, bt, length)  # [B, Hkv, L, D]
    q_dense = q.view(batch, length, hq, d).transpose(1, 2)  # [B, Hq, L, D]

    def paged():
        return paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out, validate=False, max_query_len=length)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_dense, k_dense, v_dense, is_causal=True,
                                                                enable_gqa=True)

    n_chk = min(batch, 2)
    ref = ref_paged_prefill_attention(q[: n_chk * length], kc, vc, bt[:n_chk], sl[:n_chk], qsl[: n_chk + 1],
                                      compute_dtype=torch.float64)
    paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out)
    err = relative_error(out[: n_chk * length], ref)
    err_sdpa = relative_error(sdpa().transpose(1, 2).reshape(-1, hq, d)[: n_chk * length], ref)
    if not err < 3e-2:
        raise RuntimeError(f"paged prefill is wrong at {batch}x{length}: relative error {err:.3g}")
    flops = prefill_flops(batch, length, hq, d)
    for impl, fn, e in (("paged_prefill", paged, err), ("sdpa_causal_contiguous", sdpa, err_sdpa)):
        eager = time_eager_ms(fn, device, reps=reps)
        graph = time_graph_ms(fn, device)
        best = graph if graph is not None else eager
        row = {"dtype": dname, "prompts": batch, "prompt_len": length, "impl": impl, "eager_ms": eager,
               "graph_ms": graph, "TFLOPs": flops / (best * 1e-3) / 1e12, "max_rel_err": e}
        rows.append(row)
        log(f"prefill {dname} {batch}x{length:<5} {impl:<24} eager {eager:9.4f} ms  graph "
            f"{'-' if graph is None else f'{graph:9.4f}'} ms  {row['TFLOPs']:7.3g} TFLOP/s  err {e:.1e}")
    return rows


def bench_fp8(cases, dname, device, shape, reps, read_bw, gen, log) -> list[dict]:
    """Decode on an fp8 (e4m3, per-tensor scale) cache vs the same values in a 16-bit cache: speed and error."""
    rows = []
    for batch, ctx in cases:
        ok, reason = _fits(batch, ctx, shape, 2, device, factor=1.6)
        if not ok:
            log(f"skip fp8 B={batch} L={ctx}: {reason}")
            continue
        rows.append(_bench_fp8_case(batch, ctx, dname, device, shape, reps, read_bw, gen, log))
        _empty_cache(device)
    return rows


def _bench_fp8_case(batch, ctx, dname, device, shape, reps, read_bw, gen, log) -> dict:
    hq, hkv, d, block_size = shape
    dtype = DTYPES[dname]
    query, kc, vc, bt, sl = _build(batch, ctx, hq, hkv, d, block_size, dtype, device, gen)
    k_scale = float(kc.abs().max()) / 448.0
    v_scale = float(vc.abs().max()) / 448.0
    kc8 = torch.empty(kc.shape, dtype=_common.FP8_DTYPE, device=device)
    vc8 = torch.empty_like(kc8)
    slots = torch.arange(kc.shape[0] * block_size, device=device)
    reshape_and_cache(kc.view(-1, hkv, d), vc.view(-1, hkv, d), kc8, vc8, slots, k_scale=k_scale,
                      v_scale=v_scale, validate=False)
    out16 = paged_attention_decode(query, kc, vc, bt, sl)
    out8 = paged_attention_decode(query, kc8, vc8, bt, sl, k_scale=k_scale, v_scale=v_scale)
    n_chk = min(batch, CHECK_SEQS)
    ref8 = ref_paged_attention_decode(query[:n_chk], kc8.double() * k_scale, vc8.double() * v_scale,
                                      bt[:n_chk], sl[:n_chk], compute_dtype=torch.float64)
    err_deq = relative_error(out8[:n_chk], ref8)
    err_vs16 = relative_error(out8, out16)  # the quantisation error, over the whole batch
    t = {}
    for name, args, kw in (("cache_16bit", (kc, vc), {}), ("cache_fp8", (kc8, vc8),
                                                            {"k_scale": k_scale, "v_scale": v_scale})):
        out = torch.empty_like(query)

        def fn(args=args, kw=kw, out=out):
            return paged_attention_decode(query, *args, bt, sl, out=out, validate=False, **kw)

        t[name] = (time_eager_ms(fn, device, reps=reps), time_graph_ms(fn, device))
    best = {k: (g if g is not None else e) for k, (e, g) in t.items()}
    row = {"dtype": dname, "batch": batch, "context": ctx, "k_scale": k_scale, "v_scale": v_scale,
           "eager_ms_16bit": t["cache_16bit"][0], "graph_ms_16bit": t["cache_16bit"][1],
           "eager_ms_fp8": t["cache_fp8"][0], "graph_ms_fp8": t["cache_fp8"][1],
           "speedup": best["cache_16bit"] / best["cache_fp8"],
           "pct_read_bw_fp8": 100 * decode_bytes(batch, ctx, hq, hkv, d, 1, block_size, 2)
           / (best["cache_fp8"] * 1e-3) / 1e9 / read_bw,
           "max_rel_err_vs_16bit_cache": err_vs16, "max_rel_err_vs_dequantised_fp64": err_deq}
    log(f"fp8 {dname} B={batch:<4} L={ctx:<6} 16-bit {best['cache_16bit']:9.4f} ms  fp8 {best['cache_fp8']:9.4f} ms"
        f"  x{row['speedup']:.2f}  err vs 16-bit cache {err_vs16:.2e}, vs dequantised {err_deq:.1e}")
    return row


def host_overhead_us(device: torch.device, shape=(32, 8, 128, 16), n: int = 300) -> dict:
    """Host time per call, validation off: the dispatcher vs SDPA (the smallest GPU work, batch 1, 512 tokens).

    On a GPU: the calls' enqueue time (``perf_counter`` over ``n`` back-to-back calls, before synchronising;
    the GPU work is far shorter than the host work at this size). On a CPU: the Python part of the
    dispatcher alone -- the Triton launch replaced by a no-op -- in thread CPU time (robust to other load),
    against SDPA's own fixed cost on the smallest CPU shape.
    """
    hq, hkv, d, block_size = shape
    dtype = torch.float16
    gen = torch.Generator(device=device).manual_seed(1)
    res: dict = {}
    for batch, ctx in ((1, 512), (64, 512)):
        query, kc, vc, bt, sl = _build(batch, ctx, hq, hkv, d, block_size, dtype, device, gen)
        out = torch.empty_like(query)
        if device.type == "cuda":
            paged_attention_decode(query, kc, vc, bt, sl, out=out)  # compile the kernels, check the inputs
        # Called right here, inside the loop: the closures see this iteration's tensors.
        fn = lambda: paged_attention_decode(query, kc, vc, bt, sl, out=out, validate=False)  # noqa: E731, B023
        cfg = decode_config(query, kc, bt, ctx)
        res[f"dispatch_B{batch}_L{ctx}_v{cfg.version}"] = _host_us(fn, device, n)
        if device.type == "cuda":
            k = _dense_from_paged(kc, bt, ctx)
            res[f"sdpa_B{batch}_L{ctx}"] = _host_us(lambda: _sdpa_grouped(query, k, k, d**-0.5), device, n)  # noqa: B023
    if device.type != "cuda":
        qs = torch.zeros(1, 1, 1, 16)
        res["sdpa_smallest_cpu"] = _host_us(lambda: torch.nn.functional.scaled_dot_product_attention(qs, qs, qs),
                                            device, n)
    res["method"] = ("GPU: host enqueue time per call, perf_counter" if device.type == "cuda" else
                     "CPU: thread CPU time per call, Triton launch stubbed out (the Python part only), min of 7")
    return res


def _host_us(fn: Callable[[], object], device: torch.device, n: int) -> float:
    if device.type == "cuda":
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples.append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        return min(samples)
    from triton.runtime.interpreter import InterpretedFunction

    saved = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *a, **k: None  # the Python around the launch only
    try:
        fn()
        return min(timeit.repeat(fn, number=n, repeat=7, timer=time.thread_time)) / n * 1e6
    finally:
        InterpretedFunction.run = saved


# --------------------------------------------------------------------------------------------------
# the run, its table and its plots
# --------------------------------------------------------------------------------------------------


def run(
    shapes: list[tuple[int, int]],
    dtypes: list[str],
    device: torch.device,
    shape: tuple[int, int, int, int] = (32, 8, 128, 16),
    impls: tuple[str, ...] = IMPLS,
    reps: int = 5,
    min_splits: int = 1,
    prefill_cases: list[tuple[int, int]] = (),
    fp8_cases: list[tuple[int, int]] = (),
    log=print,
) -> dict:
    """Correctness then timing for every (dtype, shape); returns the JSON-ready result dict.

    ``shape`` is (num_q_heads, num_kv_heads, head_dim, block_size).
    """
    from tqdm.auto import tqdm

    gen = torch.Generator(device=device).manual_seed(0)
    roof = read_bandwidth_gbps(device)
    read_bw = roof["read_GBps"]
    log(f"device: {_device_name(device)}; read bandwidth {read_bw:.0f} GB/s (sum over "
        f"{roof['read_bytes'] >> 20} MiB), copy {roof['copy_GBps']:.0f} GB/s (read + write)")
    correctness, rows, skipped = [], [], []
    work = [(dname, b, ctx) for dname in dtypes for b, ctx in shapes]
    for dname, batch, ctx in tqdm(work, desc="decode shapes", disable=None):
        ok, reason = _fits(batch, ctx, shape, torch.tensor([], dtype=DTYPES[dname]).element_size(), device)
        if not ok:
            skipped.append({"dtype": dname, "batch": batch, "context": ctx, "reason": reason})
            log(f"skip {dname} B={batch} L={ctx}: {reason}")
            continue
        c, t = _bench_decode_shape(dname, batch, ctx, device, shape, impls, reps, read_bw, gen, log, min_splits)
        correctness += c
        rows += t
    pdtype = "bf16" if "bf16" in dtypes else dtypes[0]
    prefill = bench_prefill(list(prefill_cases), pdtype, device, shape, reps, gen, log) if prefill_cases else []
    if fp8_cases and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        skipped.append({"fp8": "an fp8 e4m3 cache needs compute capability 8.9+ (Ada, Hopper)"})
        fp8_cases = ()
    fp8 = bench_fp8(list(fp8_cases), pdtype, device, shape, reps, read_bw, gen, log) if fp8_cases else []
    return {"read_roof": roof, "read_bandwidth_GBps": read_bw, "num_sms": num_sms(device), "correctness": correctness,
            "decode": rows, "prefill": prefill, "fp8": fp8, "host_overhead_us": host_overhead_us(device),
            "skipped": skipped}


def _fmt_row(r: dict) -> str:
    graph = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.4f}"
    return (f"{r['dtype']:>4} B={r['batch']:<4} L={r['context']:<6} {r['impl']:<16} eager {r['eager_ms']:9.4f} ms "
            f"graph {graph:>9} ms {r['GBps']:9.3g} GB/s {r['pct_read_bw']:6.3g}% of read  err={r['max_rel_err']:.1e}")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({cpu_model()}), Triton interpreter"


def table(result: dict) -> str:
    """The decode timings as a fixed-width text table (also what the lesson prints)."""
    lines = [f"{'dtype':>5} {'batch':>5} {'context':>7} {'impl':<16} {'eager ms':>10} {'graph ms':>10} "
             f"{'GB/s':>8} {'% read':>7}"]
    for r in result["decode"]:
        graph = "-" if r["graph_ms"] is None else f"{r['graph_ms']:.4f}"
        lines.append(f"{r['dtype']:>5} {r['batch']:>5} {r['context']:>7} {r['impl']:<16} {r['eager_ms']:>10.4f} "
                     f"{graph:>10} {r['GBps']:>8.3g} {r['pct_read_bw']:>6.3g}%")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Decode: one row of panels per dtype (% of the read roof per shape; roofline). Saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["decode"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    colors = {impl: plt.get_cmap("tab10")(i) for i, impl in enumerate(impls)}
    bw = result["read_bandwidth_GBps"]
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in result["meta"]["device"]), None)
    timer = "CUDA-graph time" if any(r["graph_ms"] is not None for r in rows) else "wall time (interpreter)"
    fig, axes = plt.subplots(len(dtypes), 2, figsize=(15, 4.2 * len(dtypes)), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2, 1]})
    for row_axes, dname in zip(axes, dtypes, strict=True):
        ax_bar, ax_roof = row_axes
        sel = [r for r in rows if r["dtype"] == dname]
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in sel))
        width = 0.85 / len(impls)
        for i, impl in enumerate(impls):
            ys = [next((r["pct_read_bw"] for r in sel if (r["batch"], r["context"]) == s and r["impl"] == impl), 0.0)
                  for s in shapes]
            ax_bar.bar([j + i * width for j in range(len(shapes))], ys, width, label=impl, color=colors[impl])
        ax_bar.axhline(100, color="k", lw=0.8, ls="--")
        ax_bar.set_xticks([j + 0.425 - width / 2 for j in range(len(shapes))])
        ax_bar.set_xticklabels([f"B={b}\nL={c}" for b, c in shapes], fontsize=8)
        ax_bar.set_ylabel(f"% of measured read bandwidth ({bw:.0f} GB/s)")
        ax_bar.set_title(f"{dname}: bytes a decode step must move / {timer}", fontsize=10)
        # Roofline: attainable = min(bandwidth x intensity, peak), one line; points = achieved.
        xs = [r["flops"] / r["bytes"] for r in sel]
        lo, hi = min(xs) / 4, max(max(xs) * 16, (peak * 1e3 / bw) * 4 if peak else max(xs) * 16)
        grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
        ax_roof.loglog(grid, [min(bw * x / 1e3, peak) if peak else bw * x / 1e3 for x in grid], "k-", lw=1.5,
                       label=f"roof: read {bw:.0f} GB/s" + (f", {peak:.0f} TFLOP/s (spec)" if peak else ""))
        for impl in impls:
            pts = [r for r in sel if r["impl"] == impl]
            ax_roof.scatter([r["flops"] / r["bytes"] for r in pts],
                            [r["flops"] / ((r["graph_ms"] or r["eager_ms"]) * 1e-3) / 1e12 for r in pts],
                            s=16, color=colors[impl], alpha=0.8)
        ax_roof.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax_roof.set_ylabel("achieved TFLOP/s")
        ax_roof.set_title(f"{dname}: roofline (decode sits far left of the ridge)", fontsize=10)
        ax_roof.legend(fontsize=8, loc="upper left")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(impls), fontsize=9, frameon=False)
    meta = result["meta"]
    title = f"{meta['device']}, {meta['mode']}, {meta['when']}, commit {meta['commit']}"
    if meta["mode"].endswith("interpreter"):
        title += "\ninterpreter timings: not GPU speed"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_prefill(result: dict, path: Path) -> None:
    """Paged prefill vs SDPA causal on contiguous K/V: time per prompt mix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["prefill"]
    cases = list(dict.fromkeys((r["prompts"], r["prompt_len"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        ys = [next(((r["graph_ms"] or r["eager_ms"]) for r in rows if (r["prompts"], r["prompt_len"]) == c
                    and r["impl"] == impl), 0.0) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ys, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"{b} x {n}" for b, n in cases], fontsize=9)
    ax.set_xlabel("prompts x tokens each")
    ax.set_ylabel("ms per call (CUDA graph)" if rows and rows[0]["graph_ms"] is not None else "ms per call (wall)")
    ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize=9)
    meta = result["meta"]
    ax.set_title(f"Paged prefill vs SDPA causal (contiguous K/V), {rows[0]['dtype'] if rows else ''}; "
                 f"{meta['device']}, {meta['when']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower().replace("nvidia ", "")).strip("-")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedkv.kernels.bench", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny shapes (default without a GPU)")
    size.add_argument("--quick", action="store_true", help="four decode shapes in bf16, two prefill, fp8 (<= 2 min)")
    size.add_argument("--full", action="store_true", help="the full sweep (default with a GPU, <= 8 min)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default on a GPU: benchmarks/results/gpu/<date>-<gpu>[-quick]/, to be "
                        "committed; in the interpreter: artifacts/bench_interpreter, git-ignored)")
    p.add_argument("--dtypes", default=None, help="comma-separated: fp16,bf16,fp32")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    args = p.parse_args(argv)
    if args.dtypes:
        for name in args.dtypes.split(","):
            if name not in DTYPES:
                p.error(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not _common.interpreter_on() else "cpu")
    on_gpu = device.type == "cuda"
    tiny = args.tiny or not on_gpu
    if tiny:
        model, default_dtypes, shapes = (8, 2, 64, 16), ["fp16"], TINY_SHAPES
        impls, prefill_cases, fp8_cases = IMPLS, PREFILL_TINY, FP8_TINY
        mode = "tiny-gpu" if on_gpu else "tiny-interpreter"
    elif args.quick:
        model, default_dtypes, shapes, mode = (32, 8, 128, 16), ["bf16"], QUICK_SHAPES, "quick"
        impls, prefill_cases, fp8_cases = QUICK_IMPLS, PREFILL_QUICK, FP8_QUICK
    else:
        model, default_dtypes, shapes, mode = (32, 8, 128, 16), ["bf16", "fp16"], FULL_SHAPES, "full"
        impls, prefill_cases, fp8_cases = IMPLS, PREFILL_FULL, FP8_FULL
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes
    if not on_gpu and "bf16" in dtypes:
        raise SystemExit("bf16 needs a GPU: Triton's interpreter has no bfloat16")
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    if args.out is not None:
        out_dir = args.out
    elif on_gpu and not tiny:
        suffix = "" if mode == "full" else f"-{mode}"
        out_dir = Path("benchmarks/results/gpu") / f"{date}-{_slug(_device_name(device))}{suffix}"
    else:
        out_dir = Path("artifacts/bench_interpreter")
    out_dir.mkdir(parents=True, exist_ok=True)
    if mode == "tiny-interpreter":
        print(INTERPRETER_LABEL)
    t0 = time.perf_counter()
    # Tiny contexts never earn a split; force 2 for version 4 so CI exercises the split + reduce path.
    result = run(shapes, dtypes, device, model, impls, reps=1 if tiny else 5, min_splits=2 if tiny else 1,
                 prefill_cases=prefill_cases, fp8_cases=fp8_cases)
    import triton

    result["meta"] = {
        "mode": mode, "device": _device_name(device), "when": _now(), "commit": git_commit(),
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "num_sms": result["num_sms"], "seconds": round(time.perf_counter() - t0, 1),
        "model": {"num_q_heads": model[0], "num_kv_heads": model[1], "head_dim": model[2], "block_size": model[3]},
        "dtypes": dtypes, "shapes": shapes,
        "bytes": "K+V read + Q read + O written + block tables + seq_lens, same for every impl",
        "timers": ("eager: triton.testing.do_bench median (L2 flushed, host launch included); graph: "
                   "triton.testing.do_bench_cudagraph median (GPU time only; small caches stay in L2)")
        if on_gpu else "wall clock median in Triton's interpreter",
        "note": INTERPRETER_LABEL if mode == "tiny-interpreter" else "",
    }
    print()
    print(table(result))
    print(f"\nhost cost per call (us): {result['host_overhead_us']}")
    json_path = out_dir / "bench.json"
    json_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {json_path} ({result['meta']['seconds']} s)")
    if not args.no_plot:
        plot(result, out_dir / "bench_decode.png")
        if result["prefill"]:
            plot_prefill(result, out_dir / "bench_prefill.png")
        print(f"wrote {out_dir / 'bench_decode.png'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
