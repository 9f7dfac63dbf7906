"""The runner's block tables, kept on the device and updated from each step's new block ids (Model Runner V2).

The scheduler owns the truth (``KVCacheManager.req_to_blocks``); the runner keeps a copy where the kernels read it.
vLLM 0.26's Model Runner V2 (``vllm/v1/worker/gpu/block_table.py``: ``BlockTables``) keeps one persistent
``[max_num_reqs, max_num_blocks]`` int32 tensor on the GPU: a request gets a row when it first arrives
(``NewRequestData.block_ids``, written whole), each later step appends only the blocks the scheduler added
(``CachedRequestData.new_block_ids``), so a decode step sends a few ints, not every table. The step's
``[B, W]`` table is then gathered from the rows of the scheduled requests, and the slot of every token is
computed there too (:func:`pagedkv.kernels.compute_slot_mappings`, the Triton kernel; :meth:`BlockTables.
compute_slot_mappings` also has a PyTorch path, the CPU default, since the interpreter is slow).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SLOT_MAPPING_IMPLS = ("torch", "triton")


class BlockTables:
    """Persistent device block tables, one row per request slot (``req_index``), one KV cache group.

    ``block_tables [max_num_reqs, max_num_blocks]`` int32 on ``device``; ``num_blocks[req_index]`` (host) how many
    entries of a row are real. Entries past ``num_blocks`` are stale (a previous owner's) and never read: every
    reader stops at the request's ``seq_len``. Mirrors ``BlockTables`` (``vllm/v1/worker/gpu/block_table.py``).
    """

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks: int, device: torch.device | str,
                 slot_mapping_impl: str = "torch") -> None:
        if slot_mapping_impl not in SLOT_MAPPING_IMPLS:
            raise ValueError(f"slot_mapping_impl must be one of {SLOT_MAPPING_IMPLS}, got {slot_mapping_impl!r}")
        self.block_size = block_size
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks = max_num_blocks
        self.device = torch.device(device)
        self.slot_mapping_impl = slot_mapping_impl
        self.block_tables = torch.zeros(max_num_reqs, max_num_blocks, dtype=torch.int32, device=self.device)
        self.num_blocks = [0] * max_num_reqs

    def append_block_ids(self, req_index: int, block_ids: Sequence[int], overwrite: bool) -> None:
        """Write ``block_ids`` into row ``req_index``: from entry 0 when ``overwrite`` (a new or resumed request:
        its whole table), else after its current entries (the blocks this step added). One small host-to-device
        copy. Mirrors ``BlockTables.append_block_ids`` (vLLM stages the writes and applies them in one kernel)."""
        start = 0 if overwrite else self.num_blocks[req_index]
        end = start + len(block_ids)
        if end > self.max_num_blocks:
            raise ValueError(f"request slot {req_index}: {end} blocks exceed the table's {self.max_num_blocks}")
        if block_ids:
            src = torch.tensor(list(block_ids), dtype=torch.int32)
            self.block_tables[req_index, start:end].copy_(src, non_blocking=True)
        self.num_blocks[req_index] = end

    def gather_block_tables(self, idx_mapping: torch.Tensor, width: int) -> torch.Tensor:
        """The step's ``[B, width]`` table: the rows of the scheduled requests, in batch order.
        Mirrors ``BlockTables.gather_block_tables`` (``_gather_block_tables_kernel``)."""
        return self.block_tables.index_select(0, idx_mapping.long())[:, :width]

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,  # [B] int32, on the device
        query_start_loc: torch.Tensor,  # [B + 1] int32, on the device
        positions: torch.Tensor,  # [T] int64, on the device
        token_req_index: torch.Tensor | None = None,  # [T]: idx_mapping repeated per token (torch path)
    ) -> torch.Tensor:
        """Every scheduled token's slot, ``[T]`` int64: by the Triton kernel (``slot_mapping_impl="triton"``;
        the interpreter on a CPU) or in PyTorch (one gather). Mirrors ``BlockTables.compute_slot_mappings``."""
        if self.slot_mapping_impl == "triton":
            from pagedkv.kernels import compute_slot_mappings

            # validate=False: the engine built these vectors itself, and the check would read them back to the host
            return compute_slot_mappings(self.block_tables, idx_mapping, query_start_loc, positions, self.block_size,
                                         validate=False)
        if token_req_index is None:
            counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
            token_req_index = idx_mapping.long().repeat_interleave(counts)
        block_ids = self.block_tables[token_req_index, positions // self.block_size].long()  # [T]
        return block_ids * self.block_size + positions % self.block_size
