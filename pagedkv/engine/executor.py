"""Executors: how ``EngineCore`` reaches the model runner(s).

``EngineCore`` never calls the runner itself: it hands each ``SchedulerOutput`` to an executor, which runs it on
its worker(s) and gives back the step's :class:`~pagedkv.engine.model_runner.ModelRunnerOutput`, or a
:class:`~concurrent.futures.Future` of it with ``non_block=True`` (what ``step_with_batch_queue`` uses to keep two
steps in flight). The interface other executors implement (a multiprocess tensor-parallel one, say):

- ``execute_model(scheduler_output, non_block=False) -> ModelRunnerOutput | Future[ModelRunnerOutput]``: run the
  step on every worker; the output is the samples (one worker's, when they all sample the same tokens);
- ``kv_cache_bytes() -> int``, ``shutdown()``; ``max_concurrent_batches`` (2 with async scheduling).

The ``SchedulerOutput`` is the only thing that travels to a worker each step (plain data: ids, token ids, block
ids, sampling parameters), so a worker in another process can be driven by the same loop.

Mirrors ``vllm/v1/executor/abstract.py`` (``Executor``) and ``vllm/v1/executor/uniproc_executor.py``
(``UniProcExecutor``: the worker in the engine's own process; its ``execute_model(..., non_block=True)`` wraps
the worker's async output in a future).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pagedkv.engine.model_runner import ModelRunner, ModelRunnerOutput
from pagedkv.sched_output import SchedulerOutput


class DeferredOutput(Future):
    """A future whose result is fetched when first asked for: ``result()`` waits for the step's samples on the
    device (``AsyncModelRunnerOutput.get_output``), not before. Mirrors how ``UniProcExecutor.collective_rpc`` wraps an
    ``AsyncModelRunnerOutput`` in an ``AsyncOutputFuture`` (``vllm/v1/executor/uniproc_executor.py``)."""

    def __init__(self, async_output: Any) -> None:
        super().__init__()
        self._async_output = async_output

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if not self.done():
            try:
                self.set_result(self._async_output.get_output())
            except BaseException as exc:
                self.set_exception(exc)
        return super().result(timeout)


class Executor:
    """The executor interface (see the module docstring). Mirrors ``vllm/v1/executor/abstract.py: Executor``."""

    max_concurrent_batches = 1

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        raise NotImplementedError

    def kv_cache_bytes(self) -> int:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release the workers (nothing to release for a runner in this process)."""


class UniProcExecutor(Executor):
    """One model runner in the engine's own process. ``async_scheduling`` sets ``max_concurrent_batches`` to 2,
    as vLLM 0.26 does (``VllmConfig.max_concurrent_batches``). Mirrors ``UniProcExecutor``."""

    def __init__(self, model_runner: ModelRunner, async_scheduling: bool = True) -> None:
        self.model_runner = model_runner
        self.max_concurrent_batches = 2 if async_scheduling else 1

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step on the runner. ``non_block``: return at once with a future; the runner has launched the
        step (on a GPU the device runs on) and the future's ``result()`` waits for its samples."""
        output = self.model_runner.execute_model(scheduler_output)
        if non_block:
            return DeferredOutput(output)
        return output.get_output()

    def kv_cache_bytes(self) -> int:
        return self.model_runner.kv_cache_bytes()
