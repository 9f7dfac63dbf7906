"""``EngineCore``: the loop between the scheduler and the model runner, stepped as vLLM 0.26 steps it.

One step is lesson 4's loop with a real model behind an executor::

    scheduler_output = scheduler.schedule()                          # who runs, how many tokens, which blocks
    model_output = model_executor.execute_model(scheduler_output)    # one forward + sampling, on the worker(s)
    scheduler.update_from_output(scheduler_output, model_output)     # keep tokens, finish requests

That is :meth:`EngineCore.step`, the sync loop (``async_scheduling=False``). vLLM 0.26's default for the models
the lab serves is async scheduling (``SchedulerConfig.async_scheduling`` becomes ``True`` in
``vllm/config/vllm.py``): the scheduler is an :class:`~pagedkv.async_scheduler.AsyncScheduler` and the engine
steps with :meth:`EngineCore.step_with_batch_queue`, which keeps two batches in flight: it schedules and launches
step N+1 *before* it waits for step N's samples, so the host's scheduling and input preparation overlap the
device's forward. ``step_fn`` is the one the engine uses.

The interface (what ``LLM.generate``, an online server's ``AsyncLLM`` and tests build on):

- ``EngineCore(scheduler, model_executor, *, eos_token_ids=(), tokenizer_eos_token_id=None,
  async_scheduling=True)``;
- ``add_request(EngineCoreRequest)``: queue a request (``ValueError`` and no change if the scheduler refuses it);
- ``abort_requests(request_ids) -> list[str]``: finish requests at once, wherever they are (freeing their
  blocks); ids may also be put on ``aborts_queue`` from another thread: they are aborted before the next
  ``update_from_output``, as vLLM does (``_process_aborts_queue``);
- ``step() -> (EngineCoreOutputs, model_executed)`` and ``step_with_batch_queue() -> (EngineCoreOutputs | None,
  model_executed)``: ``None`` when the call only scheduled (the queue was not full). An output lists, for every
  request that advanced, its new token ids and, when it finished, ``finish_reason`` (``"stop"``, ``"length"``)
  and ``stop_reason``;
- ``has_requests()``, ``has_unfinished_requests()``; ``stats`` (steps, tokens, host seconds per phase).

Not thread-safe beyond ``aborts_queue``: call ``add_request``/``abort_requests`` between steps.

Mirrors ``vllm/v1/engine/core.py`` (``EngineCore``: ``add_request``, ``abort_requests``, ``step``,
``step_with_batch_queue``, ``_process_aborts_queue``) and ``vllm/v1/engine/__init__.py`` (``EngineCoreRequest``,
``EngineCoreOutput``, ``EngineCoreOutputs``). vLLM checks stop tokens inside the scheduler (``check_stop``); the
lab's scheduler knows only ``max_tokens``, so the core checks them right after ``update_from_output``.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.engine.executor import Executor
from pagedkv.request import Request, RequestStatus
from pagedkv.scheduler import Scheduler


@dataclass
class EngineCoreRequest:
    """A request as the engine core receives it: ids already tokenized, ``sampling_params.max_tokens`` already
    what the request may generate. Mirrors ``EngineCoreRequest`` (``vllm/v1/engine/__init__.py``)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # pagedkv.engine.SamplingParams
    arrival_time: float | None = None
    priority: int = 0
    cache_salt: str | None = None  # prefix-cache isolation (vLLM's ``cache_salt``)


@dataclass
class EngineCoreOutput:
    """What one request did in one step: its new token ids; ``finish_reason`` when it finished (``"stop"``,
    ``"length"``); ``stop_reason`` the stop token that ended it (``None`` for the tokenizer's EOS);
    ``num_cached_tokens`` its prefix-cache hit at first admission; ``new_logprobs``, when the request asks for
    logprobs, the new token's row: the token ids (sampled first, then the batch's top ``k``), their logprobs and
    the sampled token's rank; ``new_prompt_logprobs_tensors``, when the request asks for prompt logprobs, its
    prompt's rows (one a prompt token after the first), with its first token. Mirrors ``EngineCoreOutput``."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    new_logprobs: tuple[list[int], list[float], int] | None = None
    new_prompt_logprobs_tensors: Any = None  # LogprobsLists

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    """One step's outputs, in scheduling order. Mirrors ``EngineCoreOutputs``."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: set[str] = field(default_factory=set)


