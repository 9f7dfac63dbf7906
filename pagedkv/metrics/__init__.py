"""Counters the engine reports, kept where vLLM 0.26 keeps its own (``vllm/v1/metrics/``)."""

from pagedkv.metrics.stats import PrefixCacheStats

__all__ = ["PrefixCacheStats"]
