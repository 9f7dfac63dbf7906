"""The KV cache manager: each request's block table, allocated on demand from the shared BlockPool.

Mirrors ``vllm/v1/core/kv_cache_manager.py`` (``KVCacheManager``) together with the per-request
bookkeeping of ``vllm/v1/core/single_type_kv_cache_manager.py`` (``req_to_blocks``, ``num_cached_block``).
Copy-on-write for forked sequences follows vLLM V0's block manager (V1 serves n > 1 by prefix caching).

Two ways to build one:

- ``KVCacheManager(num_blocks, block_size)`` (lessons 2-7): one full-attention group, its tables kept
  here, in one flat piece of code you can read top to bottom (and override, in the exercises).
- ``KVCacheManager(kv_cache_config, max_model_len=...)`` (lesson 8): any ``KVCacheConfig``, through a
  coordinator (``pagedkv.kv_cache_coordinator``) over one ``SingleTypeKVCacheManager`` per group, as vLLM
  0.26 is built. With one group the public API is the same as above (lists of blocks and block ids); with
  several groups (a hybrid model) per-group values come back as vLLM returns them: ``get_block_ids`` a tuple
  with one list per group, ``get_computed_blocks`` and ``allocate_slots`` a ``KVCacheBlocks``. For one
  full-attention group both ways behave identically (``tests/test_hybrid_kv_cache.py`` checks it).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pagedkv.block_pool import BlockPool
from pagedkv.block_table import compute_slot_mapping
from pagedkv.kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from pagedkv.kv_cache_utils import (
    BlockHash,
    KVCacheBlock,
    get_hash_fn,
    short_hash,
    update_block_hashes,
)
from pagedkv.kv_events import (
    BlockCopied,
    BlockRemoved,
    BlocksAllocated,
    BlocksFreed,
    BlocksTouched,
    KVCacheEvent,
    RequestForked,
    SkippedBlocksRemoved,
)
from pagedkv.metrics.stats import PrefixCacheStats
from pagedkv.request import Request
from pagedkv.single_type_kv_cache_manager import FullAttentionManager, blocks_written
from pagedkv.trace import EventTrace
from pagedkv.utils import cdiv, check_int


class UnknownRequestError(KeyError, ValueError):
    """A request id the manager holds no blocks for (catch it as KeyError or ValueError)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


@dataclass
class KVCacheBlocks:
    """Blocks of one request, one sequence per KV cache group: ``blocks[g][i]`` is group ``g``'s ``i``-th
    block. What a several-group ``KVCacheManager`` returns from ``get_computed_blocks``, ``allocate_slots``
    and ``get_blocks``. Mirrors ``KVCacheBlocks`` in ``vllm/v1/core/kv_cache_manager.py``."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(itertools.chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        """One list of block ids per group (0 where a group holds the null block)."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.blocks))


