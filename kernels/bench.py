"""Benchmark of the paged decode kernels: correctness first, then time, bandwidth and a roofline plot.

    python -m pagedkv.kernels.bench                # full sweep on a GPU; tiny interpreter run on a CPU
    python -m pagedkv.kernels.bench --quick        # three shapes, fp16 (a GPU smoke test)
    python -m pagedkv.kernels.bench --tiny         # tiny shapes (what CI runs, in the interpreter)
    python -m pagedkv.kernels.bench --out DIR      # where the JSON and the plot go

For every (dtype, batch, context) it

1. checks each implementation against a float64 reference on the first few sequences (a kernel that is
   fast and wrong is not reported as fast);
2. times each decode version, PyTorch SDPA on the same K/V laid out contiguously (the no-paging ideal)
   and gather-then-SDPA (naive paging: copy the blocks out, then attend), with
   ``triton.testing.do_bench`` (median, L2 flushed between runs) on a GPU;
3. reports achieved bandwidth for the bytes a decode step must move -- K and V read, Q read, O written,
   block tables and lengths read -- the same byte count for every implementation, and that bandwidth as
   a percentage of the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB) measured in the same run.

Full sweep: batch 1, 8, 64, 256 x context 512, 4096, 32768; 32 query heads, 8 KV heads, head dim 128;
block size 16; bf16 and fp16. Shapes whose caches would not fit in free GPU memory are skipped and
listed as skipped.

Without a GPU, the kernels run in Triton's interpreter: NumPy executes each program of the grid one
after another. Those timings are labelled as such and say nothing about GPU speed; the tiny mode exists
so CI proves the script and every kernel still run.
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
from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.attention import ref_paged_attention_decode, relative_error

from . import _common
from .decode import num_sms, paged_attention_decode
from .decode_v1 import launch_decode_v1
from .decode_v2 import launch_decode_v2
from .decode_v3 import launch_decode_v3
from .decode_v4 import choose_num_splits, launch_decode_v4

FULL_SHAPES = [(b, ctx) for b in (1, 8, 64, 256) for ctx in (512, 4096, 32768)]
QUICK_SHAPES = [(1, 32768), (8, 4096), (64, 4096)]
TINY_SHAPES = [(1, 200), (4, 64)]
IMPLS = ("v1", "v2", "v3", "v4", "sdpa_contiguous", "gather_sdpa")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
CHECK_SEQS = 4  # sequences checked against the float64 reference per shape
# Published peak dense fp16/bf16 tensor throughput, for the roofline's compute roof (a spec, not measured).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
INTERPRETER_LABEL = (
    "INTERPRETER TIMINGS (Triton's NumPy interpreter on the CPU, programs run one after another): "
    "they measure Python overhead and say nothing about GPU speed"
)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on a GPU, wall clock elsewhere."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up (the interpreter rewrites the kernel's AST on first call)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Bytes per second a plain device-to-device copy reaches (read + write counted), in GB/s."""
    n = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=9)
    return 2 * n / (ms * 1e-3) / 1e9


def decode_bytes(batch: int, ctx: int, hq: int, hkv: int, d: int, elt: int, block_size: int) -> int:
    """Bytes one decode step must move: K+V read, Q read, O written, block tables + seq_lens read."""
    kv = 2 * batch * ctx * hkv * d * elt
    qo = 2 * batch * hq * d * elt
    tables = batch * math.ceil(ctx / block_size) * 4 + batch * 4
    return kv + qo + tables


def decode_flops(batch: int, ctx: int, hq: int, d: int) -> int:
    """Multiply-adds x 2 of q·Kᵀ and p·V for every query head."""
    return 4 * batch * hq * ctx * d


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


