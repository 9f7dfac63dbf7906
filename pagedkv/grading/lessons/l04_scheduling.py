"""Lesson 4's exercises: a scheduler with the admission loop, the victim choice and the preemption step
plugged in from the learner's functions, and the checks that run it in lockstep with the reference.

The learner writes three functions (see ``grading/source/04_scheduling.ipynb``):

- ``schedule_waiting(scheduler, step)``: the admission loop of ``Scheduler.schedule`` (vLLM:
  the ``while self.waiting`` loop of ``vllm/v1/core/sched/scheduler.py``);
- ``select_victim(running, policy)``: which running request to preempt;
- ``preempt(scheduler, step, victim)``: preemption by recompute (vLLM: ``Scheduler._preempt_request``).

:class:`PluggableScheduler` calls them where the reference :class:`~pagedkv.scheduler.Scheduler` runs its
own; a hook left out uses the reference, so each exercise is graded on its own. A check serves a scenario with
the learner's scheduler (:func:`drive_serve`, run where the learner's code runs: the sandbox under ``pagedkv
grade``) and with the reference, on shadow memory with the fake model; each run comes back as a plain record of
every step, and the check compares the two step by step and stops at the first difference with a message that
names the step, the requests and the rule (admitting past a request that does not fit, preempting the oldest,
losing output tokens on recompute, ...). ``select_victim`` is also called on its own cases
(:func:`drive_select_victim`: the requests are built there from plain specs, the chosen one's id comes back).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedkv.grading import checks
from pagedkv.grading.checks import describe, drive, fail, require_function, where
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request, RequestStatus
from pagedkv.scheduler import Scheduler, _StepState
from pagedkv.sim.model import FakeModel
from pagedkv.sim.runner import KVCacheCorruptionError, SimModelRunner
from pagedkv.utils import cdiv, check_int

MODEL = FakeModel(vocab_size=1000, seed=4)


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
        if num_new_tokens == 0 and state.token_budget == 0:
            raise ValueError(
                f"step.schedule({rid!r}, 0): this step's token budget is used up (step.token_budget is 0): stop "
                "admitting once it reaches 0 (admit while step.token_budget > 0)"
            )
        check_int(num_new_tokens, f"step.schedule({rid!r}, ...): the number of tokens", 1)
        if rid in state.num_scheduled_tokens:
            still = " and is still in scheduler.waiting: pop each admitted request from the queue (scheduler.waiting" \
                ".pop_request() takes the head, the request peek_request() returned)" \
                if any(r is request for r in s.waiting) else ""
            raise ValueError(f"step.schedule({rid!r}, ...): {rid!r} is already scheduled in this step{still}")
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
        if table is None:
            raise ValueError(
                f"step.schedule({rid!r}, {num_new_tokens}): {rid!r} holds no blocks. Did allocate_slots return None "
                "for it? Then it does not fit, and admission stops there (first come, first served): it stays "
                "waiting. Otherwise call allocate_slots (with its cache hits) before step.schedule"
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
# Scenarios run where the learner's code runs: they drive the scheduler and record what they saw
# ---------------------------------------------------------------------------------------------------
#: The hooks of :class:`PluggableScheduler`, in the order :func:`drive_serve` takes them.
HOOKS = ("schedule_waiting", "select_victim", "preempt")

#: Steps after which a scenario that has not finished stops.
MAX_STEPS = 3000


def scenario_spec(scenario: Scenario) -> dict[str, Any]:
    """The scenario as plain data (``Scenario(**spec)`` rebuilds it): what a check sends to :func:`drive_serve`."""
    return asdict(scenario)


def plain_value(value: Any) -> Any:
    """``value`` as plain data: numbers, strings, lists, tuples and dicts of them; a numpy scalar becomes its
    number; anything else (an object the learner's code put where the library keeps a number) becomes the text
    ``<its repr>``, so that a record can always be sent and shows what was there."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) in (list, tuple):
        return type(value)(plain_value(v) for v in value)
    if type(value) is dict:
        return {plain_value(k): plain_value(v) for k, v in value.items()}
    if type(value).__module__.startswith("numpy") and getattr(value, "shape", None) == ():
        return plain_value(value.item())
    return f"<{describe(value, 80)}>"


def _number(value: Any) -> Any:
    return value if type(value) is int else plain_value(value)


def request_ids(queue: Any) -> list[Any]:
    """The ids of the requests in ``queue`` (``scheduler.waiting``, ``scheduler.running``), in its order."""
    return [plain_value(r.request_id) if isinstance(r, Request) else f"<{describe(r, 60)}>" for r in queue]


def raised_record(exc: BaseException) -> dict[str, str]:
    """What a record keeps of an exception the learner's code raised (or made the library raise)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        message = f"<{type(exc).__name__} whose str() raised>"
    return {"raised": type(exc).__name__, "message": message[:2000], "where": where(exc)}


def _victim_record(rid: Any, request: Request | None, scheduler: Scheduler, outputs_before: list[Any]) -> Any:
    """What a preempted request looks like right after the step that preempted it."""
    if request is None:
        return None
    manager = scheduler.kv_cache_manager
    status = request.status
    return {
        "outputs_before": outputs_before,
        "outputs": _tokens(request.output_token_ids),
        "all_token_ids": _tokens(request.all_token_ids),
        "prompt_token_ids": _tokens(request.prompt_token_ids),
        "blocks": plain_value(manager.get_block_ids(rid)) if rid in manager.req_to_blocks else None,
        "num_computed_tokens": plain_value(request.num_computed_tokens),
        "status": status.name if isinstance(status, RequestStatus) else f"<{describe(status, 60)}>",
        "running": any(r is request for r in scheduler.running),
        "waiting": any(r is request for r in scheduler.waiting),
    }


def drive_serve(spec: dict[str, Any], schedule_waiting: Any = None, select_victim: Any = None, preempt: Any = None,
                max_steps: int = MAX_STEPS) -> dict[str, Any]:
    """Serve the scenario ``spec`` (:func:`scenario_spec`) with a :class:`PluggableScheduler` whose hooks are these
    functions (None: the reference's), on shadow memory with the fake model, and record every step as plain data.

    Returns ``{"config", "steps", "end", "outputs"}``: per step the waiting and running ids before it, what was
    scheduled (in order) and where each chunk starts, the preempted ids and what their requests look like just
    after, the queues and free blocks after ``schedule()`` and after the step's update, every request's
    ``num_computed_tokens`` and ``num_preemptions``; a step where something raised (or the KV cache was found
    corrupted) ends the record with what was raised. ``end``: "finished", "raised" or "max_steps"; ``outputs``:
    each request's output tokens at the end. A scenario: it records, never judges (the check compares the record
    with the reference's)."""
    scenario = Scenario(**spec)
    scheduler = PluggableScheduler(scenario.manager(), scenario.max_num_seqs, scenario.budget, scenario.policy,
                                   schedule_waiting=schedule_waiting, select_victim=select_victim, preempt=preempt)
    runner = SimModelRunner.for_scheduler(scheduler, MODEL)
    reqs = scenario.fresh_requests()
    last_arrival = max(scenario.arrivals.values(), default=0)
    steps: list[dict[str, Any]] = []
    record: dict[str, Any] = {
        "config": {
            "max_num_running_reqs": scheduler.max_num_running_reqs,
            "block_size": scheduler.block_size,
            "reserve_full_isl": bool(getattr(scheduler, "scheduler_reserve_full_isl", False)),
            "policy": scheduler.policy.value,
        },
        "steps": steps,
        "end": "max_steps",
    }
    for step in range(max_steps):
        rec: dict[str, Any] = {"step": step}
        phase = "add_request"
        try:
            for rid, _, _, _ in scenario.requests:
                if scenario.arrivals.get(rid, 0) == step:
                    scheduler.add_request(reqs[rid])
            if step > last_arrival and not scheduler.has_unfinished_requests():
                record["end"] = "finished"
                break
            steps.append(rec)
            phase = "before"
            rec["waiting_before"] = request_ids(scheduler.waiting)
            rec["running_before"] = request_ids(scheduler.running)
            outputs_before = {r.request_id: list(r.output_token_ids) for r in scheduler.running
                              if isinstance(r, Request)}  # a victim is one of them
            phase = "schedule"
            out = scheduler.schedule()
            phase = "observe"
            manager = scheduler.kv_cache_manager
            rec["scheduled"] = dict(out.num_scheduled_tokens)  # the library's: ids and ints
            rec["starts"] = {rid: _number(n) for rid, n in out.num_computed_tokens.items()}
            rec["preempted"] = list(out.preempted_req_ids)
            rec["victims"] = {rid: _victim_record(rid, reqs.get(rid), scheduler, plain_value(outputs_before.get(rid)))
                              for rid in rec["preempted"] if isinstance(rid, str)}
            rec["waiting_mid"] = request_ids(scheduler.waiting)
            rec["running_mid"] = request_ids(scheduler.running)
            rec["status_mid"] = {plain_value(r.request_id): _status(r.status) for r in scheduler.running
                                 if isinstance(r, Request)}
            rec["free_mid"] = plain_value(manager.get_num_free_blocks())
            rec["num_tokens"] = {r.request_id: plain_value(r.num_tokens) for r in scheduler.waiting
                                 if isinstance(r, Request)}
            phase = "execute"
            samples = runner.execute(out, scheduler.requests)
            phase = "update"
            scheduler.update_from_output(out, samples)
            phase = "after"
            rec["waiting_after"] = request_ids(scheduler.waiting)
            rec["running_after"] = request_ids(scheduler.running)
            rec["requests_after"] = {rid: [_number(r.num_computed_tokens), _number(r.num_preemptions)]
                                     for rid, r in scheduler.requests.items()}
            rec["free_after"] = plain_value(manager.get_num_free_blocks())
        except KVCacheCorruptionError as exc:
            rec["corrupt"] = str(exc)
            record["end"] = "raised"
            break
        except Exception as exc:  # noqa: BLE001 - the learner's code raised (or made the library raise)
            rec.update(during=phase, **raised_record(exc))
            if not steps or steps[-1] is not rec:
                steps.append(rec)
            record["end"] = "raised"
            break
    record["outputs"] = {rid: _tokens(r.output_token_ids) for rid, r in reqs.items()}
    return record


def _status(status: Any) -> str:
    return status.name if isinstance(status, RequestStatus) else f"<{describe(status, 60)}>"


def _tokens(tokens: Any) -> Any:
    try:
        return plain_value(list(tokens))
    except Exception:  # noqa: BLE001 - not a sequence: the learner's code put something else there
        return f"<{describe(tokens, 60)}>"


def drive_select_victim(cases: Sequence[tuple[list[tuple[str, int, float]], str]], select_victim: Any) -> list[dict]:
    """Call ``select_victim(running, policy)`` on each case (``running`` given as ``(request_id, priority,
    arrival_time)``, built here as ``Request`` objects) and record what came back: ``{"victim": id}`` when it is
    one of them (the very object), ``{"none": True}``, ``{"returned": repr}`` for anything else, or what it
    raised (then the record stops)."""
    out: list[dict] = []
    for specs, policy in cases:
        running = [Request(rid, [1], priority=p, arrival_time=float(t)) for rid, p, t in specs]
        try:
            got = select_victim(list(running), policy)
        except Exception as exc:  # noqa: BLE001
            out.append(raised_record(exc))
            break
        index = next((i for i, r in enumerate(running) if r is got), None)
        if index is not None:
            out.append({"victim": specs[index][0]})
        elif got is None:
            out.append({"none": True})
        else:
            out.append({"returned": describe(got)})
    return out


# ---------------------------------------------------------------------------------------------------
# The checks: the learner's record against the reference's, step by step
# ---------------------------------------------------------------------------------------------------
_REFERENCE_RECORDS: dict[str, dict[str, Any]] = {}


def _reference_record(spec: dict[str, Any], max_steps: int) -> dict[str, Any]:
    """The reference's record of the scenario (run here, with the library's hooks; kept: it never changes)."""
    key = repr((sorted(spec.items()), max_steps))
    if key not in _REFERENCE_RECORDS:
        if len(_REFERENCE_RECORDS) >= 1000:  # a long notebook session: keep the memory bounded
            _REFERENCE_RECORDS.clear()
        _REFERENCE_RECORDS[key] = drive(drive_serve, spec, None, None, None, max_steps, timeout=600.0,
                                        name=f"the reference on scenario {spec.get('name')!r}")
    return _REFERENCE_RECORDS[key]


def _admission_diagnosis(step: int, extra: str, ref: dict, cfg: dict, mine_before_waiting: list[str]) -> str:
    """Why the reference did not admit ``extra`` in this step (``ref``: the reference's record of the step)."""
    if ref["preempted"]:
        return (
            f"step {step}: your scheduler admitted {extra!r} in a step that preempted "
            f"{list(ref['preempted'])}: no waiting request is admitted in a step that preempted "
            "(check step.preempted first)"
        )
    waiting_now = ref["waiting_mid"]
    if len(ref["running_mid"]) >= cfg["max_num_running_reqs"]:
        return (
            f"step {step}: your scheduler admitted {extra!r} although max_num_seqs={cfg['max_num_running_reqs']} "
            "requests were already running: stop when len(scheduler.running) reaches scheduler.max_num_running_reqs"
        )
    ahead = [r for r in mine_before_waiting if r in waiting_now and r != extra]
    if ahead and mine_before_waiting.index(ahead[0]) < mine_before_waiting.index(extra):
        head = ahead[0]
        need = cdiv(ref["num_tokens"][head], cfg["block_size"])
        return (
            f"step {step}: your scheduler admitted {extra!r} past {head!r}, which did not fit ({head!r} needs "
            f"about {need} blocks, {ref['free_mid']} were free): admission is first "
            "come first served and stops at the first request that does not fit (allocate_slots returns None)"
        )
    num_tokens = ref["num_tokens"].get(extra)
    if num_tokens is not None and cfg["reserve_full_isl"]:
        need = cdiv(num_tokens, cfg["block_size"])
        return (
            f"step {step}: your scheduler admitted {extra!r}, which should have stayed waiting: its chunk fits, but "
            f"its whole sequence ({num_tokens} tokens, about {need} blocks with the cached prefix counted) does "
            f"not ({ref['free_mid']} blocks free). vLLM 0.26 admits a request only when "
            "all of it fits (scheduler_reserve_full_isl): pass full_sequence_must_fit="
            "scheduler.scheduler_reserve_full_isl to allocate_slots"
        )
    return f"step {step}: your scheduler admitted {extra!r}, which should have stayed waiting"


def _check_no_admission_when_preempting(step: int, mine: dict) -> None:
    preempted = mine["preempted"]
    if not preempted:
        return
    admitted = [r for r in mine["scheduled"] if r in mine["waiting_before"] or r in preempted]
    if admitted:
        fail(
            f"step {step}: your scheduler admitted {admitted[0]!r} in a step that preempted "
            f"{list(preempted)}: no waiting request is admitted in a step that preempted "
            "(memory is short; check step.preempted first)"
        )


def _check_victims(step: int, mine: dict) -> None:
    for rid in mine["preempted"]:
        if isinstance(rid, str) and rid not in mine["victims"]:
            fail(f"step {step}: the scenario's record is incomplete: no record of the preempted {rid!r}")
        v = mine["victims"].get(rid)
        if v is None:
            continue
        before, prompt = v["outputs_before"], v["prompt_token_ids"]
        if v["outputs"] != before or not (isinstance(prompt, list) and isinstance(before, list)) \
                or v["all_token_ids"] != prompt + before:
            fail(
                f"step {step}: preempting {rid!r} lost output tokens: before, its outputs were "
                f"{before}, after, output_token_ids={v['outputs']} and all_token_ids ends with "
                f"{v['all_token_ids'][len(prompt):]}. Recompute keeps the generated tokens: they are "
                "part of what the request computes again when it is readmitted"
            )
        if v["blocks"] is not None:
            fail(
                f"step {step}: {rid!r} was preempted but still holds blocks {v['blocks']}: give them back with "
                "scheduler.kv_cache_manager.free(victim)"
            )
        if v["num_computed_tokens"] != 0:
            fail(
                f"step {step}: after preemption by recompute {rid!r} has num_computed_tokens="
                f"{v['num_computed_tokens']}, expected 0: its KV went with its blocks, so everything is computed again"
            )
        if v["status"] != RequestStatus.PREEMPTED.name:
            fail(f"step {step}: the preempted {rid!r} has status {v['status']}, expected PREEMPTED")
        if v["running"]:
            fail(f"step {step}: the preempted {rid!r} is still in scheduler.running")
        if not v["waiting"]:
            fail(
                f"step {step}: the preempted {rid!r} is neither running nor waiting: it was lost. Put it back in "
                "scheduler.waiting (at the head: scheduler.waiting.prepend_request(victim))"
            )


def _compare_step(step: int, mine: dict, ref: dict, cfg: dict) -> None:
    """The step as ``schedule()`` returned it: preemptions, who was scheduled, how many tokens, from where."""
    my_sched, ref_sched = mine["scheduled"], ref["scheduled"]
    my_pre, ref_pre = list(mine["preempted"]), list(ref["preempted"])
    waiting_before, running_before = mine["waiting_before"], mine["running_before"]
    if my_pre != ref_pre:
        if ref_pre and my_pre and my_pre[0] != ref_pre[0]:
            got, want = my_pre[0], ref_pre[0]
            rule = (
                "under FCFS the victim is the newest running request (the last in scheduler.running)"
                if cfg["policy"] == "fcfs"
                else "under priority the victim is the running request with the largest (priority, arrival_time)"
            )
            oldest = running_before[0] if running_before else None
            extra = " (that is the oldest running request)" if got == oldest and cfg["policy"] == "fcfs" else ""
            fail(f"step {step}: your scheduler preempted {got!r}{extra}, expected {want!r}: {rule}")
        fail(f"step {step}: your scheduler preempted {my_pre}, expected {ref_pre}")
    extra = [r for r in my_sched if r not in ref_sched]
    if extra:
        if extra[0] in waiting_before:
            fail(_admission_diagnosis(step, extra[0], ref, cfg, waiting_before))
        fail(f"step {step}: your scheduler scheduled {extra[0]!r}, which the reference did not")
    missing = [r for r in ref_sched if r not in my_sched]
    if missing:
        rid = missing[0]
        if not any(r in waiting_before for r in my_sched) and rid in waiting_before:
            stub = " Nothing was admitted at all: is schedule_waiting still the stub?" if not my_sched else ""
            fail(
                f"step {step}: {rid!r} fits ({ref_sched[rid]} tokens, blocks free) but your scheduler did not admit "
                f"it.{stub}"
            )
        fail(f"step {step}: {rid!r} should have been scheduled ({ref_sched[rid]} tokens) but was not")
    for rid, n in ref_sched.items():
        if my_sched[rid] != n:
            fail(
                f"step {step}: {rid!r} was given {my_sched[rid]} tokens, expected {n}: a request gets "
                "min(num_tokens - num_computed_tokens, step.token_budget) new tokens"
            )
        if mine["starts"].get(rid) != ref["starts"][rid]:
            fail(
                f"step {step}: {rid!r}'s chunk starts at position {mine['starts'].get(rid)}, expected "
                f"{ref['starts'][rid]}: on admission, set request.num_computed_tokens to its prefix-cache "
                "hit length (the token count get_computed_blocks returns) before step.schedule"
            )
    if list(my_sched) != list(ref_sched):
        fail(
            f"step {step}: requests scheduled in the order {list(my_sched)}, expected {list(ref_sched)} (running "
            "requests first, then the admitted ones in queue order)"
        )
    statuses = mine.get("status_mid", {})
    for rid, want in ref.get("status_mid", {}).items():  # the library's running requests: all must be there
        if rid not in statuses:
            if rid in mine["running_mid"]:
                fail(f"step {step}: the scenario's record is incomplete: no status of the running {rid!r}")
            continue
        if statuses[rid] != want:
            fail(
                f"step {step}: {rid!r} is in scheduler.running with status {statuses[rid]}, expected {want}: on "
                "admission set request.status = RequestStatus.RUNNING"
            )
    both = set(mine["running_mid"]) & set(mine["waiting_mid"])
    if both:
        fail(
            f"step {step}: {sorted(both, key=str)} are both running and waiting: pop an admitted request from "
            "scheduler.waiting"
        )


def _compare_after(step: int, mine: dict, ref: dict) -> None:
    """The scheduler after the step's update: the queues, every request's counters, the free blocks."""
    got, want = mine["waiting_after"], ref["waiting_after"]
    if got != want:
        for rid in ref["preempted"]:
            if rid in got and rid in want and got.index(rid) != want.index(rid) and want.index(rid) == 0:
                fail(
                    f"step {step}: the waiting queue is {got}, expected {want}: a preempted request goes back to "
                    "the head of waiting (scheduler.waiting.prepend_request), so it is the first readmitted"
                )
        fail(f"step {step}: the waiting queue is {got}, expected {want}")
    if mine["running_after"] != ref["running_after"]:
        fail(f"step {step}: scheduler.running is {mine['running_after']}, expected {ref['running_after']}")
    for rid, (computed, preemptions) in ref["requests_after"].items():
        m = mine["requests_after"].get(rid)
        if m is None:
            fail(f"step {step}: {rid!r} is no longer in scheduler.requests")
        if m[0] != computed:
            fail(f"step {step}: {rid!r} has num_computed_tokens={m[0]}, expected {computed}")
        if m[1] != preemptions:
            fail(
                f"step {step}: {rid!r} has num_preemptions={m[1]}, expected {preemptions} "
                "(add one each time it is preempted)"
            )
    if mine["free_after"] != ref["free_after"]:
        fail(f"step {step}: {mine['free_after']} blocks are free, expected {ref['free_after']}")


def _raised(step: int, mine: dict, what: str) -> None:
    fail(f"step {step}: {what} raised {mine['raised']}: {mine['message']}{mine['where']}")


def _compare_records(mine: dict, ref: dict) -> None:
    """Fail (``AssertionError``) at the first step where the learner's record differs from the reference's."""
    cfg = ref["config"]
    if ref["end"] != "finished":
        fail(f"not finished after {len(ref['steps'])} steps")
    steps = mine["steps"]
    for i, r in enumerate(ref["steps"]):
        if i >= len(steps):
            fail(
                f"step {i}: scheduler.waiting and scheduler.running are empty, but "
                f"{sorted(r['waiting_before'] + r['running_before'])} are not finished"
            )
        m = steps[i]
        during = m.get("during")
        if during == "add_request":
            _raised(i, m, "scheduler.add_request()")
        if during == "schedule":
            _raised(i, m, "scheduler.schedule()")
        if during in ("before", "observe"):
            _raised(i, m, "reading the scheduler's queues, requests and blocks")
        _check_no_admission_when_preempting(i, m)
        _check_victims(i, m)
        _compare_step(i, m, r, cfg)
        if "corrupt" in m:
            fail(f"{m['corrupt']} (the KV cache was corrupted: a request read tokens that are not its own)")
        if during == "execute":
            _raised(i, m, "running the step on the fake model")
        if during == "update":
            _raised(i, m, "scheduler.update_from_output()")
        if during == "after":
            _raised(i, m, "reading the scheduler's queues, requests and blocks")
        _compare_after(i, m, r)
    n = len(ref["steps"])
    if len(steps) > n:
        unfinished = sorted(steps[n - 1]["requests_after"], key=str) if n else []
        fail(f"step {n}: every request should be finished, but {unfinished} are not")


def run_lockstep(scenario: Scenario, hooks: dict[str, Callable | None], *, max_steps: int = MAX_STEPS,
                 timeout: float = 30.0) -> int:
    """Serve ``scenario`` with a ``PluggableScheduler`` using ``hooks`` and with the reference, and compare them
    step by step; fail (``AssertionError``) at the first difference. Returns the number of steps.

    The learner's run is one :func:`~pagedkv.grading.checks.drive` of :func:`drive_serve` (in the sandbox under
    ``pagedkv grade``), bounded by ``timeout`` seconds; the reference's runs here."""
    return _lockstep(scenario, hooks, max_steps=max_steps, timeout=timeout, total=timeout)


def _clock() -> Callable[[], float]:
    """What time limits count: CPU seconds under ``pagedkv grade`` (the checks' clock), else the wall clock."""
    return checks.cpu_clock or time.monotonic


def _lockstep(scenario: Scenario, hooks: dict[str, Callable | None], *, max_steps: int, timeout: float,
              total: float) -> int:
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise TypeError(f"run_lockstep: unknown hooks {unknown} (the hooks are {list(HOOKS)})")
    spec = scenario_spec(scenario)
    ref = _reference_record(spec, max_steps)
    label = scenario.describe()
    yours = " and ".join(h for h in HOOKS if hooks.get(h) is not None) or "hooks"
    too_slow = (f"the scenarios did not finish within {total:g} s with your {yours}: is there an infinite loop (for "
                f"instance a request that is never popped from scheduler.waiting)? It was serving {label}")
    if timeout <= 0:
        fail(too_slow)
    try:
        mine = drive(drive_serve, spec, *(hooks.get(h) for h in HOOKS), min(max_steps, len(ref["steps"]) + 1),
                     timeout=timeout, name=f"scenario {scenario.name!r} with your {yours}")
    except AssertionError as exc:
        if "did not finish within" in str(exc):
            fail(too_slow)
        raise
    try:
        _compare_records(mine, ref)
    except AssertionError as exc:
        raise AssertionError(f"{label}: {exc}") from None
    outputs = mine["outputs"]
    for rid, prompt, max_tokens, _ in scenario.requests:
        want = MODEL.generate(prompt, max_tokens)
        if outputs.get(rid) != want:
            fail(f"{label}: {rid!r} generated {outputs.get(rid)}, but alone it generates {want}")
    return len(ref["steps"])


def check_hook(name: str, fn: Callable, scenarios: Sequence[Scenario], *, timeout: float = 30.0) -> None:
    """Run every scenario in lockstep with ``fn`` as the hook ``name`` (the others are the reference), all of them
    within ``timeout`` seconds (CPU seconds under ``pagedkv grade``): one drive of the learner's scheduler each."""
    clock = _clock()
    start = clock()
    for scenario in scenarios:
        _lockstep(scenario, {name: fn}, max_steps=MAX_STEPS, timeout=timeout - (clock() - start), total=timeout)


# ---------------------------------------------------------------------------------------------------
# select_victim on its own
# ---------------------------------------------------------------------------------------------------
def expected_victim(running: Sequence[Request], policy: str) -> Request:
    if policy == "priority":
        return max(running, key=lambda r: (r.priority, r.arrival_time))
    return running[-1]


VictimCase = tuple[list[tuple[str, int, float]], str]


def _victim_case(case: tuple[Sequence[Any], str]) -> VictimCase:
    """A case as plain data: ``([(request_id, priority, arrival_time), ...], policy)`` (``Request`` objects are
    taken too)."""
    running, policy = case
    return ([(r.request_id, r.priority, r.arrival_time) if isinstance(r, Request)
             else (str(r[0]), int(r[1]), float(r[2])) for r in running], policy)


def check_select_victim_cases(select_victim: Callable, cases: Sequence[tuple[Sequence[Any], str]], *,
                              timeout: float = 30.0) -> None:
    """Call ``select_victim`` on each ``(running, policy)`` (one :func:`drive_select_victim`) and compare with the
    rule; messages name the mistake (the oldest instead of the newest, the most important instead of the
    least, ties the wrong way)."""
    cases = [_victim_case(c) for c in cases]
    results = drive(drive_select_victim, cases, select_victim, timeout=timeout, name="select_victim on its cases")
    for k, (specs, policy) in enumerate(cases):
        want = expected_victim([Request(rid, [1], priority=p, arrival_time=t) for rid, p, t in specs],
                               policy).request_id
        desc = ", ".join(f"{rid}(priority {p}, arrival {t:g})" if policy == "priority" else rid
                         for rid, p, t in specs)
        call = f"select_victim([{desc}], {policy!r})"
        if k >= len(results):
            fail(f"{call}: no result came back")
        got = results[k]
        if "raised" in got:
            fail(f"{call} raised {got['raised']}: {got['message']}{got['where']}")
        if got.get("victim") == want:
            continue
        if got.get("none"):
            fail(f"{call} returned None, expected {want!r}: is the function still the stub?")
        if "victim" not in got:
            fail(f"{call} returned {got.get('returned')}, which is not one of the running requests (return the "
                 "Request itself)")
        victim = got["victim"]
        priority = {rid: p for rid, p, _ in specs}
        hint = ""
        if policy == "fcfs" and victim == specs[0][0]:
            hint = (" That is the oldest running request; FCFS preempts the newest (the last in `running`): it has "
                    "the least work invested, and the oldest keep making progress.")
        elif policy == "fcfs":
            latest = max(specs, key=lambda r: r[2])[0]
            prio = expected_victim([Request(rid, [1], priority=p, arrival_time=t) for rid, p, t in specs],
                                   "priority").request_id
            said = [what for what, who in (("the latest arrival", latest), ("the priority rule's victim", prio))
                    if who == victim]
            hint = (f" {victim!r} is {' and '.join(said) if said else 'not the last in running'}; FCFS preempts the "
                    "last request in `running` (the newest admitted: after preemptions, admission order is not "
                    "arrival order), whatever the priorities and arrival times.")
        elif policy == "priority":
            if priority[victim] < max(priority.values()):
                hint = (f" {victim!r} has priority {priority[victim]}, but {want!r} has "
                        f"{priority[want]}: a larger priority value is less important (vLLM's convention), "
                        "and the least important request is the victim.")
            elif {t for rid, _, t in specs if rid == victim} == {t for rid, _, t in specs if rid == want}:
                hint = (f" {victim!r} and {want!r} tie on priority and arrival time: the victim is then the first of "
                        "them in `running`, as vLLM's max(running, key=lambda r: (r.priority, r.arrival_time)) "
                        "returns it (not the largest request id, nor the last).")
            else:
                hint = " On equal priority, the victim is the one that arrived last (largest arrival_time)."
        fail(f"{call} returned {victim!r}, expected {want!r}.{hint}")


def random_victim_cases(seed: int, n: int = 200) -> list[VictimCase]:
    """``n`` seeded cases ``([(request_id, priority, arrival_time), ...], policy)``."""
    rng = random.Random(seed)
    cases = []
    for k in range(n):
        size = rng.randint(1, 8)
        arrivals = rng.sample(range(100), size)
        running = [(f"v{k}-{i}", rng.randint(0, 3), float(arrivals[i])) for i in range(size)]
        if size > 1 and rng.random() < 0.25:  # a full tie (requests added at the same time): max keeps the first
            i, j = rng.sample(range(size), 2)
            running[j] = (running[j][0], running[i][1], running[i][2])
        if rng.random() < 0.5:  # admission order is usually arrival order, but not after preemptions
            running.sort(key=lambda r: r[2])
        cases.append((running, rng.choice(["fcfs", "priority"])))
    return cases


def example_victim_cases() -> list[VictimCase]:
    a, b, c, d = ("a", 1, 0.0), ("b", 2, 1.0), ("c", 2, 0.5), ("d", 0, 2.0)
    e = ("e", 2, 1.0)  # b's priority and arrival time: the first of the two in running is the victim
    return [
        ([a, b, c], "fcfs"),
        ([d, a], "fcfs"),
        ([a], "fcfs"),
        ([a, b, c, d], "priority"),
        ([a, c, b], "priority"),
        ([d, a], "priority"),
        ([a, b, e], "priority"),
    ]


# ---------------------------------------------------------------------------------------------------
# Entry points for the exercise notebook's test cells
# ---------------------------------------------------------------------------------------------------
def grade_hook(name: str, fn: Any, scenarios: Sequence[Scenario], *, timeout: float = 30.0) -> None:
    """A test case: ``fn`` as the hook ``name`` must reproduce the reference on every scenario (one drive of the
    learner's scheduler each), all of them within ``timeout`` seconds (CPU seconds under ``pagedkv grade``)."""
    require_function(fn, name)
    check_hook(name, fn, scenarios, timeout=timeout)


def grade_select_victim(fn: Any, cases: Sequence[tuple[Sequence[Any], str]], scenarios: Sequence[Scenario]) -> None:
    """A test case for ``select_victim``: direct cases, then the scenarios in lockstep."""
    require_function(fn, "select_victim")
    check_select_victim_cases(fn, cases)
    check_hook("select_victim", fn, scenarios)


def public_scenarios(first: int, count: int, **kw) -> list[Scenario]:
    return [random_scenario(seed, **kw) for seed in range(first, first + count)]
