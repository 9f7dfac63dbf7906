"""PagedKV Lab: vLLM's PagedAttention rebuilt from scratch.

The names mirror vLLM V1 (``vllm/v1/core/``) so that every class here maps onto one there.
"""

from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_manager import KVCacheManager, UnknownRequestError
from pagedkv.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from pagedkv.request import Request, RequestStatus
from pagedkv.trace import EventTrace, TraceEvent

__all__ = [
    "BlockPool",
    "EventTrace",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "Request",
    "RequestStatus",
    "TraceEvent",
    "UnknownRequestError",
]
