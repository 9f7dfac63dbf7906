"""Block tables and slot mapping: from a request's logical token positions to physical cache slots.

A block table is a request's page table: entry ``i`` is the physical block holding its tokens
``i * block_size`` to ``(i + 1) * block_size - 1``. A token at position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the flattened cache
``[num_blocks * block_size, num_kv_heads, head_dim]``. The slot mapping of a step (one slot per scheduled
token) is what ``pagedkv.kernels.reshape_and_cache`` consumes to write the new K and V.
Mirrors the host-side computation of vLLM 0.26's V1 runner (``vllm/v1/worker/block_table.py``,
``BlockTable.compute_slot_mapping``), which 0.26 runs for MoE and Mamba-hybrid models. For dense models 0.26 runs
Model Runner V2, which computes the slots on the GPU (``vllm/v1/worker/gpu/block_table.py``,
``BlockTables.compute_slot_mappings``, the Triton ``_compute_slot_mappings_kernel``): the lab's engine does that in
:mod:`pagedkv.engine.block_table`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The slot of a token that must not be written (padding): ``reshape_and_cache`` skips it.
PAD_SLOT_ID = -1


def compute_slot_mapping(block_ids: Sequence[int], positions: Iterable[int], block_size: int) -> list[int]:
    """Physical slot of each token position: ``block_ids[p // block_size] * block_size + p % block_size``.

    Raises ``ValueError`` for a position below 0 or past the end of the block table.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    slots: list[int] = []
    capacity = len(block_ids) * block_size
    for p in positions:
        if p < 0 or p >= capacity:
            raise ValueError(
                f"position {p} is outside the block table ({len(block_ids)} blocks x {block_size} = {capacity} slots)"
            )
        slots.append(block_ids[p // block_size] * block_size + p % block_size)
    return slots


def make_block_table_tensor(
    block_tables: Sequence[Sequence[int]], max_num_blocks: int | None = None, device: str | None = None
) -> torch.Tensor:
    """Pad a batch's block tables into the kernel's ``int32 [B, max_num_blocks]`` tensor (padding 0, the
    null block, which the kernel never reads because it stops at ``seq_lens``); ``max_num_blocks`` defaults to
    the longest table. Built in one ``torch.tensor`` call (the engine builds one every step). vLLM 0.26 keeps
    a preallocated ``[max_num_reqs, max_num_blocks]`` buffer instead: Model Runner V2 gathers the scheduled
    requests' rows from it on the GPU (``BlockTables.gather_block_tables``, ``vllm/v1/worker/gpu/block_table.py``),
    the V1 runner hands out its first rows (``BlockTable.get_device_tensor``, ``vllm/v1/worker/block_table.py``)."""
    import torch

    width = max((len(t) for t in block_tables), default=0) if max_num_blocks is None else max_num_blocks
    if any(len(t) > width for t in block_tables):
        raise ValueError(f"a block table is longer than max_num_blocks={width}")
    rows = [list(t) + [0] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(len(rows), width)  # [B, max_num_blocks]