class KVCacheManager:
    """Hands out blocks to requests as their tokens grow, shares cached prefixes, and frees them.

    ``req_to_blocks[request_id]`` is the request's block table (logical block ``i`` → a ``KVCacheBlock``).
    A table only grows while the request runs: one block at a time as decode crosses a block boundary, or
    several for a prefill chunk. ``free`` returns them all when the request finishes or is preempted.

    With ``enable_kv_cache_events`` (or a trace attached, ``set_trace``) every change is recorded as a plain
    event (``pagedkv.kv_events``): the pool's ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` and the
    lab's table events, queued in order and drained by ``take_events()``, as vLLM 0.26's
    ``KVCacheManager.take_events`` drains its pool's.
    """

    def __init__(
        self,
        num_blocks: int | KVCacheConfig,
        block_size: int | None = None,
        enable_caching: bool = True,
        hash_fn: str | Callable[[Any], BlockHash] = "builtin",
        *,
        max_model_len: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_kv_cache_events: bool = False,
    ) -> None:
        """``KVCacheManager(num_blocks, block_size)``: one full-attention group (lessons 2-7).
        ``KVCacheManager(kv_cache_config, max_model_len=..., max_in_flight_tokens=...)``: the groups of a
        ``KVCacheConfig`` through a coordinator (vLLM's ``KVCacheManager(kv_cache_config, max_model_len,
        ...)``). ``max_model_len`` caps the slots a request gets (``None``: no cap); ``max_in_flight_tokens``
        (tokens scheduled but not yet processed; ``None``: set by the ``Scheduler`` from its
        ``max_num_batched_tokens``, else ``max_model_len``) caps what the admission gate counts for a
        sliding-window group. ``enable_kv_cache_events``: record events for ``take_events()`` (vLLM's
        ``enable_kv_cache_events``)."""
        self.coordinator: KVCacheCoordinator | None = None
        self.max_model_len = max_model_len
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.trace: EventTrace | None = None
        if isinstance(num_blocks, KVCacheConfig):
            self._init_groups(num_blocks, block_size, enable_caching, hash_fn, max_model_len, max_in_flight_tokens)
            self._sync_pool_events()
            return
        block_size = check_int(block_size, "block_size", 1)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_fn)
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.num_gpu_blocks = num_blocks
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already entered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # Token slots each request's table was sized for (computed tokens + the step's new ones).
        self.req_num_tokens: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_stats = PrefixCacheStats()
        self.num_kv_cache_groups = 1
        self.max_in_flight_tokens = max_in_flight_tokens
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")
        self.kv_cache_config = KVCacheConfig.single_group(num_blocks, spec)

    def _init_groups(
        self,
        config: KVCacheConfig,
        block_size: int | None,
        enable_caching: bool,
        hash_fn: str | Callable[[Any], BlockHash],
        max_model_len: int | None,
        max_in_flight_tokens: int | None,
    ) -> None:
        for name, value in (("max_model_len", max_model_len), ("max_in_flight_tokens", max_in_flight_tokens)):
            if value is not None:
                check_int(value, f"{name} (or None)", 1)
        limit = sys.maxsize if max_model_len is None else max_model_len
        self.kv_cache_config = config
        self.coordinator = get_kv_cache_coordinator(config, limit, max_in_flight_tokens or limit, enable_caching)
        if block_size is not None and block_size != self.coordinator.block_size:
            raise ValueError(f"block_size={block_size} disagrees with the config's {self.coordinator.block_size}")
        self.block_size = self.coordinator.block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_fn)
        self._block_pool = self.coordinator.block_pool
        self.num_gpu_blocks = config.num_blocks
        self.num_kv_cache_groups = len(config.kv_cache_groups)
        self.max_in_flight_tokens = max_in_flight_tokens
        # req_to_blocks and num_cached_block are group 0's (see __getattr__), not copies kept here.
        self.req_num_tokens = {}
        self.pending_copies = []
        self.prefix_cache_stats = PrefixCacheStats()

    def __getattr__(self, name: str) -> Any:
        """Built from a ``KVCacheConfig``, ``req_to_blocks`` and ``num_cached_block`` are group 0's
        (``single_type_managers[0]``'s): for one group the tables the lessons read, for several group 0's
        (``get_blocks`` gives every group's). Looked up each time, never stored, so there is one copy."""
        if name in ("req_to_blocks", "num_cached_block"):
            coordinator = self.__dict__.get("coordinator")
            if coordinator is not None:
                return getattr(coordinator.single_type_managers[0], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def block_pool(self) -> BlockPool:
        return self._block_pool

    @block_pool.setter
    def block_pool(self, pool: BlockPool) -> None:
        self._block_pool = pool
        if self.coordinator is not None:
            self.coordinator.set_block_pool(pool)
        self._sync_pool_events()

    @property
    def single_type_managers(self) -> tuple:
        """One ``SingleTypeKVCacheManager`` per group (empty for the flat one-group manager)."""
        return () if self.coordinator is None else self.coordinator.single_type_managers

    def set_max_in_flight_tokens(self, max_in_flight_tokens: int) -> None:
        """Set the in-flight bound of the sliding-window admission cap (``KVCacheCoordinator
        .set_max_in_flight_tokens``); a no-op for the flat manager, which has no window."""
        self.max_in_flight_tokens = max_in_flight_tokens
        if self.coordinator is not None:
            self.coordinator.set_max_in_flight_tokens(max_in_flight_tokens)

    def max_num_blocks_for(self, num_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at once, all groups together: every
        block for a full-attention group, at most ``max_admission_blocks_per_request`` for a sliding-window
        one. What ``Scheduler.add_request`` compares with the pool."""
        if self.coordinator is None:
            return cdiv(num_tokens, self.block_size)
        total = 0
        for m in self.coordinator.single_type_managers:
            n = cdiv(num_tokens, m.block_size)
            cap = m._max_admission_blocks_per_request
            total += n if cap is None else min(n, cap)
        return total

    # --- events and tracing -------------------------------------------------------------------------
    def set_trace(self, trace: EventTrace | None) -> None:
        """Hand every event to ``trace`` (``EventTrace.record_kv_event``) once the change it describes is
        complete, so a listener may take a snapshot; ``None`` stops it. A lab addition: vLLM has no trace."""
        self.trace = trace
        self._sync_pool_events()

    @property
    def recording(self) -> bool:
        """Whether events are being made: for ``take_events()`` or for a trace."""
        return self.enable_kv_cache_events or self.trace is not None

    def _sync_pool_events(self) -> None:
        # The pool records its events whenever this manager does (a learner's pool may not know of them).
        self.block_pool.enable_kv_cache_events = self.recording

    def _record(self, event: KVCacheEvent | None = None, request_id: str | None = None) -> None:
        """Queue what the pool recorded since the last call, then ``event``, and hand them to the trace.

        Called only where the change is complete (a popped block already sits in its table), so the pool's
        evictions are taken here, not when they happen; they are the ones made for ``request_id``. The
        callers build an event only ``if self.recording``: an unrecorded run pays one test per change."""
        if not self.recording:
            return
        take = getattr(self.block_pool, "take_events", None)
        events: list[KVCacheEvent] = [
            replace(e, request_id=request_id) if isinstance(e, BlockRemoved) else e for e in (take() if take else [])
        ]
        if event is not None:
            events.append(event)
        if self.trace is not None:
            for e in events:
                self.trace.record_kv_event(e)
        if self.enable_kv_cache_events:
            self.kv_event_queue.extend(events)

    def take_events(self) -> list[KVCacheEvent]:
        """Return the events recorded since the last call, oldest first, and empty the queue (``[]`` unless
        built with ``enable_kv_cache_events``). Mirrors ``KVCacheManager.take_events``."""
        self._record()
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # --- prefix cache -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens, and their token count.

        The request's tokens are its prompt and any outputs (a preempted request recomputes both). The
        last token is never a hit: its forward pass is what samples the next token, so a hit covering every
        token is cut back by one block. Nothing in the pool changes (the hit is taken by ``allocate_slots``);
        only the prefix-cache counters move. A request that skips reading the prefix cache
        (``skip_reading_prefix_cache``: it asks for prompt logprobs) gets no hit, and nothing is counted. Mirrors
        ``KVCacheManager.get_computed_blocks``.

        Built from a ``KVCacheConfig``, the coordinator finds the hit (``find_longest_cache_hit``): a list
        for one group (a sliding-window group's begins with null blocks), a ``KVCacheBlocks`` for several.
        """
        if self.coordinator is not None:
            return self._get_computed_blocks_groups(request)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
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
            self._record()
        return ok

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Take these blocks out of the prefix cache (``BlockPool.evict_blocks``): their KV is not what their
        hash says (never written, or failed to load). Mirrors ``KVCacheManager.evict_blocks``."""
        self.block_pool.evict_blocks(block_ids)
        self._record()

    # --- allocation ---------------------------------------------------------------------------------
    def _blocks_written(self, request: Request, blocks: list[KVCacheBlock], num_new_tokens: int) -> list[int]:
        """Indices of blocks already in the table that this step writes into while another request shares
        them: each needs a private copy first (copy-on-write)."""
        return blocks_written(blocks, request.num_computed_tokens, num_new_tokens, self.block_size)

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
        self._check_hit_blocks(rid, hits)
        self._check_hit_length(request, len(hits))

    def _check_hit_blocks(self, rid: str, hits: list[KVCacheBlock], allow_null: bool = False) -> None:
        """Each hit a cached block of this pool, each once (``allow_null``: null entries pass, as in a
        sliding-window group's hit)."""
        seen: set[int] = set()
        for block in hits:
            if allow_null and block.is_null and self.block_pool.owns(block):
                continue
            if not self.block_pool.owns(block) or block.is_null:
                raise ValueError(f"request {rid!r}: cache hit {block!r} is not a usable block of this pool")
            if block.block_hash is None:
                raise ValueError(f"request {rid!r}: cache hit {block!r} holds no cached prefix")
            if block.block_id in seen:
                raise ValueError(f"request {rid!r}: cache hit block {block.block_id} is given twice")
            seen.add(block.block_id)

    def _check_hit_length(self, request: Request, num_hit_blocks: int) -> None:
        if num_hit_blocks * self.block_size >= request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: {num_hit_blocks} cache-hit blocks cover all {request.num_tokens} "
                "tokens; the last token is always computed (get_computed_blocks cuts a full hit back by one block)"
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

        Built from a ``KVCacheConfig``: the same, group by group through the coordinator, and first (as vLLM
        does, even when the allocation then fails) each sliding-window group releases the blocks that fell
        out of its window (``remove_skipped_blocks``, replaced by the null block); the admission gate counts
        at most ``max_admission_blocks_per_request`` blocks for such a group. ``new_computed_blocks`` is what
        ``get_computed_blocks`` returned; several groups get a ``KVCacheBlocks`` back.
        """
        num_new_tokens = check_int(num_new_tokens, "num_new_tokens", 0)
        if not isinstance(full_sequence_must_fit, bool):
            raise ValueError(f"full_sequence_must_fit must be a bool, got {full_sequence_must_fit!r}")
        if self.coordinator is not None:
            return self._allocate_slots_groups(request, num_new_tokens, new_computed_blocks, full_sequence_must_fit)
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
            if self.recording:
                self._record(BlocksTouched(rid, [b.block_id for b in hits], len(hits) * self.block_size))
        new_blocks: list[KVCacheBlock] = []
        for i in cow:
            src = req_blocks[i]
            (dst,) = self.block_pool.get_new_blocks(1)
            req_blocks[i] = dst
            self.block_pool.free_blocks([src])  # ref_cnt > 1, so it stays held by the other sharers
            new_blocks.append(dst)
            self._record(None, rid)
            if i < self.num_cached_block.get(rid, 0):
                # A full block copied before its KV was computed (a fork made before the parent's step
                # completed): the private copy is cached again once it is written.
                self.num_cached_block[rid] = i
            copied = i * self.block_size < request.num_computed_tokens  # holds KV worth copying
            if copied:
                self.pending_copies.append((src.block_id, dst.block_id))
            if self.recording:
                self._record(BlockCopied(rid, src.block_id, dst.block_id, copied))
        fresh = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(fresh)
        new_blocks.extend(fresh)
        self._record(None, rid)  # the evictions, now that the blocks sit in the table
        self.req_num_tokens[rid] = max(self.req_num_tokens.get(rid, 0), num_tokens_need_slot)
        if fresh and self.recording:
            self._record(BlocksAllocated(rid, [b.block_id for b in fresh], len(req_blocks)))
        if self.enable_caching:
            # Slots may run ahead of the tokens (a lookahead); only blocks of known tokens are hashed.
            self._cache_blocks(request, min(num_tokens_need_slot, request.num_tokens))
            self._record(None, rid)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter in the prefix cache the request's blocks that are full once ``num_computed_tokens`` tokens are
        computed (only blocks of known tokens: capped at ``request.num_tokens``). The async scheduler calls it when
        a sample arrives, since the block holding it could not be hashed when it was allocated. Mirrors
        ``KVCacheManager.cache_blocks``."""
        if not self.enable_caching:
            return
        if self.coordinator is not None:
            if any(request.request_id in m.req_to_blocks for m in self.coordinator.single_type_managers):
                self._cache_group_blocks(request, min(num_computed_tokens, request.num_tokens))
        elif request.request_id in self.req_to_blocks:
            self._cache_blocks(request, min(num_computed_tokens, request.num_tokens))
            self._record(None, request.request_id)

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
        if self.coordinator is not None:
            self._free_groups(request)
            return
        blocks = self.req_to_blocks.pop(rid)
        self.num_cached_block.pop(rid, None)
        self.req_num_tokens.pop(rid, None)
        ordered = list(reversed(blocks))
        self.block_pool.free_blocks(ordered)
        if self.recording:
            self._record(BlocksFreed(rid, [b.block_id for b in ordered]), rid)

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
        if self.coordinator is not None:
            for m in self.coordinator.single_type_managers:
                m.fork(pid, cid)
            self.req_num_tokens[cid] = self.req_num_tokens.get(pid, n)
            child.num_computed_tokens = n
            if self.recording:
                self._record(RequestForked(cid, pid, [], self._tables(cid)), cid)
            return
        blocks = self.req_to_blocks[pid]
        self.block_pool.touch(blocks)
        self.req_to_blocks[cid] = list(blocks)
        self.num_cached_block[cid] = self.num_cached_block.get(pid, 0)
        self.req_num_tokens[cid] = self.req_num_tokens.get(pid, n)
        child.num_computed_tokens = n
        if self.recording:
            self._record(RequestForked(cid, pid, [b.block_id for b in blocks]), cid)

    def get_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the recorded copy-on-write copies, as ``(src_block_id, dst_block_id)``; the
        model runner performs them before the step's forward pass (``SchedulerOutput.blocks_to_copy``)."""
        copies, self.pending_copies = self.pending_copies, []
        for m in self.single_type_managers:
            copies.extend(m.pending_copies)
            m.pending_copies = []
        return copies

    # --- reading ------------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int] | tuple[list[int], ...]:
        """The request's block table as block ids: a list for one KV cache group; with several, one list per
        group (vLLM's form; 0 where a sliding-window group has released a block). Mirrors
        ``KVCacheManager.get_block_ids``. ``UnknownRequestError`` for a request that holds no table."""
        if request_id not in self.req_to_blocks:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks in this KV cache manager")
        if self.num_kv_cache_groups == 1:
            return [b.block_id for b in self.req_to_blocks[request_id]]
        return self.get_blocks(request_id).get_block_ids()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks in every group, always as a ``KVCacheBlocks`` (one sequence per group, also
        for one group): the uniform form for code that serves any model. Empty for an unknown request.
        Mirrors ``KVCacheManager.get_blocks``."""
        if self.coordinator is None:
            return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))
        return KVCacheBlocks(tuple(list(b) for b in self.coordinator.get_blocks(request_id)))

    def get_slot_mapping(self, request_id: str, start: int, end: int) -> list[int] | tuple[list[int], ...]:
        """Physical slots of the request's token positions ``start`` to ``end - 1``: a list for one group,
        one list per group for several (each group's layers write into their own blocks)."""
        tables = self.get_blocks(request_id).get_block_ids()
        if request_id not in self.req_to_blocks:
            raise UnknownRequestError(f"request {request_id!r} holds no blocks in this KV cache manager")
        slots = tuple(compute_slot_mapping(t, range(start, end), self.block_size) for t in tables)
        return slots[0] if self.num_kv_cache_groups == 1 else slots

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
        } | self._snapshot_groups()

    # --- several KV cache groups (built from a KVCacheConfig) ---------------------------------------
    def _as_group_blocks(self, blocks: Any) -> tuple[list[KVCacheBlock], ...]:
        """``new_computed_blocks`` in any of the forms ``get_computed_blocks`` returns, one list per group."""
        n = self.num_kv_cache_groups
        if blocks is None:
            return tuple([] for _ in range(n))
        if isinstance(blocks, KVCacheBlocks):
            groups = tuple(list(g) for g in blocks.blocks)
        elif n == 1 and all(isinstance(b, KVCacheBlock) for b in blocks):
            groups = (list(blocks),)
        else:
            groups = tuple(list(g) for g in blocks)
        if len(groups) != n:
            raise ValueError(f"cache hits for {len(groups)} KV cache groups given, the manager has {n}")
        return groups

    def _pack(self, groups: tuple[list[KVCacheBlock], ...]) -> list[KVCacheBlock] | KVCacheBlocks:
        return groups[0] if self.num_kv_cache_groups == 1 else KVCacheBlocks(groups)

    def _get_computed_blocks_groups(self, request: Request) -> tuple[Any, int]:
        assert self.coordinator is not None
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self._pack(tuple([] for _ in range(self.num_kv_cache_groups))), 0
        update_block_hashes(request, self.block_size, self.hash_fn)
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_hit_tokens
        return self._pack(tuple(list(h) for h in hits)), num_hit_tokens

    def _check_group_hits(self, request: Request, hits: tuple[list[KVCacheBlock], ...]) -> None:
        """``_check_hits`` for each group: null entries are allowed only in a group that skips tokens, and
        every group's hit must cover the same number of positions."""
        assert self.coordinator is not None
        rid = request.request_id
        if rid in self.req_to_blocks or request.num_computed_tokens:
            raise ValueError(
                f"request {rid!r}: cache hits can only be added before its first allocation "
                f"({request.num_computed_tokens} computed tokens)"
            )
        lengths = {len(h) for h in hits}
        if len(lengths) != 1:
            sizes = [len(h) for h in hits]
            raise ValueError(f"request {rid!r}: the groups' cache hits differ in length ({sizes} blocks)")
        for manager, group in zip(self.coordinator.single_type_managers, hits, strict=True):
            self._check_hit_blocks(rid, group, allow_null=not isinstance(manager, FullAttentionManager))
        self._check_hit_length(request, lengths.pop())

    def _allocate_slots_groups(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Any, full_sequence_must_fit: bool
    ) -> list[KVCacheBlock] | KVCacheBlocks | None:
        """``allocate_slots`` through the coordinator. Mirrors ``KVCacheManager.allocate_slots`` of vLLM 0.26."""
        coord = self.coordinator
        assert coord is not None
        rid = request.request_id
        hits = self._as_group_blocks(new_computed_blocks)
        has_hits = any(hits)
        if has_hits:
            self._check_group_hits(request, hits)
        limit = sys.maxsize if self.max_model_len is None else self.max_model_len
        num_local_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        total_computed = min(num_local_computed, limit)
        pool = self.block_pool
        if full_sequence_must_fit:
            full = min(request.num_tokens, limit)
            need = coord.get_num_blocks_to_allocate(rid, full, hits, total_computed, apply_admission_cap=True)
            if need > pool.get_num_free_blocks():
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens, limit)
        # Out-of-window blocks go first (vLLM frees them even if this allocation then fails), on the
        # processed-token basis: tokens still in flight (async scheduling) may be read by a running step.
        in_flight = getattr(request, "num_in_flight_tokens", 0)
        before = self._held_ids(rid) if self.recording else set()
        coord.remove_skipped_blocks(rid, max(0, total_computed - in_flight))
        if self.recording:
            dropped = sorted(before - self._held_ids(rid))
            if dropped:
                self._record(SkippedBlocksRemoved(rid, dropped, self._tables(rid)), rid)
        num_needed = coord.get_num_blocks_to_allocate(rid, num_tokens_need_slot, hits, num_local_computed)
        held = rid in self.req_to_blocks
        managers = coord.single_type_managers
        num_cow = 0 if has_hits or not held else sum(
            m.get_num_cow_blocks(rid, request.num_computed_tokens, num_new_tokens) for m in managers
        )
        if num_needed + num_cow > pool.get_num_free_blocks():
            return None

        # From here on the allocation cannot fail.
        if has_hits:
            coord.allocate_new_computed_blocks(rid, hits, num_local_computed)
            if self.recording:
                ids = [b.block_id for g in hits for b in g if not b.is_null]
                self._record(BlocksTouched(rid, ids, len(hits[0]) * self.block_size, self._tables(rid)), rid)
        before = self._tables(rid) if num_cow and self.recording else None
        fresh_cow = tuple(
            m.copy_on_write(rid, request.num_computed_tokens, num_new_tokens) if num_cow else [] for m in managers
        )
        if before is not None:
            self._record_copies(rid, before)
        fresh = coord.allocate_new_blocks(rid, num_tokens_need_slot)
        self._record(None, rid)  # the evictions, now that the blocks sit in the tables
        self.req_num_tokens[rid] = max(self.req_num_tokens.get(rid, 0), num_tokens_need_slot)
        if any(fresh) and self.recording:
            ids = [b.block_id for g in fresh for b in g]
            self._record(BlocksAllocated(rid, ids, sum(len(t) for t in self._tables(rid)), self._tables(rid)))
        if self.enable_caching:
            self._cache_group_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return self._pack(tuple(c + f for c, f in zip(fresh_cow, fresh, strict=True)))

    def _cache_group_blocks(self, request: Request, num_known: int) -> None:
        """Every group enters the request's blocks full of its first ``num_known`` tokens in the prefix cache
        (several-group form; ``KVCacheCoordinator.cache_blocks``)."""
        assert self.coordinator is not None
        update_block_hashes(request, self.block_size, self.hash_fn)
        if self.recording:  # a group at a time: each BlockStored seen with its state
            for m in self.coordinator.single_type_managers:
                m.cache_blocks(request, num_known)
                self._record(None, request.request_id)
        else:
            self.coordinator.cache_blocks(request, num_known)

    def _held_ids(self, rid: str) -> set[int]:
        assert self.coordinator is not None
        return {b.block_id for group in self.coordinator.get_blocks(rid) for b in group if not b.is_null}

    def _free_groups(self, request: Request) -> None:
        assert self.coordinator is not None
        rid = request.request_id
        freed = [b.block_id for group in self.coordinator.get_blocks(rid) for b in reversed(group) if not b.is_null]
        self.coordinator.free(rid)
        self.req_num_tokens.pop(rid, None)
        if self.recording:
            self._record(BlocksFreed(rid, freed), rid)

    def _record_copies(self, rid: str, before: list[list[int]]) -> None:
        """A ``BlockCopied`` for each block that copy-on-write replaced in any group (``before``: the tables
        just before), ``copied`` when its KV is to be copied (it is in that group's ``pending_copies``)."""
        assert self.coordinator is not None
        for m, old, new in zip(self.coordinator.single_type_managers, before, self._tables(rid), strict=True):
            for src, dst in zip(old, new, strict=False):
                if src != dst:
                    self._record(BlockCopied(rid, src, dst, (src, dst) in m.pending_copies), rid)

    def _tables(self, rid: str) -> list[list[int]]:
        """The request's table in every group, as block ids (0 for the null block): what group events carry."""
        assert self.coordinator is not None
        return [[b.block_id for b in g] for g in self.coordinator.get_blocks(rid)]

    def _snapshot_groups(self) -> dict[str, Any]:
        """Built from a ``KVCacheConfig``: what each group is, and every request's table in each group."""
        if self.coordinator is None:
            return {}
        groups = []
        for g in self.kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            window = getattr(spec, "sliding_window", None)
            kind = "sliding_window" if isinstance(spec, SlidingWindowSpec) else "full_attention"
            groups.append({"kind": kind, "sliding_window": window, "layer_names": list(g.layer_names)})
        tables: dict[str, list[list[int]]] = {}
        for gi, m in enumerate(self.coordinator.single_type_managers):
            for rid, blocks in m.req_to_blocks.items():
                tables.setdefault(rid, [[] for _ in groups])[gi] = [b.block_id for b in blocks]
        return {"groups": groups, "group_block_tables": tables}
