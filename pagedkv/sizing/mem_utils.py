"""Measuring device memory, as ``vllm/utils/mem_utils.py`` in vLLM 0.26 does: snapshots and the profiling
context that turns two of them into the figures of a profile run. Needs CUDA to measure; nothing here runs on a
CPU except :func:`format_gib`."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

__all__ = ["GiB", "MemoryProfilingResult", "MemorySnapshot", "format_gib", "memory_profiling"]

#: Bytes in a GiB (``vllm/utils/mem_constants.py::GiB_bytes``).
GiB = 1 << 30


def format_gib(b: int | float) -> str:
    """Bytes as GiB rounded to 2 places, exactly as vLLM 0.26 prints them (``vllm/utils/mem_utils.py::format_gib``)."""
    return f"{round(b / GiB, 2)}"


@dataclass
class MemorySnapshot:
    """Device memory at one moment, as ``vllm/utils/mem_utils.py::MemorySnapshot`` measures it: torch's peak
    allocated bytes, free and total from ``mem_get_info``, and what the process holds outside torch's pool
    (``non_torch = (total - free) - torch.cuda.memory_reserved()``, which also counts other processes)."""

    torch_peak: int = 0
    free_memory: int = 0
    total_memory: int = 0
    cuda_memory: int = 0
    torch_memory: int = 0
    non_torch_memory: int = 0
    timestamp: float = 0.0

    @classmethod
    def measure(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        cuda_memory = total - free
        torch_memory = torch.cuda.memory_reserved(device)
        return cls(
            torch_peak=torch.cuda.memory_stats(device).get("allocated_bytes.all.peak", 0),
            free_memory=free,
            total_memory=total,
            cuda_memory=cuda_memory,
            torch_memory=torch_memory,
            non_torch_memory=cuda_memory - torch_memory,
            timestamp=time.time(),
        )

    def __sub__(self, other: MemorySnapshot) -> MemorySnapshot:
        return MemorySnapshot(
            *(
                getattr(self, f) - getattr(other, f)
                for f in (
                    "torch_peak",
                    "free_memory",
                    "total_memory",
                    "cuda_memory",
                    "torch_memory",
                    "non_torch_memory",
                    "timestamp",
                )
            )
        )


@dataclass
class MemoryProfilingResult:
    """``vllm/utils/mem_utils.py::MemoryProfilingResult``: the figures of one profile run, in bytes."""

    baseline: MemorySnapshot
    weights_memory: int = 0
    torch_peak_increase: int = 0
    non_torch_increase: int = 0
    before_profile: MemorySnapshot | None = None
    after_profile: MemorySnapshot | None = None
    profile_time: float = 0.0

    @property
    def non_kv_cache_memory(self) -> int:
        return self.non_torch_increase + self.torch_peak_increase + self.weights_memory


@contextlib.contextmanager
def memory_profiling(
    baseline: MemorySnapshot, device: torch.device, weights_memory: int = 0
) -> Generator[MemoryProfilingResult, None, None]:
    """Measure the memory of the code run inside, as ``vllm/utils/mem_utils.py::memory_profiling`` does: reset
    torch's peak counter, snapshot, run, free the cache, snapshot again; the torch peak increase is the
    activations' peak, the non-torch increase since ``baseline`` is the CUDA context's growth (cuBLAS, NCCL,
    attention workspaces). Needs CUDA."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    result = MemoryProfilingResult(baseline=baseline, weights_memory=weights_memory)
    result.before_profile = MemorySnapshot.measure(device)
    yield result
    gc.collect()
    torch.cuda.empty_cache()
    result.after_profile = MemorySnapshot.measure(device)
    diff = result.after_profile - result.before_profile
    result.torch_peak_increase = diff.torch_peak
    result.non_torch_increase = (result.after_profile - baseline).non_torch_memory
    result.profile_time = diff.timestamp

