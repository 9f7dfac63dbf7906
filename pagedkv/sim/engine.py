"""The engine loop: schedule, execute, update, until every request is done; with the metrics the lesson plots.

Mirrors ``vllm/v1/engine/core.py`` (``EngineCore.step``: ``schedule()``, ``execute_model()``,
``update_from_output()``) with simulated time: each step advances a clock by the cost model's estimate
of that step on the modelled GPU. That is the sync loop (``async_scheduling=False``); vLLM 0.26's default for
dense models is async scheduling, ``EngineCore.step_with_batch_queue`` with two batches in flight (the lab's
``pagedkv.engine``, lesson 7). The simulator keeps the sync loop on purpose: it has no host work to overlap,
and its steps are the ones lesson 4's scheduler makes, one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.request import Request
from pagedkv.sched_output import SchedulerOutput
from pagedkv.scheduler import Scheduler
from pagedkv.sim.cost import CostModel, StepCost
from pagedkv.sim.runner import SimModelRunner


@dataclass(frozen=True)
class StepRecord:
    """What one step did and what the KV cache held after it."""

    step: int
    start_s: float  # simulated clock when the step began
    duration_s: float
    num_running: int  # requests in `running` after scheduling (the concurrency)
    num_waiting: int
    num_scheduled_reqs: int  # the batch size
    num_scheduled_tokens: int
    num_decode_reqs: int  # scheduled requests given exactly one token
    num_sampled: int  # output tokens this step produced (samples kept)
    num_preempted: int
    num_swapped_blocks: int  # swap-out + swap-in blocks
    kv_reserved_slots: int  # token slots in blocks held by requests
    kv_used_slots: int  # of which hold a token's KV
    bound: str  # "memory" or "compute"

    @property
    def waste_percent(self) -> float:
        if self.kv_reserved_slots == 0:
            return 0.0
        return 100.0 * (self.kv_reserved_slots - self.kv_used_slots) / self.kv_reserved_slots


@dataclass
class SimResult:
    """Outputs and metrics of one ``run_to_completion``."""

    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str]
    steps: list[StepRecord]
    sim_time_s: float
    num_prompt_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_swap_outs: int
    num_recompute_preemptions: int
    arrival_s: dict[str, float] = field(default_factory=dict)
    first_token_s: dict[str, float] = field(default_factory=dict)
    finish_s: dict[str, float] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per simulated second."""
        return self.num_generated_tokens / self.sim_time_s if self.sim_time_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        """Prompt + generated tokens per simulated second."""
        total = self.num_prompt_tokens + self.num_generated_tokens
        return total / self.sim_time_s if self.sim_time_s > 0 else 0.0

    def _weights(self) -> np.ndarray:
        return np.array([s.duration_s for s in self.steps], dtype=float)

    @property
    def mean_concurrency(self) -> float:
        """Running requests, averaged over simulated time."""
        w = self._weights()
        return float(np.average([s.num_running for s in self.steps], weights=w)) if w.sum() > 0 else 0.0

    @property
    def saturated_concurrency(self) -> float:
        """Running requests averaged over the time some request was waiting for a seat: the concurrency the
        pool (or ``max_num_seqs``) allows when demand exceeds it. Falls back to ``mean_concurrency`` when
        nothing ever waited."""
        sat = self._saturated()
        if not sat:
            return self.mean_concurrency
        return float(np.average([s.num_running for s in sat], weights=[s.duration_s for s in sat]))

    def _saturated(self) -> list[StepRecord]:
        return [s for s in self.steps if s.num_waiting > 0 and s.duration_s > 0]

    @property
    def saturated_batch_size(self) -> float:
        """Requests per step, averaged over the time requests were queued (``mean_batch_size`` if never)."""
        sat = self._saturated()
        if not sat:
            return self.mean_batch_size
        return float(np.average([s.num_scheduled_reqs for s in sat], weights=[s.duration_s for s in sat]))

    @property
    def saturated_tokens_per_s(self) -> float:
        """Generated tokens per second while requests were queued: the steady-state throughput of a server
        that always has work, without the drain at the end (``tokens_per_s`` if nothing ever queued)."""
        sat = self._saturated()
        if not sat:
            return self.tokens_per_s
        return sum(s.num_sampled for s in sat) / sum(s.duration_s for s in sat)

    @property
    def max_concurrency(self) -> int:
        return max((s.num_running for s in self.steps), default=0)

    @property
    def mean_batch_size(self) -> float:
        """Requests per step, averaged over simulated time."""
        w = self._weights()
        return float(np.average([s.num_scheduled_reqs for s in self.steps], weights=w)) if w.sum() > 0 else 0.0

    @property
    def waste_percent(self) -> float:
        """KV memory held by requests but holding no token, in percent, averaged over simulated time
        (slot-seconds wasted over slot-seconds held)."""
        w = self._weights()
        reserved = np.array([s.kv_reserved_slots for s in self.steps], dtype=float) @ w
        used = np.array([s.kv_used_slots for s in self.steps], dtype=float) @ w
        return float(100.0 * (reserved - used) / reserved) if reserved > 0 else 0.0

    def latencies_s(self) -> np.ndarray:
        return np.array([self.finish_s[r] - self.arrival_s.get(r, 0.0) for r in self.finish_s])

    def timeline(self) -> dict[str, np.ndarray]:
        """Per-step arrays for plots: ``t_s`` (step start), ``running``, ``batch``, ``tokens``, ``waste_percent``."""
        return {
            "t_s": np.array([s.start_s for s in self.steps]),
            "duration_s": self._weights(),
            "running": np.array([s.num_running for s in self.steps]),
            "waiting": np.array([s.num_waiting for s in self.steps]),
            "batch": np.array([s.num_scheduled_reqs for s in self.steps]),
            "tokens": np.array([s.num_scheduled_tokens for s in self.steps]),
            "waste_percent": np.array([s.waste_percent for s in self.steps]),
            "preempted": np.array([s.num_preempted for s in self.steps]),
        }

    def summary(self) -> dict[str, float]:
        return {
            "steps": self.num_steps,
            "sim_time_s": self.sim_time_s,
            "generated_tokens": self.num_generated_tokens,
            "tokens_per_s": self.tokens_per_s,
            "mean_concurrency": self.mean_concurrency,
            "saturated_concurrency": self.saturated_concurrency,
            "saturated_tokens_per_s": self.saturated_tokens_per_s,
            "max_concurrency": self.max_concurrency,
            "mean_batch_size": self.mean_batch_size,
            "waste_percent": self.waste_percent,
            "preemptions": self.num_preemptions,
            "swap_outs": self.num_swap_outs,
        }


