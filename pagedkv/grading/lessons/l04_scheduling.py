"""Lesson 4's exercises: a scheduler with the admission loop, the victim choice and the preemption step
plugged in from the learner's functions, and the checks that run it in lockstep with the reference.

The learner writes three functions (see ``grading/source/04_scheduling.ipynb``):

- ``schedule_waiting(scheduler, step)``: the admission loop of ``Scheduler.schedule`` (vLLM:
  the ``while self.waiting`` loop of ``vllm/v1/core/sched/scheduler.py``);
- ``select_victim(running, policy)``: which running request to preempt;
- ``preempt(scheduler, step, victim)``: preemption by recompute (vLLM: ``Scheduler._preempt_request``).

:class:`PluggableScheduler` calls them where the reference :class:`~pagedkv.scheduler.Scheduler` runs its
own; a hook left out uses the reference, so each exercise is graded on its own. The check functions serve a
scenario with the learner's scheduler and with the reference at the same time, step by step, on shadow
memory with the fake model, and stop at the first difference with a message that names the step, the
requests and the rule (admitting past a request that does not fit, preempting the oldest, losing output
tokens on recompute, ...).
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request, RequestStatus
from pagedkv.scheduler import Scheduler, _StepState
from pagedkv.sim.model import FakeModel
from pagedkv.sim.runner import KVCacheCorruptionError, SimModelRunner
from pagedkv.utils import cdiv, check_int

MODEL = FakeModel(vocab_size=1000, seed=4)


def _fail(message: str) -> None:
    raise AssertionError(message)


def _where(exc: BaseException) -> str:
    """Where the learner's code raised: the innermost frame that is not in the library."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/pagedkv/" not in f.filename]
    if not frames:
        return ""
    last = frames[-1]
    code = (last.line or "").strip()
    return f" (in {last.name}, line {last.lineno}: {code})" if code else f" (in {last.name}, line {last.lineno})"


# ---------------------------------------------------------------------------------------------------
# The pluggable scheduler
# ---------------------------------------------------------------------------------------------------
class StepView:
    """The step being scheduled, as the exercise functions see it.

    ``token_budget``: tokens still available in this step. ``preempted``: the requests preempted so far in
    this step (a list). ``num_scheduled_tokens``: a copy of what is scheduled so far. ``schedule(request,
    num_new_tokens)`` records an admitted request's tokens and takes them from the budget.
    """

    def __init__(self, scheduler: Scheduler, state: _StepState) -> None:
        self._scheduler = scheduler
        self._state = state

    @property
    def token_budget(self) -> int:
        return self._state.token_budget

    @property
    def preempted(self) -> list[Request]:
        return self._state.preempted

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return dict(self._state.num_scheduled_tokens)

    def schedule(self, request: Request, num_new_tokens: int) -> None:
        """Schedule ``num_new_tokens`` tokens of a request just admitted, starting at its
        ``num_computed_tokens``. Checks (``ValueError``) that it is running, has the slots, and fits the budget."""
        s, state = self._scheduler, self._state
        rid = getattr(request, "request_id", None)
        if not isinstance(request, Request):
            raise ValueError(f"step.schedule takes a Request, got {type(request).__name__}")
        check_int(num_new_tokens, f"step.schedule({rid!r}, ...): the number of tokens", 1)
        if rid in state.num_scheduled_tokens:
            raise ValueError(f"step.schedule({rid!r}, ...): {rid!r} is already scheduled in this step")
        if num_new_tokens > state.token_budget:
            raise ValueError(
                f"step.schedule({rid!r}, {num_new_tokens}): only {state.token_budget} tokens are left in this "
                "step's budget (step.token_budget): schedule min(tokens to compute, step.token_budget)"
            )
        if not any(r is request for r in s.running):
            raise ValueError(
                f"step.schedule({rid!r}, ...): {rid!r} is not in scheduler.running: append it there (and pop it "
                "from scheduler.waiting) before scheduling its tokens"
            )
        manager = s.kv_cache_manager
        table = manager.req_to_blocks.get(rid)
        end = request.num_computed_tokens + num_new_tokens
        if end > request.num_tokens:
            raise ValueError(
                f"step.schedule({rid!r}, {num_new_tokens}): {rid!r} has {request.num_tokens} tokens and "
                f"num_computed_tokens={request.num_computed_tokens}, so at most "
                f"{request.num_tokens - request.num_computed_tokens} can be scheduled"
            )
        if table is None or len(table) * manager.block_size < end:
            have = 0 if table is None else len(table) * manager.block_size
            raise ValueError(
                f"step.schedule({rid!r}, {num_new_tokens}): its block table has {have} slots but tokens up to "
                f"position {end - 1} need {end}: call allocate_slots (with its cache hits) first"
            )
        state.add(request, num_new_tokens, manager.get_block_ids(rid))
        if request.num_preemptions > 0:
            state.scheduled_resumed.append(request)
        else:
            state.scheduled_new.append(request)
        copies = manager.get_pending_copies()
        if copies:
            state.copies[rid] = copies