def _bench_shape(dname, batch, ctx, device, hq, hkv, d, block_size, impls, reps, splits, copy_bw, gen, log):
    """Check, then time, every implementation at one (dtype, batch, context); returns (correctness, timings)."""
    dtype = DTYPES[dname]
    elt = torch.tensor([], dtype=dtype).element_size()
    scale = d**-0.5
    query, kc, vc, bt, sl = _build(batch, ctx, hq, hkv, d, block_size, dtype, device, gen)
    nbytes = decode_bytes(batch, ctx, hq, hkv, d, elt, block_size)
    out = torch.empty_like(query)
    n_chk = min(batch, CHECK_SEQS)
    ref = ref_paged_attention_decode(query[:n_chk], kc, vc, bt[:n_chk], sl[:n_chk], compute_dtype=torch.float64)
    dense: dict[str, torch.Tensor] = {}

    # The public function validates once (in the correctness step); the timed calls go straight to the
    # launchers, so Python-side checks do not count as kernel time.
    launchers = {"v1": launch_decode_v1, "v2": launch_decode_v2, "v3": launch_decode_v3,
                 "v4": lambda *a: launch_decode_v4(*a, num_splits=splits)}

    def call(impl: str, timed: bool = True):
        if impl.startswith("v"):
            if not timed:
                return paged_attention_decode(query, kc, vc, bt, sl, version=int(impl[1]), out=out,
                                              num_splits=splits if impl == "v4" else None)
            launchers[impl](out, query, kc, vc, bt, sl, scale)
            return out
        if impl == "sdpa_contiguous":
            return _sdpa_grouped(query, dense["k"], dense["v"], scale)
        return _gather_sdpa(query, kc, vc, bt, ctx, scale)

    correctness, timings = [], []
    for impl in impls:
        if impl == "sdpa_contiguous":
            dense["k"] = _dense_from_paged(kc, bt, ctx)  # the no-paging ideal: the same K/V, contiguous
            dense["v"] = _dense_from_paged(vc, bt, ctx)
        elif dense:
            dense.clear()  # free the contiguous copy before gather-then-SDPA makes its own
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.fill_(float("nan"))
        got = call(impl, timed=False)
        err = relative_error(got[:n_chk], ref)
        correctness.append({"dtype": dname, "batch": batch, "context": ctx, "impl": impl, "max_rel_err": err})
        if not err < 3e-2:
            raise RuntimeError(f"{impl} is wrong at {dname} B={batch} L={ctx}: relative error {err:.3g}")
        ms = time_ms(lambda impl=impl: call(impl), device, reps=reps)
        gbps = nbytes / (ms * 1e-3) / 1e9
        row = {"dtype": dname, "batch": batch, "context": ctx, "impl": impl, "ms": ms, "GBps": gbps,
               "pct_copy_bw": 100 * gbps / copy_bw, "bytes": nbytes, "flops": decode_flops(batch, ctx, hq, d),
               "num_splits": splits if impl == "v4" else None, "max_rel_err": err}
        timings.append(row)
        log(_fmt_row(row))
    return correctness, timings


def run(
    shapes: list[tuple[int, int]],
    dtypes: list[str],
    device: torch.device,
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    impls: tuple[str, ...] = IMPLS,
    reps: int = 5,
    min_splits: int = 1,
    log=print,
) -> dict:
    """Correctness then timing for every (dtype, shape); returns the JSON-ready result dict."""
    gen = torch.Generator(device=device).manual_seed(0)
    copy_bw = copy_bandwidth_gbps(device)
    sms = num_sms(device)
    log(f"device: {_device_name(device)}; copy bandwidth {copy_bw:.1f} GB/s (dst.copy_(src), read + write)")
    correctness, timings, skipped = [], [], []
    for dname in dtypes:
        elt = torch.tensor([], dtype=DTYPES[dname]).element_size()
        for batch, ctx in shapes:
            cache_bytes = 2 * batch * math.ceil(ctx / block_size) * block_size * hkv * d * elt
            free = _free_bytes(device)
            if 2.1 * cache_bytes > 0.92 * free:  # the paged cache + one dense copy must fit
                reason = f"needs ~{2.1 * cache_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
                skipped.append({"dtype": dname, "batch": batch, "context": ctx, "reason": reason})
                log(f"skip {dname} B={batch} L={ctx}: {reason}")
                continue
            splits = max(min_splits, choose_num_splits(batch, hkv, ctx, sms))
            c, t = _bench_shape(dname, batch, ctx, device, hq, hkv, d, block_size, impls, reps, splits, copy_bw,
                                gen, log)
            correctness += c
            timings += t
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"copy_bandwidth_GBps": copy_bw, "num_sms": sms, "correctness": correctness, "timings": timings,
            "skipped": skipped}


def _fmt_row(r: dict) -> str:
    splits = f" splits={r['num_splits']}" if r.get("num_splits") else ""
    return (f"{r['dtype']:>4} B={r['batch']:<4} L={r['context']:<6} {r['impl']:<16} {r['ms']:10.4f} ms "
            f"{r['GBps']:9.3g} GB/s {r['pct_copy_bw']:6.3g}% of copy  err={r['max_rel_err']:.1e}{splits}")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"


