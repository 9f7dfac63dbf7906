"""What a prefix-cache lookup costs: ``get_computed_blocks`` on a long prompt, and hashing per block.

Run it: ``python -m pagedkv.benchmarks.prefix_cache`` (``--help`` for sizes). It prints two tables:

1. ``KVCacheManager.get_computed_blocks`` for a prompt whose every full block is already cached (a full
   hit, cut back by one block so the last token is recomputed), in microseconds, median over repeats.
   The first call on a request hashes its full blocks and stores the hashes on the request
   (``request.block_hashes``); later calls only look them up. Both are timed and labelled apart: the first
   call is what a new request pays, a repeat is what a request that waits (or is preempted and comes back)
   pays on every scheduling attempt.
2. ``hash_block_tokens`` per block along a chain, for Python's builtin ``hash`` and for sha256 of a canonical
   encoding (the stable one), in microseconds per block.

vLLM measures the same thing in ``benchmarks/benchmark_prefix_caching.py`` (end to end) and
``tests/v1/core/test_prefix_caching.py`` (correctness); this one times the block manager alone.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.kv_cache_utils import HASH_FUNCTIONS, get_hash_fn, hash_request_tokens
from pagedkv.request import Request
from pagedkv.utils import check_int

HASH_FN_NAMES: tuple[str, ...] = ("builtin", "sha256")


@dataclass(frozen=True)
class LookupTiming:
    """``get_computed_blocks`` on a fully cached prompt."""

    hash_fn: str
    call: str  # "first" (hashes the prompt's blocks, then looks them up) or "repeat" (looks up only)
    prompt_tokens: int
    block_size: int
    hit_blocks: int  # blocks found in the cache (a full hit is cut back by one block)
    median_us: float  # median over the repeats, microseconds per call
    min_us: float

    @property
    def us_per_block(self) -> float:
        """Median microseconds per block found in the cache."""
        return self.median_us / max(1, self.hit_blocks)


@dataclass(frozen=True)
class HashTiming:
    """``hash_block_tokens`` along a chain of full blocks."""

    hash_fn: str
    block_size: int
    num_blocks: int  # blocks hashed per repeat
    us_per_block: float  # median over the repeats, microseconds per block
    min_us_per_block: float  # the fastest repeat (least disturbed by other work on the machine)


@dataclass(frozen=True)
class PrefixCacheBenchResult:
    lookups: list[LookupTiming]
    hashing: list[HashTiming]

    def lookup(self, hash_fn: str, call: str) -> LookupTiming:
        for t in self.lookups:
            if t.hash_fn == hash_fn and t.call == call:
                return t
        raise KeyError((hash_fn, call))

    def hash_cost(self, hash_fn: str) -> HashTiming:
        for t in self.hashing:
            if t.hash_fn == hash_fn:
                return t
        raise KeyError(hash_fn)


def _time_us(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e3


def _random_tokens(n: int, seed: int, vocab_size: int = 32_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def time_lookup(
    hash_fn: str, prompt_tokens: int = 4096, block_size: int = 16, repeats: int = 51, seed: int = 0
) -> tuple[LookupTiming, LookupTiming]:
    """Time ``get_computed_blocks`` for a prompt that is fully cached: first calls and repeat calls.

    A first request computes the prompt (``allocate_slots``), which caches its full blocks. Each timed first
    call uses a fresh ``Request`` with the same tokens (built before the clock starts), so it hashes every
    full block and then walks the cache; repeat calls reuse one request whose hashes are already stored.
    """
    block_size = check_int(block_size, "block_size", 1)
    prompt_tokens = check_int(prompt_tokens, "prompt_tokens", block_size + 1, why="more than one block, for a hit")
    repeats = check_int(repeats, "repeats", 1)
    tokens = _random_tokens(prompt_tokens, seed)
    num_blocks = prompt_tokens // block_size + 2  # the prompt's blocks, its partial last one, the null block
    manager = KVCacheManager(num_blocks, block_size, enable_caching=True, hash_fn=hash_fn)
    owner = Request("owner", tokens)
    if manager.allocate_slots(owner, prompt_tokens) is None:
        raise RuntimeError("the pool is too small for the prompt")
    manager.free(owner)  # the blocks stay cached in the free queue: a lookup must still find them

    expected_hits = (prompt_tokens - 1) // block_size
    probes = [Request(f"probe-{i}", tokens) for i in range(repeats)]
    # Correctness before timing: the full hit, cut back by one block.
    hits, num_hit_tokens = manager.get_computed_blocks(probes[0])
    if len(hits) != expected_hits or num_hit_tokens != expected_hits * block_size:
        raise RuntimeError(f"expected a hit of {expected_hits} blocks, got {len(hits)}")
    probes[0] = Request("probe-0", tokens)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        first = [_time_us(lambda r=r: manager.get_computed_blocks(r)) for r in probes]
        again = probes[-1]
        repeat = [_time_us(lambda: manager.get_computed_blocks(again)) for _ in range(repeats)]
    finally:
        if gc_was_enabled:
            gc.enable()

    def summary(call: str, times: Sequence[float]) -> LookupTiming:
        return LookupTiming(
            hash_fn, call, prompt_tokens, block_size, expected_hits, statistics.median(times), min(times)
        )

    return summary("first", first), summary("repeat", repeat)


def time_hashing(
    hash_fn: str, block_size: int = 16, num_blocks: int = 256, repeats: int = 41, seed: int = 1
) -> HashTiming:
    """Time hashing a chain of ``num_blocks`` full blocks (``hash_block_tokens`` each, parent chained)."""
    block_size = check_int(block_size, "block_size", 1)
    num_blocks = check_int(num_blocks, "num_blocks", 1)
    repeats = check_int(repeats, "repeats", 1)
    fn = get_hash_fn(hash_fn)  # ValueError naming the choices
    tokens = _random_tokens(num_blocks * block_size, seed)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        per_block = [_time_us(lambda: hash_request_tokens(fn, block_size, tokens)) / num_blocks for _ in range(repeats)]
    finally:
        if gc_was_enabled:
            gc.enable()
    return HashTiming(hash_fn, block_size, num_blocks, statistics.median(per_block), min(per_block))


def run_benchmark(
    prompt_tokens: int = 4096,
    block_size: int = 16,
    repeats: int = 51,
    hash_blocks: int = 256,
    hash_repeats: int = 41,
    hash_fns: Sequence[str] = HASH_FN_NAMES,
) -> PrefixCacheBenchResult:
    """Both measurements for every hash function."""
    for name in hash_fns:
        if name not in HASH_FUNCTIONS:
            raise ValueError(f"unknown hash function {name!r}; use one of {sorted(HASH_FUNCTIONS)}")
    lookups: list[LookupTiming] = []
    hashing: list[HashTiming] = []
    for name in hash_fns:
        lookups.extend(time_lookup(name, prompt_tokens, block_size, repeats))
        hashing.append(time_hashing(name, block_size, hash_blocks, hash_repeats))
    return PrefixCacheBenchResult(lookups, hashing)


def format_table(result: PrefixCacheBenchResult) -> str:
    """The two tables as text."""
    lines: list[str] = []
    if result.lookups:
        t0 = result.lookups[0]
        lines.append(
            f"get_computed_blocks, {t0.prompt_tokens}-token prompt, block_size {t0.block_size}, full hit "
            f"({t0.hit_blocks} blocks: the last block is recomputed)"
        )
        lines.append(f"{'hash fn':<8} {'call':<40} {'median us':>10} {'min us':>10} {'us/hit blk':>10}")
        for t in result.lookups:
            if t.call == "first":
                label = f"first: hash {t.prompt_tokens // t.block_size} blocks + look up"
            else:
                label = "repeat: look up (hashes kept on request)"
            lines.append(f"{t.hash_fn:<8} {label:<40} {t.median_us:>10.1f} {t.min_us:>10.1f} {t.us_per_block:>10.3f}")
    if result.hashing:
        h0 = result.hashing[0]
        if lines:
            lines.append("")
        lines.append(f"hash_block_tokens along a chain, block_size {h0.block_size}, {h0.num_blocks} blocks")
        lines.append(f"{'hash fn':<8} {'median us/block':>15} {'min us/block':>12} {'vs builtin':>11}")
        base = next((h.us_per_block for h in result.hashing if h.hash_fn == "builtin"), None)
        for h in result.hashing:
            ratio = f"{h.us_per_block / base:>10.1f}x" if base else f"{'-':>11}"
            lines.append(f"{h.hash_fn:<8} {h.us_per_block:>15.3f} {h.min_us_per_block:>12.3f} {ratio}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedkv bench prefix_cache",
        description="Time prefix-cache lookups (get_computed_blocks) and block hashing (builtin vs sha256).",
    )
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=51, help="timed lookups per kind (the median is shown)")
    parser.add_argument("--hash-blocks", type=int, default=256, help="blocks hashed per hashing repeat")
    parser.add_argument("--hash-repeats", type=int, default=41)
    args = parser.parse_args(argv)
    result = run_benchmark(args.prompt_tokens, args.block_size, args.repeats, args.hash_blocks, args.hash_repeats)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
