"""A simulated model runner: performs a step's block movements on shadow memory, writes the step's tokens,
checks every request reads back its own tokens, and samples from the fake model.

Order matters and is vLLM's: swap-out, swap-in and copy-on-write copies happen before the forward pass,
in that order (a block freed by a swap-out may be the destination of a swap-in or a copy in the same step),
then the step's K and V are written at the slot mapping (``reshape_and_cache``), then attention reads the
block tables.

Mirrors the role of the model runner's ``execute_model``: in vLLM 0.26, Model Runner V2's for dense models
(``vllm/v1/worker/gpu/model_runner.py``, ``GPUModelRunner.execute_model``; ``VllmConfig.use_v2_model_runner``),
the V1 runner's for MoE and Mamba-hybrid models (``vllm/v1/worker/gpu_model_runner.py``); for the swaps and
copies, vLLM V0's ``CacheEngine.swap_out`` / ``swap_in`` / ``copy``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pagedkv.request import Request
from pagedkv.sched_output import SchedulerOutput
from pagedkv.shadow import ShadowKVCache
from pagedkv.sim.model import FakeModel


class KVCacheCorruptionError(AssertionError):
    """A request read back a token that is not its own: a scheduler or block-manager bug."""


class SimModelRunner:
    """Executes ``SchedulerOutput``s against a ``ShadowKVCache`` (``shadow=True``) and a ``FakeModel``.

    With ``verify=True`` every scheduled request's whole context is read back along its block table after
    the step's writes and compared with its tokens (O(context) per request per step: for tests and small
    demos). With ``shadow=False`` nothing is stored; the runner only samples, for large benchmarks.
    """

    def __init__(
        self,
        model: FakeModel | None = None,
        *,
        num_gpu_blocks: int = 0,
        block_size: int = 16,
        num_cpu_blocks: int = 0,
        shadow: bool = True,
        verify: bool = True,
    ) -> None:
        self.model = model or FakeModel()
        self.block_size = block_size
        self.shadow = ShadowKVCache(num_gpu_blocks, block_size, num_cpu_blocks) if shadow else None
        self.verify = verify and shadow
        self._hash_state: dict[str, tuple[int, int]] = {}  # rid -> (tokens hashed, state)
        self.num_steps = 0

    @classmethod
    def for_scheduler(cls, scheduler, model: FakeModel | None = None, **kwargs) -> SimModelRunner:  # noqa: ANN001
        """A runner whose shadow memory matches the scheduler's GPU and CPU pools."""
        return cls(
            model,
            num_gpu_blocks=scheduler.kv_cache_manager.num_gpu_blocks,
            block_size=scheduler.block_size,
            num_cpu_blocks=scheduler.cpu_block_pool.num_blocks,
            **kwargs,
        )

    def _sample(self, request: Request, num_tokens: int) -> int:
        """The fake model's next token after the request's first ``num_tokens`` tokens (hashed incrementally:
        a request's tokens are only ever appended, so the cached prefix state stays valid)."""
        rid = request.request_id
        done, state = self._hash_state.get(rid, (0, self.model.initial_state()))
        if done > num_tokens:
            done, state = 0, self.model.initial_state()
        state = self.model.extend_state(state, request.all_token_ids[done:num_tokens])
        self._hash_state[rid] = (num_tokens, state)
        return self.model.token_from_state(state)

    def forget(self, request_id: str) -> None:
        self._hash_state.pop(request_id, None)

    def execute(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, int]:
        """Run one step. ``requests`` maps ids to requests (``scheduler.requests``). Returns one sample per
        request whose chunk reached the end of its tokens (partial prefills get none)."""
        shadow = self.shadow
        if shadow is not None:
            shadow.swap_out(output.blocks_to_swap_out)
            shadow.swap_in(output.blocks_to_swap_in)
            shadow.copy_blocks(output.blocks_to_copy)
            for rid, n in output.num_scheduled_tokens.items():
                req = requests[rid]
                start = output.num_computed_tokens[rid]
                shadow.write(output.slot_mapping[rid], req.all_token_ids[start : start + n])
        if self.verify:
            for rid, n in output.num_scheduled_tokens.items():
                req = requests[rid]
                end = output.num_computed_tokens[rid] + n
                got = shadow.read(output.block_tables[rid], end)
                want = req.all_token_ids[:end]
                if got != want:
                    pos = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
                    raise KVCacheCorruptionError(
                        f"step {output.step}: request {rid!r} reads token {got[pos]} at position {pos} of its "
                        f"block table {output.block_tables[rid]}, expected {want[pos]}"
                    )
        partial = output.partial_prefill_req_ids or set()
        samples: dict[str, int] = {}
        for rid, n in output.num_scheduled_tokens.items():
            if rid in partial:
                continue
            end = output.num_computed_tokens[rid] + n
            samples[rid] = self._sample(requests[rid], end)
        for rid in output.finished_req_ids:
            self.forget(rid)
        self.num_steps += 1
        return samples
