"""Lesson 8's parity check: the lab's KV cache manager and scheduler over hybrid KV cache groups against vLLM
0.26's own, on the same random workloads (skipped, with the reason, when vLLM's sources cannot be fetched)."""

from __future__ import annotations

import pytest

from pagedkv import KVCacheManager
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


def test_lesson_8_runs_the_hybrid_manager_and_scheduler_drivers():
    assert LESSON_DRIVERS[8] == [("hybrid_manager", None), ("hybrid_scheduler", None)]


def test_the_library_agrees_with_vllm_on_hybrid_configs(hybrid_report):
    assert hybrid_report.ok, str(hybrid_report)
    assert [d.name for d in hybrid_report.drivers] == ["hybrid_manager", "hybrid_scheduler"]
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