def _kv_occupancy(scheduler: Scheduler) -> tuple[int, int]:
    """(slots in blocks held by requests, slots of those holding a computed token). Counts per request: a
    block shared by two requests counts twice in both (the workloads measured here share none)."""
    m = scheduler.kv_cache_manager
    bs = m.block_size
    reserved = used = 0
    for rid, blocks in m.req_to_blocks.items():
        cap = len(blocks) * bs
        reserved += cap
        req = scheduler.requests.get(rid)
        if req is not None:
            used += min(req.num_computed_tokens, cap)
    return reserved, used


def run_to_completion(
    scheduler: Scheduler,
    requests: Sequence[Request],
    *,
    runner: SimModelRunner | None = None,
    cost_model: CostModel | None = None,
    arrival_times: Sequence[float] | None = None,
    max_steps: int = 10_000_000,
    progress: bool = False,
    on_step: Callable[[SchedulerOutput, StepCost], None] | None = None,
) -> SimResult:
    """Serve ``requests`` to the end and measure it.

    All requests arrive at time 0 (an offline batch, as in the PagedAttention paper's throughput runs)
    unless ``arrival_times`` gives each one's arrival in simulated seconds. ``runner`` defaults to a
    ``SimModelRunner`` without shadow memory (fast); pass ``SimModelRunner.for_scheduler(scheduler)`` to
    check every step's KV. ``cost_model`` defaults to ``CostModel(block_size=scheduler.block_size)`` (H100,
    Llama-2-7B). ``progress=True`` shows a tqdm bar of finished requests. Raises ``RuntimeError`` if the
    scheduler stalls (nothing scheduled while requests wait).
    """
    runner = runner or SimModelRunner(shadow=False)
    cost_model = cost_model or CostModel(block_size=scheduler.block_size)
    reqs = list(requests)
    if arrival_times is not None and len(arrival_times) != len(reqs):
        raise ValueError(f"{len(arrival_times)} arrival times for {len(reqs)} requests")
    arrivals = [0.0] * len(reqs) if arrival_times is None else [float(t) for t in arrival_times]
    order = sorted(range(len(reqs)), key=lambda i: (arrivals[i], i))
    by_id = {r.request_id: r for r in reqs}
    if len(by_id) != len(reqs):
        raise ValueError("request ids must be unique")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc="requests", unit="req")

    clock = 0.0
    nxt = 0
    steps: list[StepRecord] = []
    arrival_s: dict[str, float] = {}
    first_token_s: dict[str, float] = {}
    finish_s: dict[str, float] = {}
    num_generated = 0
    while nxt < len(order) or scheduler.has_unfinished_requests():
        while nxt < len(order) and arrivals[order[nxt]] <= clock:
            req = reqs[order[nxt]]
            scheduler.add_request(req)
            arrival_s[req.request_id] = arrivals[order[nxt]]
            nxt += 1
        if not scheduler.has_unfinished_requests():
            clock = arrivals[order[nxt]]
            continue
        if len(steps) >= max_steps:
            raise RuntimeError(f"gave up after {max_steps} steps")
        output = scheduler.schedule()
        if output.is_empty() and not output.blocks_to_swap_out:
            if nxt < len(order):
                clock = max(clock, arrivals[order[nxt]])
                scheduler.update_from_output(output, {})
                continue
            raise RuntimeError(
                f"scheduler stalled at step {output.step}: nothing scheduled, {len(scheduler.waiting)} waiting, "
                f"{len(scheduler.running)} running"
            )
        samples = runner.execute(output, scheduler.requests)
        cost = cost_model.step_cost(output)
        if on_step is not None:
            on_step(output, cost)
        start = clock
        clock += cost.time_s
        new_tokens = scheduler.update_from_output(output, samples)
        for rid in new_tokens:
            num_generated += 1
            if rid not in first_token_s:
                first_token_s[rid] = clock
        for rid in scheduler.finished_req_ids:
            if rid in by_id and rid not in finish_s:
                finish_s[rid] = clock
                runner.forget(rid)
                if bar is not None:
                    bar.update(1)
        reserved, used = _kv_occupancy(scheduler)
        steps.append(
            StepRecord(
                step=output.step if output.step is not None else len(steps),
                start_s=start,
                duration_s=cost.time_s,
                num_running=len(scheduler.running),
                num_waiting=len(scheduler.waiting),
                num_scheduled_reqs=output.num_reqs,
                num_scheduled_tokens=output.total_num_scheduled_tokens,
                num_decode_reqs=sum(1 for n in output.num_scheduled_tokens.values() if n == 1),
                num_sampled=len(new_tokens),
                num_preempted=len(output.preempted_req_ids),
                num_swapped_blocks=len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in),
                kv_reserved_slots=reserved,
                kv_used_slots=used,
                bound=cost.bound,
            )
        )
    if bar is not None:
        bar.close()
    return SimResult(
        outputs={r.request_id: list(r.output_token_ids) for r in reqs},
        finish_reasons={r.request_id: r.get_finished_reason() or "" for r in reqs},
        steps=steps,
        sim_time_s=clock,
        num_prompt_tokens=sum(r.num_prompt_tokens for r in reqs),
        num_generated_tokens=num_generated,
        num_preemptions=scheduler.num_preemptions,
        num_swap_outs=scheduler.num_swap_outs,
        num_recompute_preemptions=scheduler.num_recompute_preemptions,
        arrival_s=arrival_s,
        first_token_s=first_token_s,
        finish_s=finish_s,
    )
