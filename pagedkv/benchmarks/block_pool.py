"""Is the free-block queue really O(1)? Allocate+free and cache-hit removal against pool size.

Run it: ``python -m pagedkv.benchmarks.block_pool`` (``--help`` for sizes; about 20 s by default). It
prints one table per operation, at pool sizes of 1e3, 1e5 and 1e6 blocks:

1. ``alloc+free``: take the block at the head of the free queue and put it back at the tail (``popleft()``
   then ``append()``), the pair of operations every allocation and free of an uncached block costs. Because
   each freed block goes to the tail, the run cycles through the whole pool, so a big pool is also a pool
   that does not fit in the CPU cache.
2. ``touch``: take a block out of the *middle* of the queue (a prefix-cache hit on a free cached block,
   ``BlockPool.touch``) and append it back (its request finished: ``free_blocks`` puts cached blocks at the
   tail). The block is chosen at random.

Each is timed for three containers of the same free blocks:

- ``FreeKVCacheBlockQueue``: the library's doubly linked list threaded through the blocks (O(1) everything);
- ``list``: a naive Python list of block ids, ``pop(0)`` and ``remove(id)`` (both O(n): they shift or scan
  the array);
- ``deque``: ``collections.deque`` of block ids, the fastest queue CPython has (O(1) at both ends, all in
  C). Its ``remove(id)`` scans from the left: O(n).

plus two reference rows: ``BlockPool`` (the whole ``get_new_blocks(1)`` + ``free_blocks([block])`` path
around the queue: argument checks, ref counts, eviction check) and ``2 empty calls`` (two Python method
calls that do nothing: the floor under any queue whose operations are Python methods).

Targets (issue 3): the linked list's time per operation flat within 1.5x from 1e3 to 1e6 blocks, and its
throughput at least half of the deque's. Timings are the best of ``repeats`` rounds (the least disturbed
one, as ``timeit`` recommends), with the garbage collector off, and the rounds of the different pool sizes
interleaved so that load from other processes does not land on one size only. vLLM has no such benchmark; its
``FreeKVCacheBlockQueue`` in ``vllm/v1/core/kv_cache_utils.py`` exists for exactly this reason.
"""

from __future__ import annotations

import argparse
import collections
import gc
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from pagedkv.utils import check_int

#: Pool sizes of the default run (blocks).
DEFAULT_SIZES: tuple[int, ...] = (1_000, 100_000, 1_000_000)
OPS: tuple[str, ...] = ("alloc+free", "touch")
#: The containers compared, in table order.
IMPLS: tuple[str, ...] = ("FreeKVCacheBlockQueue", "deque", "list")
#: Reference rows (alloc+free only).
REFERENCE_IMPLS: tuple[str, ...] = ("BlockPool", "2 empty calls")
LINKED, DEQUE, LIST = IMPLS
FLATNESS_TARGET = 1.5  # max / min time per op over the sizes
DEQUE_FRACTION_TARGET = 0.5  # throughput as a fraction of the deque's

OP_TITLES = {
    "alloc+free": "alloc+free: popleft() a block from the head, append() it at the tail",
    "touch": "touch: remove() a random free block from the middle, append() it at the tail",
}
OP_CALLS = {
    "alloc+free": {
        LINKED: "q.append(q.popleft())",
        DEQUE: "d.append(d.popleft())",
        LIST: "l.append(l.pop(0))",
        "BlockPool": "pool.free_blocks(pool.get_new_blocks(1))",
        "2 empty calls": "g(f())",
    },
    "touch": {LINKED: "q.remove(b); q.append(b)", DEQUE: "d.remove(i); d.append(i)", LIST: "l.remove(i); l.append(i)"},
}


@dataclass(frozen=True)
class Timing:
    """One (operation, container, pool size) measurement."""

    op: str  # "alloc+free" or "touch"
    impl: str  # a name from IMPLS or REFERENCE_IMPLS
    num_blocks: int  # blocks in the free queue
    ns_per_op: float  # best round, nanoseconds per operation (one op = a removal and an append)
    ns_median: float  # median round
    ops_per_round: int
    rounds: int

    @property
    def ops_per_s(self) -> float:
        return 1e9 / self.ns_per_op


