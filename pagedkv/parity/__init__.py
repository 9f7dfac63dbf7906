"""Prove it against vLLM itself: drive vLLM 0.26's own ``KVCacheManager`` and ``Scheduler`` beside the lab's
(or yours) on the same random workloads and compare what they do after every operation and every step.

vLLM's ``vllm/v1/core/`` is pure Python: it runs on a CPU without a GPU and without installing vLLM. The
first check downloads the vLLM 0.26.0 wheel once (``pip download vllm==0.26.0 --no-deps``, about 300 MB),
keeps only its ``.py`` sources, and installs the few pure-Python packages its core imports into a folder
of their own (see :mod:`pagedkv.parity.fetch` for where, and why not the lab's environment); vLLM then
runs in a worker process so that nothing of it enters your Python session. vLLM's traces are cached, so
later checks with the same seeds take seconds.

Drivers (:mod:`pagedkv.parity.workloads`):

- ``manager`` (lessons 2 and 3: prefix caching off, then on): admit requests (cache lookup then
  ``allocate_slots``), decode tokens, free, reset; block ids, hit lengths and free counts after every
  operation.
- ``scheduler`` (lesson 4): FCFS, recompute preemption, chunked prefill, prefix caching, vLLM 0.26's
  full-sequence admission gate on (the lab's default); scheduled tokens, preemptions, block tables and kept
  outputs after every step.
- ``hybrid_manager`` and ``hybrid_scheduler`` (lesson 8): the same over KV cache groups on one pool (full
  attention + sliding window, full + two sliding groups of one spec, and all sliding), vLLM's own
  ``HybridKVCacheCoordinator``/``UnitaryKVCacheCoordinator`` against the lab's: prefix sharing, chunked
  prefill and decodes past the window, frees and evictions; block ids per group, hit lengths and free
  counts after every operation, and the scheduler step for step.
- ``async_scheduler`` (lesson 7): the same workloads through the ``AsyncScheduler``, called in the order vLLM
  0.26's ``EngineCore.step_with_batch_queue`` calls it (schedule N+1, then update N): scheduled tokens, output
  placeholders, preemptions, block tables, and which samples are kept after every call.
- ``hybrid_async_scheduler`` (lesson 8): the ``AsyncScheduler`` over the hybrid groups, two batches in flight,
  so a sliding group's admission cap counts ``VllmConfig.max_in_flight_tokens`` (``max_concurrent_batches``,
  2, times ``max_num_batched_tokens``); a ``Scheduler``-compatible ``impl`` that is not an ``AsyncScheduler``
  leaves this driver to the library's ``AsyncScheduler``.

``impl`` may be a ``BlockPool``-, ``KVCacheManager``- or ``Scheduler``-compatible class (yours), run on the
lab's side in place of the library's.

    >>> from pagedkv import parity
    >>> print(parity.check(3, seeds=20))          # doctest: +SKIP
    The library agrees with vLLM 0.26 on 20 random workloads: block pool + KV cache manager ...

Command line: ``python -m pagedkv.parity [--lesson 2|3|4|7|8] [--seeds N]``.
"""

from __future__ import annotations

from typing import Any

from pagedkv.parity.report import Divergence, DriverResult, ParityReport
from pagedkv.utils import check_int

__all__ = ["Divergence", "DriverResult", "ParityReport", "available", "check"]


def available() -> tuple[bool, str]:
    """Whether vLLM 0.26's sources are (or can now be made) ready: ``(True, where)`` or ``(False, one-line
    reason)``. May download and install on first use (see :mod:`pagedkv.parity.fetch`); never raises."""
    try:
        from pagedkv.parity import fetch

        sources = fetch.ensure_vllm(log=lambda _msg: None)
        return True, f"vLLM {fetch.VLLM_VERSION}'s sources are ready in {sources.cache_dir}"
    except Exception as exc:  # noqa: BLE001 - the contract is a reason, never an exception
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return False, reason


def check(lesson: int, seeds: int = 20, impl: Any = None) -> ParityReport:
    """Drive vLLM 0.26 and the lab (or ``impl``, your class) through ``seeds`` random workloads of
    ``lesson``'s driver (2: block pool and manager, prefix caching off; 3: with prefix caching; 4: the
    scheduler; 7: the async scheduler, two batches in flight; 8: manager, scheduler and async scheduler over
    hybrid KV cache groups) and report: ``print(report)`` says "agrees with vLLM 0.26 on N random workloads"
    or shows the first diverging step with both sides' block tables; ``report.ok`` is the verdict. When vLLM's sources
    cannot be fetched (offline, unsupported platform) the report says why (``report.skipped``) instead of
    raising. ``ValueError`` for a lesson other than 2, 3, 4, 7, 8 or a seed count below 1. For lesson 8,
    ``impl`` is a ``KVCacheManager``-compatible class built as ``impl(kv_cache_config, max_model_len=...,
    max_in_flight_tokens=..., enable_caching=...)``, or a ``Scheduler``-compatible one."""
    from pagedkv.parity.runner import LESSON_DRIVERS, run

    if isinstance(lesson, bool) or lesson not in LESSON_DRIVERS:
        raise ValueError(f"lesson must be one of {sorted(LESSON_DRIVERS)}, got {lesson!r}")
    seeds = check_int(seeds, "seeds", 1)
    return run([lesson], seeds, impl)
