"""The baseline paging replaced: every request reserves ``max_len`` contiguous token slots up front.

Before vLLM, serving systems (FasterTransformer, Orca) stored each sequence's KV in one contiguous region
sized for the longest possible sequence, because the attention kernel read it as one run and the output
length is unknown in advance. :class:`ContiguousKVCacheManager` reproduces that inside the same scheduler:
a request's first allocation reserves a contiguous run of ``ceil(max_len / block_size)`` blocks (first fit,
with :class:`pagedkv.contiguous.FirstFitAllocator`), and it never needs another. Same pool, same scheduler,
same workload: only the allocation rule differs, so any difference in concurrency, waste or throughput is
paging's doing.

There is no vLLM counterpart; this is the "Orca (Max)" baseline of the PagedAttention paper.
"""

from __future__ import annotations

from pagedkv.contiguous import FirstFitAllocator
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.kv_cache_utils import KVCacheBlock
from pagedkv.request import Request
from pagedkv.utils import cdiv, check_int


class ContiguousKVCacheManager(KVCacheManager):
    """A KV cache manager that reserves ``max_len`` slots per request, contiguously, at its first allocation.

    No prefix caching, no forks. ``allocate_slots`` returns the reserved run the first time (or ``None``
    when no hole of that size is left), then ``[]``; asking for a slot past ``max_len`` is a ``ValueError``.
    """

    def __init__(self, num_blocks: int, block_size: int, max_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        if max_len <= 0:
            raise ValueError(f"max_len must be > 0, got {max_len}")
        self.max_len = max_len
        self.blocks_per_request = cdiv(max_len, block_size)
        if self.blocks_per_request > num_blocks - 1:
            raise ValueError(f"max_len={max_len} needs {self.blocks_per_request} blocks; the pool has {num_blocks - 1}")
        # Holes over the usable blocks 1..num_blocks-1 (block 0 is the null block): index i is block i + 1.
        self.allocator = FirstFitAllocator(num_blocks - 1)

    @property
    def max_num_requests(self) -> int:
        """How many reservations fit in the pool: the concurrency ceiling."""
        return (self.num_gpu_blocks - 1) // self.blocks_per_request

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Reserve the request's ``max_len`` run at its first allocation; ``[]`` afterwards. The reservation
        covers the longest sequence, so vLLM 0.26's full-sequence gate (``full_sequence_must_fit``) always
        holds once it is made and changes nothing here."""
        if new_computed_blocks:
            raise ValueError("the contiguous baseline has no prefix cache")
        num_new_tokens = check_int(num_new_tokens, "num_new_tokens", 0)
        rid = request.request_id
        need = request.num_computed_tokens + num_new_tokens
        if need > self.max_len:
            raise ValueError(f"request {rid!r} needs {need} slots, past its reservation of max_len={self.max_len}")
        if self.req_to_blocks.get(rid):
            return []
        start = self.allocator.allocate(rid, self.blocks_per_request)
        if start is None:
            return None
        blocks = [self.block_pool.blocks[1 + start + i] for i in range(self.blocks_per_request)]
        self.block_pool.touch(blocks)  # out of the free queue, ref_cnt 1
        self.req_to_blocks[rid] = blocks
        self.req_num_tokens[rid] = self.blocks_per_request * self.block_size
        if self.trace is not None:
            ids = [b.block_id for b in blocks]
            caption = f"{rid} reserves blocks {ids[0]}..{ids[-1]} (max_len {self.max_len})"
            self.trace.record("allocate", rid, ids, caption)
        return blocks

    def free(self, request: Request) -> None:
        super().free(request)
        if request.request_id in self.allocator.allocations:
            self.allocator.free(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        raise ValueError("the contiguous baseline does not share blocks between requests")
