"""Lesson 8's parity check: the lab's KV cache manager, scheduler and async scheduler over hybrid KV cache groups
against vLLM 0.26's own, on the same random workloads (skipped, with the reason, when vLLM's sources cannot be
fetched)."""

from __future__ import annotations

import pytest

from pagedkv import KVCacheManager
from pagedkv.async_scheduler import AsyncScheduler
from pagedkv.parity import ParityReport, available, check
from pagedkv.parity.runner import LESSON_DRIVERS
from pagedkv.single_type_kv_cache_manager import SlidingWindowManager

pytestmark = [pytest.mark.parity, pytest.mark.slow]

NUM_SEEDS = 200


@pytest.fixture(scope="module")
def hybrid_report() -> ParityReport:
    ok, reason = available()
    if not ok:
        pytest.skip(f"vLLM 0.26's sources are unavailable: {reason}")
    from pagedkv.parity.runner import run

    report = run([8], NUM_SEEDS, log=lambda _msg: None)
    if report.skipped is not None:
        pytest.skip(f"vLLM 0.26's side could not run: {report.skipped}")
    return report


DRIVERS = ["hybrid_manager", "hybrid_scheduler", "hybrid_async_scheduler"]


def test_lesson_8_runs_the_hybrid_manager_and_scheduler_drivers():
    assert LESSON_DRIVERS[8] == [(name, None) for name in DRIVERS]


def test_the_library_agrees_with_vllm_on_hybrid_configs(hybrid_report):
    assert hybrid_report.ok, str(hybrid_report)
    assert [d.name for d in hybrid_report.drivers] == DRIVERS
    assert all(d.seeds_run == d.seeds_agreeing == NUM_SEEDS for d in hybrid_report.drivers)


class WiderWindow(KVCacheManager):
    """A planted bug: every sliding-window group keeps one token more than its window."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for m in self.single_type_managers:
            if isinstance(m, SlidingWindowManager):
                m.sliding_window += 1


def test_a_window_off_by_one_is_caught(hybrid_report):
    report = check(8, seeds=20, impl=WiderWindow)
    assert not report.ok and report.skipped is None
    d = report.drivers[0].divergence
    assert d is not None and d.vllm != d.lab
    assert "Your WiderWindow DIVERGES from vLLM 0.26" in str(report)
    assert ".g" in str(report)  # per-group tables are shown


class OneBatchInFlight(AsyncScheduler):
    """The bug 155d428 fixed: a sliding group's admission cap counts one step's tokens in flight, not vLLM's
    ``VllmConfig.max_concurrent_batches`` (2 with async scheduling) times ``max_num_batched_tokens``."""

    max_concurrent_batches = 1


def test_one_batch_in_flight_is_caught_by_the_hybrid_async_driver(hybrid_report):
    """22 of the 200 seeds catch it, the first seed 16 (the lab admits a request that vLLM's cap refuses)."""
    report = check(8, seeds=17, impl=OneBatchInFlight)
    async_driver = report.drivers[DRIVERS.index("hybrid_async_scheduler")]
    assert async_driver.name == "hybrid_async_scheduler" and async_driver.divergence is not None


def test_the_hybrid_async_driver_preempts_with_steps_in_flight():
    """Tight pools: requests preempted while a step of theirs is in flight, in sliding and full+sliding
    layouts (no vLLM needed to see it)."""
    from pagedkv.parity import workloads
    from pagedkv.parity.lab_side import LabAsyncSchedulerSide

    layouts = set()
    for seed in range(20):
        cfg, drive = workloads.driver("hybrid_async_scheduler", seed, None)
        for entry in drive(LabAsyncSchedulerSide(cfg), seed, cfg):
            sched, update = entry["obs"].get("schedule"), entry["obs"].get("update")
            assert "error" not in (sched or {}) and "error" not in (update or {})
            if sched and any(sched["placeholders"][r] > 0 for r in sched["preempted"]):
                layouts.add(tuple(kind for kind, _ in cfg.groups))
    assert {("sliding",), ("full", "sliding")} <= layouts
