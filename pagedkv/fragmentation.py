"""Fragmentation, as arithmetic: contiguous max-length reservation versus paging.

Lesson 1 measures what paging buys before any kernel exists. A naive engine reserves one contiguous region of
``max_len`` token slots per sequence, because its attention kernel reads the KV cache as one run and the
output length is unknown in advance. Paging (PagedAttention) cuts the cache into fixed-size blocks of
``block_size`` token slots and gives a sequence only ``ceil(num_tokens / block_size)`` of them.

Two kinds of waste follow:

- internal fragmentation: slots reserved for a sequence but never written. Contiguous reservation wastes
  ``max_len - num_tokens`` per sequence; paging wastes at most one partly filled block,
  ``blocks_needed(n, b) * b - n < b``.
- external fragmentation: free memory split into holes too small to use. It needs an allocator working over
  time; see :mod:`pagedkv.contiguous`.

Everything here is pure Python on integers (no tensors) and validates its input: a negative token count, a
non-positive block size or ``max_len``, a negative pool or an unknown policy raises ``ValueError`` naming the
bad argument.

vLLM counterparts: ``vllm.utils.cdiv`` (our :func:`blocks_needed`), the admission loop of
``vllm/v1/core/sched/scheduler.py`` (``Scheduler.schedule``, which stops at the first waiting request that
``KVCacheManager.allocate_slots`` cannot serve: our ``policy="fcfs"``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.utils import check_int

__all__ = [
    "POLICIES",
    "BlockSizeStats",
    "blocks_needed",
    "block_size_sweep",
    "block_table_entries",
    "contiguous_capacity",
    "contiguous_internal_waste",
    "contiguous_waste_percent",
    "paged_admission",
    "paged_internal_waste",
    "paged_reserved_slots",
    "sample_request_lengths",
    "waste_percent",
]

#: Admission policies of :func:`paged_admission`.
POLICIES = ("fcfs", "skip")


def _check_tokens(num_tokens: object, name: str = "num_tokens") -> int:
    return check_int(num_tokens, name, 0)


def _check_block_size(block_size: object) -> int:
    return check_int(block_size, "block_size", 1)


def _check_lens(lens: Iterable[object]) -> list[int]:
    if isinstance(lens, (str, bytes)):
        raise ValueError(f"lens must be a sequence of token counts, got {lens!r}")
    try:
        items = list(lens)
    except TypeError:
        raise ValueError(f"lens must be a sequence of token counts, got {lens!r}") from None
    return [_check_tokens(n, f"lens[{i}]") for i, n in enumerate(items)]


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` token slots that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``.

    0 tokens need 0 blocks; 40 tokens in blocks of 16 need 3 (the third one is half empty). Changes nothing.
    Mirrors ``vllm.utils.cdiv``, which the KV cache manager uses for the same count.
    """
    n = _check_tokens(num_tokens)
    b = _check_block_size(block_size)
    return -(-n // b)


def contiguous_capacity(pool_blocks: int, max_len: int, block_size: int) -> int:
    """How many sequences fit in a pool of ``pool_blocks`` blocks when each reserves ``max_len`` tokens up front.

    Each sequence takes ``blocks_needed(max_len, block_size)`` blocks whatever its real length; the answer is
    the pool divided by that, rounded down. The seed card's example: 128 blocks, ``max_len`` 512, blocks of
    16: 32 blocks per sequence, 4 sequences. There is no vLLM counterpart: this is the pre-vLLM baseline.
    """
    pool = check_int(pool_blocks, "pool_blocks", 0)
    m = check_int(max_len, "max_len", 1)
    return pool // blocks_needed(m, block_size)


def paged_admission(
    lens: Sequence[int], pool_blocks: int, block_size: int, policy: str = "fcfs"
) -> list[int]:
    """Indices of the sequences admitted into a pool of ``pool_blocks`` blocks, in order, when each takes
    only ``blocks_needed(len, block_size)`` blocks.

    Sequences are considered in the order given. ``policy="fcfs"`` stops at the first one that does not fit,
    as vLLM's scheduler does (``Scheduler.schedule`` in ``vllm/v1/core/sched/scheduler.py`` breaks out of its
    waiting loop when ``allocate_slots`` returns None), so a long request at the head is never overtaken.
    ``policy="skip"`` passes over a sequence that does not fit and keeps trying the later ones, as the seed
    card's loop does: more sequences admitted, at the price of starving the long one. Changes nothing; all
    input is checked before any sequence is considered.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    tokens = _check_lens(lens)
    pool = check_int(pool_blocks, "pool_blocks", 0)
    b = _check_block_size(block_size)

    free = pool
    admitted: list[int] = []
    for i, n in enumerate(tokens):
        need = blocks_needed(n, b)
        if need <= free:
            free -= need
            admitted.append(i)
        elif policy == "fcfs":
            break
    return admitted


def paged_reserved_slots(num_tokens: int, block_size: int) -> int:
    """Token slots that paging reserves for a sequence of ``num_tokens`` tokens: whole blocks only."""
    return blocks_needed(num_tokens, block_size) * _check_block_size(block_size)


def paged_internal_waste(num_tokens: int, block_size: int) -> int:
    """Slots reserved but unused under paging: the empty tail of the last block, always < ``block_size``."""
    return paged_reserved_slots(num_tokens, block_size) - _check_tokens(num_tokens)


def contiguous_internal_waste(num_tokens: int, max_len: int) -> int:
    """Slots reserved but unused when a sequence of ``num_tokens`` tokens reserves ``max_len`` slots."""
    n = _check_tokens(num_tokens)
    m = check_int(max_len, "max_len", 1)
    if n > m:
        raise ValueError(f"num_tokens ({n}) exceeds max_len ({m}): the reservation cannot hold it")
    return m - n


def waste_percent(lens: Sequence[int], block_size: int) -> float:
    """Internal fragmentation under paging, in percent of the reserved slots.

    ``100 * sum(reserved - used) / sum(reserved)`` where a sequence of ``n`` tokens reserves
    ``blocks_needed(n, block_size) * block_size`` slots. 0.0 when nothing is reserved (no sequences, or
    only empty ones).
    """
    tokens = _check_lens(lens)
    b = _check_block_size(block_size)
    reserved = sum(blocks_needed(n, b) * b for n in tokens)
    if reserved == 0:
        return 0.0
    return 100.0 * (reserved - sum(tokens)) / reserved


def contiguous_waste_percent(lens: Sequence[int], max_len: int) -> float:
    """Internal fragmentation of max-length reservation, in percent of the reserved slots."""
    tokens = _check_lens(lens)
    if not tokens:
        return 0.0
    waste = sum(contiguous_internal_waste(n, max_len) for n in tokens)
    return 100.0 * waste / (len(tokens) * int(max_len))


def block_table_entries(lens: Sequence[int], block_size: int) -> int:
    """Total block-table entries (one per block, a logical-to-physical mapping each) for all sequences."""
    tokens = _check_lens(lens)
    b = _check_block_size(block_size)
    return sum(blocks_needed(n, b) for n in tokens)


@dataclass(frozen=True)
class BlockSizeStats:
    """What one block size costs on a set of sequences (a row of :func:`block_size_sweep`)."""

    block_size: int
    waste_percent: float  # internal fragmentation, % of reserved slots
    mean_entries: float  # block-table entries per sequence
    max_entries: int  # the longest block table: the width of the padded block_tables tensor


def block_size_sweep(lens: Sequence[int], block_sizes: Iterable[int]) -> list[BlockSizeStats]:
    """The block-size trade-off, one row per size: small blocks waste little but need long block tables."""
    tokens = _check_lens(lens)
    if not tokens:
        raise ValueError("lens is empty: nothing to measure")
    rows = []
    for b in block_sizes:
        entries = [blocks_needed(n, b) for n in tokens]
        rows.append(
            BlockSizeStats(
                block_size=_check_block_size(b),
                waste_percent=waste_percent(tokens, b),
                mean_entries=sum(entries) / len(entries),
                max_entries=max(entries),
            )
        )
    return rows


def sample_request_lengths(
    n: int, *, seed: int = 0, median: float = 300.0, sigma: float = 0.9, max_len: int = 2048
) -> list[int]:
    """``n`` synthetic request lengths (prompt + output tokens), seeded and reproducible.

    A lognormal with the given median and shape ``sigma``, rounded and clipped to ``[1, max_len]``: skewed to
    the right like chat traces such as ShareGPT (most requests a few hundred tokens, a long tail). A stand-in
    shaped like such traces, not real data.
    """
    count = check_int(n, "n", 0)
    if median <= 0 or sigma < 0:
        raise ValueError(f"median must be > 0 and sigma >= 0, got median={median}, sigma={sigma}")
    cap = check_int(max_len, "max_len", 1)
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=float(np.log(median)), sigma=sigma, size=count)
    return [int(x) for x in np.clip(np.rint(draws), 1, cap)]


def main() -> None:
    """``python -m pagedkv.fragmentation`` (``pagedkv bench fragmentation``): lesson 1's numbers as tables."""
    lens = [40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110]
    pool, max_len, block = 128, 512, 16
    print(f"The source card's example: {pool} blocks of {block} slots, max_len {max_len}, {len(lens)} requests")
    print(f"  contiguous (max_len each) : {contiguous_capacity(pool, max_len, block):>3} sequences")
    print(f"  paged, FCFS               : {len(paged_admission(lens, pool, block, 'fcfs')):>3} sequences")
    print(f"  paged, skip (card's loop) : {len(paged_admission(lens, pool, block, 'skip')):>3} sequences")
    contiguous_waste = contiguous_waste_percent(lens, max_len)
    print(f"  waste: contiguous {contiguous_waste:.1f} %, paged {waste_percent(lens, block):.1f} %")
    workload = sample_request_lengths(10_000, seed=0)
    print("\nBlock size sweep on 10,000 synthetic ShareGPT-like lengths (lognormal, median 300, sigma 0.9):")
    print(f"  {'block':>5} {'waste %':>8} {'entries/seq':>12} {'longest table':>14}")
    for row in block_size_sweep(workload, [1, 2, 4, 8, 16, 32, 64, 128, 256]):
        print(f"  {row.block_size:>5} {row.waste_percent:>8.2f} {row.mean_entries:>12.1f} {row.max_entries:>14}")


if __name__ == "__main__":
    main()
