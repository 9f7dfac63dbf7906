"""Lesson 4's exercise checks: the reference answers pass, and each plausible mistake fails with a message
that names the rule (checked in-process here; tests/test_grading.py grades the generated notebooks)."""

from __future__ import annotations

import pytest

from pagedkv import Request, RequestStatus
from pagedkv.grading.lessons.l04_scheduling import (
    PluggableScheduler,
    example_scenarios,
    example_victim_cases,
    grade_hook,
    grade_select_victim,
    public_scenarios,
    random_victim_cases,
    run_lockstep,
)


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
    ],
)
def test_select_victim_mistakes(fn, message):
    with pytest.raises(AssertionError, match=message):
        grade_select_victim(fn, example_victim_cases(), SCENARIOS)


def test_infinite_loop_is_reported():
    with pytest.raises(AssertionError, match="infinite loop"):
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
