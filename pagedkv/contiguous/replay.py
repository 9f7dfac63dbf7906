"""A replay of requests over time against a contiguous allocator and against paging: external fragmentation.

A request can be refused although the free slots add up to more than it needs: no single hole of the
contiguous allocator (:class:`pagedkv.contiguous.allocator.FirstFitAllocator`) is large enough. That is
external fragmentation. :func:`make_trace` draws a seeded trace of requests (arrival, duration, size);
:func:`simulate_first_fit` replays it against the first-fit allocator and records, for every arrival, whether
it was admitted and why not; :func:`simulate_paged` replays the same trace with paging's rule (a request fits
when enough blocks are free, wherever they are), for contrast.

There is no vLLM counterpart (vLLM never allocates KV contiguously; the vLLM paper, section 2.3 and figure 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.contiguous.allocator import FirstFitAllocator
from pagedkv.fragmentation import blocks_needed

__all__ = ["AllocationEvent", "TraceRequest", "make_trace", "simulate_first_fit", "simulate_paged"]


@dataclass(frozen=True)
class TraceRequest:
    """A request in a replayed trace: it arrives at ``arrival``, holds ``size`` slots for ``duration`` steps."""

    request_id: int
    arrival: int
    duration: int
    size: int


@dataclass(frozen=True)
class AllocationEvent:
    """What happened when a request arrived."""

    time: int
    request_id: int
    size: int  # slots asked for
    admitted: bool
    free_before: int  # free slots when it arrived, in total
    largest_hole: int  # the largest run it could have had (for paging: all free slots)
    live: int  # sequences holding memory after this event

    @property
    def external_fragmentation(self) -> bool:
        """Refused although enough memory was free in total."""
        return not self.admitted and self.size <= self.free_before


def make_trace(
    n: int, *, seed: int = 0, mean_gap: float = 1.0, mean_duration: float = 40.0,
    sizes: Sequence[int] | None = None, median: float = 300.0, sigma: float = 0.9, max_size: int = 2048,
) -> list[TraceRequest]:
    """``n`` requests, seeded: Poisson arrivals (mean gap ``mean_gap`` steps), durations geometric-like
    (exponential, mean ``mean_duration``, at least 1), sizes from ``sizes`` or a lognormal like
    :func:`pagedkv.fragmentation.sample_request_lengths`."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(mean_gap, size=n)
    arrivals = np.floor(np.cumsum(gaps)).astype(int)
    durations = np.maximum(1, np.rint(rng.exponential(mean_duration, size=n))).astype(int)
    if sizes is None:
        draw = rng.lognormal(float(np.log(median)), sigma, size=n)
        size_list = [int(x) for x in np.clip(np.rint(draw), 1, max_size)]
    else:
        if len(sizes) != n:
            raise ValueError(f"sizes has {len(sizes)} entries, expected n={n}")
        size_list = [int(s) for s in sizes]
    return [
        TraceRequest(i, int(arrivals[i]), int(durations[i]), size_list[i]) for i in range(n)
    ]


def _replay(trace, try_admit, release, free_now, largest_now) -> list[AllocationEvent]:
    """Replay ``trace`` in time order: at each step, departures first, then arrivals in request order.
    A refused request is dropped (a real engine would queue it; here what matters is why it was refused)."""
    events: list[AllocationEvent] = []
    live: dict[int, int] = {}  # request_id -> departure time
    for req in sorted(trace, key=lambda r: (r.arrival, r.request_id)):
        for rid, end in sorted(live.items(), key=lambda kv: (kv[1], kv[0])):
            if end <= req.arrival:
                release(rid)
                del live[rid]
        free_before, largest = free_now(), largest_now()
        ok = try_admit(req)
        if ok:
            live[req.request_id] = req.arrival + req.duration
        events.append(
            AllocationEvent(req.arrival, req.request_id, req.size, ok, free_before, largest, len(live))
        )
    return events


def simulate_first_fit(trace: Sequence[TraceRequest], num_slots: int) -> list[AllocationEvent]:
    """Replay ``trace`` against a :class:`FirstFitAllocator` of ``num_slots`` slots; one event per request."""
    alloc = FirstFitAllocator(num_slots)
    return _replay(
        trace,
        lambda r: alloc.allocate(r.request_id, r.size) is not None,
        alloc.free,
        lambda: alloc.num_free_slots,
        lambda: alloc.largest_hole,
    )


def simulate_paged(trace: Sequence[TraceRequest], num_blocks: int, block_size: int) -> list[AllocationEvent]:
    """Replay ``trace`` with paging: a request takes ``blocks_needed(size, block_size)`` blocks from anywhere
    in the pool, so it is refused only when too few blocks are free in total. Sizes in the events are slots,
    as in :func:`simulate_first_fit`; free counts are whole free blocks times ``block_size``."""
    free = [int(num_blocks)]
    held: dict[int, int] = {}

    def admit(r: TraceRequest) -> bool:
        need = blocks_needed(r.size, block_size)
        if need > free[0]:
            return False
        free[0] -= need
        held[r.request_id] = need
        return True

    def release(rid: int) -> None:
        free[0] += held.pop(rid)

    return _replay(trace, admit, release, lambda: free[0] * block_size, lambda: free[0] * block_size)