class EngineCore:
    """The scheduler and an executor, stepped (see the module docstring). Mirrors ``EngineCore``."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_executor: Executor,
        *,
        eos_token_ids: Iterable[int] = (),
        tokenizer_eos_token_id: int | None = None,
        async_scheduling: bool = True,
    ) -> None:
        from pagedkv.async_scheduler import AsyncScheduler

        if async_scheduling and not isinstance(scheduler, AsyncScheduler):
            raise ValueError("async_scheduling needs an AsyncScheduler (output placeholders); got a "
                             f"{type(scheduler).__name__}")
        self.scheduler = scheduler
        self.model_executor = model_executor
        self.async_scheduling = async_scheduling
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer_eos_token_id = tokenizer_eos_token_id
        # vLLM: batch_queue_size = VllmConfig.max_concurrent_batches (2 with async scheduling, V2 runner, no PP)
        self.batch_queue_size = 2 if async_scheduling else 1
        self.batch_queue: deque[tuple[Any, Any]] | None = (
            deque(maxlen=self.batch_queue_size) if self.batch_queue_size > 1 else None)
        self.step_fn = self.step if self.batch_queue is None else self.step_with_batch_queue
        self.aborts_queue: queue.Queue[list[str] | str] = queue.Queue()
        self.requests: dict[str, Request] = {}  # unfinished requests, by id
        self._stop_ids: dict[str, frozenset[int]] = {}
        self._ignore_eos: dict[str, bool] = {}
        self._num_cached: dict[str, int] = {}
        # attention_s and sample_s are parts of forward_s (the runner's StepTimes)
        self.stats: dict[str, float] = {"steps": 0, "forward_tokens": 0, "schedule_s": 0.0, "prepare_s": 0.0,
                                        "forward_s": 0.0, "attention_s": 0.0, "sample_s": 0.0, "update_s": 0.0}

    # ------------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> Request:
        """Queue ``request`` in the scheduler (which refuses, with ``ValueError`` and no change, a duplicate id
        or a request that could never fit); returns the scheduler's :class:`~pagedkv.request.Request`.
        Its stop tokens are ``stop_token_ids`` plus, unless ``ignore_eos``, the model's EOS ids and the tokenizer's;
        with ``min_tokens`` the runner is given a copy of its parameters that knows the EOS ids too (it masks them).
        Mirrors ``EngineCore.add_request``."""
        params = request.sampling_params
        eos = self.eos_token_ids | ({self.tokenizer_eos_token_id} if self.tokenizer_eos_token_id is not None else set())
        if params.min_tokens and not eos <= params.all_stop_token_ids:  # what min_tokens masks: on a copy
            params = replace(params)
            params.update_from_generation_config({"eos_token_id": sorted(self.eos_token_ids)},
                                                 self.tokenizer_eos_token_id)
        kwargs: dict[str, Any] = {"priority": request.priority, "sampling_params": params,
                                  "cache_salt": request.cache_salt}
        if request.arrival_time is not None:
            kwargs["arrival_time"] = request.arrival_time
        req = Request(request.request_id, request.prompt_token_ids, params.max_tokens, **kwargs)
        self.scheduler.add_request(req)
        rid = req.request_id
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:  # the model's EOS ids and the tokenizer's, as vLLM's InputProcessor.process_inputs
            stop |= eos  # gives each request (SamplingParams.update_from_generation_config)
        self.requests[rid] = req
        self._stop_ids[rid] = frozenset(stop)
        self._ignore_eos[rid] = params.ignore_eos
        return req

    def abort_requests(self, request_ids: str | Iterable[str]) -> list[str]:
        """Finish these requests now (``FINISHED_ABORTED``), wherever they are, freeing their blocks; unknown or
        finished ids are skipped. A step in flight for one of them is discarded when it returns. Returns the ids
        aborted. Mirrors ``EngineCore.abort_requests``."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for rid in done:
            self._forget(rid)
        return done

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix: ``False`` (nothing changed) while requests hold blocks, unless
        ``reset_running_requests``, which preempts them first. Mirrors ``EngineCore.reset_prefix_cache``
        (``vllm/v1/engine/core.py``), which hands it to the scheduler."""
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def _process_aborts_queue(self) -> None:
        ids: list[str] = []
        while not self.aborts_queue.empty():
            item = self.aborts_queue.get_nowait()
            ids.extend([item] if isinstance(item, str) else item)
        if ids:
            self.abort_requests(ids)

    def _forget(self, rid: str) -> None:
        self.requests.pop(rid, None)
        self._stop_ids.pop(rid, None)
        self._ignore_eos.pop(rid, None)
        self._num_cached.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones the runner has not been told of yet (the next step tells it).
        Mirrors ``SchedulerInterface.has_requests``."""
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests()

    # ------------------------------------------------------------------------------------------------
    # Stepping
    # ------------------------------------------------------------------------------------------------
    def _schedule(self) -> Any:
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.stats["schedule_s"] += time.perf_counter() - t0
        for new in scheduler_output.scheduled_new_reqs:
            self._num_cached.setdefault(new.req_id, new.num_computed_tokens)
        return scheduler_output

    def _execute(self, scheduler_output: Any) -> Any:
        future = self.model_executor.execute_model(scheduler_output, non_block=True)
        times = getattr(getattr(self.model_executor, "model_runner", None), "last_step_times", None)
        if times is not None:
            self.stats["prepare_s"] += times.prepare_s
            self.stats["forward_s"] += times.forward_s
            self.stats["attention_s"] += times.attention_s
            self.stats["sample_s"] += times.sample_s
        if scheduler_output.total_num_scheduled_tokens:
            self.stats["steps"] += 1
            self.stats["forward_tokens"] += scheduler_output.total_num_scheduled_tokens
        return future

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """Schedule, execute, wait for the samples, update: one step, nothing in flight between calls.
        Returns the step's outputs and whether the model ran. Mirrors ``EngineCore.step``."""
        if not self.has_requests():
            return EngineCoreOutputs(), False
        scheduler_output = self._schedule()
        model_output = self._execute(scheduler_output).result()
        self._process_aborts_queue()
        outputs = self._update_from_output(scheduler_output, model_output)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def step_with_batch_queue(self) -> tuple[EngineCoreOutputs | None, bool]:
        """Async scheduling's step: if the scheduler has requests, schedule and launch a batch, and while the
        queue is not full return at once (``None``); otherwise, or when nothing more can be scheduled, wait for
        the oldest batch in flight and update the scheduler from it. So step N+1 is scheduled (its decodes at the
        placeholders of step N's samples) before step N's samples are read. Mirrors
        ``EngineCore.step_with_batch_queue`` (structured output's deferred sampling left out)."""
        batch_queue = self.batch_queue
        assert batch_queue is not None and len(batch_queue) < self.batch_queue_size
        model_executed = False
        if self.has_requests():
            scheduler_output = self._schedule()
            future = self._execute(scheduler_output)
            model_executed = scheduler_output.total_num_scheduled_tokens > 0
            batch_queue.appendleft((future, scheduler_output))
            if len(batch_queue) < self.batch_queue_size and (model_executed or self.has_requests()):
                return None, model_executed  # don't block unless the queue is full or nothing is left
        elif not batch_queue:
            return None, False
        future, scheduler_output = batch_queue.pop()
        model_output = future.result()
        self._process_aborts_queue()
        return self._update_from_output(scheduler_output, model_output), model_executed

    def _update_from_output(self, scheduler_output: Any, model_output: Any) -> EngineCoreOutputs:
        """``update_from_output``, then the stop tokens: a request that sampled one finishes ``"stop"`` (a stop
        token outranks ``max_tokens``, as vLLM's ``check_stop`` orders them)."""
        t0 = time.perf_counter()
        sampled = model_output.as_dict() if hasattr(model_output, "as_dict") else dict(model_output)
        logprobs = getattr(model_output, "logprobs", None)
        prompt_logprobs = getattr(model_output, "prompt_logprobs_dict", None) or {}
        new_tokens = self.scheduler.update_from_output(scheduler_output, sampled)
        result = EngineCoreOutputs()
        for rid, tokens in new_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            stop_reason = None
            token = tokens[-1]
            # below min_tokens no token stops the request (vLLM's check_stop; the runner masks them anyway)
            if token in self._stop_ids.get(rid, ()) and req.num_output_tokens >= req.sampling_params.min_tokens:
                eos = self.tokenizer_eos_token_id
                stop_reason = None if token == eos and not self._ignore_eos[rid] else token
                if not req.is_finished():
                    self.scheduler.finish_requests(rid, RequestStatus.FINISHED_STOPPED)
                elif req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
                    req.status = RequestStatus.FINISHED_STOPPED
            out = EngineCoreOutput(rid, list(tokens), None, stop_reason, self._num_cached.get(rid, 0),
                                   req.num_preemptions)
            if logprobs is not None and getattr(req.sampling_params, "logprobs", None) is not None:
                i = model_output.req_id_to_index[rid]
                out.new_logprobs = (logprobs.logprob_token_ids[i], logprobs.logprobs[i],
                                    logprobs.sampled_token_ranks[i])
            out.new_prompt_logprobs_tensors = prompt_logprobs.get(rid)
            if req.is_finished():
                out.finish_reason = req.get_finished_reason()
                result.finished_requests.add(rid)
                self._forget(rid)
            result.outputs.append(out)
        self.stats["update_s"] += time.perf_counter() - t0
        return result

    def shutdown(self) -> None:
        self.model_executor.shutdown()
