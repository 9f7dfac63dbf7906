"""A shadow KV cache for tests and lessons: each slot stores the token whose "KV" was written there.

Real K and V are vectors that depend on a token and everything before it; for checking a block manager
it is enough to store the token id. After the scheduler's swaps and copies are applied and a step's new
tokens are written at their slot mapping, reading a request's block table must give back exactly that
request's tokens: a wrong cache hit, a shared block written in place, a lost copy or a bad swap all show up
as a wrong token. There is no vLLM counterpart; vLLM's tests compare model outputs instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

EMPTY = -1  # a slot nobody wrote


class ShadowKVCache:
    """``num_blocks`` GPU blocks and ``num_cpu_blocks`` CPU blocks of ``block_size`` token slots."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.block_size = block_size
        self.gpu: list[list[int]] = [[EMPTY] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[int]] = [[EMPTY] * block_size for _ in range(num_cpu_blocks)]

    def write(self, slot_mapping: Sequence[int], token_ids: Sequence[int]) -> None:
        """Write token ``token_ids[i]`` at slot ``slot_mapping[i]`` (slot -1 is skipped, as in
        ``reshape_and_cache``)."""
        if len(slot_mapping) != len(token_ids):
            raise ValueError(f"{len(slot_mapping)} slots for {len(token_ids)} tokens")
        for slot, tok in zip(slot_mapping, token_ids, strict=True):
            if slot >= 0:
                self.gpu[slot // self.block_size][slot % self.block_size] = tok

    def read(self, block_ids: Sequence[int], num_tokens: int) -> list[int]:
        """The first ``num_tokens`` tokens stored along a block table."""
        bs = self.block_size
        return [self.gpu[block_ids[p // bs]][p % bs] for p in range(num_tokens)]

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """GPU block ``src`` → GPU block ``dst`` for each pair (copy-on-write)."""
        for src, dst in pairs:
            self.gpu[dst] = list(self.gpu[src])

    def swap_out(self, pairs: Iterable[tuple[int, int]]) -> None:
        """GPU block → CPU block for each ``(gpu, cpu)`` pair."""
        for gpu, cpu in pairs:
            self.cpu[cpu] = list(self.gpu[gpu])

    def swap_in(self, pairs: Iterable[tuple[int, int]]) -> None:
        """CPU block → GPU block for each ``(cpu, gpu)`` pair."""
        for cpu, gpu in pairs:
            self.gpu[gpu] = list(self.cpu[cpu])
