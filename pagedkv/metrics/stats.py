"""Prefix-cache counters: what the cache manager counts between two reads of its stats.

Mirrors ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py`` (its fields ``requests``, ``queries``, ``hits``
and ``reset`` come from ``BaseCacheStats`` there). The lab keeps the four and adds ``hit_rate``; vLLM's
``preempted_*`` counters and its ``record`` method are left out: the lab's ``KVCacheManager.get_computed_blocks``
counts every lookup the same way, preempted or not.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrefixCacheStats"]


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens. Mirrors ``PrefixCacheStats`` in ``vllm/v1/metrics/stats.py``."""

    requests: int = 0  # lookups made
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache
    reset: bool = False  # the cache was reset since the last read

    @property
    def hit_rate(self) -> float:
        """Hits over queries, 0.0 before any query (``CachingMetrics.hit_rate`` in vLLM's stats.py)."""
        return self.hits / self.queries if self.queries else 0.0
