"""``compute_slot_mappings``: each scheduled token's KV slot, computed on the device from the block tables kept there.

Model Runner V2 (vLLM 0.26's default runner for dense models) keeps every request's block table on the GPU
(``BlockTables``, one row per request slot) and turns a step's positions into slots there, so the host sends only
the step's new block ids and a few small vectors. Program ``b`` handles the ``b``-th scheduled request: it reads
the request's row ``idx_mapping[b]`` of the persistent table and, for its tokens
``query_start_loc[b]:query_start_loc[b+1]``, writes ``slot = table[row, pos // block_size] * block_size +
pos % block_size``.

Mirrors ``_compute_slot_mappings_kernel`` (``vllm/v1/worker/gpu/block_table.py``), one KV cache group and no
context parallelism; vLLM's kernel also pads the tail of its persistent buffer with ``PAD_SLOT_ID`` (-1) for
CUDA graphs, which the lab's graph buffers do themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_runnable


@triton.jit
def _compute_slot_mappings_kernel(
    idx_mapping_ptr,  # [B] int32: the scheduled request's row in the persistent block table
    query_start_loc_ptr,  # [B + 1] int32
    positions_ptr,  # [T] int64
    block_table_ptr,  # [max_num_reqs, max_num_blocks] int32
    block_table_stride,  # row stride of the block table
    slot_mapping_ptr,  # [T] int64 (written)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    TRITON_BLOCK: tl.constexpr,  # tokens handled per iteration
):
    b = tl.program_id(0)
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    start = tl.load(query_start_loc_ptr + b)
    end = tl.load(query_start_loc_ptr + b + 1)
    for i in range(start, end, TRITON_BLOCK):
        offs = i + tl.arange(0, TRITON_BLOCK)
        mask = offs < end
        pos = tl.load(positions_ptr + offs, mask=mask, other=0)
        block_ids = tl.load(block_table_ptr + row * block_table_stride + pos // BLOCK_SIZE, mask=mask, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(slot_mapping_ptr + offs, slots, mask=mask)


def compute_slot_mappings(
    block_tables: torch.Tensor,  # [max_num_reqs, max_num_blocks] int32
    idx_mapping: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    positions: torch.Tensor,  # [T] int64
    block_size: int,
    out: torch.Tensor | None = None,  # [>= T] int64
) -> torch.Tensor:
    """The ``[T]`` int64 slot of every scheduled token (request after request, as ``query_start_loc`` says).
    All tensors on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``). ``ValueError`` on a wrong dtype or
    device; nothing is written then."""
    tensors = {"block_tables": block_tables, "idx_mapping": idx_mapping, "query_start_loc": query_start_loc,
               "positions": positions}
    device = block_tables.device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, block_tables on {device}: give them one device")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if idx_mapping.shape[0] + 1 != query_start_loc.shape[0]:
        raise ValueError(f"{idx_mapping.shape[0]} requests but {query_start_loc.shape[0]} query_start_loc entries")
    check_runnable(device)
    num_tokens = positions.shape[0]
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=device)
    num_reqs = idx_mapping.shape[0]
    if num_reqs and num_tokens:
        _compute_slot_mappings_kernel[(num_reqs,)](
            idx_mapping, query_start_loc, positions.contiguous(), block_tables, block_tables.stride(0), out,
            BLOCK_SIZE=block_size, TRITON_BLOCK=256,
        )
    return out[:num_tokens]
