"""What one scheduler step tells the model runner to do.

Mirrors ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``, ``NewRequestData``, ``CachedRequestData``),
plus the block movements that vLLM V0's ``SchedulerOutputs`` carried for swapping
(``blocks_to_swap_out``, ``blocks_to_swap_in``, ``blocks_to_copy``): V1 dropped swapping, the lesson keeps
it to compare it with recomputation.

The model runner performs the three block movements in this order, before the step's forward pass:
``blocks_to_swap_out`` (GPU → CPU), ``blocks_to_swap_in`` (CPU → GPU), ``blocks_to_copy`` (GPU → GPU,
copy-on-write). Then it writes each scheduled token's K and V at ``slot_mapping[req_id]`` and runs attention
over ``block_tables[req_id]``.

Lab extensions (vLLM 0.26's ``SchedulerOutput``, ``vllm/v1/core/sched/output.py``, has none of these
fields; its worker keeps the block tables and computes the slot mapping itself: on the GPU under Model
Runner V2, 0.26's runner for dense models, ``vllm/v1/worker/gpu/block_table.py``: ``BlockTables``; on the host
under the V1 runner, ``vllm/v1/worker/block_table.py``): ``block_tables`` and ``slot_mapping`` per request
(so a step can be read without a worker), ``num_computed_tokens`` per request (vLLM carries it inside ``NewRequestData``
and ``CachedRequestData``), ``partial_prefill_req_ids``, ``step``, and the block movements
``blocks_to_swap_out`` and ``blocks_to_swap_in`` (vLLM V0's swap lists; vLLM 0.26 has no swapping) and
``blocks_to_copy`` (the lab's fork copy-on-write; vLLM 0.26's only copies are ``kv_cache_block_copies``,
for partial prefix hits in hybrid models).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class ReqIdList(list):
    """Request ids in the order things happened to them. Compares equal to a list in that order, and to a
    set or frozenset of the same ids (vLLM's ``preempted_req_ids`` is a set)."""

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (set, frozenset)):
            return set(self) == other
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


@dataclass
class NewRequestData:
    """A request scheduled for the first time (the runner has no state for it yet).
    Mirrors ``NewRequestData`` in ``vllm/v1/core/sched/output.py``."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]  # its whole block table after this step's allocation
    num_computed_tokens: int  # prefix-cache hit length: the first scheduled position
    sampling_params: Any = None  # the request's SamplingParams, for the runner's sampler (None: greedy)


@dataclass
class CachedRequestData:
    """Requests the runner has seen before: running ones and resumed (preempted, re-admitted) ones.
    Mirrors ``CachedRequestData`` in ``vllm/v1/core/sched/output.py``."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks added to each table this step
    num_computed_tokens: list[int] = field(default_factory=list)  # first scheduled position of each
    # Every token of each resumed request (prompt and outputs): the runner dropped its state at preemption and
    # rebuilds it from these. vLLM 0.26's ``CachedRequestData.all_token_ids`` (V1 runner); Model Runner V2 gets
    # them as ``NewRequestData.prefill_token_ids`` instead (resumed requests travel as new ones there).
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan. Every per-request dict lists requests in scheduling order: the running requests
    first, in their queue order, then those admitted from ``waiting``.

    ``num_computed_tokens[r]`` is the position of ``r``'s first scheduled token (what
    ``request.num_computed_tokens`` was before ``schedule()`` advanced it); ``r`` is given
    ``num_scheduled_tokens[r]`` tokens from there. ``partial_prefill_req_ids`` are the requests whose chunk
    stops short of their last token: the runner's sample for them is discarded. ``step`` is the index of the
    ``schedule()`` call that made this output (``None`` for one built by hand).

    With several KV cache groups (a hybrid model), ``group_block_tables[r][g]`` is ``r``'s table in group
    ``g`` (block 0, the null block, where a sliding-window group has released a block) and
    ``group_slot_mapping[r][g]`` where each scheduled token's K/V goes in group ``g``'s layers;
    ``block_tables`` and ``slot_mapping`` hold group 0's. Both are lab extensions, as ``block_tables`` is
    (vLLM 0.26's worker keeps the tables; its ``NewRequestData.block_ids`` is a tuple with one list per
    group). A hand-built output may leave the group fields empty: read them through ``tables_per_group`` and
    ``slots_per_group``.
    """

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    preempted_req_ids: ReqIdList = field(default_factory=ReqIdList)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src_gpu_block, dst_gpu_block)
    block_tables: dict[str, list[int]] = field(default_factory=dict)  # KV cache group 0's
    slot_mapping: dict[str, list[int]] = field(default_factory=dict)  # one slot per scheduled token (group 0)
    # Every group's (one tuple entry per KV cache group; the same as above when there is one group):
    group_block_tables: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    group_slot_mapping: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)
    partial_prefill_req_ids: set[str] | None = None
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    finished_req_ids: set[str] = field(default_factory=set)  # finished since the previous step
    step: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.preempted_req_ids, ReqIdList):
            self.preempted_req_ids = ReqIdList(self.preempted_req_ids or [])
        if not self.total_num_scheduled_tokens:
            self.total_num_scheduled_tokens = sum(self.num_scheduled_tokens.values())

    def tables_per_group(self, req_id: str) -> tuple[list[int], ...]:
        """``req_id``'s block table in every KV cache group (``(block_tables[req_id],)`` if none were set)."""
        return self.group_block_tables.get(req_id) or (self.block_tables[req_id],)

    def slots_per_group(self, req_id: str) -> tuple[list[int], ...]:
        """``req_id``'s slot mapping in every KV cache group (``(slot_mapping[req_id],)`` if none were set)."""
        return self.group_slot_mapping.get(req_id) or (self.slot_mapping[req_id],)

    @property
    def scheduled_req_ids(self) -> list[str]:
        """The scheduled requests in scheduling order."""
        return list(self.num_scheduled_tokens)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    def flat_slot_mapping(self, req_ids: Iterable[str] | None = None) -> list[int]:
        """All scheduled tokens' slots, request after request in scheduling order: the ``slot_mapping[T]``
        that ``reshape_and_cache`` takes for the whole batch."""
        ids = self.num_scheduled_tokens if req_ids is None else req_ids
        return [s for rid in ids for s in self.slot_mapping[rid]]

    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
