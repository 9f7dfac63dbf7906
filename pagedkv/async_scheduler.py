"""Async scheduling: step N+1 is scheduled while step N still runs, before N's samples exist.

vLLM 0.26 schedules this way by default (``SchedulerConfig.async_scheduling=None`` becomes ``True`` in
``vllm/config/vllm.py``; ``get_scheduler_cls()`` then returns ``AsyncScheduler``), and ``EngineCore`` steps with
``step_with_batch_queue``: two batches in flight, so the host's scheduling and input preparation for step N+1
overlap the GPU's forward of step N.

The scheduler cannot know step N's sampled token when it schedules N+1, so it counts it as an **output
placeholder**: a request whose chunk reached the end of its tokens gets ``num_output_placeholders += 1`` when
scheduled, and the next ``schedule()`` gives it a decode token at the placeholder's position (the runner reads
the input token from its own last sample, on the device). When the sample arrives, ``update_from_output``
appends it and takes the placeholder back. What 0.26 throws away:

- a sample for a request that finished meanwhile (it stopped on the previous step's token, or was aborted):
  ``update_from_output`` skips a request that is gone (``Scheduler.update_from_output``: "the request is
  already finished");
- the partial prefill's sample (the runner's; no placeholder is ever made for a partial chunk);
- samples in flight when ``reset_prefix_cache(reset_running_requests=True)`` force-preempts
  (``async_tokens_to_discard``).

A request preempted while its step is in flight **keeps** that step's sample (its KV will be recomputed, or
swapped, with the token included). And a request whose in-flight step already reaches ``max_tokens`` is not
scheduled again (the check at the top of ``Scheduler.schedule``'s running loop), so no step is wasted at the
length cap; only a stop token (EOS) costs one discarded step.

Mirrors ``vllm/v1/core/sched/async_scheduler.py`` (``AsyncScheduler``) line for line, speculative decoding and
pipeline parallelism left out.
"""

from __future__ import annotations

from pagedkv.request import Request, RequestStatus
from pagedkv.sched_output import SchedulerOutput
from pagedkv.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    """``Scheduler`` with output placeholders: ``schedule()`` may be called again before the previous step's
    ``update_from_output``. Same constructor as :class:`~pagedkv.scheduler.Scheduler`."""

    #: Two steps in flight (vLLM 0.26's ``VllmConfig.max_concurrent_batches``, ``vllm/config/vllm.py``: 2 with
    #: async scheduling and no pipeline parallelism), so a sliding-window group's admission cap counts
    #: ``2 · max_num_batched_tokens`` tokens in flight (``VllmConfig.max_in_flight_tokens``): out-of-window blocks
    #: are freed on the processed-token basis, so both steps' chunks are held at once. With one step's worth, a
    #: request could be admitted to a pool that cannot hold its peak and then preempt itself forever.
    max_concurrent_batches = 2

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` (as the plain scheduler does), then give every scheduled request
        whose chunk reaches the end of its tokens one placeholder for the token this step will sample.
        Mirrors ``AsyncScheduler._update_after_schedule``."""
        super()._update_after_schedule(scheduler_output)
        partial = scheduler_output.partial_prefill_req_ids or set()
        for rid in scheduler_output.num_scheduled_tokens:
            if rid in partial:  # vLLM's request.is_prefill_chunk: this step samples nothing to keep
                continue
            self.requests[rid].num_output_placeholders += 1

    def _update_request_with_output(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """Keep the sample (append, check for a stop), take its placeholder back, and enter in the prefix cache
        the blocks now full of known tokens (a running request only: a preempted one holds no blocks). A sample
        in flight when ``reset_prefix_cache`` force-preempted the request is dropped instead.
        Mirrors ``AsyncScheduler._update_request_with_output``."""
        if request.async_tokens_to_discard > 0:
            request.async_tokens_to_discard -= 1
            return [], None
        status_before_update = request.status
        kept, stopped = super()._update_request_with_output(request, new_token_ids)
        request.num_output_placeholders -= len(kept)
        assert request.num_output_placeholders >= 0
        if status_before_update == RequestStatus.RUNNING:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
        return kept, stopped

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """As ``Scheduler.reset_prefix_cache``; a request force-preempted here has its in-flight samples marked
        to be discarded (``async_tokens_to_discard``), since they were sampled from KV the reset invalidates.
        Mirrors the async branch of ``Scheduler.reset_prefix_cache``."""
        if reset_running_requests:
            while self.running:
                request = self.running.pop()
                self._preempt_request(request)
                request.async_tokens_to_discard = request.num_output_placeholders
                request.num_output_placeholders = 0
        return self.kv_cache_manager.reset_prefix_cache()
