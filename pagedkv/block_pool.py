"""The BlockPool: every KV cache block, the free queue, and the prefix cache's hash map.

Mirrors ``vllm/v1/core/block_pool.py`` (``BlockPool``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, overload

from pagedkv.kv_cache_utils import (
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    builtin_hash,
    generate_block_hash_extra_keys,
    make_block_hash_with_group_id,
    update_block_hashes,
)
from pagedkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.utils import check_int

if TYPE_CHECKING:
    from pagedkv.request import Request


class BlockTableIndexError(IndexError, ValueError):
    """``cache_full_blocks`` asked for blocks past the end of the table it was given (catch it as IndexError,
    what indexing the table would raise, or ValueError, the lab's error for a bad argument)."""


class BlockPool:
    """All ``num_blocks`` physical blocks of the KV cache, by id.

    Block 0 is the null block: a placeholder that is never handed out (vLLM uses it for skipped
    sliding-window blocks), so ``num_blocks - 1`` blocks are usable. Every usable block is either in the
    free queue with ``ref_cnt == 0`` or held by ``ref_cnt`` requests. A free block may still hold a cached
    prefix (its ``block_hash`` is set and it is in ``cached_block_hash_to_block``): it stays reusable by a
    cache hit until it is popped for a new allocation, and only then is it evicted.

    With ``enable_kv_cache_events`` the pool records what enters and leaves the prefix cache
    (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``pagedkv.kv_events``) in ``kv_event_queue``,
    drained by ``take_events()``, as vLLM 0.26's ``BlockPool`` does.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False) -> None:
        num_blocks = check_int(num_blocks, "num_blocks", 1, why="block 0 is the null block")
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}. Usually one block per hash; two requests that computed the same
        # prefix at the same time each hold a full block with that hash, and both are kept.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.num_evictions = 0
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    # --- prefix cache lookups -----------------------------------------------------------------------
    @overload
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None: ...

    @overload
    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None: ...

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int] | None = None
    ) -> KVCacheBlock | list[KVCacheBlock] | None:
        """The block holding the prefix with this hash, or ``None``. Changes nothing (a hit is only taken
        by ``touch``). Mirrors ``BlockPool.get_cached_block``.

        With ``kv_cache_group_ids`` (hybrid models: each group caches its own blocks of a prefix), one block
        per group in that order, or ``None`` when any group misses, as vLLM 0.26 answers; without, the block
        of group 0 (the lessons' single-group form)."""
        if kv_cache_group_ids is None:
            return self._get_one_block(block_hash)
        found = []
        for group_id in kv_cache_group_ids:
            block = self._get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            found.append(block)
        return found

    def _get_one_block(self, key: Any) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(key)
        if not blocks:
            return None
        return next(iter(blocks.values()))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int | None = None,
        hash_fn: Callable[[Any], BlockHash] = builtin_hash,
        kv_cache_group_id: int = 0,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        Each newly full block takes its hash from ``request.block_hashes`` (the chain over the request's
        tokens), so a later request with the same prefix finds it. Only full blocks are cached: a partly
        filled block's KV is not final. The KV cache manager keeps ``request.block_hashes`` up to date; a
        caller that does not may pass ``block_size`` (and ``hash_fn``) to have the missing hashes computed.
        Null blocks (a sliding-window table's released entries) are skipped. ``kv_cache_group_id`` keys the
        entry by group (``make_block_hash_with_group_id``): in a hybrid model each group caches its own block
        of a prefix. With events enabled, one ``BlockStored`` names the blocks cached. Mirrors
        ``BlockPool.cache_full_blocks``.
        """
        # checked before anything changes: a negative start would index the table from its end and cache its
        # last block under another position's hash, and a table shorter than num_full_blocks would fail midway
        # (vLLM slices, blocks[num_cached_blocks:num_full_blocks], and asserts on the hashes)
        num_cached_blocks = check_int(num_cached_blocks, "num_cached_blocks", 0)
        num_full_blocks = check_int(num_full_blocks, "num_full_blocks", None)
        if num_cached_blocks >= num_full_blocks:
            return
        if num_full_blocks > len(blocks):
            raise BlockTableIndexError(f"num_full_blocks={num_full_blocks} is past the end of the blocks given: the "
                                       f"table has {len(blocks)} (blocks[{num_cached_blocks}:{num_full_blocks}])")
        if block_size is not None and len(request.block_hashes) < num_full_blocks:
            update_block_hashes(request, block_size, hash_fn)
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id!r} has {len(request.block_hashes)} block hashes, {num_full_blocks} needed"
            )
        cached: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue
            block_hash = make_block_hash_with_group_id(request.block_hashes[i], kv_cache_group_id)
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
            cached.append(i)
        if self.enable_kv_cache_events and cached:
            # The block size the hashes were made with (update_block_hashes records it); 0 if unknown.
            size = block_size or (request.block_hasher_key or (0,))[0]
            self.kv_event_queue.append(self._block_stored(request, blocks, cached, size, kv_cache_group_id))

    def _block_stored(
        self, request: Request, blocks: Sequence[KVCacheBlock], positions: list[int], block_size: int, group_id: int
    ) -> BlockStored:
        """The ``BlockStored`` of the blocks at ``positions`` of a request's table: their hashes, their
        tokens, the hash before the first one. Mirrors ``BlockPool._build_block_stored_event``."""
        hashes, tokens = request.block_hashes, request.all_token_ids
        extra_keys = [generate_block_hash_extra_keys(request, i) for i in positions]
        return BlockStored(
            block_hashes=[hashes[i] for i in positions],
            parent_block_hash=hashes[positions[0] - 1] if positions[0] > 0 else None,
            token_ids=[t for i in positions for t in tokens[i * block_size : (i + 1) * block_size]],
            block_size=block_size,
            lora_id=request.lora_id,
            extra_keys=extra_keys if any(k is not None for k in extra_keys) else None,
            group_idx=group_id,
            block_ids=[blocks[i].block_id for i in positions],
            request_id=request.request_id,
        )

    # --- allocation ---------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue; each gets ``ref_cnt = 1``.

        A popped block that still holds a cached prefix is evicted now (its hash cleared and removed from
        the map): this is the only place eviction happens. Raises ``ValueError``, and changes nothing,
        when fewer blocks are free. Mirrors ``BlockPool.get_new_blocks``.
        """
        num_blocks = check_int(num_blocks, "num_blocks", 0)
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"Cannot get {num_blocks} free blocks from the pool: {self.get_num_free_blocks()} are free"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            assert block.ref_cnt == 0, block
            block.ref_cnt = 1
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """If ``block`` holds a cached prefix, forget it (a ``BlockRemoved`` event when events are on). Mirrors
        ``BlockPool._maybe_evict_cached_block``."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        blocks = self.cached_block_hash_to_block.get(block_hash)
        if blocks is not None:
            blocks.pop(block.block_id, None)
            if not blocks:
                del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        self.num_evictions += 1
        if self.enable_kv_cache_events:
            raw, group_id = block_hash if isinstance(block_hash, tuple) else (block_hash, 0)
            self.kv_event_queue.append(BlockRemoved(block_hashes=[raw], group_idx=group_id, block_ids=[block.block_id]))
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the cached prefix of each given block (its hash cleared and removed from the map); blocks
        without a hash are left alone, and a held block stays held (only its cache entry goes). Used for
        blocks whose KV will never be written, so that no later request hits them. ``ValueError`` (no change)
        for an id that is not a usable block of this pool. Mirrors ``BlockPool.evict_blocks``."""
        ids = list(block_ids)
        n = self.num_gpu_blocks
        for block_id in ids:
            check_int(block_id, "a block id to evict", 1, n - 1, why="the usable blocks of this pool")
        for block_id in ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a cache hit): ``ref_cnt + 1``; a block that was free (ref_cnt 0,
        a cached prefix nobody held) leaves the free queue, so it can no longer be evicted. The null block and
        blocks of another pool raise ``ValueError`` before anything changes. Mirrors ``BlockPool.touch``."""
        blocks = list(blocks)
        own, n = self.blocks, self.num_gpu_blocks
        for block in blocks:
            if block.is_null or not (0 <= block.block_id < n and own[block.block_id] is block):
                raise ValueError(f"cannot touch {block!r}: not a usable block of this pool")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching ``ref_cnt == 0`` go back to the free queue.

        Blocks without a hash hold nothing worth keeping: they go to the head, as a group in the order given,
        so the first one given is reused first. Blocks with a hash go to the tail in the order given, so they
        are evicted last and a later request can still hit them. (``KVCacheManager.free`` passes a request's
        blocks in reverse, so its deepest prefix blocks are evicted before the shared roots.) Freeing a block
        that is already free, or the null block, raises ``ValueError`` before anything changes.
        Mirrors ``BlockPool.free_blocks``.
        """
        blocks = list(ordered_blocks)
        for block in blocks:
            if not self.owns(block) or block.ref_cnt <= 0 or block.is_null:
                self._raise_bad_free(blocks, block)
        if len(blocks) > 1:
            counts = Counter(id(b) for b in blocks)
            if len(counts) != len(blocks):
                for block in blocks:
                    if counts[id(block)] > block.ref_cnt:
                        self._raise_bad_free(blocks, block)
        to_head: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    to_head.append(block)
                else:
                    self.free_block_queue.append(block)
        self.free_block_queue.appendleft_n(to_head)

    def owns(self, block: object) -> bool:
        """Whether ``block`` is one of this pool's blocks (not merely one with the same id from another pool)."""
        if not isinstance(block, KVCacheBlock):
            return False
        block_id = block.block_id
        return 0 <= block_id < self.num_gpu_blocks and self.blocks[block_id] is block

    def _raise_bad_free(self, blocks: list[KVCacheBlock], block: KVCacheBlock) -> None:
        if not self.owns(block):
            raise ValueError(f"{block!r} does not belong to this pool")
        if block.is_null:
            raise ValueError("cannot free the null block (block 0): it is never handed out")
        times = sum(1 for b in blocks if b is block)
        raise ValueError(
            f"cannot free block {block.block_id}: ref_cnt is {block.ref_cnt} but it is freed {times} time(s)"
            " (already free?)"
        )

    # --- whole-pool operations ----------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (an ``AllBlocksCleared`` event when events are on). Refuses (returns
        ``False``, changes nothing) while any request holds blocks, since their hashes are still in use.
        Mirrors ``BlockPool.reset_prefix_cache``."""
        num_used = self.num_gpu_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return the events recorded since the last call, oldest first, and empty the queue (``[]`` when
        events are off). Mirrors ``BlockPool.take_events``."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached ones included (they are reusable). Mirrors ``BlockPool.get_num_free_blocks``."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (the null block excluded) held by requests, 0.0 to 1.0."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total if total > 0 else 0.0

    def get_num_cached_blocks(self) -> int:
        return sum(len(v) for v in self.cached_block_hash_to_block.values())
