"""What the kernel benchmark runs: the shapes, the inputs (a shuffled paged cache), the baselines (SDPA on
contiguous K/V, gather-then-SDPA) and one benchmark per case -- decode, prefill, fp8 -- each checked against the
float64 reference before it is timed (``python -m pagedkv.kernels.bench``)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from pagedkv.attention import ref_paged_attention_decode, ref_paged_prefill_attention, relative_error

from . import _common
from .bench_report import _fmt_row
from .bench_timing import (
    _empty_cache,
    _free_bytes,
    _host_us,
    decode_bytes,
    decode_flops,
    prefill_flops,
    time_eager_ms,
    time_graph_ms,
)
from .cache import reshape_and_cache
from .decode import decode_config, paged_attention_decode
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


def _cases_that_fit(cases, what, device, shape, factor, log) -> Iterator[tuple[int, int]]:
    """The ``(batch, tokens)`` cases whose 16-bit paged cache, ``factor`` times over, fits in free memory: the
    others are logged as skipped (``what`` names the benchmark); the allocator's cache is emptied after each."""
    for batch, length in cases:
        ok, reason = _fits(batch, length, shape, 2, device, factor=factor)
        if not ok:
            log(f"skip {what} {batch}x{length}: {reason}")
            continue
        yield batch, length
        _empty_cache(device)


def bench_prefill(cases, dname, device, shape, reps, gen, log) -> list[dict]:
    """Paged prefill (whole prompts through the block table) vs SDPA causal on the same K/V, contiguous."""
    rows = []
    for batch, length in _cases_that_fit(cases, f"prefill {dname}", device, shape, 3, log):
        rows += _bench_prefill_case(batch, length, dname, device, shape, reps, gen, log)
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
    return [_bench_fp8_case(batch, ctx, dname, device, shape, reps, read_bw, gen, log)
            for batch, ctx in _cases_that_fit(cases, "fp8", device, shape, 1.6, log)]


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
