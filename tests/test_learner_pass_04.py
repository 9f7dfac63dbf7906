"""Set 04 (scheduling), a learner's pass: plausible mistakes that the set's own tests do not plant fail with a
message that names the mistake (the call, what happened, and the rule), in a check cell and under grading alike
(both run these checks: the lockstep records are compared in the grader's process)."""

from __future__ import annotations

import pytest
from test_exercises_04_scheduling import SCENARIOS, preempt, schedule_waiting, select_victim

from pagedkv import RequestStatus
from pagedkv.grading.lessons.l04_scheduling import example_victim_cases, grade_hook, grade_select_victim

assert preempt and select_victim  # the reference answers the mistakes below are made from


def waiting_no_status(scheduler, step):  # admitted, but its status left WAITING
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if (
            manager.allocate_slots(request, num_new, hits, full_sequence_must_fit=scheduler.scheduler_reserve_full_isl)
            is None
        ):
            break
        scheduler.waiting.pop_request()
        request.num_computed_tokens = num_hit
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_never_pops(scheduler, step):  # admitted, but left in the waiting queue
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if (
            manager.allocate_slots(request, num_new, hits, full_sequence_must_fit=scheduler.scheduler_reserve_full_isl)
            is None
        ):
            break
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_ignores_none(scheduler, step):  # admits whether or not allocate_slots found the room
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget > 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        manager.allocate_slots(request, num_new, hits, full_sequence_must_fit=scheduler.scheduler_reserve_full_isl)
        scheduler.waiting.pop_request()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def waiting_budget_ge_0(scheduler, step):  # goes on admitting with an empty budget
    if step.preempted:
        return
    manager = scheduler.kv_cache_manager
    while scheduler.waiting and step.token_budget >= 0 and len(scheduler.running) < scheduler.max_num_running_reqs:
        request = scheduler.waiting.peek_request()
        hits, num_hit = manager.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, step.token_budget)
        if (
            manager.allocate_slots(request, num_new, hits, full_sequence_must_fit=scheduler.scheduler_reserve_full_isl)
            is None
        ):
            break
        scheduler.waiting.pop_request()
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        step.schedule(request, num_new)


def victim_latest_arrival(running, policy):  # FCFS read as "the latest arrival"
    if policy == "fcfs":
        return max(running, key=lambda r: r.arrival_time)
    return max(running, key=lambda r: (r.priority, r.arrival_time))


def victim_policies_swapped(running, policy):
    if policy == "priority":
        return running[-1]
    return max(running, key=lambda r: (r.priority, r.arrival_time))


def test_the_reference_answers_still_pass() -> None:
    grade_hook("schedule_waiting", schedule_waiting, SCENARIOS[:12])


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            waiting_no_status,
            r"step 0: 'A' is in scheduler.running with status WAITING, expected RUNNING: on "
            r"admission set request.status = RequestStatus.RUNNING",
        ),
        (
            waiting_never_pops,
            r"'A' is already scheduled in this step and is still in scheduler.waiting: pop each "
            r"admitted request",
        ),
        (waiting_ignores_none, r"'big' holds no blocks. Did allocate_slots return None for it\? Then it does not fit"),
        (waiting_budget_ge_0, r"this step's token budget is used up \(step.token_budget is 0\)"),
    ],
    ids=["no_status", "never_pops", "ignores_none", "budget_ge_0"],
)
def test_admission_mistakes_are_named(fn, message) -> None:
    with pytest.raises(AssertionError, match=message):
        grade_hook("schedule_waiting", fn, SCENARIOS)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            victim_latest_arrival,
            r"select_victim\(\[a, b, c\], 'fcfs'\) returned 'b', expected 'c'. 'b' is the latest "
            r"arrival and the priority rule's victim; FCFS preempts the last request in `running`",
        ),
        (
            victim_policies_swapped,
            r"returned 'b', expected 'c'. 'b' is the latest arrival and the priority rule's "
            r"victim",
        ),
    ],
    ids=["latest_arrival", "policies_swapped"],
)
def test_fcfs_victim_mistakes_are_named(fn, message) -> None:
    with pytest.raises(AssertionError, match=message):
        grade_select_victim(fn, example_victim_cases(), SCENARIOS)


def victim_last_of_a_tie(running, policy):  # sorted is stable: the LAST of two full ties
    return sorted(running, key=lambda r: (r.priority, r.arrival_time))[-1] if policy == "priority" else running[-1]


def victim_by_the_waiting_queues_order(running, policy):  # the priority queue's last: ties go to the larger id
    from pagedkv.request_queue import PriorityRequestQueue

    if policy != "priority":
        return running[-1]
    queue = PriorityRequestQueue()
    for r in running:
        queue.add_request(r)
    return queue[len(queue) - 1]


@pytest.mark.parametrize("fn", [victim_last_of_a_tie, victim_by_the_waiting_queues_order])
def test_a_full_tie_goes_to_the_first_in_running(fn) -> None:
    """vLLM 0.26 picks ``max(running, key=lambda r: (r.priority, r.arrival_time))``: on a full tie the first in
    ``running``. No case had a full tie, so the last of the tied, or the library's priority queue's order (a
    red-team pass: 2/2 without writing the rule), scored full marks."""
    with pytest.raises(AssertionError, match=r"returned 'e', expected 'b'. 'e' and 'b' tie on priority and arrival"):
        grade_select_victim(fn, example_victim_cases(), SCENARIOS)
