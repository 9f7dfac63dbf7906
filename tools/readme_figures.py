"""Draw the README's two pictures into docs/img/ (deterministic; run again after changing the widget or the core).

    .venv/bin/python tools/readme_figures.py

- ``filmstrip.svg``: the block-table widget's static picture (its key frames) for a small scheduler run with a
  shared system prompt (prefix hits), a fork that copies on write, and a swap preemption.
- ``concurrency.png``: how many sequences fit in a KV pool at once, contiguous ``max_ctx`` reservation
  against paging, for Llama 3.1 8B's per-token KV size, on lesson 1's workload and setting (the same 10,000
  ShareGPT-like lengths, ``max_ctx`` 2,048, blocks of 16, FCFS), so its ratio is the one lesson 1 computes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pagedkv import KVCacheManager, Request  # noqa: E402
from pagedkv.fragmentation import (  # noqa: E402
    blocks_needed,
    contiguous_capacity,
    paged_admission,
    sample_request_lengths,
)
from pagedkv.scheduler import Scheduler  # noqa: E402
from pagedkv.widgets import BlockTableWidget, TraceRecorder  # noqa: E402

OUT = ROOT / "docs" / "img"


def scheduler_run() -> TraceRecorder:
    """Four requests in 15 usable blocks of 4 tokens: prefix hits, a fork with copy-on-write, a swap."""
    m = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=32, preemption_mode="swap", num_cpu_blocks=8)
    system = list(range(100, 108))  # a shared 8-token system prompt: two full blocks
    rec = TraceRecorder(s)

    def step(token: int) -> None:
        out = s.schedule()
        s.update_from_output(out, {r: token for r in out.num_scheduled_tokens})

    a = Request("A", system + [1, 2], max_tokens=10)
    s.add_request(a)
    step(7)
    s.add_request(Request("B", system + [4, 5, 6, 7, 8], max_tokens=12))  # hits A's two full blocks
    step(7)
    s.fork(a, Request("C", list(a.all_token_ids), max_tokens=10))  # shares A's partly filled last block
    for i in range(30):
        if i == 2:
            s.add_request(Request("D", list(range(300, 315)), max_tokens=10))  # the pool runs out: a swap
        if not s.has_unfinished_requests():
            break
        step(9 + i)
    rec.detach()
    return rec


def concurrency_figure(path: Path) -> float:
    """Draw the figure; return paging's ratio at 40 GiB (the README quotes it)."""
    kv_per_token = 2 * 32 * 8 * 128 * 2  # Llama 3.1 8B, bf16: 128 KiB
    block_size, max_ctx = 16, 2048  # lesson 1, section 4
    block_bytes = kv_per_token * block_size
    # lesson 1's workload, exactly: ShareGPT-like lengths, median 300, clipped to max_ctx
    lens = sample_request_lengths(10_000, seed=0, median=300, sigma=0.9, max_len=max_ctx)
    gib = list(range(4, 101, 4))
    pools = [g * 2**30 // block_bytes for g in gib]
    contiguous = [contiguous_capacity(p, max_ctx, block_size) for p in pools]
    paged = [len(paged_admission(lens, p, block_size, "fcfs")) for p in pools]
    expected = blocks_needed(max_ctx, block_size) / (sum(blocks_needed(n, block_size) for n in lens) / len(lens))
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    ax.plot(gib, paged, marker=".", label=f"paged, blocks of {block_size} tokens")
    ax.plot(gib, contiguous, marker=".", label=f"contiguous, max_ctx {max_ctx:,} reserved")
    ax.set(xlabel="KV cache memory (GiB)", ylabel="sequences held at once",
           title="Llama 3.1 8B (bf16, 128 KiB of KV per token), lesson 1's ShareGPT-like requests")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    k = gib.index(40)
    ratio = paged[k] / contiguous[k]
    ax.annotate(f"{ratio:.1f}x at 40 GiB (expected {expected:.2f}x)", (40, paged[k]), xytext=(46, paged[k] * 0.62),
                arrowprops={"arrowstyle": "->"})  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    print(
        f"concurrency: paged/contiguous = {ratio:.2f}x at 40 GiB, "
        f"{min(p / c for p, c in zip(paged, contiguous, strict=True)):.2f}-"
        f"{max(p / c for p, c in zip(paged, contiguous, strict=True)):.2f}x over 4-100 GiB, expected {expected:.2f}x"
    )
    return ratio


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    w = BlockTableWidget.from_recorder(
        scheduler_run(), title="Four requests, 15 blocks: prefix hits, a fork with copy-on-write, a swap preemption"
    )
    (OUT / "filmstrip.svg").write_text(w.filmstrip_svg())
    concurrency_figure(OUT / "concurrency.png")
    print("key frames:", w.key_frames())
    print(f"wrote {OUT / 'filmstrip.svg'} and {OUT / 'concurrency.png'}")


if __name__ == "__main__":
    main()
