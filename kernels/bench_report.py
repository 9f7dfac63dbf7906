"""The kernel benchmark's output: its text table and its plots (``python -m pagedkv.kernels.bench``)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pagedkv.benchmarks.provenance import cpu_model

# Published peak dense fp16/bf16 tensor throughput, for the roofline's compute roof (a spec, not measured).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}
INTERPRETER_LABEL = (
    "INTERPRETER TIMINGS (Triton's NumPy interpreter on the CPU, programs run one after another): "
    "they measure Python overhead and say nothing about GPU speed"
)


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


def host_cost_table(host: dict) -> str:
    """The host cost per call (``result["host_overhead_us"]``, microseconds) as a short table: one row per call,
    its batch, context and decode version read from the key (``dispatch_B1_L512_v4``), the method in the title."""
    title = "host cost per call" + (f" ({host['method']})" if host.get("method") else "") + ":"
    lines = [title, f"  {'call':<26} {'batch':>5} {'context':>7} {'us/call':>8}"]
    for key, us in host.items():
        if key == "method":
            continue
        m = re.fullmatch(r"(\w+?)_B(\d+)_L(\d+)(?:_v(\d+))?", key)
        name, batch, ctx = (m.group(1) + (f" (v{m.group(4)})" if m.group(4) else ""), m.group(2), m.group(3)) if m \
            else (key.replace("_", " ").replace("cpu", "CPU"), "-", "-")
        lines.append(f"  {name:<26} {batch:>5} {ctx:>7} {us:>8.1f}")
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

