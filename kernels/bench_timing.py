"""The kernel benchmark's clocks and yardsticks: eager and CUDA-graph timers, the measured read roof, the
bytes and FLOPs a step must move, and the host cost per call (``python -m pagedkv.kernels.bench``)."""

from __future__ import annotations

import math
import statistics
import time
import timeit
from collections.abc import Callable

import torch


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


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return 1 << 40


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


