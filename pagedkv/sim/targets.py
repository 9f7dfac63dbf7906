"""Lesson 4's targets, measured: ``python -m pagedkv.sim.targets`` prints them as a table.

One ShareGPT-shaped workload is served twice on the simulator, at equal KV memory (the pool vLLM's
profiling formula gives Llama-2-7B on an H100-80GB): once with paging, once with each request reserving
``max_len`` contiguous slots up front. The targets, from the PagedAttention paper and the source card:

- KV memory waste under 4 % with paging, against 60–80 % for max-length reservation;
- at least 3x the concurrency at equal memory.

Concurrency is the number of running requests averaged over the time requests were queued (the ceiling the
memory imposes); waste is held-but-empty token slots over held slots, averaged over simulated time.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.scheduler import Scheduler
from pagedkv.sim.baseline import ContiguousKVCacheManager
from pagedkv.sim.cost import CostModel
from pagedkv.sim.engine import SimResult, run_to_completion
from pagedkv.sim.workload import WorkloadSpec, clone_requests, make_requests

PAGED_WASTE_MAX = 4.0
RESERVED_WASTE_RANGE = (60.0, 80.0)
MIN_CONCURRENCY_RATIO = 3.0


@dataclass
class TargetReport:
    num_requests: int
    num_blocks: int
    block_size: int
    max_len: int
    kv_gb: float
    paged: SimResult
    reserved: SimResult
    wall_s: float

    @property
    def concurrency_ratio(self) -> float:
        return self.paged.saturated_concurrency / self.reserved.saturated_concurrency

    @property
    def throughput_ratio(self) -> float:
        """End to end, the drain of the last long requests included."""
        return self.paged.tokens_per_s / self.reserved.tokens_per_s

    @property
    def steady_throughput_ratio(self) -> float:
        """While requests were queued (the server always had work)."""
        return self.paged.saturated_tokens_per_s / self.reserved.saturated_tokens_per_s

    def checks(self) -> dict[str, bool]:
        lo, hi = RESERVED_WASTE_RANGE
        return {
            "paging waste < 4 %": self.paged.waste_percent < PAGED_WASTE_MAX,
            "reservation waste in 60-80 %": lo <= self.reserved.waste_percent <= hi,
            "concurrency >= 3x": self.concurrency_ratio >= MIN_CONCURRENCY_RATIO,
            "same outputs": self.paged.outputs == self.reserved.outputs,
        }

    @property
    def ok(self) -> bool:
        return all(self.checks().values())


def measure(
    num_requests: int = 1000,
    *,
    seed: int = 0,
    block_size: int = 16,
    max_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    cost_model: CostModel | None = None,
    progress: bool = False,
) -> TargetReport:
    """Serve one workload with paging and with max-length reservation at equal KV memory."""
    t0 = time.perf_counter()
    cm = cost_model or CostModel(block_size=block_size)
    num_blocks = cm.num_gpu_blocks()
    requests = make_requests(WorkloadSpec(num_requests=num_requests, max_len=max_len, seed=seed))
    paged = run_to_completion(
        Scheduler(KVCacheManager(num_blocks, block_size, enable_caching=False), max_num_seqs, max_num_batched_tokens),
        clone_requests(requests),
        cost_model=cm,
        progress=progress,
    )
    reserved = run_to_completion(
        Scheduler(ContiguousKVCacheManager(num_blocks, block_size, max_len), max_num_seqs, max_num_batched_tokens),
        clone_requests(requests),
        cost_model=cm,
        progress=progress,
    )
    return TargetReport(
        num_requests=num_requests,
        num_blocks=num_blocks,
        block_size=block_size,
        max_len=max_len,
        kv_gb=num_blocks * cm.kv_bytes_per_block / 1e9,
        paged=paged,
        reserved=reserved,
        wall_s=time.perf_counter() - t0,
    )


def format_table(report: TargetReport) -> str:
    r, p = report.reserved, report.paged
    lo, hi = RESERVED_WASTE_RANGE
    rows = [
        ("KV memory waste (%)", f"{r.waste_percent:.1f}", f"{p.waste_percent:.1f}", f"paging < {PAGED_WASTE_MAX:g}; "
         f"reservation {lo:g}-{hi:g}"),
        ("concurrency (queued-time mean)", f"{r.saturated_concurrency:.1f}", f"{p.saturated_concurrency:.1f}",
         f">= {MIN_CONCURRENCY_RATIO:g}x: {report.concurrency_ratio:.2f}x"),
        ("max concurrency", f"{r.max_concurrency}", f"{p.max_concurrency}", ""),
        ("batch size (queued-time mean)", f"{r.saturated_batch_size:.1f}", f"{p.saturated_batch_size:.1f}", ""),
        ("throughput, queued-time (gen tok/s)", f"{r.saturated_tokens_per_s:.0f}", f"{p.saturated_tokens_per_s:.0f}",
         f"{report.steady_throughput_ratio:.2f}x"),
        ("throughput, end to end (gen tok/s)", f"{r.tokens_per_s:.0f}", f"{p.tokens_per_s:.0f}",
         f"{report.throughput_ratio:.2f}x"),
        ("simulated time (s)", f"{r.sim_time_s:.1f}", f"{p.sim_time_s:.1f}", ""),
        ("steps", f"{r.num_steps}", f"{p.num_steps}", ""),
        ("preemptions", f"{r.num_preemptions}", f"{p.num_preemptions}", ""),
    ]
    w0 = max(len(x[0]) for x in rows)
    head = f"{'metric':<{w0}}  {'max-length reservation':>22}  {'paging':>10}  target"
    lines = [
        "Lesson 4 targets: Llama-2-7B on an H100-SXM-80GB (cost model), "
        f"{report.num_requests} ShareGPT-shaped requests",
        f"equal KV memory: {report.num_blocks} blocks x {report.block_size} tokens = {report.kv_gb:.1f} GB; "
        f"max_len {report.max_len}",
        "",
        head,
        "-" * len(head),
    ]
    lines += [f"{a:<{w0}}  {b:>22}  {c:>10}  {d}".rstrip() for a, b, c, d in rows]
    lines.append("")
    for name, ok in report.checks().items():
        lines.append(f"[{'PASS' if ok else 'FAIL'}] {name}")
    lines.append(f"(wall time {report.wall_s:.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv bench scheduling", description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--progress", action="store_true", help="show tqdm bars")
    args = parser.parse_args(argv)
    report = measure(args.num_requests, seed=args.seed, max_num_seqs=args.max_num_seqs, progress=args.progress)
    print(format_table(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
