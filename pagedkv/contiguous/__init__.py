"""Contiguous KV allocation, the problem paging removed (lesson 1): the first-fit allocator
(:mod:`pagedkv.contiguous.allocator`) and a replay of requests over time against it and against paging
(:mod:`pagedkv.contiguous.replay`). Re-exported here, where lesson 1 and :mod:`pagedkv.sim.baseline` import them.
No vLLM counterpart: vLLM never allocates KV contiguously."""

from pagedkv.contiguous.allocator import FirstFitAllocator, Hole
from pagedkv.contiguous.replay import (
    AllocationEvent,
    TraceRequest,
    make_trace,
    simulate_first_fit,
    simulate_paged,
)

__all__ = [
    "AllocationEvent",
    "FirstFitAllocator",
    "Hole",
    "TraceRequest",
    "make_trace",
    "simulate_first_fit",
    "simulate_paged",
]