def table(result: dict) -> str:
    """The timings as a fixed-width text table (also what the lesson prints)."""
    lines = [f"{'dtype':>5} {'batch':>5} {'context':>7} {'impl':<16} {'ms':>10} {'GB/s':>9} {'% copy':>7}"]
    for r in result["timings"]:
        lines.append(f"{r['dtype']:>5} {r['batch']:>5} {r['context']:>7} {r['impl']:<16} {r['ms']:>10.4f} "
                     f"{r['GBps']:>9.3g} {r['pct_copy_bw']:>6.3g}%")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Roofline (left) and % of copy bandwidth per shape (right), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["timings"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    bw = result["copy_bandwidth_GBps"]
    x = [r["flops"] / r["bytes"] for r in rows]
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in result["device"]), None)
    xs = [min(x) / 4, max(max(x) * 64, 1000)]
    roof = [min(bw * xi / 1e3, peak) if peak else bw * xi / 1e3 for xi in xs]
    ax1.loglog(xs, roof, "k-", lw=1.5, label=f"memory roof: measured copy {bw:.0f} GB/s"
               + (f"; compute roof {peak:.0f} TFLOP/s (spec)" if peak else ""))
    if peak:
        ridge = peak * 1e3 / bw
        xs2 = [xs[0], ridge, xs[1]]
        ax1.loglog(xs2, [bw * xs2[0] / 1e3, peak, peak], "k-", lw=1.5)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for impl in impls:
        sel = [r for r in rows if r["impl"] == impl]
        ax1.scatter([r["flops"] / r["bytes"] for r in sel], [r["flops"] / (r["ms"] * 1e-3) / 1e12 for r in sel],
                    label=impl, s=18, alpha=0.8)
    ax1.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax1.set_ylabel("achieved TFLOP/s")
    ax1.set_title("Roofline: decode attention sits far left of the ridge")
    ax1.legend(fontsize=7)
    shapes = list(dict.fromkeys((r["dtype"], r["batch"], r["context"]) for r in rows))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        ys = []
        for s in shapes:
            hit = [r["pct_copy_bw"] for r in rows if (r["dtype"], r["batch"], r["context"]) == s and r["impl"] == impl]
            ys.append(hit[0] if hit else 0.0)
        ax2.bar([j + i * width for j in range(len(shapes))], ys, width, label=impl)
    ax2.axhline(100, color="k", lw=0.8)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
    ax2.set_xticklabels([f"{d}\nB={b}\nL={c}" for d, b, c in shapes], fontsize=6)
    ax2.set_ylabel("achieved bandwidth (% of measured copy bandwidth)")
    ax2.set_title("Useful bytes moved per second, relative to a plain copy")
    ax2.legend(fontsize=7)
    title = f"{result['device']}  ({result['mode']}, {result['when']})"
    if result["mode"].endswith("interpreter"):
        title += "\n" + "interpreter timings: not GPU speed"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m pagedkv.kernels.bench", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny shapes (default without a GPU)")
    size.add_argument("--quick", action="store_true", help="three shapes, fp16 only")
    size.add_argument("--full", action="store_true", help="the full sweep (default with a GPU)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default: benchmarks/results/gpu on a GPU, to be committed; "
                        "artifacts/bench_interpreter in the interpreter, git-ignored)")
    p.add_argument("--dtypes", default=None, help="comma-separated: fp16,bf16,fp32")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not _common.interpreter_on() else "cpu")
    on_gpu = device.type == "cuda"
    tiny = args.tiny or not on_gpu
    if tiny:
        shapes, hq, hkv, d, default_dtypes = TINY_SHAPES, 8, 2, 64, ["fp16", "fp32"]
        mode = "tiny-gpu" if on_gpu else "tiny-interpreter"
    elif args.quick:
        shapes, hq, hkv, d, default_dtypes, mode = QUICK_SHAPES, 32, 8, 128, ["fp16"], "quick"
    else:
        shapes, hq, hkv, d, default_dtypes, mode = FULL_SHAPES, 32, 8, 128, ["bf16", "fp16"], "full"
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes
    for name in dtypes:
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
        if DTYPES[name] == torch.bfloat16 and not on_gpu:
            p.error("bf16 needs a GPU: Triton's interpreter has no bfloat16")
    if args.out is not None:
        out_dir = args.out
    elif on_gpu and not tiny:
        out_dir = Path("benchmarks/results/gpu") if mode == "full" else Path("benchmarks/results/gpu-quick")
    else:
        out_dir = Path("artifacts/bench_interpreter")
    out_dir.mkdir(parents=True, exist_ok=True)
    block_size = 16
    if mode == "tiny-interpreter":
        print(INTERPRETER_LABEL)
    # Tiny contexts never earn a split from the heuristic; force 2 so CI exercises the split + reduce path.
    result = run(shapes, dtypes, device, hq, hkv, d, block_size, reps=3 if tiny else 5, min_splits=2 if tiny else 1)
    result.update({
        "mode": mode,
        "device": _device_name(device),
        "when": _now(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "config": {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d, "block_size": block_size,
                   "dtypes": dtypes, "shapes": shapes,
                   "bytes": "K+V read + Q read + O written + block tables + seq_lens, same for every impl",
                   "timer": "triton.testing.do_bench median" if on_gpu else "wall clock median"},
        "note": INTERPRETER_LABEL if mode == "tiny-interpreter" else "",
    })
    print()
    print(table(result))
    json_path = out_dir / "bench_decode.json"
    json_path.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {json_path}")
    if not args.no_plot:
        png = out_dir / "bench_decode_roofline.png"
        plot(result, png)
        print(f"wrote {png}")
    return result["timings"]


if __name__ == "__main__":
    main(sys.argv[1:])