class PluggableScheduler(Scheduler):
    """A ``Scheduler`` (recompute preemption) whose admission loop, victim choice and preemption step are
    functions passed in; ``None`` keeps the reference's.

    - ``schedule_waiting(scheduler, step)`` replaces ``Scheduler._schedule_waiting``;
    - ``select_victim(running, policy)`` (a copy of ``running``; ``"fcfs"`` or ``"priority"``) returns the
      request to preempt;
    - ``preempt(scheduler, step, victim)`` takes the victim (already removed from ``running``) off the GPU
      and puts it back in ``waiting``; the scheduler then lists it in ``step.preempted``.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        *,
        schedule_waiting: Callable[[Scheduler, StepView], Any] | None = None,
        select_victim: Callable[[list[Request], str], Request] | None = None,
        preempt: Callable[[Scheduler, StepView, Request], Any] | None = None,
    ) -> None:
        super().__init__(kv_cache_manager, max_num_seqs, max_num_batched_tokens, policy=policy)
        self.schedule_waiting_fn = schedule_waiting
        self.select_victim_fn = select_victim
        self.preempt_fn = preempt

    def _schedule_waiting(self, state: _StepState) -> None:
        if self.schedule_waiting_fn is None:
            return super()._schedule_waiting(state)
        self.schedule_waiting_fn(self, StepView(self, state))
        if len(self.running) > self.max_num_running_reqs:
            raise ValueError(
                f"after schedule_waiting, {len(self.running)} requests are running but max_num_seqs is "
                f"{self.max_num_running_reqs}: stop admitting when len(scheduler.running) reaches "
                "scheduler.max_num_running_reqs"
            )

    def _select_victim(self) -> Request:
        if self.select_victim_fn is None:
            return super()._select_victim()
        victim = self.select_victim_fn(list(self.running), self.policy.value)
        if not any(r is victim for r in self.running):
            raise ValueError(
                f"select_victim returned {victim!r}, which is not one of the running requests "
                f"{[r.request_id for r in self.running]}"
            )
        return victim

    def _preempt_request(self, request: Request, state: _StepState | None = None) -> None:
        if self.preempt_fn is None:
            return super()._preempt_request(request, state)
        if state is None:
            state = _StepState(token_budget=0)
        state.copies.pop(request.request_id, None)
        self.preempt_fn(self, StepView(self, state), request)
        state.preempted.append(request)


# ---------------------------------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------------------------------
@dataclass
class Scenario:
    """A workload and a pool: requests ``(rid, prompt, max_tokens, priority)``, added before step
    ``arrivals[rid]`` (default 0), served by a scheduler with these settings."""

    name: str
    num_blocks: int
    block_size: int
    max_num_seqs: int
    budget: int
    requests: list[tuple[str, list[int], int, int]]
    arrivals: dict[str, int] = field(default_factory=dict)
    policy: str = "fcfs"
    caching: bool = False

    def fresh_requests(self) -> dict[str, Request]:
        return {
            rid: Request(rid, prompt, max_tokens=m, priority=p, arrival_time=float(i))
            for i, (rid, prompt, m, p) in enumerate(self.requests)
        }

    def manager(self) -> KVCacheManager:
        return KVCacheManager(self.num_blocks, self.block_size, enable_caching=self.caching)

    def describe(self) -> str:
        return (
            f"scenario {self.name!r} ({len(self.requests)} requests, {self.num_blocks - 1} usable blocks of "
            f"{self.block_size} tokens, budget {self.budget} tokens/step, max_num_seqs {self.max_num_seqs}, "
            f"policy {self.policy}, prefix caching {'on' if self.caching else 'off'})"
        )


def example_scenarios() -> list[Scenario]:
    """Small hand-made scenarios, each isolating one rule."""
    return [
        Scenario("chunked prefill", 16, 4, 3, 12, [("A", [1] * 10, 3, 0), ("B", [2] * 6, 3, 0),
                                                   ("C", [3] * 5, 3, 0), ("D", [4] * 3, 3, 0)]),
        Scenario("fcfs stops at the first that does not fit", 8, 4, 4, 1000,
                 [("run", [1] * 8, 4, 0), ("big", [2] * 24, 2, 0), ("small", [3] * 4, 2, 0)],
                 arrivals={"big": 1, "small": 1}),
        Scenario("max_num_seqs", 40, 4, 2, 64, [(f"r{i}", [i + 1] * 5, 3, 0) for i in range(5)]),
        Scenario("prefix hit", 20, 4, 4, 64,
                 [("a", list(range(10)), 3, 0), ("b", list(range(8)) + [50, 51, 52, 53], 3, 0)],
                 arrivals={"b": 2}, caching=True),
        Scenario("preemption", 7, 4, 4, 64,
                 [("A", [1] * 8, 5, 0), ("B", [2] * 8, 5, 0), ("C", [3] * 8, 5, 0), ("D", [4] * 3, 2, 0)],
                 arrivals={"D": 1}),
        Scenario("no admission in a preempting step", 5, 4, 4, 64,
                 [("A", [1] * 8, 5, 0), ("X", [2] * 5, 5, 5), ("D", [3] * 3, 2, 1)],
                 arrivals={"D": 1}, policy="priority"),
        Scenario("repeated preemption", 11, 2, 6, 10,
                 [(f"p{i}", [i + 1] * (3 + i), 6 + i, 0) for i in range(5)]),
    ]


def random_scenario(seed: int, *, policy: str | None = None, caching: bool | None = None) -> Scenario:
    """A seeded random workload under memory pressure (some runs preempt often, some never)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(6, 24)
    usable = (num_blocks - 1) * block_size
    shared = [rng.randrange(100) for _ in range(rng.choice([0, 0, block_size, 2 * block_size]))]
    reqs = []
    arrivals = {}
    for i in range(rng.randint(3, 10)):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(100) for _ in range(rng.randint(1, 20))]
        if len(prompt) >= usable:
            prompt = prompt[: max(1, usable // 2)]
        max_tokens = max(1, min(rng.randint(1, 16), usable - len(prompt)))
        rid = f"s{seed}-{i}"
        reqs.append((rid, prompt, max_tokens, rng.randint(0, 3)))
        arrivals[rid] = rng.choice([0, 0, 0, rng.randint(1, 12)])
    return Scenario(
        f"random #{seed}",
        num_blocks,
        block_size,
        rng.randint(1, 6),
        rng.randint(2, 40),
        reqs,
        arrivals,
        policy=policy if policy is not None else rng.choice(["fcfs", "priority"]),
        caching=caching if caching is not None else rng.random() < 0.5,
    )


# ---------------------------------------------------------------------------------------------------
# Lockstep comparison with the reference
# ---------------------------------------------------------------------------------------------------
def _ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def _admission_diagnosis(step: int, extra: str, ref: Scheduler, ref_out, mine_before_waiting: list[str]) -> str:
    """Why the reference did not admit ``extra`` in this step."""
    if ref_out.preempted_req_ids:
        return (
            f"step {step}: your scheduler admitted {extra!r} in a step that preempted "
            f"{list(ref_out.preempted_req_ids)}: no waiting request is admitted in a step that preempted "
            "(check step.preempted first)"
        )
    waiting_now = _ids(ref.waiting)
    if len(ref.running) >= ref.max_num_running_reqs:
        return (
            f"step {step}: your scheduler admitted {extra!r} although max_num_seqs={ref.max_num_running_reqs} "
            "requests were already running: stop when len(scheduler.running) reaches scheduler.max_num_running_reqs"
        )
    ahead = [r for r in mine_before_waiting if r in waiting_now and r != extra]
    if ahead and mine_before_waiting.index(ahead[0]) < mine_before_waiting.index(extra):
        head = ahead[0]
        req = ref.requests[head]
        need = cdiv(req.num_tokens, ref.block_size)
        return (
            f"step {step}: your scheduler admitted {extra!r} past {head!r}, which did not fit ({head!r} needs "
            f"about {need} blocks, {ref.kv_cache_manager.get_num_free_blocks()} were free): admission is first "
            "come first served and stops at the first request that does not fit (allocate_slots returns None)"
        )
    req = ref.requests.get(extra)
    if req is not None and getattr(ref, "scheduler_reserve_full_isl", False):
        need = cdiv(req.num_tokens, ref.block_size)
        return (
            f"step {step}: your scheduler admitted {extra!r}, which should have stayed waiting: its chunk fits, but "
            f"its whole sequence ({req.num_tokens} tokens, about {need} blocks with the cached prefix counted) does "
            f"not ({ref.kv_cache_manager.get_num_free_blocks()} blocks free). vLLM 0.26 admits a request only when "
            "all of it fits (scheduler_reserve_full_isl): pass full_sequence_must_fit="
            "scheduler.scheduler_reserve_full_isl to allocate_slots"
        )
    return f"step {step}: your scheduler admitted {extra!r}, which should have stayed waiting"


def _check_no_admission_when_preempting(step: int, out, waiting_before: list[str]) -> None:
    if not out.preempted_req_ids:
        return
    admitted = [r for r in out.num_scheduled_tokens if r in waiting_before or r in out.preempted_req_ids]
    if admitted:
        _fail(
            f"step {step}: your scheduler admitted {admitted[0]!r} in a step that preempted "
            f"{list(out.preempted_req_ids)}: no waiting request is admitted in a step that preempted "
            "(memory is short; check step.preempted first)"
        )


def _check_victims(step: int, out, mine: Scheduler, outputs_before: dict[str, list[int]], reqs: dict[str, Request]):
    for rid in out.preempted_req_ids:
        v = reqs[rid]
        if v.output_token_ids != outputs_before[rid] or v.all_token_ids != v.prompt_token_ids + outputs_before[rid]:
            _fail(
                f"step {step}: preempting {rid!r} lost output tokens: before, its outputs were "
                f"{outputs_before[rid]}, after, output_token_ids={v.output_token_ids} and all_token_ids ends with "
                f"{v.all_token_ids[len(v.prompt_token_ids):]}. Recompute keeps the generated tokens: they are "
                "part of what the request computes again when it is readmitted"
            )
        if rid in mine.kv_cache_manager.req_to_blocks:
            _fail(
                f"step {step}: {rid!r} was preempted but still holds blocks "
                f"{mine.kv_cache_manager.get_block_ids(rid)}: give them back with "
                "scheduler.kv_cache_manager.free(victim)"
            )
        if v.num_computed_tokens != 0:
            _fail(
                f"step {step}: after preemption by recompute {rid!r} has num_computed_tokens="
                f"{v.num_computed_tokens}, expected 0: its KV went with its blocks, so everything is computed again"
            )
        if v.status != RequestStatus.PREEMPTED:
            _fail(f"step {step}: the preempted {rid!r} has status {v.status.name}, expected PREEMPTED")
        if any(r is v for r in mine.running):
            _fail(f"step {step}: the preempted {rid!r} is still in scheduler.running")
        if not any(r is v for r in mine.waiting):
            _fail(
                f"step {step}: the preempted {rid!r} is neither running nor waiting: it was lost. Put it back in "
                "scheduler.waiting (at the head: scheduler.waiting.prepend_request(victim))"
            )


def _compare_step(step: int, mine: Scheduler, ref: Scheduler, o_my, o_ref, waiting_before: list[str],
                  running_before: list[str]) -> None:
    my_sched, ref_sched = o_my.num_scheduled_tokens, o_ref.num_scheduled_tokens
    my_pre, ref_pre = list(o_my.preempted_req_ids), list(o_ref.preempted_req_ids)
    if my_pre != ref_pre:
        if ref_pre and my_pre and my_pre[0] != ref_pre[0]:
            got, want = my_pre[0], ref_pre[0]
            rule = (
                "under FCFS the victim is the newest running request (the last in scheduler.running)"
                if ref.policy.value == "fcfs"
                else "under priority the victim is the running request with the largest (priority, arrival_time)"
            )
            oldest = running_before[0] if running_before else None
            extra = " (that is the oldest running request)" if got == oldest and ref.policy.value == "fcfs" else ""
            _fail(f"step {step}: your scheduler preempted {got!r}{extra}, expected {want!r}: {rule}")
        _fail(f"step {step}: your scheduler preempted {my_pre}, expected {ref_pre}")
    extra = [r for r in my_sched if r not in ref_sched]
    if extra:
        if extra[0] in waiting_before:
            _fail(_admission_diagnosis(step, extra[0], ref, o_ref, waiting_before))
        _fail(f"step {step}: your scheduler scheduled {extra[0]!r}, which the reference did not")
    missing = [r for r in ref_sched if r not in my_sched]
    if missing:
        rid = missing[0]
        if not any(r in waiting_before for r in my_sched) and rid in waiting_before:
            stub = " Nothing was admitted at all: is schedule_waiting still the stub?" if not my_sched else ""
            _fail(
                f"step {step}: {rid!r} fits ({ref_sched[rid]} tokens, blocks free) but your scheduler did not admit "
                f"it.{stub}"
            )
        _fail(f"step {step}: {rid!r} should have been scheduled ({ref_sched[rid]} tokens) but was not")
    for rid, n in ref_sched.items():
        if my_sched[rid] != n:
            _fail(
                f"step {step}: {rid!r} was given {my_sched[rid]} tokens, expected {n}: a request gets "
                "min(num_tokens - num_computed_tokens, step.token_budget) new tokens"
            )
        if o_my.num_computed_tokens[rid] != o_ref.num_computed_tokens[rid]:
            _fail(
                f"step {step}: {rid!r}'s chunk starts at position {o_my.num_computed_tokens[rid]}, expected "
                f"{o_ref.num_computed_tokens[rid]}: on admission, set request.num_computed_tokens to its prefix-cache "
                "hit length (the token count get_computed_blocks returns) before step.schedule"
            )
    if list(my_sched) != list(ref_sched):
        _fail(
            f"step {step}: requests scheduled in the order {list(my_sched)}, expected {list(ref_sched)} (running "
            "requests first, then the admitted ones in queue order)"
        )
    both = set(_ids(mine.running)) & set(_ids(mine.waiting))
    if both:
        _fail(
            f"step {step}: {sorted(both)} are both running and waiting: pop an admitted request from "
            "scheduler.waiting"
        )


def _compare_after(step: int, mine: Scheduler, ref: Scheduler, preempted: list[str]) -> None:
    if _ids(mine.waiting) != _ids(ref.waiting):
        got, want = _ids(mine.waiting), _ids(ref.waiting)
        for rid in preempted:
            if rid in got and rid in want and got.index(rid) != want.index(rid) and want.index(rid) == 0:
                _fail(
                    f"step {step}: the waiting queue is {got}, expected {want}: a preempted request goes back to "
                    "the head of waiting (scheduler.waiting.prepend_request), so it is the first readmitted"
                )
        _fail(f"step {step}: the waiting queue is {got}, expected {want}")
    if _ids(mine.running) != _ids(ref.running):
        _fail(f"step {step}: scheduler.running is {_ids(mine.running)}, expected {_ids(ref.running)}")
    for rid, r in ref.requests.items():
        m = mine.requests.get(rid)
        if m is None:
            _fail(f"step {step}: {rid!r} is no longer in scheduler.requests")
        if m.num_computed_tokens != r.num_computed_tokens:
            _fail(
                f"step {step}: {rid!r} has num_computed_tokens={m.num_computed_tokens}, "
                f"expected {r.num_computed_tokens}"
            )
        if m.num_preemptions != r.num_preemptions:
            _fail(
                f"step {step}: {rid!r} has num_preemptions={m.num_preemptions}, expected {r.num_preemptions} "
                "(add one each time it is preempted)"
            )
    if mine.kv_cache_manager.get_num_free_blocks() != ref.kv_cache_manager.get_num_free_blocks():
        _fail(
            f"step {step}: {mine.kv_cache_manager.get_num_free_blocks()} blocks are free, expected "
            f"{ref.kv_cache_manager.get_num_free_blocks()}"
        )


def run_lockstep(scenario: Scenario, hooks: dict[str, Callable | None], *, max_steps: int = 3000) -> int:
    """Serve ``scenario`` with a ``PluggableScheduler`` using ``hooks`` and with the reference, step by step;
    fail (``AssertionError``) at the first difference. Returns the number of steps."""
    label = scenario.describe()
    mine = PluggableScheduler(scenario.manager(), scenario.max_num_seqs, scenario.budget, scenario.policy, **hooks)
    ref = Scheduler(scenario.manager(), scenario.max_num_seqs, scenario.budget, policy=scenario.policy)
    my_reqs, ref_reqs = scenario.fresh_requests(), scenario.fresh_requests()
    my_run = SimModelRunner.for_scheduler(mine, MODEL)
    ref_run = SimModelRunner.for_scheduler(ref, MODEL)
    last_arrival = max(scenario.arrivals.values(), default=0)
    try:
        for step in range(max_steps):
            for rid, _, _, _ in scenario.requests:
                if scenario.arrivals.get(rid, 0) == step:
                    ref.add_request(ref_reqs[rid])
                    mine.add_request(my_reqs[rid])
            if step > last_arrival and not ref.has_unfinished_requests():
                if mine.has_unfinished_requests():
                    _fail(f"step {step}: every request should be finished, but {sorted(mine.requests)} are not")
                break
            waiting_before, running_before = _ids(mine.waiting), _ids(mine.running)
            outputs_before = {rid: list(r.output_token_ids) for rid, r in my_reqs.items()}
            o_ref = ref.schedule()
            try:
                o_my = mine.schedule()
            except Exception as exc:  # the learner's code raised inside schedule()
                _fail(f"step {step}: scheduler.schedule() raised {type(exc).__name__}: {exc}{_where(exc)}")
            _check_no_admission_when_preempting(step, o_my, waiting_before)
            _check_victims(step, o_my, mine, outputs_before, my_reqs)
            _compare_step(step, mine, ref, o_my, o_ref, waiting_before, running_before)
            s_ref = ref_run.execute(o_ref, ref.requests)
            try:
                s_my = my_run.execute(o_my, mine.requests)
            except KVCacheCorruptionError as exc:
                _fail(f"{exc} (the KV cache was corrupted: a request read tokens that are not its own)")
            ref.update_from_output(o_ref, s_ref)
            mine.update_from_output(o_my, s_my)
            _compare_after(step, mine, ref, list(o_ref.preempted_req_ids))
        else:
            _fail(f"not finished after {max_steps} steps")
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from None
    for rid, r in my_reqs.items():
        want = MODEL.generate(r.prompt_token_ids, r.max_tokens)
        if r.output_token_ids != want:
            _fail(f"{label}: {rid!r} generated {r.output_token_ids}, but alone it generates {want}")
    return step


def check_hook(name: str, fn: Callable, scenarios: Sequence[Scenario]) -> None:
    """Run every scenario in lockstep with ``fn`` as the hook ``name`` (the others are the reference)."""
    for scenario in scenarios:
        run_lockstep(scenario, {name: fn})


# ---------------------------------------------------------------------------------------------------
# select_victim on its own
# ---------------------------------------------------------------------------------------------------
def expected_victim(running: Sequence[Request], policy: str) -> Request:
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


def check_select_victim_cases(select_victim: Callable, cases: Sequence[tuple[list[Request], str]]) -> None:
    """Call ``select_victim`` on each ``(running, policy)`` and compare with the rule; messages name the
    mistake (the oldest instead of the newest, the most important instead of the least, ties the wrong way)."""
    for running, policy in cases:
        want = expected_victim(running, policy)
        desc = ", ".join(
            f"{r.request_id}(priority {r.priority}, arrival {r.arrival_time:g})"
            if policy == "priority"
            else r.request_id
            for r in running
        )
        try:
            got = select_victim(list(running), policy)
        except Exception as exc:
            _fail(f"select_victim([{desc}], {policy!r}) raised {type(exc).__name__}: {exc}{_where(exc)}")
        if got is want:
            continue
        call = f"select_victim([{desc}], {policy!r})"
        if got is None:
            _fail(f"{call} returned None, expected {want.request_id!r}: is the function still the stub?")
        if not any(got is r for r in running):
            _fail(f"{call} returned {got!r}, which is not one of the running requests (return the Request itself)")
        hint = ""
        if policy == "fcfs" and got is running[0]:
            hint = (" That is the oldest running request; FCFS preempts the newest (the last in `running`): it has "
                    "the least work invested, and the oldest keep making progress.")
        elif policy == "priority":
            worst = max(r.priority for r in running)
            if got.priority < worst:
                hint = (f" {got.request_id!r} has priority {got.priority}, but {want.request_id!r} has "
                        f"{want.priority}: a larger priority value is less important (vLLM's convention), "
                        "and the least important request is the victim.")
            else:
                hint = (" On equal priority, the victim is the one that arrived last (largest arrival_time).")
        _fail(f"{call} returned {got.request_id!r}, expected {want.request_id!r}.{hint}")


def random_victim_cases(seed: int, n: int = 200) -> list[tuple[list[Request], str]]:
    rng = random.Random(seed)
    cases = []
    for k in range(n):
        size = rng.randint(1, 8)
        arrivals = rng.sample(range(100), size)
        running = [
            Request(f"v{k}-{i}", [1], priority=rng.randint(0, 3), arrival_time=float(arrivals[i])) for i in range(size)
        ]
        if rng.random() < 0.5:  # admission order is usually arrival order, but not after preemptions
            running.sort(key=lambda r: r.arrival_time)
        cases.append((running, rng.choice(["fcfs", "priority"])))
    return cases


def example_victim_cases() -> list[tuple[list[Request], str]]:
    a = Request("a", [1], priority=1, arrival_time=0.0)
    b = Request("b", [1], priority=2, arrival_time=1.0)
    c = Request("c", [1], priority=2, arrival_time=0.5)
    d = Request("d", [1], priority=0, arrival_time=2.0)
    return [
        ([a, b, c], "fcfs"),
        ([d, a], "fcfs"),
        ([a], "fcfs"),
        ([a, b, c, d], "priority"),
        ([a, c, b], "priority"),
        ([d, a], "priority"),
    ]


# ---------------------------------------------------------------------------------------------------
# Entry points for the exercise notebook's test cells
# ---------------------------------------------------------------------------------------------------
def _require(fn: Any, name: str) -> None:
    from pagedkv.grading.checks import require_function

    require_function(fn, name)


def grade_hook(name: str, fn: Any, scenarios: Sequence[Scenario], *, timeout: float = 30.0) -> None:
    """A test case: ``fn`` as the hook ``name`` must reproduce the reference on every scenario. Under ``pagedkv
    grade`` (``fn`` a handle: every call a round trip to the sandbox, on a machine that may be busy) the bound is
    ``WALL_FACTOR`` times ``timeout``: the test case's CPU budget is what judges a slow answer there."""
    from pagedkv.grading.checks import CallTimeout, time_limit
    from pagedkv.grading.limits import WALL_FACTOR
    from pagedkv.grading.remote import is_remote

    _require(fn, name)
    if is_remote(fn):
        timeout *= WALL_FACTOR
    try:
        with time_limit(timeout, f"the {name} scenarios"):
            check_hook(name, fn, scenarios)
    except CallTimeout:
        _fail(
            f"the scenarios did not finish within {timeout:g} s with your {name}: is there an infinite loop "
            "(for instance a request that is never popped from scheduler.waiting)?"
        )


def grade_select_victim(fn: Any, cases: Sequence[tuple[list[Request], str]], scenarios: Sequence[Scenario]) -> None:
    """A test case for ``select_victim``: direct cases, then the scenarios in lockstep."""
    _require(fn, "select_victim")
    check_select_victim_cases(fn, cases)
    grade_hook("select_victim", fn, scenarios)


def public_scenarios(first: int, count: int, **kw) -> list[Scenario]:
    return [random_scenario(seed, **kw) for seed in range(first, first + count)]
