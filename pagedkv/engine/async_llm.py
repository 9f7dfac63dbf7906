"""``AsyncLLM``: the engine behind an online server. Requests join and leave while the engine steps.

``LLM.generate`` (lesson 7) takes every prompt up front and steps until all are done. A server cannot: requests
arrive at any time, each client wants its tokens as they come, and a client that goes away must stop costing
KV blocks. ``AsyncLLM`` runs one engine loop as an asyncio task beside the HTTP handlers:

    while the server runs:
        apply the adds and aborts that arrived since the last step      # the scheduler's queues change here
        if nothing is unfinished: sleep until a request arrives
        outputs = step()                                                # in a worker thread: the event loop
                                                                        # keeps serving HTTP meanwhile
        for each request with new tokens: detokenize, check stop strings, hand the delta to its client

Only the loop touches the engine (the scheduler, the pool, the model), and only between steps, so nothing
needs a lock. ``generate()`` is an async generator per request: it queues the request and yields deltas from
its own queue; if it is cancelled or closed (the client disconnected) it aborts the request, whose blocks
return to the pool before the next step. ``n > 1`` fans out into ``n`` engine requests sharing the prompt's
blocks through the prefix cache, as vLLM V1 does (``vllm/v1/engine/parallel_sampling.py``).

Mirrors ``vllm/v1/engine/async_llm.py`` (``AsyncLLM.generate``, ``abort``, ``_run_output_handler``) with the
engine core in-process: vLLM runs ``EngineCore`` in its own process (``EngineCoreProc.run_busy_loop``) and
talks to it over ZeroMQ; the lab runs the same loop as a task, its steps in a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.core import EngineCoreOutput
from pagedkv.engine.core import EngineCoreRequest as CoreRequest
from pagedkv.engine.exceptions import InvalidRequestError
from pagedkv.engine.llm import LLM
from pagedkv.engine.metrics import PrometheusStatLogger
from pagedkv.engine.output_processor import CompletionDelta, RequestState
from pagedkv.engine.sampling_params import SamplingParams

#: Steps in a row that may schedule nothing while requests are unfinished before the loop gives up on them
#: (a scheduler bug, never a wait): their clients get an error instead of waiting forever.
MAX_IDLE_STEPS = 1000


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight gets this error. Mirrors ``vllm/v1/engine/exceptions.py``."""


@dataclass
class EngineCoreRequest:
    """One engine request as the core receives it. Mirrors ``vllm/v1/engine/__init__.py: EngineCoreRequest``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    cache_salt: str | None = None
    priority: int = 0


class _LLMEngineCore:
    """The loop's view of the :class:`LLM`'s :class:`~pagedkv.engine.core.EngineCore`: ``add_request``,
    ``abort_requests``, ``step`` (one ``step_fn`` call: with async scheduling, ``step_with_batch_queue``, which may
    only launch a step and return nothing). ``seqs`` holds the requests not yet finished or aborted."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.core = llm.engine_core
        self.seqs: dict[str, EngineCoreRequest] = {}
        self.idle_steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params.with_max_tokens(request.max_tokens)
        self.core.add_request(CoreRequest(request.request_id, list(request.prompt_token_ids), params,
                                          priority=request.priority, cache_salt=request.cache_salt))
        self.seqs[request.request_id] = request  # after add_request: a refused request is not kept

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        self.core.abort_requests(list(request_ids))
        for rid in request_ids:
            self.seqs.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs) or bool(self.core.batch_queue)  # steps in flight still return

    def step(self) -> list[EngineCoreOutput]:
        """One engine-core step; the new tokens (and finish) of every request that got any."""
        core_outputs, executed = self.core.step_fn()
        got = core_outputs is not None and bool(core_outputs.outputs)
        self.idle_steps = 0 if executed or got or not self.seqs else self.idle_steps + 1
        outputs = []
        for out in core_outputs.outputs if core_outputs is not None else ():
            if out.request_id not in self.seqs:
                continue
            outputs.append(out)
            if out.finished:
                del self.seqs[out.request_id]
        return outputs


