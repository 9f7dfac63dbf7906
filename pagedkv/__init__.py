"""PagedKV Lab: vLLM's PagedAttention rebuilt from scratch.

The names mirror vLLM V1 (``vllm/v1/core/``) so that every class here maps onto one there.
"""

from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from pagedkv.kv_cache_manager import KVCacheBlocks, KVCacheManager, UnknownRequestError
from pagedkv.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from pagedkv.request import Request, RequestStatus
from pagedkv.trace import EventTrace, TraceEvent


def __getattr__(name: str):
    # The scheduler pulls in more of the library; import it on first use.
    if name in ("Scheduler", "SchedulerOutput"):
        from pagedkv import scheduler

        return getattr(scheduler, name)
    if name == "AsyncScheduler":
        from pagedkv.async_scheduler import AsyncScheduler

        return AsyncScheduler
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")


__all__ = [
    "AsyncScheduler",
    "BlockPool",
    "EventTrace",
    "FreeKVCacheBlockQueue",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheTensor",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "TraceEvent",
    "UnknownRequestError",
]