@dataclass(frozen=True)
class BlockPoolBenchResult:
    timings: list[Timing]

    @property
    def sizes(self) -> list[int]:
        return sorted({t.num_blocks for t in self.timings})

    def get(self, op: str, impl: str, num_blocks: int) -> Timing:
        for t in self.timings:
            if (t.op, t.impl, t.num_blocks) == (op, impl, num_blocks):
                return t
        raise KeyError((op, impl, num_blocks))

    def series(self, op: str, impl: str) -> list[Timing]:
        """The measurements of one container for one operation, by pool size."""
        return sorted((t for t in self.timings if t.op == op and t.impl == impl), key=lambda t: t.num_blocks)

    def deque_fraction(self, op: str, impl: str, num_blocks: int) -> float:
        """Throughput of ``impl`` as a fraction of the deque's at the same size (1.0 = as fast)."""
        return self.get(op, DEQUE, num_blocks).ns_per_op / self.get(op, impl, num_blocks).ns_per_op

    def flatness(self, op: str, impl: str) -> float:
        """Slowest over fastest time per op across the sizes measured (1.0 = perfectly flat)."""
        ns = [t.ns_per_op for t in self.series(op, impl)]
        return max(ns) / min(ns)

    def targets(self) -> dict[str, tuple[bool, str]]:
        """Issue 3's two targets for the linked list's alloc+free: name -> (met, the numbers)."""
        flat = self.flatness("alloc+free", LINKED)
        fractions = [self.deque_fraction("alloc+free", LINKED, n) for n in self.sizes]
        return {
            f"time per op flat within {FLATNESS_TARGET}x across sizes": (
                flat <= FLATNESS_TARGET,
                f"max/min = {flat:.2f}x",
            ),
            f"throughput >= {DEQUE_FRACTION_TARGET} of deque's": (
                min(fractions) >= DEQUE_FRACTION_TARGET,
                "fraction " + ", ".join(f"{f:.2f}" for f in fractions),
            ),
        }


# --------------------------------------------------------------------------------------------------
# The timed loops. Each builder returns run(k): do k operations on one container (state carries over
# between rounds, as in a long-running server). Method lookups are hoisted, the same way for everyone.
# --------------------------------------------------------------------------------------------------
Runner = Callable[[int], None]


def _runner(run: Runner, container: object) -> Runner:
    """Attach the container the loop works on (``run.container``), so tests can check it afterwards."""
    run.container = container  # type: ignore[attr-defined]
    return run


def _linked_alloc_free(n: int, rng: random.Random) -> Runner:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(n)])
    popleft, append = queue.popleft, queue.append

    def run(k: int) -> None:
        for _ in range(k):
            append(popleft())

    return _runner(run, queue)


def _deque_alloc_free(n: int, rng: random.Random) -> Runner:
    free_ids = collections.deque(range(n))
    popleft, append = free_ids.popleft, free_ids.append

    def run(k: int) -> None:
        for _ in range(k):
            append(popleft())

    return _runner(run, free_ids)


def _list_alloc_free(n: int, rng: random.Random) -> Runner:
    free_ids = list(range(n))
    pop, append = free_ids.pop, free_ids.append

    def run(k: int) -> None:
        for _ in range(k):
            append(pop(0))  # pop(0) shifts the other n - 1 ids left: O(n)

    return _runner(run, free_ids)


def _pool_alloc_free(n: int, rng: random.Random) -> Runner:
    pool = BlockPool(n + 1)  # + the null block, so that n blocks are free
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks

    def run(k: int) -> None:
        for _ in range(k):
            free_blocks(get_new_blocks(1))

    return _runner(run, pool)


class _Nothing:
    def f(self) -> None:
        return None

    def g(self, x: object) -> None:
        return None


def _empty_calls(n: int, rng: random.Random) -> Runner:
    nothing = _Nothing()
    f, g = nothing.f, nothing.g

    def run(k: int) -> None:
        for _ in range(k):
            g(f())

    return _runner(run, nothing)


_TARGETS_PER_ROUND = 4096  # random blocks drawn for touch (reused cyclically)