class AsyncLLM:
    """An :class:`LLM` served online: ``generate()`` per request, one engine loop for all of them.

    Create it inside a running event loop (``await engine.start()``) and stop it with ``await
    engine.shutdown()``. ``model_name`` is what ``/v1/models`` lists and the metrics are labelled with.
    """

    def __init__(self, llm: LLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.core = _LLMEngineCore(llm)
        self.stat_logger = PrometheusStatLogger(model_name)
        self._states: dict[str, RequestState] = {}
        self._queues: dict[str, asyncio.Queue] = {}  # engine request id -> its parent's queue
        self._pending: list[tuple[str, Any]] = []  # ("add", EngineCoreRequest) | ("abort", [ids]) | ("call", ...)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count()
        self._num_preemptions = 0
        self.dead_error: BaseException | None = None
        self.num_steps = 0
        self._shut_down = False

    # ------------------------------------------------------------------------------------------------
    # Life cycle
    # ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine loop (once)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedkv-engine")
            self._task = asyncio.create_task(self._run_engine_loop(), name="pagedkv-engine-loop")

    async def shutdown(self) -> None:
        """Stop the loop; every request still in flight is aborted and its client told so. Afterwards
        ``generate`` raises :class:`EngineDeadError` (nothing is queued)."""
        self._shut_down = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        self.core.abort_requests(list(self.core.seqs))
        self._fail_all(EngineDeadError("the server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    # ------------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int], max_tokens: int | None) -> int:
        """Check one prompt against the model and the pool; return the ``max_tokens`` to use (``None``: all
        the room ``max_model_len`` leaves). ``InvalidRequestError`` otherwise. Mirrors vLLM's
        ``get_max_tokens`` (``vllm/entrypoints/serve/utils/api_utils.py``), ``TokenizeParams._token_len_check``
        (``vllm/renderers/params.py``) and ``InputProcessor`` (``vllm/v1/engine/input_processor.py``), in vLLM's
        order: the length (against ``max_tokens or 0``), then ``max_tokens`` (chat's ``None`` is the room left,
        which a prompt of ``max_model_len`` tokens makes 0, at most the model's generation config's
        ``max_new_tokens``), then the vocabulary."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("The prompt is empty: a request needs at least one token.", "prompt")
        want = max_tokens or 0  # TokenizeParams(max_output_tokens=max_tokens or 0)
        if n > self.max_model_len - want:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{want} output tokens and your prompt contains {n} input tokens, for a total of {n + want} "
                "tokens. Please reduce the length of the input prompt or the number of requested output tokens.",
                "input_tokens")
        if max_tokens is None:  # the room left, at most the generation config's max_new_tokens (get_max_tokens)
            configured = self.llm.get_diff_sampling_param().get("max_tokens")
            max_tokens = self.max_model_len - n if configured is None else min(self.max_model_len - n, configured)
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        vocab = self.llm.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            # vLLM 0.26's words and a plain ValueError, so no param (InputProcessor._validate_model_input,
            # vllm/v1/engine/input_processor.py)
            raise InvalidRequestError(f"Token id {max(bad)} is out of vocabulary")
        try:
            self.llm._check_fits(0, n, max_tokens)
        except ValueError as exc:
            raise InvalidRequestError(str(exc).replace("prompt 0", "the prompt"), "max_tokens") from None
        return max_tokens

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[CompletionDelta, None]:
        """Queue one prompt (``sampling_params.n`` completions) and yield each completion's deltas as the
        engine produces them, until all ``n`` have finished. ``max_tokens`` in ``sampling_params`` is used as
        checked by :meth:`check_prompt` (call it first). ``sampling_params`` is checked again here, as
        ``LLM.generate`` does (a field set to an invalid value after construction raises
        :class:`InvalidRequestError`, nothing queued), and the engine keeps its own copy. Cancelling or closing the
        generator aborts whatever has not finished. ``request_id`` need not be unique: the engine's id for the
        request is it plus 8 random characters, as in vLLM. Mirrors ``AsyncLLM.generate``."""
        if self.errored:
            raise EngineDeadError(f"the engine loop failed: {self.dead_error}")
        if self._shut_down:  # no loop will ever take the request: refuse it rather than wait forever
            raise EngineDeadError("the engine has been shut down; create a new AsyncLLM")
        try:
            sampling_params = sampling_params.verified()  # the one check, SamplingParams._verify_args
            self.llm.verify_sampling_params(sampling_params)  # against the model: SamplingParams.verify
        except ValueError as exc:  # the field, where vLLM names it (its VLLMValidationError)
            raise InvalidRequestError(str(exc), getattr(exc, "parameter", None)) from None
        stop = list(stop) or list(sampling_params.stop)  # the keyword's, else the parameters' own (vLLM's place)
        include_stop_str_in_output = include_stop_str_in_output or sampling_params.include_stop_str_in_output
        if stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none: use stop_token_ids",
                                      "stop")
        # the caller's id gets 8 random characters, so two clients sending the same request_id both run (vLLM's
        # InputProcessor.assign_request_id); the lab's own ids are unique already
        base = f"{request_id}-{uuid.uuid4().hex[:8]}" if request_id else f"req-{next(self._ids)}"
        n = sampling_params.n
        max_tokens = sampling_params.max_tokens  # None: up to max_model_len, as vLLM's InputProcessor
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_token_ids)
        q: asyncio.Queue = asyncio.Queue()
        child_ids = [base if n == 1 else f"{base}-{j}" for j in range(n)]
        if any(rid in self._states for rid in child_ids):
            raise InvalidRequestError(f"request id {base!r} is already in use", "request_id")
        # the loop starts on first use, before anything is queued (AsyncLLM.generate's _run_output_handler())
        await self.start()
        for j, rid in enumerate(child_ids):
            params = sampling_params.for_child(j) if n > 1 else sampling_params
            self._states[rid] = RequestState(rid, j, list(prompt_token_ids), params, list(stop),
                                             include_stop_str_in_output, self.tokenizer)
            self._queues[rid] = q
            self._pending.append(("add", EngineCoreRequest(rid, list(prompt_token_ids), params, max_tokens,
                                                           cache_salt, priority)))
        assert self._wake is not None
        self._wake.set()
        remaining = set(child_ids)
        try:
            while remaining:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining.discard(child_ids[item.index])
                yield item
        finally:  # cancelled (client gone), closed early, or failed: abort what is still running
            if remaining:
                self.abort([rid for rid in child_ids if rid in remaining])

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (one id, or several): their clients get nothing more, and the engine frees their blocks
        before its next step. Unknown or finished ids are ignored. Mirrors ``AsyncLLM.abort``, which takes
        ``str | Iterable[str]`` (a single id is not read as its characters)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids = [rid for rid in request_ids if self._states.pop(rid, None) is not None]
        for rid in ids:
            self._queues.pop(rid, None)
        if ids:
            self._pending.append(("abort", ids))
            if self._wake is not None:
                self._wake.set()

    async def call_between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in the engine loop between two steps (when the engine's state is consistent) and
        return its result: how ``/pagedkv/snapshot`` reads the block tables while a load runs. Mirrors
        vLLM's utility calls into the engine core (``EngineCoreProc._handle_client_request``)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(("call", (fn, fut)))
        assert self._wake is not None, "call await start() first"
        self._wake.set()
        return await fut

    # ------------------------------------------------------------------------------------------------
    # The engine loop
    # ------------------------------------------------------------------------------------------------
    def _apply_pending(self) -> None:
        """Apply the adds, aborts and calls queued since the last step, in order. After an abort the gauges are
        recorded at once: a step may still be in flight (async scheduling), and until it returns an HTTP handler
        could read a pool already freed (a snapshot) beside gauges that still count the aborted request."""
        pending, self._pending = self._pending, []
        for kind, arg in pending:
            if kind == "add":
                if arg.request_id not in self._states:
                    continue  # aborted before it reached the engine
                try:
                    self.core.add_request(arg)
                except ValueError as exc:  # check_prompt should have caught it: tell the client, carry on
                    self._deliver_error(arg.request_id, InvalidRequestError(str(exc)))
            elif kind == "abort":
                self.core.abort_requests(arg)
                self._record_scheduler_stats()
            else:
                fn, fut = arg
                if not fut.done():
                    try:
                        fut.set_result(fn())
                    except Exception as exc:
                        fut.set_exception(exc)

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        self._states.pop(rid, None)
        q = self._queues.pop(rid, None)
        if q is not None:
            q.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._states):
            self._deliver_error(rid, exc)
        for kind, arg in self._pending:
            if kind == "call" and not arg[1].done():
                arg[1].set_exception(exc)
        self._pending = []

    async def _run_engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        try:
            while True:
                self._apply_pending()
                if not self.core.has_unfinished_requests():
                    self._record_scheduler_stats()  # aborts since the last step: the gauges show them gone
                    self._wake.clear()
                    if not self._pending:
                        await self._wake.wait()
                    continue
                outputs = await loop.run_in_executor(self._executor, self.core.step)
                self.num_steps += 1
                self._process_outputs(outputs)
                self._record_scheduler_stats()
                if self.core.idle_steps > MAX_IDLE_STEPS:
                    stuck = list(self.core.seqs)
                    self.core.abort_requests(stuck)
                    for rid in stuck:
                        self._deliver_error(rid, EngineDeadError(
                            f"the scheduler scheduled nothing for {MAX_IDLE_STEPS} steps; request aborted"))
                    self.core.idle_steps = 0
                await asyncio.sleep(0)  # let the HTTP handlers run between steps
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in a step: fail every request in flight, keep answering HTTP
            self.dead_error = exc
            self._fail_all(EngineDeadError(f"the engine loop failed: {type(exc).__name__}: {exc}"))

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Hand each request's new tokens to its client; finish and abort on stop strings. Mirrors
        ``OutputProcessor.process_outputs``."""
        now = time.monotonic()
        to_abort = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted while the step ran
            state.num_cached_tokens = out.num_cached_tokens
            state.num_preemptions = out.num_preemptions
            delta = state.add_tokens(out.new_token_ids, out.finish_reason, out.stop_reason, now, out.new_logprobs,
                                     out.new_prompt_logprobs_tensors)
            if delta is not None:
                self._queues[out.request_id].put_nowait(delta)
            if state.finished:
                if out.finish_reason is None:  # a stop string: the engine still runs it
                    to_abort.append(out.request_id)
                del self._states[out.request_id]
                del self._queues[out.request_id]
                self.stat_logger.record_finished(state.finish_reason or "abort", len(state.prompt_token_ids),
                                                 state.token_times, state.arrival_time, now)
        if to_abort:
            self.core.abort_requests(to_abort)  # between steps: safe to touch the engine

    def _record_scheduler_stats(self) -> None:
        sched = self.llm.scheduler
        running, waiting = sched.get_request_counts()
        new_preemptions = sched.num_preemptions - self._num_preemptions
        self._num_preemptions = sched.num_preemptions
        stats = sched.kv_cache_manager.make_prefix_cache_stats()
        self.stat_logger.record_scheduler(running, waiting, sched.kv_cache_manager.usage, new_preemptions,
                                          stats.queries, stats.hits)
