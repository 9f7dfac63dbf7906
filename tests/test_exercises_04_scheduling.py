"""Lesson 4's exercise checks: the reference answers pass, and each plausible mistake fails with a message
that names the rule (checked in-process here; tests/test_grading.py grades the generated notebooks)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from pagedkv import Request, RequestStatus
from pagedkv.grading.lessons import l04_scheduling
from pagedkv.grading.lessons.l04_scheduling import (
    PluggableScheduler,
    drive_select_victim,
    drive_serve,
    example_scenarios,
    example_victim_cases,
    grade_hook,
    grade_select_victim,
    public_scenarios,
    random_victim_cases,
    run_lockstep,
    scenario_spec,
)
from pagedkv.grading.plain import decode, encode

ROOT = Path(__file__).resolve().parents[1]


def schedule_waiting(scheduler, step):
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0:
        if len(scheduler.running) >= scheduler.max_num_running_reqs:
            break
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if manager.allocate_slots(request, num_new, hits,
                                  full_sequence_must_fit=scheduler.scheduler_reserve_full_isl) is None:
            break
        scheduler.waiting.pop_request()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def select_victim(running, policy):
    return max(running, key=lambda r: (r.priority, r.arrival_time)) if policy == "priority" else running[-1]


def preempt(scheduler, step, victim):
    scheduler.kv_cache_manager.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    scheduler.waiting.prepend_request(victim)


# --- plausible mistakes ------------------------------------------------------------------------------
def waiting_skips_ahead(scheduler, step):  # the seed card's loop: pass over a request that does not fit
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    for request in list(scheduler.waiting):
        if step.token_budget <= 0 or len(scheduler.running) >= scheduler.max_num_running_reqs:
            break
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if manager.allocate_slots(request, num_new, hits,
                                  full_sequence_must_fit=scheduler.scheduler_reserve_full_isl) is None:
            continue
        scheduler.waiting.remove_request(request)
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_while_preempting(scheduler, step):
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if manager.allocate_slots(request, num_new, hits,
                                  full_sequence_must_fit=scheduler.scheduler_reserve_full_isl) is None:
            break
        scheduler.waiting.pop_request()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_ignores_hits(scheduler, step):
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if manager.allocate_slots(request, num_new, hits,
                                  full_sequence_must_fit=scheduler.scheduler_reserve_full_isl) is None:
            break
        scheduler.waiting.pop_request()
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_first_chunk_only(scheduler, step):  # the gate before vLLM 0.26: only the chunk must fit
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if manager.allocate_slots(request, num_new, hits) is None:
            break
        scheduler.waiting.pop_request()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_infinite(scheduler, step):
    while scheduler.waiting:
        pass


def victim_oldest(running, policy):
    return max(running, key=lambda r: (r.priority, r.arrival_time)) if policy == "priority" else running[0]


def victim_most_important(running, policy):
    return min(running, key=lambda r: (r.priority, r.arrival_time)) if policy == "priority" else running[-1]


def preempt_loses_outputs(scheduler, step, victim):
    scheduler.kv_cache_manager.free(victim)
    del victim.output_token_ids[:]
    del victim._all_token_ids[victim.num_prompt_tokens :]
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    scheduler.waiting.prepend_request(victim)


def preempt_to_tail(scheduler, step, victim):
    scheduler.kv_cache_manager.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    scheduler.waiting.add_request(victim)


def preempt_keeps_computed(scheduler, step, victim):
    scheduler.kv_cache_manager.free(victim)
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    scheduler.waiting.prepend_request(victim)


def preempt_stub(scheduler, step, victim): ...


def schedule_waiting_stub(scheduler, step): ...


def select_victim_stub(running, policy): ...


def victim_id(running, policy):  # the id, not the request
    return select_victim(running, policy).request_id


def victim_copy(running, policy):  # an equal-looking request that is not one of them
    v = select_victim(running, policy)
    return Request(v.request_id, [1], priority=v.priority, arrival_time=v.arrival_time)


def victim_raises(running, policy):
    return running[len(running)]


def waiting_raises(scheduler, step):
    if scheduler.step == 2:
        raise ValueError("boom")
    schedule_waiting(scheduler, step)


SCENARIOS = example_scenarios() + public_scenarios(0, 30)


def test_reference_answers_pass():
    grade_hook("schedule_waiting", schedule_waiting, SCENARIOS)
    grade_select_victim(select_victim, example_victim_cases() + random_victim_cases(5, 100), SCENARIOS)
    grade_hook("preempt", preempt, SCENARIOS)
    for scenario in SCENARIOS[:12]:
        run_lockstep(scenario, {"schedule_waiting": schedule_waiting, "select_victim": select_victim,
                                "preempt": preempt})


@pytest.mark.parametrize(
    ("name", "fn", "message"),
    [
        ("schedule_waiting", schedule_waiting_stub, "still the stub"),
        ("schedule_waiting", waiting_skips_ahead, "past 'big', which did not fit"),
        ("schedule_waiting", waiting_while_preempting, "in a step that preempted"),
        ("schedule_waiting", waiting_ignores_hits, "prefix-cache hit length"),
        ("schedule_waiting", waiting_first_chunk_only, "whole sequence"),
        ("preempt", preempt_stub, "still holds blocks"),
        ("preempt", preempt_loses_outputs, "lost output tokens"),
        ("preempt", preempt_to_tail, "head of waiting"),
        ("preempt", preempt_keeps_computed, "expected 0"),
        ("select_victim", victim_oldest, "oldest running request"),
    ],
)
def test_mistakes_fail_with_a_message_naming_the_rule(name, fn, message):
    with pytest.raises(AssertionError, match=message):
        grade_hook(name, fn, SCENARIOS)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (select_victim_stub, "still the stub"),
        (victim_oldest, "That is the oldest running request"),
        (victim_most_important, "less important"),
        (victim_id, "returned 'c', which is not one of the running requests"),
        (victim_copy, "which is not one of the running requests"),
        (victim_raises, r"select_victim\(\[a, b, c\], 'fcfs'\) raised IndexError: list index out of range \(in "
                        r"victim_raises, line \d+: return running\[len\(running\)\]\)"),
    ],
)
def test_select_victim_mistakes(fn, message):
    with pytest.raises(AssertionError, match=message):
        grade_select_victim(fn, example_victim_cases(), SCENARIOS)


def test_infinite_loop_is_reported():
    with pytest.raises(AssertionError, match=r"the scenarios did not finish within 1 s with your schedule_waiting: is "
                                             r"there an infinite loop \(for instance a request that is never popped "
                                             r"from scheduler.waiting\)\? It was serving scenario 'chunked prefill'"):
        grade_hook("schedule_waiting", waiting_infinite, SCENARIOS[:1], timeout=1)


def test_step_view_validates():
    scenario = example_scenarios()[0]
    errors = []

    def bad(scheduler, step):
        request = scheduler.waiting.peek_request()
        for args in ((request, 0), (request, 10**6), (request, 3)):
            try:
                step.schedule(*args)
            except ValueError as exc:
                errors.append(str(exc))

    s = PluggableScheduler(scenario.manager(), 4, 12, schedule_waiting=bad)
    s.add_request(Request("A", [1] * 10))
    s.schedule()
    assert len(errors) == 3
    assert "int >= 1" in errors[0] and "budget" in errors[1] and "not in scheduler.running" in errors[2]


def test_a_raise_in_the_hook_is_reported_with_its_step_and_line():
    with pytest.raises(AssertionError, match=r"step 2: scheduler.schedule\(\) raised ValueError: boom \(in "
                                             r"waiting_raises, line \d+: raise ValueError"):
        grade_hook("schedule_waiting", waiting_raises, example_scenarios()[:1])


def test_records_are_plain_and_deterministic():
    spec = scenario_spec(example_scenarios()[4])
    record = drive_serve(spec, None, None, preempt)
    assert decode(encode(record)) == record == drive_serve(spec, None, None, preempt)
    assert record["end"] == "finished" and any(step["preempted"] for step in record["steps"])
    assert record == drive_serve(spec)  # the reference's hooks give the same record
    cases = example_victim_cases()
    assert drive_select_victim(cases, select_victim) == [{"victim": v} for v in "caabbab"]


def _stub_everything_hidden(monkeypatch, symbols):
    """What the sandbox does to the library: every listed symbol raises."""
    for symbol in symbols:
        parts = symbol.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for part in parts[i:-1]:
            owner = getattr(owner, part)

        def stub(*args, _symbol=symbol, **kwargs):
            raise RuntimeError(f"your code calls the library's {_symbol}, which is not available while grading")

        monkeypatch.setattr(owner, parts[-1], stub)


@pytest.mark.parametrize("question", ["schedule_waiting", "select_victim", "preempt"])
def test_scenarios_run_where_the_reference_and_the_checks_are_stubs(monkeypatch, question):
    """The scenarios call nothing the sandbox hides for the exercise (its reference, the lesson's checks and case
    builders, ``expected_victim``): with all of them stubbed, the solution's records are the reference's; and a
    select_victim that asks the lesson module's ``expected_victim`` for the answer fails."""
    from pagedkv.grading import worker

    refs = {q.name: q.reference for q in worker.load_tests(ROOT / "grading" / "autograder" / "04_scheduling.zip")}
    assert "pagedkv.grading.lessons.l04_scheduling.example_scenarios" in refs[question]
    specs = [scenario_spec(s) for s in example_scenarios() + public_scenarios(0, 8)]
    want = [drive_serve(spec) for spec in specs]
    cases = example_victim_cases() + random_victim_cases(5, 50)
    want_victims = drive_select_victim(cases, select_victim)
    hooks = {"schedule_waiting": schedule_waiting, "select_victim": select_victim, "preempt": preempt}
    args = [hooks[h] if h == question else None for h in ("schedule_waiting", "select_victim", "preempt")]

    def through_the_lesson(running, policy):
        return l04_scheduling.expected_victim(running, policy)

    _stub_everything_hidden(monkeypatch, refs[question])
    assert [drive_serve(spec, *args) for spec in specs] == want
    if question == "select_victim":
        assert drive_select_victim(cases, select_victim) == want_victims
        assert "not available while grading" in drive_select_victim(cases, through_the_lesson)[0]["message"]