def _linked_touch(n: int, rng: random.Random) -> Runner:
    blocks = [KVCacheBlock(i) for i in range(n)]
    queue = FreeKVCacheBlockQueue(blocks)
    remove, append = queue.remove, queue.append
    targets = [blocks[rng.randrange(n)] for _ in range(_TARGETS_PER_ROUND)]

    def run(k: int) -> None:
        for j in range(k):
            block = targets[j % _TARGETS_PER_ROUND]
            remove(block)
            append(block)

    return _runner(run, queue)


def _deque_touch(n: int, rng: random.Random) -> Runner:
    free_ids = collections.deque(range(n))
    remove, append = free_ids.remove, free_ids.append
    targets = [rng.randrange(n) for _ in range(_TARGETS_PER_ROUND)]

    def run(k: int) -> None:
        for j in range(k):
            block_id = targets[j % _TARGETS_PER_ROUND]
            remove(block_id)  # scans from the left until it finds the id: O(n)
            append(block_id)

    return _runner(run, free_ids)


def _list_touch(n: int, rng: random.Random) -> Runner:
    free_ids = list(range(n))
    remove, append = free_ids.remove, free_ids.append
    targets = [rng.randrange(n) for _ in range(_TARGETS_PER_ROUND)]

    def run(k: int) -> None:
        for j in range(k):
            block_id = targets[j % _TARGETS_PER_ROUND]
            remove(block_id)  # scans to the id, then shifts the rest left: O(n)
            append(block_id)

    return _runner(run, free_ids)


BUILDERS: dict[tuple[str, str], Callable[[int, random.Random], Runner]] = {
    ("alloc+free", LINKED): _linked_alloc_free,
    ("alloc+free", DEQUE): _deque_alloc_free,
    ("alloc+free", LIST): _list_alloc_free,
    ("alloc+free", "BlockPool"): _pool_alloc_free,
    ("alloc+free", "2 empty calls"): _empty_calls,
    ("touch", LINKED): _linked_touch,
    ("touch", DEQUE): _deque_touch,
    ("touch", LIST): _list_touch,
}


def _calibrate(run: Runner, round_time: float, max_ops: int | None = None) -> int:
    """Ops per round so that one round of ``run`` takes about ``round_time`` seconds (like timeit.autorange)."""
    cap = max_ops if max_ops is not None else 1 << 62
    k = 1
    while True:
        t0 = time.perf_counter_ns()
        run(k)
        dt = time.perf_counter_ns() - t0
        if dt >= 2_000_000 or k >= cap:
            break
        k = min(cap, k * 4)
    return max(1, min(cap, int(k * round_time * 1e9 / max(dt, 1))))


def measure_series(
    op: str,
    impl: str,
    sizes: Sequence[int],
    round_time: float = 0.05,
    repeats: int = 7,
    seed: int = 0,
) -> list[Timing]:
    """Time ``op`` on ``impl`` at every pool size, the rounds interleaved across the sizes.

    Interleaving (size 1, size 2, size 3, size 1, ...) means a burst of load from another process slows
    one round of each size rather than every round of one size, so the best rounds stay comparable and
    the flatness ratio measures the container, not the machine.
    """
    repeats = check_int(repeats, "repeats", 1)
    if isinstance(round_time, bool) or not isinstance(round_time, (int, float)) or not 0 < round_time < float("inf"):
        raise ValueError(f"round_time must be a finite number of seconds > 0, got {round_time!r}")
    try:
        builder = BUILDERS[(op, impl)]
    except KeyError:
        raise ValueError(f"no benchmark for op={op!r} impl={impl!r}; have {sorted(BUILDERS)}") from None
    for i, n in enumerate(sizes):
        check_int(n, f"pool sizes[{i}]", 1)
    runners = [builder(n, random.Random(seed)) for n in sizes]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        ks = [_calibrate(run, round_time) for run in runners]
        per_op: list[list[float]] = [[] for _ in sizes]
        for _ in range(repeats):
            for i, (run, k) in enumerate(zip(runners, ks, strict=True)):
                t0 = time.perf_counter_ns()
                run(k)
                per_op[i].append((time.perf_counter_ns() - t0) / k)
    finally:
        if gc_was_enabled:
            gc.enable()
    return [
        Timing(op, impl, n, min(times), statistics.median(times), k, repeats)
        for n, k, times in zip(sizes, ks, per_op, strict=True)
    ]


