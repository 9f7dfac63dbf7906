"""``pagedkv.parity``: the library against vLLM 0.26's own core, on the same random workloads.

The tests that need vLLM's sources skip, with the reason, when they cannot be fetched (offline, another
platform); vLLM's traces are deterministic and cached, so a verdict never depends on the network once the
sources are there, nor on timing.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from pagedkv import BlockPool
from pagedkv.parity import ParityReport, available, check
from pagedkv.parity import fetch as parity_fetch
from pagedkv.parity.report import Divergence, DriverResult
from pagedkv.parity.runner import compare
from pagedkv.scheduler import Scheduler

pytestmark = pytest.mark.parity


class WrongOrderBlockPool(BlockPool):
    """A planted bug: freed blocks go back to the free queue in the reverse of the order given."""

    def free_blocks(self, ordered_blocks):
        super().free_blocks(list(ordered_blocks)[::-1])


@pytest.fixture(scope="module")
def library_report() -> ParityReport:
    ok, reason = available()
    if not ok:
        pytest.skip(f"vLLM 0.26's sources are unavailable: {reason}")
    from pagedkv.parity.runner import run

    report = run([2, 3, 4, 7], 20, log=lambda _msg: None)
    if report.skipped is not None:
        pytest.skip(f"vLLM 0.26's side could not run: {report.skipped}")
    return report


def test_the_library_agrees_with_vllm_on_every_driver(library_report):
    report = library_report
    assert [(d.name, d.enable_caching) for d in report.drivers] == [
        ("manager", False),
        ("manager", True),
        ("scheduler", None),
        ("async_scheduler", None),
    ]
    assert report.ok, str(report)
    assert all(d.seeds_run == d.seeds_agreeing == 20 for d in report.drivers)
    assert str(report).count("agrees with vLLM 0.26 on 20 random workloads") == 4


def test_the_async_driver_reaches_the_placeholder_rules():
    """The async workloads preempt requests whose step is in flight and stop requests (EOS) with a step in flight,
    whose sample is then discarded: the cases where placeholders matter (no vLLM needed to see it)."""
    from pagedkv.parity import workloads
    from pagedkv.parity.lab_side import LabAsyncSchedulerSide

    preempted_in_flight = discarded = 0
    for seed in range(20):
        cfg = workloads.scheduler_config(seed)
        seen_finished: set[str] = set()
        for entry in workloads.run_async_scheduler(LabAsyncSchedulerSide(cfg), seed, cfg):
            sched, update = entry["obs"].get("schedule"), entry["obs"].get("update")
            assert "error" not in (sched or {}) and "error" not in (update or {})
            if sched:
                preempted_in_flight += sum(sched["placeholders"][r] > 0 for r in sched["preempted"])
            if update:
                discarded += len(seen_finished & set(update["finished"]))  # a batch updated after it stopped
                seen_finished |= set(update["finished"])
    assert preempted_in_flight >= 5 and discarded >= 5


def test_a_planted_bug_is_reported_at_its_first_diverging_step(library_report):
    report = check(3, seeds=5, impl=WrongOrderBlockPool)
    assert not report.ok and report.skipped is None
    (driver,) = report.drivers
    assert driver.seeds_agreeing < driver.seeds_run == 5
    d = driver.divergence
    # Seed 0's operations 0-5 do not depend on the free order; operation 6 is the first allocation after a
    # request freed several blocks at once.
    assert (d.seed, d.index, d.op["op"]) == (0, 6, "admit")
    assert d.vllm["new_blocks"] != d.lab["new_blocks"]
    text = str(report)
    assert "Your WrongOrderBlockPool DIVERGES from vLLM 0.26" in text
    assert "first divergence: workload seed 0" in text and "block tables (vLLM 0.26 | yours)" in text


def test_the_command_line_reports_agreement(library_report):
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.parity", "--lesson", "4", "--seeds", "5"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "The library's Scheduler agrees with vLLM 0.26 on 5 random workloads" in proc.stdout


def test_unavailable_sources_give_a_one_line_reason_and_a_skipped_report(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEDKV_VLLM_WHEEL", str(tmp_path / "no-such.whl"))
    ok, reason = available()
    assert not ok and "\n" not in reason and "PAGEDKV_VLLM_WHEEL" in reason
    report = check(2, seeds=3)
    assert report.skipped is not None and not report.ok
    assert str(report).startswith("vLLM 0.26 parity check skipped: ")


def test_unsupported_platform_is_said_plainly(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDKV_VLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(parity_fetch.sys, "platform", "win32")
    ok, reason = available()
    assert not ok and reason.startswith("unsupported platform")


@pytest.mark.parametrize("lesson, seeds", [(1, 5), (5, 5), (True, 5), (2, 0), (2, True), (3, 2.5)])
def test_check_refuses_bad_arguments(lesson, seeds):
    with pytest.raises(ValueError):
        check(lesson, seeds)


def test_compare_finds_the_first_differing_entry_and_a_trace_that_ends_early():
    a = [{"op": {"op": "free", "rid": "m0"}, "obs": {"num_free": 3}}] * 2
    b = [a[0], {"op": {"op": "free", "rid": "m0"}, "obs": {"num_free": 4}}]
    assert compare(0, {}, a, a) is None
    d = compare(7, {"num_blocks": 4}, a, b)
    assert (d.seed, d.index, d.vllm, d.lab) == (7, 1, {"num_free": 3}, {"num_free": 4})
    d = compare(7, {}, a, a[:1])
    assert d.index == 1 and d.lab is None


def test_report_text_and_html():
    report = ParityReport([4], "Your Sched", [DriverResult("scheduler", 3, 3, 0.5, 0.1)])
    assert str(report).startswith("Your Sched agrees with vLLM 0.26 on 3 random workloads")
    div = Divergence(1, 2, {"num_blocks": 8}, {"op": "step", "step": 2}, {"tables": {"s0": [1, 2]}},
                     {"tables": {"s0": [1, 3]}})
    report.drivers.append(DriverResult("scheduler", 4, 3, 0.5, 0.1, div))
    assert not report.ok and "s0: [1, 2] | [1, 3]   <-- differs" in str(report)
    page = report._repr_html_()
    assert page.startswith("<pre") and '<td style="background:#ffd7d5">3</td>' in page


class FirstChunkScheduler(Scheduler):
    """Admits on the first chunk (the gate off), where vLLM 0.26 waits until the whole prompt fits."""

    def __init__(self, kv_cache_manager, max_num_seqs, max_num_batched_tokens):
        super().__init__(kv_cache_manager, max_num_seqs, max_num_batched_tokens, scheduler_reserve_full_isl=False)


def test_the_scheduler_driver_sees_the_admission_gate(library_report):
    report = check(4, seeds=20, impl=FirstChunkScheduler)
    assert not report.ok
    d = report.drivers[0].divergence
    assert d.op["op"] == "step" and d.vllm["scheduled"] != d.lab["scheduled"]


def test_a_scheduler_factory_is_accepted(library_report):
    report = check(4, seeds=5, impl=functools.partial(Scheduler, policy="fcfs"))
    assert report.ok, str(report)
    assert str(report).startswith("Your Scheduler agrees with vLLM 0.26 on 5 random workloads")


def test_a_constructor_that_raises_is_the_first_divergence(library_report):
    class BrokenPool(BlockPool):
        def __init__(self, num_blocks, enable_caching=True):
            raise RuntimeError("not written yet")

    report = check(2, seeds=3, impl=BrokenPool)
    d = report.drivers[0].divergence
    assert d.index == 0 and d.lab == {"error": "RuntimeError: not written yet"}
