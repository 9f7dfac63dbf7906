"""KV cache events: plain records of what the block pool and the KV cache manager did.

Mirrors ``vllm/distributed/kv_events.py`` (``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, ``MEDIUM_GPU``). In vLLM 0.26 the ``BlockPool`` (``vllm/v1/core/block_pool.py``) appends
them to its ``kv_event_queue`` when built with ``enable_kv_cache_events=True``, and the scheduler drains them
once a step through ``KVCacheManager.take_events()`` and publishes them, so that a KV-aware router knows which
prefixes each engine holds. Recording changes nothing in the pool: it is a side channel.

The lab records more than vLLM publishes, and marks what is its own:

- fields ``block_ids`` and ``request_id`` on ``BlockStored`` and ``BlockRemoved``: a router needs only the
  hashes, but the block-table widget points at the physical block and says which request an eviction served;
- the events of a request's block table that vLLM does not publish (``BlocksAllocated``, ``BlocksTouched``,
  ``BlockCopied``, ``RequestForked``, ``BlocksFreed``, ``SkippedBlocksRemoved``), recorded by the lab's
  ``KVCacheManager``: the widget draws every change of the pool, not only what enters or leaves the prefix
  cache. Their names follow the manager methods that make them.

The captions the widget shows are made from these events by ``pagedkv.trace.format_kv_event``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Where the blocks live (``MEDIUM_GPU`` in ``vllm/distributed/kv_events.py``); the lab's pool is the GPU one.
MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class KVCacheEvent:
    """Base class of every KV cache event (``KVCacheEvent`` in ``vllm/distributed/kv_events.py``)."""


# --- vLLM's events ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockStored(KVCacheEvent):
    """Full blocks entered in the prefix cache, in table order (``BlockStored``; vLLM's ``BlockPool.
    cache_full_blocks`` records one per call). ``block_hashes`` are the chain hashes without the group id,
    ``parent_block_hash`` the hash of the block before the first one (``None`` at the start of a request),
    ``token_ids`` the tokens they hold, ``group_idx`` the KV cache group."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    # The lab's: the physical blocks, and the request whose tokens they hold.
    block_ids: list[int] = field(default_factory=list)
    request_id: str | None = None


@dataclass(frozen=True)
class BlockRemoved(KVCacheEvent):
    """A block's prefix left the cache (``BlockRemoved``; vLLM's ``BlockPool._maybe_evict_cached_block``
    records one per hash): evicted because the block was popped for reuse, or by ``evict_blocks``."""

    block_hashes: list[Any]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    # The lab's: the physical block, and the request it was popped for (None for ``evict_blocks``).
    block_ids: list[int] = field(default_factory=list)
    request_id: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared(KVCacheEvent):
    """Every cached prefix was forgotten (``AllBlocksCleared``; vLLM's ``BlockPool.reset_prefix_cache``)."""


# --- the lab's events: a request's block table (vLLM publishes none of these) -----------------------------
# ``tables`` (one list of block ids per KV cache group, 0 for the null block) is set when the manager was
# built from a KVCacheConfig: the widget then draws one table per group.
@dataclass(frozen=True)
class BlocksAllocated(KVCacheEvent):
    """The lab's: fresh blocks popped for a request and appended to its table (``allocate_slots``)."""

    request_id: str
    block_ids: list[int]
    num_blocks_in_table: int
    tables: list[list[int]] | None = None


@dataclass(frozen=True)
class BlocksTouched(KVCacheEvent):
    """The lab's: cache hits put at the start of a request's table, ``ref_cnt + 1`` each (``allocate_slots``
    with ``new_computed_blocks``, which calls ``BlockPool.touch``)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    tables: list[list[int]] | None = None


@dataclass(frozen=True)
class BlockCopied(KVCacheEvent):
    """The lab's: copy-on-write, the fresh ``dst`` replaces the shared ``src`` in the request's table
    (``allocate_slots`` writing into a block a fork shares), ``src`` losing one reference; ``copied``: its KV
    is copied (``get_pending_copies``), unless it held nothing computed yet."""

    request_id: str
    src: int
    dst: int
    copied: bool = True


@dataclass(frozen=True)
class RequestForked(KVCacheEvent):
    """The lab's: ``request_id`` shares every block of ``parent_request_id``'s table (``fork``)."""

    request_id: str
    parent_request_id: str
    block_ids: list[int]
    tables: list[list[int]] | None = None


@dataclass(frozen=True)
class BlocksFreed(KVCacheEvent):
    """The lab's: a request's blocks released, ``ref_cnt - 1`` each, in the order freed (``free``)."""

    request_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class SkippedBlocksRemoved(KVCacheEvent):
    """The lab's: a sliding-window group released the blocks that fell out of its window, the null block in
    their place (``remove_skipped_blocks``, called by ``allocate_slots``). ``block_ids`` are the blocks
    released; ``tables`` what the request holds afterwards."""

    request_id: str
    block_ids: list[int]
    tables: list[list[int]]
