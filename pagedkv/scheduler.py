"""Continuous batching under memory pressure: vLLM V1's scheduler on top of the KV cache manager.

There is no prefill phase and no decode phase. Every request has ``num_computed_tokens`` (tokens whose K and
V are in the cache) and ``num_tokens`` (prompt + outputs so far); each step gives requests new tokens so
that the first catches up with the second, under a token budget (``max_num_batched_tokens``) and a cap on
running requests (``max_num_seqs``). A long prompt is simply given a chunk at a time (chunked prefill); a
decoding request is given one token. Running requests are served first, in order; then waiting requests
are admitted, first come first served, until one does not fit; as in vLLM 0.26
(``scheduler_reserve_full_isl``, on by default) a waiting request fits only when its whole current sequence
does, not merely its first chunk.

When a running request cannot get a block, another running request is preempted: the newest one (FCFS)
or the lowest-priority one. By *recompute*, its blocks are freed and its KV will be computed again from its
prompt and outputs; by *swap*, its blocks are first copied to a CPU block pool and copied back before it
runs again. Either way no output token is lost, so preemption never changes what a request generates.
Under the priority policy the victim may be a request already scheduled earlier in the same step: the blocks
its allocation entered in the prefix cache for that step are evicted from the cache before they are freed,
since no forward pass will write them (the lab departs from vLLM 0.26 here, which leaves them cached).

Mirrors ``vllm/v1/core/sched/scheduler.py`` (``Scheduler``). Swapping follows vLLM V0
(``vllm/core/scheduler.py``: ``_preempt_by_swap``, ``_swap_in``; ``vllm/core/block_manager.py``:
``swap_out``, ``swap_in``); V1 only recomputes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.block_table import compute_slot_mapping
from pagedkv.cpu_block_pool import CPUBlockPool
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request, RequestStatus, as_token_ids
from pagedkv.request_queue import SchedulingPolicy, create_request_queue
from pagedkv.sched_output import CachedRequestData, NewRequestData, ReqIdList, SchedulerOutput
from pagedkv.single_type_kv_cache_manager import FullAttentionManager
from pagedkv.trace import EventTrace
from pagedkv.utils import cdiv, check_int

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class _StepState:
    """What the step being scheduled has decided so far (the local variables of vLLM's ``schedule()``)."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_running: list[Request] = field(default_factory=list)
    scheduled_new: list[Request] = field(default_factory=list)
    scheduled_resumed: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    copies: dict[str | None, list[tuple[int, int]]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def add(self, request: Request, num_new_tokens: int, new_block_ids: list[int]) -> None:
        rid = request.request_id
        self.num_scheduled_tokens[rid] = num_new_tokens
        self.new_block_ids[rid] = new_block_ids
        self.token_budget -= num_new_tokens

    def remove(self, request: Request) -> None:
        """Undo the scheduling of a running request that is preempted later in the same step: its tokens go
        back to the budget and its copy-on-write copies are dropped (its blocks are gone)."""
        rid = request.request_id
        self.token_budget += self.num_scheduled_tokens.pop(rid)
        self.new_block_ids.pop(rid, None)
        self.copies.pop(rid, None)
        self.scheduled_running = [r for r in self.scheduled_running if r is not request]


class Scheduler:
    """vLLM V1's scheduler: continuous batching with chunked prefill, preemption, FCFS or priority.

    ``waiting`` is a queue (``FCFSRequestQueue`` or ``PriorityRequestQueue``) that iterates in admission
    order; ``running`` is a list in admission order; ``requests`` maps every unfinished request id to its
    request. ``swapped`` maps a request swapped out to the CPU pool to its CPU block ids.

    ``scheduler_reserve_full_isl`` (default ``True``, as ``SchedulerConfig.scheduler_reserve_full_isl`` in
    vLLM 0.26) admits a waiting request only when its whole current sequence fits in the free blocks, prefix
    hits counted (``allocate_slots(..., full_sequence_must_fit=True)``), not merely its first chunk: vLLM's
    reason is that it "prevents over-admission and KV cache thrashing with chunked prefill". ``False`` admits
    on the first chunk, as vLLM did before the gate.

    Over KV cache groups (a manager built from a ``KVCacheConfig``, lesson 8): the same loop; each step's
    output carries every request's table in every group (``SchedulerOutput.group_block_tables`` and
    ``group_slot_mapping``; ``block_tables`` and ``slot_mapping`` hold group 0's, which for one group is
    everything). A manager built without ``max_in_flight_tokens`` gets ``max_concurrent_batches ·
    max_num_batched_tokens`` (vLLM's ``VllmConfig.max_in_flight_tokens``), the bound of its sliding-window
    admission cap. Swap preemption needs one full-attention group; with any other config a swap falls back
    to recompute (vLLM 0.26 only recomputes).
    """

    #: Steps that may be in flight at once (vLLM's ``max_concurrent_batches``): 1 when every step's output
    #: is consumed before the next is scheduled.
    max_concurrent_batches = 1

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        preemption_mode: str = "recompute",
        num_cpu_blocks: int = 0,
        *,
        long_prefill_token_threshold: int = 0,
        scheduler_reserve_full_isl: bool = True,
    ) -> None:
        if not isinstance(kv_cache_manager, KVCacheManager):
            raise ValueError(f"kv_cache_manager must be a KVCacheManager, got {type(kv_cache_manager).__name__}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            check_int(value, name, 1)
        try:
            self.policy = SchedulingPolicy(policy)
        except ValueError:
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}") from None
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        check_int(long_prefill_token_threshold, "long_prefill_token_threshold", 0)
        if not isinstance(scheduler_reserve_full_isl, bool):
            raise ValueError(f"scheduler_reserve_full_isl must be a bool, got {scheduler_reserve_full_isl!r}")
        self.kv_cache_manager = kv_cache_manager
        self.scheduler_reserve_full_isl = scheduler_reserve_full_isl
        self.block_size = kv_cache_manager.block_size
        self.max_num_running_reqs = max_num_seqs  # vLLM's name for the max_num_seqs cap
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_scheduled_tokens = max_num_batched_tokens  # vLLM's name
        self.preemption_mode = preemption_mode
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.cpu_block_pool = CPUBlockPool(num_cpu_blocks)
        if kv_cache_manager.coordinator is not None and kv_cache_manager.max_in_flight_tokens is None:
            kv_cache_manager.set_max_in_flight_tokens(self.max_concurrent_batches * max_num_batched_tokens)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        self.swapped: dict[str, list[int]] = {}
        # Ids finished since the last schedule(); the next SchedulerOutput carries them, then they reset.
        self.finished_req_ids: set[str] = set()
        self.step = 0  # schedule() calls completed
        self._unconsumed_steps: set[int] = set()  # outputs scheduled but not yet passed to update_from_output
        self.trace: EventTrace | None = None
        # Counters for lessons and benchmarks.
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_recompute_preemptions = 0

    # ------------------------------------------------------------------------------------------------
    # Tracing and inspection
    # ------------------------------------------------------------------------------------------------
    def set_trace(self, trace: EventTrace | None) -> None:
        """Record the scheduler's events (admit, schedule, preempt, swap_out, swap_in, finish) and, through the
        manager, the pool's, in ``trace``; ``None`` stops recording."""
        self.trace = trace
        self.kv_cache_manager.set_trace(trace)

    def _record(self, kind: str, request_id: str | None, block_ids: Sequence[int], caption: str, **data: Any) -> None:
        if self.trace is not None:
            self.trace.record(kind, request_id, list(block_ids), caption, step=self.step, **data)

    def snapshot(self) -> dict[str, Any]:
        """The manager's snapshot plus the queues, the CPU pool and the step count, as plain data (what the
        block-table widget draws). ``step`` is the number of ``schedule()`` calls completed."""
        snap = self.kv_cache_manager.snapshot()
        snap["waiting"] = [r.request_id for r in self.waiting]
        snap["running"] = [r.request_id for r in self.running]
        snap["cpu"] = {
            "num_blocks": self.cpu_block_pool.num_blocks,
            "block_tables": {rid: list(ids) for rid, ids in self.swapped.items()},
            "free": list(self.cpu_block_pool.free_blocks),
        }
        snap["step"] = self.step
        return snap

    def get_request_counts(self) -> tuple[int, int]:
        """``(num_running, num_waiting)``. Mirrors ``Scheduler.get_request_counts``."""
        return len(self.running), len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        """Mirrors ``Scheduler.get_num_unfinished_requests``."""
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Mirrors ``SchedulerInterface.has_unfinished_requests``."""
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """Whether requests finished since the last step (their ids go out with the next one)."""
        return bool(self.finished_req_ids)

    # ------------------------------------------------------------------------------------------------
    # Adding requests
    # ------------------------------------------------------------------------------------------------
    def max_blocks_needed(self, request: Request) -> int:
        """Blocks the request would hold at its longest: ``ceil((len(prompt) + max_tokens) / block_size)``;
        over KV cache groups, the sum of each group's most (``KVCacheManager.max_num_blocks_for``: a
        sliding-window group never holds more than its window's worth)."""
        if self.kv_cache_manager.coordinator is not None:
            return self.kv_cache_manager.max_num_blocks_for(request.num_prompt_tokens + request.max_tokens)
        return cdiv(request.num_prompt_tokens + request.max_tokens, self.block_size)

    def _check_can_ever_fit(self, request: Request) -> None:
        need = self.max_blocks_needed(request)
        usable = self.kv_cache_manager.num_gpu_blocks - 1
        if need > usable:
            raise ValueError(
                f"request {request.request_id!r} can never fit: {request.num_prompt_tokens} prompt tokens + "
                f"max_tokens={request.max_tokens} need {need} blocks of {self.block_size} tokens, but the pool has "
                f"only {usable} usable blocks (num_blocks={self.kv_cache_manager.num_gpu_blocks}, block 0 is null)"
            )

    def add_request(self, request: Request) -> None:
        """Queue a new request in ``waiting`` (appended under FCFS, inserted by priority otherwise).

        Refuses (``ValueError``, nothing changed) a non-``Request``, a duplicate id, a request that is not a
        fresh waiting one, and a request that could never fit even alone in the pool:
        ``ceil((len(prompt) + max_tokens) / block_size) > num_blocks - 1``. Admitting such a request would stall
        the queue behind it forever. Mirrors ``Scheduler.add_request`` (vLLM refuses it earlier, in the
        input processor, against ``max_model_len``).
        """
        if not isinstance(request, Request):
            raise ValueError(f"add_request takes a Request, got {type(request).__name__}")
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}: a request with this id is already in the scheduler")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens != 0:
            raise ValueError(
                f"request {rid!r} must be a new WAITING request with num_computed_tokens 0, got status "
                f"{request.status.name} and num_computed_tokens {request.num_computed_tokens}"
            )
        if rid in self.kv_cache_manager.req_to_blocks:
            raise ValueError(f"request {rid!r} already holds blocks in the KV cache manager")
        self._check_can_ever_fit(request)
        self.waiting.add_request(request)
        self.requests[rid] = request

    # ------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step: which requests get how many new tokens, and what the runner must move.

        First the running requests, in order: each is given ``min(num_tokens - num_computed_tokens, budget)``
        tokens (a running request with nothing new, e.g. waiting for its sample, is skipped) and the blocks
        they need. When ``allocate_slots`` comes back empty, a victim is preempted (``_select_victim``: the
        newest running request under FCFS, the worst ``(priority, arrival_time)`` under priority; if it was
        already scheduled in this step its tokens return to the budget) and the allocation is retried; if the
        victim is the request itself, the running loop stops. Then, only if nothing was preempted, waiting
        requests are admitted in queue order until one does not fit (``allocate_slots`` returns ``None``; with
        ``scheduler_reserve_full_isl``, when its whole sequence would not fit), the
        budget runs out or ``max_num_seqs`` run: an admitted request's ``num_computed_tokens`` is set to its
        prefix-cache hit length (or, if it was swapped out, kept, and its blocks swapped in). The manager's
        ``prefix_cache_stats`` count one lookup per admission: a lookup that is not admitted is taken back.

        Finally every scheduled request's ``num_computed_tokens`` advances by its scheduled count, so the next
        step could be scheduled before this one's samples arrive. ``finished_req_ids`` is handed over and
        reset. Mirrors ``Scheduler.schedule`` and ``Scheduler._update_after_schedule``.
        """
        state = _StepState(token_budget=self.max_num_batched_tokens)
        leftover = self.kv_cache_manager.get_pending_copies()  # copies recorded outside schedule(), if any
        if leftover:
            state.copies[None] = leftover
        self._schedule_running(state)
        self._schedule_waiting(state)
        return self._make_output(state)

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        # Placeholders (async scheduling) count as tokens: a decode is scheduled before its input is sampled.
        num_new = request.num_tokens + request.num_output_placeholders - num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return min(num_new, token_budget)

    def _schedule_running(self, state: _StepState) -> None:
        """The running loop of ``Scheduler.schedule``: serve running requests in order, preempting on need."""
        manager = self.kv_cache_manager
        req_index = 0
        while req_index < len(self.running) and state.token_budget > 0:
            request = self.running[req_index]
            if (
                request.num_output_placeholders > 0
                and request.num_computed_tokens + 2 - request.num_output_placeholders
                >= request.num_prompt_tokens + request.max_tokens
            ):
                # Async scheduling: the step in flight already reaches max_tokens, so no step is scheduled
                # for a token that could never be kept (vLLM's check, same place).
                req_index += 1
                continue
            num_new = self._num_new_tokens(request, request.num_computed_tokens, state.token_budget)
            if num_new <= 0:
                req_index += 1
                continue
            new_blocks = None
            while True:
                new_blocks = manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self._select_victim()
                victim_index = next(i for i, r in enumerate(self.running) if r is victim)
                del self.running[victim_index]
                if victim_index < req_index:
                    req_index -= 1
                was_scheduled = victim.request_id in state.num_scheduled_tokens
                if was_scheduled:
                    # Its allocate_slots in this step entered the blocks this step was to fill in the prefix
                    # cache; no forward pass will write them now, so they must not be found by a later hit.
                    self._uncache_unwritten_blocks(victim)
                self._preempt_request(victim, state)  # first: a swap-out reads this step's copies
                if was_scheduled:
                    state.remove(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            state.add(request, num_new, self._group0_ids(new_blocks))
            state.scheduled_running.append(request)
            copies = manager.get_pending_copies()
            if copies:
                state.copies[request.request_id] = copies
            req_index += 1

    def _schedule_waiting(self, state: _StepState) -> None:
        """The waiting loop of ``Scheduler.schedule``: nobody is admitted in a step that preempted; otherwise
        admit in queue order and stop at the first request that does not fit."""
        if state.preempted:
            return
        manager = self.kv_cache_manager
        while self.waiting and state.token_budget > 0:
            if len(self.running) >= self.max_num_running_reqs:
                break
            request = self.waiting.peek_request()
            rid = request.request_id
            cpu_blocks = self.swapped.get(rid)
            # The lookup's counters are kept only if the request is admitted: a request stuck at the head of
            # the queue is looked up every step, but it is one query (as vLLM counts it: see its test
            # test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request).
            stats = manager.prefix_cache_stats
            stats_before = (stats.requests, stats.queries, stats.hits)
            if cpu_blocks is not None:
                # Swapped out: its KV comes back from the CPU pool, so no prefix-cache lookup.
                hits, num_computed = [], request.num_computed_tokens
            else:
                hits, num_computed = manager.get_computed_blocks(request)
            num_new = self._num_new_tokens(request, num_computed, state.token_budget)
            new_blocks = (
                manager.allocate_slots(
                    request, num_new, hits, full_sequence_must_fit=self.scheduler_reserve_full_isl
                )
                if num_new > 0
                else None
            )
            if new_blocks is None:
                # Nothing to compute until its last sample arrives (num_new == 0), or it does not fit: FCFS, so
                # it blocks the ones behind it. Either way it was not admitted, so its lookup does not count.
                stats.requests, stats.queries, stats.hits = stats_before
                break
            self.waiting.pop_request()
            if cpu_blocks is not None:
                self._swap_in(request, cpu_blocks, state)
            request.num_computed_tokens = num_computed
            if request.status == RequestStatus.PREEMPTED:
                state.scheduled_resumed.append(request)
            else:
                state.scheduled_new.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            state.add(request, num_new, self._table(rid))
            copies = manager.get_pending_copies()
            if copies:
                state.copies[rid] = copies
            self._record(
                "admit",
                rid,
                self._table(rid),
                f"{rid} admitted: {num_computed} tokens cached, {num_new} scheduled",
                num_computed_tokens=num_computed,
                num_new_tokens=num_new,
                resumed=request.num_preemptions > 0,
            )

    def _table(self, rid: str) -> list[int]:
        """Group 0's block ids of the request (its whole table when there is one group)."""
        ids = self.kv_cache_manager.get_block_ids(rid)
        return list(ids[0]) if isinstance(ids, tuple) else ids

    @staticmethod
    def _group0_ids(blocks: Any) -> list[int]:
        groups = getattr(blocks, "blocks", None)
        return [b.block_id for b in (groups[0] if groups is not None else blocks)]

    def _make_output(self, state: _StepState) -> SchedulerOutput:
        manager = self.kv_cache_manager
        order = list(state.num_scheduled_tokens)
        block_tables: dict[str, list[int]] = {}
        slot_mapping: dict[str, list[int]] = {}
        group_block_tables: dict[str, tuple[list[int], ...]] = {}
        group_slot_mapping: dict[str, tuple[list[int], ...]] = {}
        starts: dict[str, int] = {}
        partial: set[str] = set()
        for rid in order:
            req = self.requests[rid]
            n = state.num_scheduled_tokens[rid]
            start = req.num_computed_tokens
            tables = manager.get_blocks(rid).get_block_ids()
            group_block_tables[rid] = tables
            group_slot_mapping[rid] = tuple(
                compute_slot_mapping(t, range(start, start + n), self.block_size) for t in tables
            )
            block_tables[rid] = tables[0]
            slot_mapping[rid] = group_slot_mapping[rid][0]
            starts[rid] = start
            if start + n < req.num_tokens + req.num_output_placeholders:
                partial.add(rid)
        copies = [pair for pairs in state.copies.values() for pair in pairs]
        cached = CachedRequestData()
        for req in state.scheduled_running + state.scheduled_resumed:
            cached.req_ids.append(req.request_id)
            cached.new_block_ids.append(state.new_block_ids[req.request_id])
            cached.num_computed_tokens.append(starts[req.request_id])
        cached.resumed_req_ids = {r.request_id for r in state.scheduled_resumed}
        cached.all_token_ids = {r.request_id: list(r.all_token_ids) for r in state.scheduled_resumed}
        output = SchedulerOutput(
            num_scheduled_tokens=dict(state.num_scheduled_tokens),
            total_num_scheduled_tokens=sum(state.num_scheduled_tokens.values()),
            preempted_req_ids=ReqIdList(r.request_id for r in state.preempted),
            blocks_to_swap_out=list(state.swap_out),
            blocks_to_swap_in=list(state.swap_in),
            blocks_to_copy=copies,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            group_block_tables=group_block_tables,
            group_slot_mapping=group_slot_mapping,
            num_computed_tokens=starts,
            partial_prefill_req_ids=partial,
            scheduled_new_reqs=[
                NewRequestData(
                    r.request_id, list(r.prompt_token_ids), list(block_tables[r.request_id]), starts[r.request_id],
                    r.sampling_params,
                )
                for r in state.scheduled_new
            ],
            scheduled_cached_reqs=cached,
            finished_req_ids=self.finished_req_ids,
            step=self.step,
        )
        assert output.total_num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_running_reqs
        # Advance AFTER the output is built: the output carries where each chunk starts.
        self._update_after_schedule(output)
        self.finished_req_ids = set()
        self._unconsumed_steps.add(self.step)
        self._record(
            "schedule",
            None,
            [],
            f"step {self.step}: {output.total_num_scheduled_tokens} tokens for {len(order)} requests"
            + (f", preempted {list(output.preempted_req_ids)}" if output.preempted_req_ids else ""),
            num_scheduled_tokens=dict(state.num_scheduled_tokens),
            preempted_req_ids=list(output.preempted_req_ids),
        )
        self.step += 1
        return output

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance every scheduled request's ``num_computed_tokens`` by its scheduled count, so that the next
        step could be scheduled before this one's samples arrive. Mirrors ``Scheduler._update_after_schedule``
        (``AsyncScheduler`` adds its placeholders here)."""
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
            self.requests[rid].num_in_flight_tokens += n  # until its output is taken (update_from_output)

    # ------------------------------------------------------------------------------------------------
    # Preemption
    # ------------------------------------------------------------------------------------------------
    def _select_victim(self) -> Request:
        """The running request to preempt: the newest (the last in ``running``) under FCFS; under priority
        the one with the largest ``(priority, arrival_time)``, the first such in ``running`` on a tie.
        Mirrors the victim choice inside ``Scheduler.schedule``."""
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _uncache_unwritten_blocks(self, request: Request) -> None:
        """Evict from the prefix cache the blocks of ``request`` that were cached by this step's
        ``allocate_slots`` but hold no KV yet: those past its ``num_computed_tokens`` (which still counts only
        what earlier steps computed). Called when a request scheduled earlier in the step is preempted later in
        the same step (the priority policy), before its blocks are freed: otherwise they would go back to the
        free queue with their hashes, and a later request with the same prefix would hit blocks that no
        forward pass ever wrote. vLLM 0.26's ``Scheduler.schedule`` gives the victim's tokens back to the budget
        but leaves its hashes in place; the eviction uses ``KVCacheManager.evict_blocks``, which vLLM uses for
        blocks whose KV failed to load (``Scheduler._handle_invalid_blocks``)."""
        manager = self.kv_cache_manager
        rid = request.request_id
        if rid not in manager.req_to_blocks:
            return
        first_unwritten = request.num_computed_tokens // self.block_size
        unwritten = {
            b.block_id
            for blocks in manager.get_blocks(rid).blocks
            for b in blocks[first_unwritten:]
            if b.block_hash is not None and not b.is_null
        }
        if unwritten:
            manager.evict_blocks(unwritten)

    def _preempt_request(self, request: Request, state: _StepState | None = None) -> None:
        """Take a request (already removed from ``running``) off the GPU and put it back in ``waiting``.

        By swap, when ``preemption_mode == "swap"`` and the CPU pool has room for the
        ``ceil(num_computed_tokens / block_size)`` blocks at the front of its table: those blocks are paired
        with CPU blocks (``blocks_to_swap_out``), ``num_computed_tokens`` is kept, and the request will come back
        through ``blocks_to_swap_in``. Otherwise by recompute: ``num_computed_tokens`` goes back to 0 and its
        KV will be recomputed (prefix-cache hits permitting). Either way its GPU blocks are freed, its output
        tokens are kept, its status becomes ``PREEMPTED``, and it goes to the head of ``waiting`` (under the
        priority policy, to its place by priority). Mirrors ``Scheduler._preempt_request``; swap mirrors
        vLLM V0's ``Scheduler._preempt_by_swap``.
        """
        manager = self.kv_cache_manager
        rid = request.request_id
        table = self._table(rid) if rid in manager.req_to_blocks else []
        num_blocks = cdiv(request.num_computed_tokens, self.block_size)
        mode = "recompute"
        one_full_group = manager.coordinator is None or (
            manager.num_kv_cache_groups == 1 and isinstance(manager.single_type_managers[0], FullAttentionManager)
        )
        if (
            self.preemption_mode == "swap"
            and one_full_group
            and state is not None  # a swap-out must travel in a step's output
            and 0 < num_blocks <= len(table)
            and num_blocks <= self.cpu_block_pool.get_num_free_blocks()
        ):
            mode = "swap"
            # The swap-out runs first in the next forward's order, on the blocks as the previous step left
            # them: a block replaced by copy-on-write in this step still holds its data at the source.
            replaced = {dst: src for src, dst in state.copies.get(rid, [])}
            gpu_ids = [replaced.get(b, b) for b in table[:num_blocks]]
            cpu_ids = self.cpu_block_pool.allocate(num_blocks)
            pairs = list(zip(gpu_ids, cpu_ids, strict=True))
            self.swapped[rid] = cpu_ids
            state.swap_out.extend(pairs)
            self.num_swap_outs += 1
            self._record(
                "swap_out",
                rid,
                gpu_ids,
                f"{rid} swaps {num_blocks} blocks out to CPU blocks {cpu_ids}",
                pairs=[list(p) for p in pairs],
            )
        if state is not None:
            state.copies.pop(rid, None)
        if rid in manager.req_to_blocks:
            manager.free(request)
        if mode == "recompute":
            request.num_computed_tokens = 0
            self.num_recompute_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        if state is not None:
            state.preempted.append(request)
        self._record(
            "preempt",
            rid,
            table,
            f"{rid} preempted by {mode}: back to waiting"
            + (f" with {request.num_computed_tokens} tokens on CPU" if mode == "swap" else ", KV to recompute"),
            mode=mode,
            num_computed_tokens=request.num_computed_tokens,
        )

    def _swap_in(self, request: Request, cpu_blocks: list[int], state: _StepState) -> None:
        """Pair the request's CPU blocks with the front of its new GPU table (``blocks_to_swap_in``) and
        release the CPU blocks (the runner copies them before anything can reuse them). Mirrors vLLM V0's
        ``Scheduler._swap_in``."""
        rid = request.request_id
        table = self._table(rid)
        pairs = list(zip(cpu_blocks, table[: len(cpu_blocks)], strict=True))
        state.swap_in.extend(pairs)
        del self.swapped[rid]
        self.cpu_block_pool.free(cpu_blocks)
        self._record(
            "swap_in",
            rid,
            [g for _, g in pairs],
            f"{rid} swaps {len(pairs)} blocks back in from CPU blocks {cpu_blocks}",
            pairs=[list(p) for p in pairs],
        )

    # ------------------------------------------------------------------------------------------------
    # After the forward pass
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def _as_token(rid: str, value: Any) -> int | None:
        if value is None:
            return None
        if isinstance(value, (list, tuple)):
            if len(value) == 0:
                return None
            if len(value) != 1:
                raise ValueError(f"request {rid!r}: one sampled token per step expected, got {list(value)}")
            value = value[0]
        (token,) = as_token_ids(rid, [value])  # an int in [0, MAX_TOKEN_ID]; ValueError otherwise
        return token

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: Mapping[str, int]
    ) -> dict[str, list[int]]:
        """Take the step's samples: append each kept one to its request, finish requests that are done.

        ``sampled_token_ids`` maps each scheduled request to the token sampled after its chunk (``None`` or
        ``[]`` for none; a one-element list is accepted, as vLLM's runner returns). A sample is kept only when
        the request's chunk reached the end of its tokens; a partial prefill's sample is discarded (its logits
        came from the middle of the prompt). A request that reaches ``max_tokens`` finishes
        ``FINISHED_LENGTH_CAPPED``, one that samples its ``eos_token_id`` ``FINISHED_STOPPED``; both release
        their blocks (and CPU blocks). Samples for requests finished meanwhile (aborted) are ignored; a
        request preempted since the step was scheduled still keeps its sample.

        Everything is checked before anything changes (``ValueError``): the output must come from this
        scheduler and not have been used already; samples must belong to scheduled requests (an empty entry,
        ``None`` or ``[]``, for any other request is ignored); each scheduled,
        unfinished request whose chunk reached its end needs one. Returns ``{req_id: [kept token]}``.
        Mirrors ``Scheduler.update_from_output`` and ``check_stop`` (``vllm/v1/core/sched/utils.py``).
        """
        if not isinstance(scheduler_output, SchedulerOutput):
            raise ValueError(f"scheduler_output must be a SchedulerOutput, got {type(scheduler_output).__name__}")
        if not isinstance(sampled_token_ids, Mapping):
            raise ValueError(
                f"sampled_token_ids must be a dict {{req_id: token}}, got {type(sampled_token_ids).__name__}"
            )
        step = scheduler_output.step
        if step is not None and step not in self._unconsumed_steps:
            raise ValueError(
                f"the output of step {step} was already passed to update_from_output, or is not from this scheduler"
            )
        scheduled = scheduler_output.num_scheduled_tokens
        tokens = {rid: self._as_token(rid, v) for rid, v in sampled_token_ids.items()}
        # An entry with no sample (None or []) for an unscheduled request is harmless (vLLM's runner output may
        # list requests with empty samples); a real token for one is a mistake.
        extra = [rid for rid, token in tokens.items() if rid not in scheduled and token is not None]
        if extra:
            raise ValueError(f"samples for requests that were not scheduled in this step: {extra}")
        partial = scheduler_output.partial_prefill_req_ids
        to_apply: list[tuple[Request, int]] = []
        for rid in scheduled:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue  # finished (aborted) while the step ran
            if partial is not None:
                reached_end = rid not in partial
            else:  # a hand-built output: judge by the request's state now
                reached_end = request.num_computed_tokens >= request.num_tokens
            token = tokens.get(rid)
            if not reached_end:
                continue  # a partial prefill: its sample, if any, is discarded
            if token is None:
                raise ValueError(
                    f"request {rid!r} was scheduled to the end of its tokens but has no sample in sampled_token_ids"
                )
            to_apply.append((request, token))

        # Validated: now change things.
        if step is not None:  # an output of schedule() (not built by hand): its tokens are processed now
            self._unconsumed_steps.discard(step)
            for rid, n in scheduled.items():
                request = self.requests.get(rid)
                if request is not None:
                    request.num_in_flight_tokens -= n  # as vLLM's Scheduler.update_from_output
        new_tokens: dict[str, list[int]] = {}
        for request, token in to_apply:
            kept, stopped = self._update_request_with_output(request, [token])
            if kept:
                new_tokens[request.request_id] = kept
            if stopped is not None:
                self._finish_request(request, stopped)
        return new_tokens

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """Append the step's sampled token(s) to ``request`` and check for a stop: its ``eos_token_id``
        (``FINISHED_STOPPED``) or ``max_tokens`` (``FINISHED_LENGTH_CAPPED``). Returns the tokens kept and the
        finished status (``None``: it goes on); the caller frees a finished request. Mirrors
        ``Scheduler._update_request_with_output`` and ``check_stop`` (``vllm/v1/core/sched/utils.py``)."""
        status = None
        for token in new_token_ids:
            request.append_output_token_ids(token)
            if request.eos_token_id is not None and token == request.eos_token_id:
                status = RequestStatus.FINISHED_STOPPED
            elif request.num_output_tokens >= request.max_tokens:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
            if status is not None:
                break
        return list(new_token_ids), status

    # ------------------------------------------------------------------------------------------------
    # Finishing
    # ------------------------------------------------------------------------------------------------
    def _finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from its queue, release its GPU and CPU blocks, forget it. Mirrors
        ``Scheduler._free_request``."""
        rid = request.request_id
        if request.status == RequestStatus.RUNNING:
            self.running = [r for r in self.running if r is not request]
        else:
            self.waiting.remove_requests([request])
        freed: list[int] = []
        if rid in self.kv_cache_manager.req_to_blocks:
            groups = self.kv_cache_manager.get_blocks(rid).blocks
            freed = [b.block_id for blocks in groups for b in blocks if not b.is_null]
            self.kv_cache_manager.free(request)
        cpu = self.swapped.pop(rid, None)
        if cpu is not None:
            self.cpu_block_pool.free(cpu)
        request.status = status
        self.finished_req_ids.add(rid)
        del self.requests[rid]
        self._record(
            "finish",
            rid,
            freed,
            f"{rid} finished ({request.get_finished_reason()}) after {request.num_output_tokens} tokens",
            reason=request.get_finished_reason(),
        )

    def finish_requests(
        self,
        request_ids: str | Iterable[str] | None,
        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
    ) -> list[str]:
        """Finish requests from outside (a client went away): remove them wherever they are and free their
        blocks. ``None`` finishes every request. Unknown or already finished ids are skipped, as in vLLM
        (an abort may race with a natural finish). Returns the ids actually finished.
        Mirrors ``Scheduler.finish_requests``."""
        if not isinstance(finished_status, RequestStatus) or not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* RequestStatus, got {finished_status!r}")
        if request_ids is None:
            ids = list(self.requests)
        elif isinstance(request_ids, str):
            ids = [request_ids]
        else:
            ids = list(dict.fromkeys(request_ids))
        done: list[str] = []
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            self._finish_request(request, finished_status)
            done.append(rid)
        return done

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[str]:
        """``finish_requests(request_ids, FINISHED_ABORTED)``."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------------------------------------
    # Forks and the prefix cache
    # ------------------------------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child`` as a running request sharing all of ``parent``'s blocks (``KVCacheManager.fork``):
        parallel sampling (n > 1) or beam search. The child must begin with the parent's computed tokens and
        takes its ``num_computed_tokens``; it joins the end of ``running`` (so under FCFS it is the newest).
        ``ValueError`` (no change) when the parent is not running, the child's id is taken, the child is not
        a fresh request, ``max_num_seqs`` requests already run, or the child could never fit.
        Mirrors vLLM V0's ``Scheduler.fork_seq`` (V1 serves n > 1 through prefix caching instead).
        """
        if not isinstance(parent, Request) or not isinstance(child, Request):
            raise ValueError("fork takes two Requests")
        pid, cid = parent.request_id, child.request_id
        if self.requests.get(pid) is not parent or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"parent {pid!r} is not a running request of this scheduler")
        if cid in self.requests:
            raise ValueError(f"duplicate request id {cid!r}")
        if child.status != RequestStatus.WAITING or child.num_computed_tokens != 0:
            raise ValueError(f"child {cid!r} must be a fresh WAITING request")
        if len(self.running) >= self.max_num_running_reqs:
            raise ValueError(f"cannot fork {cid!r}: max_num_seqs={self.max_num_running_reqs} requests already run")
        self._check_can_ever_fit(child)
        self.kv_cache_manager.fork(parent, child)  # validates the tokens; raises before any change
        child.status = RequestStatus.RUNNING
        self.requests[cid] = child
        self.running.append(child)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix. Refuses (``False``) while requests hold blocks, unless
        ``reset_running_requests``: then every running request is first preempted (newest first, so they come
        back in their order; by recompute, since there is no step to carry a swap). Mirrors
        ``Scheduler.reset_prefix_cache``."""
        if reset_running_requests:
            while self.running:
                self._preempt_request(self.running.pop())
        return self.kv_cache_manager.reset_prefix_cache()
