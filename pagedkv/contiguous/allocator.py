"""A contiguous KV-cache allocator, first fit: what each sequence's KV cache lived in before paging.

Before paging, each sequence's KV cache was one contiguous run of token slots, reserved when the sequence was
admitted and released when it finished. :class:`FirstFitAllocator` keeps the free runs (holes) as a sorted list
and gives each request the lowest-addressed hole that is large enough (first fit, the textbook policy of
``malloc`` and of OS memory managers); a freed run is merged with the holes beside it. Sequences finish in a
different order from the one they arrived in, so the holes multiply: :mod:`pagedkv.contiguous.replay` replays a
trace against this allocator to show the external fragmentation that follows.

There is no vLLM counterpart: vLLM never allocates KV contiguously; this is the problem PagedAttention
removed (the vLLM paper, section 2.3 and figure 3).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

from pagedkv.utils import check_int

__all__ = ["FirstFitAllocator", "Hole"]


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
