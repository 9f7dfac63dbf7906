"""Draw the README's two pictures into docs/img/ (deterministic; run again after changing the widget or the core).

    .venv/bin/python tools/readme_figures.py

- ``filmstrip.svg``: the block-table widget's static picture (its key frames) for a small scheduler run with a
  shared system prompt (prefix hits), a fork that copies on write, and a swap preemption.
- ``concurrency.png``: how many sequences fit in a KV pool at once, contiguous ``max_len`` reservation
  against paging, for Llama 3.1 8B's per-token KV size (lessons 0 and 1).
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
from pagedkv.fragmentation import contiguous_capacity, paged_admission, sample_request_lengths  # noqa: E402
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


def concurrency_figure(path: Path) -> None:
    kv_per_token = 2 * 32 * 8 * 128 * 2  # Llama 3.1 8B, bf16: 128 KiB
    block_size, max_len = 16, 4096
    block_bytes = kv_per_token * block_size
    lens = sample_request_lengths(5000, seed=0, max_len=max_len)  # ShareGPT-like, median 300 tokens
    gib = list(range(4, 101, 4))
    pools = [g * 2**30 // block_bytes for g in gib]
    contiguous = [contiguous_capacity(p, max_len, block_size) for p in pools]
    paged = [len(paged_admission(lens, p, block_size, "fcfs")) for p in pools]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    ax.plot(gib, paged, marker=".", label=f"paged, blocks of {block_size} tokens")
    ax.plot(gib, contiguous, marker=".", label=f"contiguous, max_len {max_len:,} reserved")
    ax.set(xlabel="KV cache memory (GiB)", ylabel="sequences held at once",
           title="Llama 3.1 8B (bf16, 128 KiB of KV per token), ShareGPT-like requests")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    k = gib.index(40)
    ax.annotate(f"{paged[k] / contiguous[k]:.0f}x at 40 GiB", (40, paged[k]), xytext=(52, paged[k] * 0.55),
                arrowprops={"arrowstyle": "->"})  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


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
