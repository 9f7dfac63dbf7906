"""The host-memory pool that preemption by swapping copies KV blocks into (vLLM V0; V1 only recomputes)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from pagedkv.utils import check_int

__all__ = ["CPUBlockPool"]


class CPUBlockPool:
    """The host-memory blocks that swapped-out KV waits in: ``num_blocks`` ids, all usable (no null block).

    A plain free list: swapping copies whole blocks, so nothing here is shared or cached.
    Mirrors the CPU side of vLLM V0's ``CpuGpuBlockAllocator`` (``vllm/core/block/cpu_gpu_block_allocator.py``).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = check_int(num_blocks, "num_cpu_blocks", 0)
        self.free_blocks: deque[int] = deque(range(self.num_blocks))

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free list. ``ValueError`` (no change) when fewer are free."""
        n = check_int(n, "n", 0)
        if n > len(self.free_blocks):
            raise ValueError(f"cannot take {n} CPU blocks: {len(self.free_blocks)} are free")
        return [self.free_blocks.popleft() for _ in range(n)]

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the tail of the free list. ``ValueError``, with nothing changed, unless every id is
        a block of this pool that is allocated now, given once (a block freed twice would be handed out twice)."""
        ids = list(block_ids)
        free = set(self.free_blocks)
        seen: set[int] = set()
        for b in ids:
            check_int(b, "a CPU block id", 0, self.num_blocks - 1, why="the blocks of this pool")
            if b in free:
                raise ValueError(f"CPU block {b} is not allocated: it is in the free list already")
            if b in seen:
                raise ValueError(f"CPU block {b} is given twice in {ids}: a block is freed once")
            seen.add(b)
        self.free_blocks.extend(int(b) for b in ids)
