"""One KV cache group's block tables: full attention keeps every block, sliding window releases old ones.

A hybrid model has several KV cache groups (``pagedkv.kv_cache_interface``), each with its own table per
request, all drawing blocks from one ``BlockPool``. Each group has a manager of its attention type; they
differ in three rules:

- which tokens a layer still needs (``get_num_skipped_tokens``): none are skipped under full attention; a
  sliding-window layer skips everything before ``num_computed_tokens - sliding_window + 1``;
- what is done with blocks that are no longer needed (``remove_skipped_blocks``): freed, and replaced in the
  table by the null block (block 0), so that a table's positions still line up with token positions;
- what counts as a prefix-cache hit (``find_longest_cache_hit``): full attention needs every block of the
  prefix, left to right; a sliding-window layer needs only the last ``cdiv(sliding_window - 1, block_size)``
  blocks before the hit's end, found right to left.

Mirrors ``vllm/v1/core/single_type_kv_cache_manager.py`` (``SingleTypeKVCacheManager``,
``FullAttentionManager``, ``SlidingWindowManager``, ``get_manager_for_kv_cache_spec``). Lab differences:
every group has the same block size (vLLM 0.26 also allows multiples of a ``hash_block_size``); no EAGLE,
context parallelism, KV connectors, partial-block hits or sparse retention; fork with copy-on-write is
the lab's extension (see ``KVCacheManager.fork``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from pagedkv.kv_cache_utils import BlockHash, KVCacheBlock
from pagedkv.request import Request
from pagedkv.utils import cdiv


def blocks_written(
    blocks: Sequence[KVCacheBlock], num_computed_tokens: int, num_new_tokens: int, block_size: int
) -> list[int]:
    """Indices of the table's blocks that the next ``num_new_tokens`` tokens land in while another request
    shares them (``ref_cnt > 1``): each needs a private copy first (copy-on-write, the lab's fork)."""
    if num_new_tokens <= 0 or not blocks:
        return []
    first = num_computed_tokens // block_size
    last = min(len(blocks), cdiv(num_computed_tokens + num_new_tokens, block_size))
    return [i for i in range(first, last) if blocks[i].ref_cnt > 1]


class SingleTypeKVCacheManager(ABC):
    """The block tables of one KV cache group (``kv_cache_group_id``), whose layers share ``kv_cache_spec``.

    ``req_to_blocks[request_id]`` is the request's table in this group (position ``i`` holds tokens
    ``i·block_size ..``; the null block where the group no longer needs them); ``num_cached_block`` counts
    each running request's leading entries already offered to the prefix cache. Mirrors
    ``SingleTypeKVCacheManager``.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self._max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []

    @property
    def _null_block(self) -> KVCacheBlock:
        return self.block_pool.null_block

    # --- how many blocks ----------------------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks this group needs for the request's table to cover ``num_tokens`` tokens: fresh blocks
        beyond what it holds and its hits (skipped, out-of-window positions need none: they get the null
        block), plus its hits that sit in the free queue (touching them takes them out). With
        ``apply_admission_cap`` (the full-sequence admission gate) a sliding-window group counts at most
        ``max_admission_blocks_per_request``, the most it ever holds at once. Changes nothing. Mirrors
        ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``."""
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self._max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self._max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # A running request has no new hits.
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0)
        # The first skipped hits become null blocks (not touched); the rest count if they are free.
        num_skipped_new_computed = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(
            1 for b in new_computed_blocks[num_skipped_new_computed:] if b.ref_cnt == 0 and not b.is_null
        )
        return num_new_blocks + num_evictable

    # --- allocation ---------------------------------------------------------------------------------
    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
    ) -> None:
        """Put a new request's prefix-cache hits at the start of its table: positions already out of this
        group's window become the null block (their hits are not touched), the rest are touched
        (``ref_cnt + 1``, out of the free queue). All of them count as cached. Mirrors
        ``SingleTypeKVCacheManager.add_local_computed_blocks``."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, f"request {request_id!r} already holds blocks in group {self.kv_cache_group_id}"
        num_skipped_blocks = self.get_num_skipped_tokens(num_local_computed_tokens) // self.block_size
        kept = list(new_computed_blocks[num_skipped_blocks:])
        if self.enable_caching:
            self.block_pool.touch([b for b in kept if not b.is_null])
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(kept)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Pop fresh blocks until the table covers ``num_tokens`` tokens; return them (table order). Mirrors
        ``SingleTypeKVCacheManager.allocate_new_blocks``."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks that are full once ``num_tokens`` tokens are computed in the prefix
        cache, under this group's id (null entries skipped). ``request.block_hashes`` must cover them.
        Mirrors ``SingleTypeKVCacheManager.cache_blocks``."""
        rid = request.request_id
        num_cached_blocks = self.num_cached_block.get(rid, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        if self._caches_blocks():
            self.block_pool.cache_full_blocks(
                request,
                self.req_to_blocks[rid],
                num_cached_blocks,
                num_full_blocks,
                kv_cache_group_id=self.kv_cache_group_id,
            )
        self.num_cached_block[rid] = num_full_blocks

    def _caches_blocks(self) -> bool:
        return True

    # --- freeing ------------------------------------------------------------------------------------
    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request's table here and return it (allocation order; nulls included). Mirrors
        ``SingleTypeKVCacheManager.pop_blocks_for_free``."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release the request's blocks in this group, last first (its deepest prefix is evicted before a
        shared root). Mirrors ``SingleTypeKVCacheManager.free``."""
        blocks = self.pop_blocks_for_free(request_id)
        self.block_pool.free_blocks([b for b in reversed(blocks) if not b.is_null])

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        """Free the blocks no longer needed once ``processed_computed_tokens`` tokens are processed, and put
        the null block in their place (the table keeps its length, so positions still match tokens). Freed
        from the newest back to the first that is already null; they keep their hashes, so a later request
        can still hit them while they sit in the free queue. A no-op for full attention. Mirrors
        ``SingleTypeKVCacheManager.remove_skipped_blocks``."""
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped_blocks = min(num_skipped_tokens // self.block_size, len(blocks))
        freed: list[KVCacheBlock] = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens at the start that the next token's attention no longer reads (0: full attention). Mirrors
        ``SingleTypeKVCacheManager.get_num_skipped_tokens``."""
        return 0

    # --- forks (lab extension) ----------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's table in this group, sharing every real block (``ref_cnt + 1``)."""
        blocks = self.req_to_blocks[parent_id]
        self.block_pool.touch([b for b in blocks if not b.is_null])
        self.req_to_blocks[child_id] = list(blocks)
        self.num_cached_block[child_id] = self.num_cached_block.get(parent_id, 0)

    def get_num_cow_blocks(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Shared blocks the next ``num_new_tokens`` tokens would write into (each needs a private copy)."""
        return len(
            blocks_written(self.req_to_blocks.get(request_id, ()), num_computed_tokens, num_new_tokens, self.block_size)
        )

    def copy_on_write(self, request_id: str, num_computed_tokens: int, num_new_tokens: int) -> list[KVCacheBlock]:
        """Replace each shared block the next tokens land in by a fresh one, recording ``(src, dst)`` in
        ``pending_copies`` when it holds computed KV; return the fresh blocks."""
        table = self.req_to_blocks[request_id]
        fresh: list[KVCacheBlock] = []
        for i in blocks_written(table, num_computed_tokens, num_new_tokens, self.block_size):
            src = table[i]
            (dst,) = self.block_pool.get_new_blocks(1)
            table[i] = dst
            self.block_pool.free_blocks([src])  # ref_cnt > 1: the other sharers keep it
            fresh.append(dst)
            if i < self.num_cached_block.get(request_id, 0):
                self.num_cached_block[request_id] = i
            if i * self.block_size < num_computed_tokens:
                self.pending_copies.append((src.block_id, dst.block_id))
        return fresh

    # --- prefix cache -------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix of at most ``max_length`` tokens that every group in ``kv_cache_group_ids``
        (all of this spec) can take from the cache: one list per group (null blocks where a group needs
        nothing) and the hit length in tokens. Changes nothing. Mirrors
        ``SingleTypeKVCacheManager.find_longest_cache_hit``."""

    @abstractmethod
    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks every request holding blocks shares (cascade attention). Mirrors
        ``SingleTypeKVCacheManager.get_num_common_prefix_blocks``."""


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block is kept until the request finishes; a hit is the longest run of cached
    blocks from the start, left to right. Mirrors ``FullAttentionManager``."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Left to right: the first missing block ends the hit (hashes chain, so every later block misses
        too). Mirrors ``FullAttentionManager.find_longest_cache_hit``."""
        block_size = kv_cache_spec.block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in block_hashes[: max(0, max_length) // block_size]:
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if not cached:
                break
            for blocks, block in zip(computed, cached, strict=True):
                blocks.append(block)
        return computed, len(computed[0]) * block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        n = 0
        for block in self.req_to_blocks[running_request_id]:
            if block.ref_cnt != len(self.req_to_blocks):
                break
            n += 1
        return n


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: token ``t`` reads only tokens ``t - sliding_window + 1 .. t``.

    Blocks wholly before the next token's window are released as the request advances
    (``remove_skipped_blocks``; the table keeps the null block there), so a request holds at most
    ``cdiv(sliding_window - 1 + tokens in flight, block_size) + 1`` blocks. A prefix hit needs only the
    ``cdiv(sliding_window - 1, block_size)`` blocks before its end: found right to left. Mirrors
    ``SlidingWindowManager``.
    """

    def __init__(self, kv_cache_spec: SlidingWindowSpec, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    @staticmethod
    def num_contiguous_blocks_for_hit(sliding_window: int, block_size: int) -> int:
        """Cached blocks a hit must end with: ``cdiv(sliding_window - 1, block_size)`` (the next token reads
        the ``sliding_window - 1`` before it). Mirrors ``SlidingWindowManager._contiguous_blocks_for_hit``."""
        return cdiv(sliding_window - 1, block_size)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """From the right end of the allowed prefix leftwards, the first run of
        ``num_contiguous_blocks_for_hit`` cached blocks ends the hit; everything before the run is the null
        block. A shorter run counts only if it reaches the very first block. E.g. block size 4, window 8
        (2 blocks needed), blocks 3 and 4 cached: ``[null, null, b3, b4]``, 16 tokens. Mirrors
        ``SlidingWindowManager.find_longest_cache_hit``."""
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        need = cls.num_contiguous_blocks_for_hit(kv_cache_spec.sliding_window, block_size)
        max_num_blocks = max(0, max_length) // block_size
        null = block_pool.null_block
        computed: tuple[list[KVCacheBlock], ...] = tuple([null] * max_num_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached:
                for blocks, block in zip(computed, cached, strict=True):
                    blocks[i] = block
                run += 1
                if run >= need:
                    for blocks in computed:
                        del blocks[i + run :]
                    found = True
                    break
            else:
                run = 0
        if not found:
            for blocks in computed:
                del blocks[run:]  # the run that reaches block 0 (possibly empty)
        return computed, len(computed[0]) * block_size

    def _caches_blocks(self) -> bool:
        # vLLM's reachable_block_mask: with a 1-token window no block is ever needed for a hit.
        return self.num_contiguous_blocks_for_hit(self.sliding_window, self.block_size) > 0

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """``max(0, num_computed_tokens - sliding_window + 1)``: with window 4 and 7 tokens computed, the
        next token (position 7) reads positions 4..7, so 4 tokens are skipped. Mirrors
        ``SlidingWindowManager.get_num_skipped_tokens``."""
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """0: the shared prefix of sliding-window tables is null blocks (vLLM does the same)."""
        return 0


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    block_pool: BlockPool,
    enable_caching: bool,
    kv_cache_group_id: int,
    max_model_len: int,
    max_in_flight_tokens: int,
) -> SingleTypeKVCacheManager:
    """The manager for a group's spec: ``FullAttentionSpec`` → ``FullAttentionManager``,
    ``SlidingWindowSpec`` → ``SlidingWindowManager`` (with its admission cap from
    ``max_admission_blocks_per_request``). ``ValueError`` for any other spec. Mirrors
    ``get_manager_for_kv_cache_spec``."""
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        cap = kv_cache_spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        return SlidingWindowManager(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id, cap)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
    raise ValueError(
        f"no KV cache manager for {type(kv_cache_spec).__name__}: use FullAttentionSpec or SlidingWindowSpec"
    )
