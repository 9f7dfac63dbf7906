"""The KV cache manager: each request's block table, allocated on demand from the shared BlockPool.

Mirrors ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``) together with the per-request
bookkeeping of ``vllm/v1/core/single_type_kv_cache_manager.py`` (``req_to_blocks``, ``num_cached_block``).
Copy-on-write for forked sequences follows vLLM V0's block manager (V1 serves n > 1 by prefix caching).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.block_pool import BlockPool
from pagedkv.block_table import compute_slot_mapping
from pagedkv.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    PrefixCacheStats,
    get_hash_fn,
    short_hash,
    update_block_hashes,
)
from pagedkv.request import Request
from pagedkv.trace import EventTrace


class UnknownRequestError(KeyError, ValueError):
    """A request id the manager holds no blocks for (catch it as KeyError or ValueError)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Hands out blocks to requests as their tokens grow, shares cached prefixes, and frees them.

    ``req_to_blocks[request_id]`` is the request's block table (logical block ``i`` → a ``KVCacheBlock``).
    A table only grows while the request runs: one block at a time as decode crosses a block boundary, or
    several for a prefill chunk. ``free`` returns them all when the request finishes or is preempted.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: str | Callable[[Any], BlockHash] = "builtin",
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an int > 0, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_fn)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.block_pool.defer_eviction_events = True
        self.num_gpu_blocks = num_blocks
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already entered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Token slots each request's table was sized for (computed tokens + the step's new ones).
        self.req_num_tokens: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self.trace: EventTrace | None = None

    # --- tracing ------------------------------------------------------------------------------------
    def set_trace(self, trace: EventTrace | None) -> None:
        """Record every change to the pool and the tables in ``trace`` (``None`` stops recording)."""
        self.trace = trace
        self.block_pool.trace = trace

    # --- prefix cache -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens, and their token count.

        The request's tokens are its prompt and any outputs (a preempted request recomputes both). The
        last token is never a hit: its forward pass is what samples the next token, so a hit covering every
        token is cut back by one block. Nothing in the pool changes (the hit is taken by ``allocate_slots``);
        only the prefix-cache counters move. Mirrors ``KVCacheManager.get_computed_blocks``.
        """
        if not self.enable_caching:
            return [], 0
        update_block_hashes(request, self.block_size, self.hash_fn)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counters gathered since the last call and start new ones."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; ``False`` (and no change) while any request holds blocks."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self.prefix_cache_stats.reset = True
        return ok

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks out of the prefix cache (``BlockPool.evict_blocks``): their KV is not what their
        hash says (never written, or failed to load). Mirrors ``KVCacheManager.evict_blocks``."""
        self.block_pool.evict_blocks(block_ids)
        self._flush_evictions(None)

    # --- allocation ---------------------------------------------------------------------------------
    def _blocks_written(self, request: Request, blocks: list[KVCacheBlock], num_new_tokens: int) -> list[int]:
        """Indices of blocks already in the table that this step writes into while another request shares
        them: each needs a private copy first (copy-on-write)."""
        if num_new_tokens <= 0 or not blocks:
            return []
        first = request.num_computed_tokens // self.block_size
        last = min(len(blocks), cdiv(request.num_computed_tokens + num_new_tokens, self.block_size))
        return [i for i in range(first, last) if blocks[i].ref_cnt > 1]

    def _check_hits(self, request: Request, hits: list[KVCacheBlock], req_blocks: list[KVCacheBlock]) -> None:
        """Refuse cache hits that ``get_computed_blocks`` could not have returned: before the request's first
        allocation only, each a cached block of this pool, each once (touching one block twice would count a
        single block for two positions of the table)."""
        rid = request.request_id
        if req_blocks or request.num_computed_tokens:
            raise ValueError(
                f"request {rid!r}: cache hits can only be added before its first allocation "
                f"(it holds {len(req_blocks)} blocks, {request.num_computed_tokens} computed tokens)"
            )
        seen: set[int] = set()
        for block in hits:
            if not self.block_pool.owns(block) or block.is_null:
                raise ValueError(f"request {rid!r}: cache hit {block!r} is not a usable block of this pool")
            if block.block_hash is None:
                raise ValueError(f"request {rid!r}: cache hit {block!r} holds no cached prefix")
            if block.block_id in seen:
                raise ValueError(f"request {rid!r}: cache hit block {block.block_id} is given twice")
            seen.add(block.block_id)
        if len(hits) * self.block_size >= request.num_tokens:
            raise ValueError(
                f"request {rid!r}: {len(hits)} cache-hit blocks cover all {request.num_tokens} tokens; the last "
                "token is always computed (get_computed_blocks cuts a full hit back by one block)"
            )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        *,
        full_sequence_must_fit: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; return the blocks newly allocated.

        The table must then cover ``request.num_computed_tokens + len(new_computed_blocks) * block_size
        + num_new_tokens`` tokens. In order: the cache hits ``new_computed_blocks`` (from
        ``get_computed_blocks``, only before the request's first allocation) are touched and put at the
        start of its table; a block this step writes into while another request shares it (a fork's partly
        filled last block) is replaced by a fresh one and the copy is recorded (``get_pending_copies``);
        fresh blocks are popped for the rest; every block that is now full is entered in the prefix cache.

        Returns the fresh blocks in table order (copy-on-write replacements included), or ``None`` with no
        change at all when the pool is short: hits that sit in the free queue count against the free
        blocks, since touching them takes them out of it.

        ``full_sequence_must_fit`` (vLLM 0.26's admission gate, ``SchedulerConfig.scheduler_reserve_full_isl``)
        first asks whether the request's whole current sequence, ``request.num_tokens`` (its prompt and any
        outputs, not ``max_tokens``), would fit: ``ceil(num_tokens / block_size)`` blocks minus those it holds
        and its hits, plus its hits that sit in the free queue, must not exceed the free blocks; otherwise
        ``None``, even when this chunk alone would fit. With chunked prefill this keeps a long prompt from
        being admitted on its first chunk only to stall (or preempt others) halfway. Mirrors
        ``KVCacheManager.allocate_slots`` (``get_num_blocks_to_allocate`` with the full sequence).
        """
        if isinstance(num_new_tokens, bool) or not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}")
        if not isinstance(full_sequence_must_fit, bool):
            raise ValueError(f"full_sequence_must_fit must be a bool, got {full_sequence_must_fit!r}")
        rid = request.request_id
        hits = list(new_computed_blocks or [])
        req_blocks = self.req_to_blocks.get(rid, [])
        if hits:
            self._check_hits(request, hits, req_blocks)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        num_tokens_need_slot = num_computed + num_new_tokens
        num_required = cdiv(num_tokens_need_slot, self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(hits))
        cow = self._blocks_written(request, req_blocks, num_new_tokens) if not hits else []
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        num_free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            num_full_blocks = cdiv(request.num_tokens, self.block_size)
            if max(0, num_full_blocks - len(req_blocks) - len(hits)) + num_evictable_hits > num_free:
                return None
        if num_new_blocks + len(cow) > num_free - num_evictable_hits:
            return None

        # From here on the allocation cannot fail.
        req_blocks = self.req_to_blocks.setdefault(rid, req_blocks)
        if hits:
            self.block_pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_block[rid] = len(hits)
            if self.trace is not None:
                ids = [b.block_id for b in hits]
                self.trace.record(
                    "touch", rid, ids, f"{rid} hits cached blocks {ids} ({len(ids) * self.block_size} tokens)"
                )
        new_blocks: list[KVCacheBlock] = []
        for i in cow:
            src = req_blocks[i]
            (dst,) = self.block_pool.get_new_blocks(1)
            req_blocks[i] = dst
            self.block_pool.free_blocks([src])  # ref_cnt > 1, so it stays held by the other sharers
            new_blocks.append(dst)
            self._flush_evictions(rid)
            if i < self.num_cached_block.get(rid, 0):
                # A full block copied before its KV was computed (a fork made before the parent's step
                # completed): the private copy is cached again once it is written.
                self.num_cached_block[rid] = i
            if i * self.block_size < request.num_computed_tokens:  # holds KV worth copying
                self.pending_copies.append((src.block_id, dst.block_id))
                if self.trace is not None:
                    self.trace.record(
                        "copy",
                        rid,
                        [src.block_id, dst.block_id],
                        f"{rid} writes into shared block {src.block_id}: copy-on-write to block {dst.block_id}",
                        src=src.block_id,
                        dst=dst.block_id,
                    )
        fresh = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(fresh)
        new_blocks.extend(fresh)
        self._flush_evictions(rid)
        self.req_num_tokens[rid] = max(self.req_num_tokens.get(rid, 0), num_tokens_need_slot)
        if fresh and self.trace is not None:
            ids = [b.block_id for b in fresh]
            self.trace.record(
                "allocate", rid, ids, f"{rid} allocates blocks {ids} (table now {len(req_blocks)} blocks)"
            )
        if self.enable_caching:
            # Slots may run ahead of the tokens (a lookahead); only blocks of known tokens are hashed.
            self._cache_blocks(request, min(num_tokens_need_slot, request.num_tokens))
        return new_blocks

    def _flush_evictions(self, request_id: str | None) -> None:
        """Record the evictions of the blocks just taken for ``request_id``, now that they are in its table."""
        pool = self.block_pool
        for block_id, block_hash in pool.deferred_evictions:
            pool.record_eviction(block_id, block_hash, request_id)
        pool.deferred_evictions.clear()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter in the prefix cache the request's blocks that are full once ``num_computed_tokens`` tokens are
        computed (only blocks of known tokens: capped at ``request.num_tokens``). The async scheduler calls it when
        a sample arrives, since the block holding it could not be hashed when it was allocated. Mirrors
        ``KVCacheManager.cache_blocks``."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks that are full once ``num_tokens`` tokens are computed."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_full <= num_cached:
            return
        update_block_hashes(request, self.block_size, self.hash_fn)
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full)
        self.num_cached_block[rid] = num_full

    def free(self, request: Request) -> None:
        """Release all of the request's blocks, last block first, and forget its table.

        Freeing in reverse puts the tail of its prefix ahead of the root in the eviction order, so a shared
        root (a system prompt) outlives the blocks that only this request used. Mirrors
        ``KVCacheManager.free``. Raises ``UnknownRequestError`` for a request that holds no table.
        """
        rid = request.request_id
        if rid not in self.req_to_blocks:
            raise UnknownRequestError(f"request {rid!r} holds no blocks in this KV cache manager")
        blocks = self.req_to_blocks.pop(rid)
        self.num_cached_block.pop(rid, None)
        self.req_num_tokens.pop(rid, None)
        ordered = list(reversed(blocks))
        self.block_pool.free_blocks(ordered)
        if self.trace is not None:
            ids = [b.block_id for b in ordered]
            self.trace.record("free", rid, ids, f"{rid} frees blocks {ids}")

    # --- forks and copy-on-write --------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's whole block table, sharing every block (``ref_cnt + 1`` each).

        The child's tokens must begin with the parent's computed tokens; it takes the parent's
        ``num_computed_tokens``. Nothing is copied now: a later write into a shared, partly filled block
        gives the writer a private copy (see ``allocate_slots``). Full shared blocks are never copied, since
        nobody writes into them again. Used for parallel sampling (n > 1) and beam search.
        """
        pid, cid = parent.request_id, child.request_id
        if pid not in self.req_to_blocks:
            raise UnknownRequestError(f"parent request {pid!r} holds no blocks in this KV cache manager")
        if cid in self.req_to_blocks:
            raise ValueError(f"child request {cid!r} already holds blocks")
        n = parent.num_computed_tokens
        if child.num_tokens < n or child.all_token_ids[:n] != parent.all_token_ids[:n]:
            raise ValueError(f"child {cid!r} must begin with the parent's {n} computed tokens to share its blocks")
        blocks = self.req_to_blocks[pid]
        self.block_pool.touch(blocks)
        self.req_to_blocks[cid] = list(blocks)
        self.num_cached_block[cid] = self.num_cached_block.get(pid, 0)
        self.req_num_tokens[cid] = self.req_num_tokens.get(pid, n)
        child.num_computed_tokens = n
        if self.trace is not None:
            ids = [b.block_id for b in blocks]
            self.trace.record("fork", cid, ids, f"{cid} forks from {pid}, sharing blocks {ids}", parent=pid)

    def get_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the recorded copy-on-write copies, as ``(src_block_id, dst_block_id)``; the
        model runner performs them before the step's forward pass (``SchedulerOutput.blocks_to_copy``)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # --- reading ------------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as block ids. Mirrors ``KVCacheManager.get_block_ids``."""
        if request_id not in self.req_to_blocks:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks in this KV cache manager")
        return [b.block_id for b in self.req_to_blocks[request_id]]

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Physical slots of the request's token positions ``start`` to ``end - 1``."""
        return compute_slot_mapping(self.get_block_ids(request_id), range(start, end), self.block_size)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def snapshot(self) -> dict[str, Any]:
        """The pool and every table as plain data (for the widget, tests and lessons). O(num_blocks)."""
        pool = self.block_pool
        return {
            "block_size": self.block_size,
            "num_blocks": pool.num_gpu_blocks,
            "blocks": [
                {
                    "block_id": b.block_id,
                    "ref_cnt": b.ref_cnt,
                    "cached": b.block_hash is not None,
                    "hash": None if b.block_hash is None else short_hash(b.block_hash),
                    "null": b.is_null,
                }
                for b in pool.blocks
            ],
            "free_queue": [b.block_id for b in pool.free_block_queue],
            "block_tables": {rid: [b.block_id for b in blocks] for rid, blocks in self.req_to_blocks.items()},
            "num_tokens": dict(self.req_num_tokens),
        }
