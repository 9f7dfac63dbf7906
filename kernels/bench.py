"""Benchmark of the paged-attention kernels: correctness first, then GPU time and host time, against a measured roof.

    python -m pagedkv.kernels.bench                # full sweep on a GPU (<= 8 min); tiny interpreter run on a CPU
    python -m pagedkv.kernels.bench --quick        # four decode shapes, two prefill shapes, fp8: <= 2 min on a GPU
    python -m pagedkv.kernels.bench --tiny         # tiny shapes in Triton's interpreter (what CI runs)
    python -m pagedkv.kernels.bench --out DIR      # where the JSON and the plots go (default: under artifacts/)

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
import platform
import sys
import time
from pathlib import Path

import torch

from pagedkv.benchmarks.provenance import git_commit
from pagedkv.utils.paths import output_path_problem

from . import _common
from .bench_cases import (  # noqa: F401 - re-exported: the benchmark's names as before the split
    CHECK_SEQS,
    DTYPES,
    FP8_FULL,
    FP8_QUICK,
    FP8_TINY,
    FULL_SHAPES,
    IMPLS,
    PREFILL_FULL,
    PREFILL_QUICK,
    PREFILL_TINY,
    QUICK_IMPLS,
    QUICK_SHAPES,
    TINY_SHAPES,
    _bench_decode_shape,
    _fits,
    _gather_sdpa,
    _sdpa_grouped,
    bench_fp8,
    bench_prefill,
    host_overhead_us,
)
from .bench_report import (  # noqa: F401
    INTERPRETER_LABEL,
    _device_name,
    _slug,
    host_cost_table,
    plot,
    plot_prefill,
    table,
)
from .bench_timing import (  # noqa: F401
    decode_bytes,
    decode_flops,
    prefill_flops,
    read_bandwidth_gbps,
    time_eager_ms,
    time_graph_ms,
)
from .decode import num_sms


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


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


def default_out_dir(mode: str, device_name: str, date: str) -> Path:
    """Where a run writes without ``--out``: under ``artifacts/`` of the current folder, which git ignores, so
    that ``./lab bench`` changes no tracked file. A GPU run meant to be committed is given
    ``--out benchmarks/results/gpu/<date>-<gpu>`` (and a README there)."""
    if mode in ("quick", "full"):
        suffix = "" if mode == "full" else f"-{mode}"
        return Path("artifacts/bench_gpu") / f"{date}-{_slug(device_name)}{suffix}"
    return Path("artifacts/bench_interpreter")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedkv bench kernels", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="tiny shapes (default without a GPU)")
    size.add_argument("--quick", action="store_true", help="four decode shapes in bf16, two prefill, fp8 (<= 2 min)")
    size.add_argument("--full", action="store_true", help="the full sweep (default with a GPU, <= 8 min)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default, git-ignored: artifacts/bench_gpu/<date>-<gpu>[-quick]/ on a GPU, "
                        "artifacts/bench_interpreter in the interpreter; a GPU run to commit: --out "
                        "benchmarks/results/gpu/<date>-<gpu>)")
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
    out_dir = args.out if args.out is not None else default_out_dir(mode, _device_name(device), date)
    problem = output_path_problem(folders={"--out" if args.out is not None else "the default folder": out_dir})
    if problem:  # one line, before the run (a traceback from mkdir, or the JSON lost after it, otherwise)
        print(f"pagedkv bench kernels: {problem}", file=sys.stderr)
        raise SystemExit(2)
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
    print(f"\n{host_cost_table(result['host_overhead_us'])}")
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