def run_benchmark(
    sizes: Sequence[int] = DEFAULT_SIZES,
    ops: Sequence[str] = OPS,
    impls: Sequence[str] = IMPLS + REFERENCE_IMPLS,
    round_time: float = 0.05,
    repeats: int = 7,
    seed: int = 0,
    progress: bool = True,
) -> BlockPoolBenchResult:
    """Every (op, impl) that has a benchmark, at every size, with a tqdm bar over them."""
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; use one of {OPS}")
    for impl in impls:
        if impl not in IMPLS + REFERENCE_IMPLS:
            raise ValueError(f"unknown impl {impl!r}; use one of {IMPLS + REFERENCE_IMPLS}")
    cases = [(op, impl) for op in ops for impl in impls if (op, impl) in BUILDERS]
    bar = None
    if progress:
        from tqdm import tqdm  # the text bar: it also reads well in a saved notebook's output

        bar = tqdm(total=len(cases), desc="block-pool benchmark", unit="case")
    timings: list[Timing] = []
    try:
        for op, impl in cases:
            if bar is not None:
                bar.set_postfix_str(f"{op} {impl}", refresh=False)
            timings.extend(measure_series(op, impl, sizes, round_time, repeats, seed))
            if bar is not None:
                bar.update()
    finally:
        if bar is not None:
            bar.close()
    return BlockPoolBenchResult(timings)


def format_table(result: BlockPoolBenchResult) -> str:
    """One table per operation, the flatness line, and the targets."""
    lines: list[str] = []
    for op in OPS:
        rows = [t for t in result.timings if t.op == op]
        if not rows:
            continue
        impls = [i for i in IMPLS + REFERENCE_IMPLS if any(t.impl == i for t in rows)]
        has_deque = any(t.impl == DEQUE for t in rows)
        if lines:
            lines.append("")
        lines.append(OP_TITLES[op])
        lines.append(f"{'container':<22} {'blocks':>10} {'ns/op':>12} {'ops/s':>14} {'vs deque':>9}  timed as")
        for impl in impls:
            for t in result.series(op, impl):
                frac = f"{result.deque_fraction(op, impl, t.num_blocks):>8.2f}x" if has_deque else f"{'-':>9}"
                call = OP_CALLS[op].get(impl, "")
                lines.append(
                    f"{impl:<22} {t.num_blocks:>10,} {t.ns_per_op:>12,.1f} {t.ops_per_s:>14,.0f} {frac}  {call}"
                )
        flat = [f"{i} {result.flatness(op, i):.2f}x" for i in impls if len(result.series(op, i)) > 1]
        if flat:
            lines.append("flatness (slowest / fastest ns/op over the sizes): " + ", ".join(flat))
    if any(t.op == "alloc+free" and t.impl == LINKED for t in result.timings) and any(
        t.op == "alloc+free" and t.impl == DEQUE for t in result.timings
    ):
        lines.append("")
        lines.append("targets for FreeKVCacheBlockQueue alloc+free ('vs deque' = throughput / deque's throughput):")
        for name, (ok, numbers) in result.targets().items():
            lines.append(f"  {'MET ' if ok else 'MISS'} {name}: {numbers}")
    return "\n".join(lines)


def _size(text: str) -> int:
    value = float(text)  # accepts 1e6 as well as 1000000
    if value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"a pool size must be a whole number >= 1, got {text!r}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedkv bench block_pool",
        description="Time allocate+free and cache-hit removal on the free-block queue vs a list and a deque.",
    )
    parser.add_argument("--sizes", type=_size, nargs="+", default=list(DEFAULT_SIZES), help="pool sizes, blocks")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--round-time", type=float, default=0.05, help="seconds per timed round (default 0.05)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per case and size; the best is shown")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a target is missed")
    args = parser.parse_args(argv)
    result = run_benchmark(
        args.sizes,
        args.ops,
        round_time=args.round_time,
        repeats=args.repeats,
        seed=args.seed,
        progress=not args.no_progress,
    )
    print(format_table(result))
    if args.check and any(t.op == "alloc+free" for t in result.timings):
        return 0 if all(ok for ok, _ in result.targets().values()) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
