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

from pagedkv.utils import check_int

from ._common import check_runnable, contiguous_index, contiguous_rows


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
    *,
    validate: bool = True,
) -> torch.Tensor:
    """The ``[T]`` int64 slot of every scheduled token (request after request, as ``query_start_loc`` says).
    All tensors on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``), in any memory layout (a strided index
    vector is copied first). ``ValueError``, with nothing written, on a wrong dtype, rank, device or length, a
    ``block_size`` below 1, or an ``out`` that is not a packed int64 vector of at least T elements; and, with
    ``validate`` (which reads the small vectors back to the host: one synchronisation on a GPU), on a
    ``query_start_loc`` that does not rise from 0 to at most T, a row outside the table, or a position past the
    end of its row."""
    tensors = {"block_tables": block_tables, "idx_mapping": idx_mapping, "query_start_loc": query_start_loc,
               "positions": positions}
    device = block_tables.device
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, block_tables on {device}: give them one device")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be a 2-D int32 tensor, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    for name in ("idx_mapping", "query_start_loc", "positions"):
        t = tensors[name]
        if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if idx_mapping.shape[0] + 1 != query_start_loc.shape[0]:
        raise ValueError(f"{idx_mapping.shape[0]} requests but {query_start_loc.shape[0]} query_start_loc entries")
    block_size = check_int(block_size, "block_size", 1)  # a Python int: Triton's constexpr
    num_tokens, num_reqs = positions.shape[0], idx_mapping.shape[0]
    if out is not None and (out.dtype != torch.int64 or out.dim() != 1 or out.shape[0] < num_tokens
                            or out.device != device or (out.shape[0] > 1 and out.stride(0) != 1)):
        raise ValueError(f"out must be a packed 1-D int64 tensor of at least {num_tokens} elements on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())} on {out.device}")
    check_runnable(device)
    if validate:
        _check_values(block_tables, idx_mapping, query_start_loc, positions, block_size)
    if out is None:
        out = torch.empty(num_tokens, dtype=torch.int64, device=device)
    if num_reqs and num_tokens:
        block_tables = contiguous_rows(block_tables)
        _compute_slot_mappings_kernel[(num_reqs,)](
            contiguous_index(idx_mapping), contiguous_index(query_start_loc), contiguous_index(positions),
            block_tables, block_tables.stride(0), out, BLOCK_SIZE=block_size, TRITON_BLOCK=256,
        )
    return out[:num_tokens]


def _check_values(block_tables: torch.Tensor, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                  positions: torch.Tensor, block_size: int) -> None:
    """What the kernel would read out of bounds through: the offsets, the rows, the positions (host copies)."""
    qsl, idx, pos = query_start_loc.cpu().long(), idx_mapping.cpu().long(), positions.cpu().long()
    num_tokens = pos.shape[0]
    if int(qsl[0]) != 0 or bool((qsl[1:] < qsl[:-1]).any()) or int(qsl[-1]) > num_tokens:
        raise ValueError(f"query_start_loc must rise from 0 to at most the {num_tokens} positions, got "
                         f"{qsl.tolist()}")
    rows, width = block_tables.shape
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
        raise ValueError(f"idx_mapping names rows {idx.tolist()}, but block_tables has rows 0..{rows - 1}")
    used = pos[: int(qsl[-1])]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= width * block_size):
        raise ValueError(f"positions must lie in 0..{width * block_size - 1} (a row holds {width} blocks of "
                         f"{block_size}), got {int(used.min())}..{int(used.max())}")
