"""A contiguous KV-cache allocator (first fit) and a replay of requests over time: external fragmentation.

Before paging, each sequence's KV cache was one contiguous run of token slots, reserved when the sequence was
admitted and released when it finished. Sequences finish in a different order from the one they arrived in,
so the free memory breaks into holes between live sequences. A request can then be refused although the
free slots add up to more than it needs: no single hole is large enough. That is external fragmentation,
and it is what this module shows, step by step.

:class:`FirstFitAllocator` keeps the holes as a sorted list and gives each request the lowest-addressed hole
that is large enough (first fit, the textbook policy of ``malloc`` and of OS memory managers).
:func:`simulate_first_fit` replays a trace of requests (arrival, duration, size) against it and records, for
every arrival, whether it was admitted and why not. :func:`simulate_paged` replays the same trace with
paging's rule (a request fits when enough blocks are free, wherever they are), for contrast.

There is no vLLM counterpart: vLLM never allocates KV contiguously; this is the problem PagedAttention
removed (the vLLM paper, section 2.3 and figure 3).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.fragmentation import blocks_needed
from pagedkv.utils import check_int

__all__ = [
    "AllocationEvent",
    "FirstFitAllocator",
    "Hole",
    "TraceRequest",
    "make_trace",
    "simulate_first_fit",
    "simulate_paged",
]


@dataclass(frozen=True)
class Hole:
    """A run of free slots ``[start, start + size)``."""

    start: int
    size: int


class FirstFitAllocator:
    """Contiguous runs of slots out of ``num_slots``, first fit.

    Invariants (checked by :meth:`check_invariants`): holes are sorted, never empty, never touch one another
    (neighbours are merged on free), never overlap an allocation; free + allocated slots == ``num_slots``.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_int(num_slots, "num_slots", 0)
        self._holes: list[Hole] = [Hole(0, self.num_slots)] if self.num_slots else []
        self.allocations: dict[Hashable, Hole] = {}  # seq_id -> its run of slots

    # -- queries -------------------------------------------------------------------------------------------
    def holes(self) -> list[Hole]:
        """The free runs, lowest address first (a copy)."""
        return list(self._holes)

    @property
    def num_free_slots(self) -> int:
        return sum(h.size for h in self._holes)

    @property
    def largest_hole(self) -> int:
        """The largest request that could be served now."""
        return max((h.size for h in self._holes), default=0)

    # -- changes -------------------------------------------------------------------------------------------
    def allocate(self, seq_id: Hashable, size: int) -> int | None:
        """Give ``seq_id`` the first hole of at least ``size`` slots; return its start, or None (no change)
        when no single hole is large enough, even if the free slots add up to ``size`` or more.

        The chosen hole shrinks from its low end; an exactly filled hole disappears.
        """
        if seq_id in self.allocations:
            raise ValueError(f"{seq_id!r} already holds slots {self.allocations[seq_id]}")
        size = check_int(size, "size", 1)
        for i, hole in enumerate(self._holes):
            if hole.size >= size:
                if hole.size == size:
                    del self._holes[i]
                else:
                    self._holes[i] = Hole(hole.start + size, hole.size - size)
                self.allocations[seq_id] = Hole(hole.start, int(size))
                return hole.start
        return None

    def free(self, seq_id: Hashable) -> None:
        """Return ``seq_id``'s run to the free list, merged with the holes on either side."""
        if seq_id not in self.allocations:
            raise ValueError(f"{seq_id!r} holds no slots")
        run = self.allocations.pop(seq_id)
        starts = [h.start for h in self._holes]
        i = bisect.bisect_left(starts, run.start)
        start, size = run.start, run.size
        if i < len(self._holes) and self._holes[i].start == start + size:  # merge with the hole after
            size += self._holes.pop(i).size
        if i > 0 and self._holes[i - 1].start + self._holes[i - 1].size == start:  # and the one before
            prev = self._holes.pop(i - 1)
            start, size, i = prev.start, prev.size + size, i - 1
        self._holes.insert(i, Hole(start, size))

    def check_invariants(self) -> None:
        used = sorted(self.allocations.values(), key=lambda h: h.start)
        runs = sorted([(h.start, h.size, "hole") for h in self._holes] + [(h.start, h.size, "seq") for h in used])
        pos = 0
        for k, (start, size, kind) in enumerate(runs):
            assert size > 0, f"empty {kind} at {start}"
            assert start == pos, f"gap or overlap at {pos}: next run starts at {start}"
            if kind == "hole" and k > 0:
                assert runs[k - 1][2] != "hole", f"two touching holes at {start}"
            pos = start + size
        assert pos == self.num_slots, f"runs cover {pos} of {self.num_slots} slots"


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
