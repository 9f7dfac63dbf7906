"""Checks for lesson 1's exercises (``grading/source/01_fragmentation.ipynb``).

Each ``check_*`` function is one test case of the set: the source's test cell calls it with the learner's function
(looked up by name in the notebook). The points follow the parts of each contract, so that a learner sees which
part is wrong and keeps the points of the others. For ``paged_admission``: the FCFS walk and the skip walk on cases
where no sequence fits exactly (1 point each), the boundary (a sequence that needs exactly the blocks still free
fits: ``<=``, not ``<``; 1 point, with a hint that names it), the refusals and the untouched argument (1 point),
and a hidden random sweep (1 point).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pagedkv.grading.checks import (
    describe,
    drive,
    expect_equal,
    expect_raises,
    fail,
    format_call,
    require_function,
    where,
)
from pagedkv.grading.lessons.depends import Earlier, with_earlier_answers

__all__ = [
    "SEED_LENS",
    "admitted",
    "check_blocks_needed_examples",
    "check_blocks_needed_hidden",
    "check_blocks_needed_random",
    "check_contiguous_capacity_examples",
    "check_contiguous_capacity_hidden",
    "check_paged_admission_boundary",
    "check_paged_admission_errors",
    "check_paged_admission_fcfs",
    "check_paged_admission_hidden",
    "check_paged_admission_skip",
    "check_waste_percent_examples",
    "check_waste_percent_hidden",
    "drive_paged_admission_keeps_lens",
    "reference_blocks_needed",
]

#: The lesson's sixteen sequences (a pool of 128 blocks of 16: FCFS admits 13, skip 14).
SEED_LENS = [40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110]

# Cases where no sequence needs exactly the blocks still free when its turn comes (so `<` and `<=` agree).
_NO_TIES = [(SEED_LENS, 128, 16), ([], 128, 16), ([16, 17], 2, 16), ([100, 1, 1], 3, 1), (SEED_LENS, 1000, 16),
            (SEED_LENS, 64, 16), (SEED_LENS, 100, 16), ([10, 20, 30], 10, 4), ([40, 40, 40], 7, 16)]
# Cases where one does: each admits a sequence into exactly the blocks left.
_TIES = [([16, 16], 2, 16), ([17, 16, 1], 2, 16), ([16, 33, 16], 5, 16), ([0, 5, 0], 0, 16), ([32], 2, 16),
         ([5, 100, 3], 1, 8)]


def reference_blocks_needed(num_tokens: int, block_size: int) -> int:
    """Exercise 1's answer: what the checks of exercises 2-4 put in place of the learner's ``blocks_needed``
    (so that a mistake in exercise 1 costs no points there; the grader keeps it out of exercise 1's reach)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return int(-(-num_tokens // block_size))


def _uses_blocks_needed(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """A check of exercise 2, 3 or 4 (the learner's function ``name``), run with exercise 1's answer in place of
    the learner's ``blocks_needed`` (:mod:`pagedkv.grading.lessons.depends`)."""
    earlier = [Earlier("blocks_needed", 1, reference_blocks_needed, lambda fn: check_blocks_needed_examples(fn))]

    def decorate(check: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(check)
        def judged(fn: Any, *args: Any, env: Any = None, **kwargs: Any) -> None:
            with_earlier_answers(fn, earlier, lambda: check(fn, *args, **kwargs), what=name, env=env)
        return judged

    return decorate


def admitted(lens: Sequence[int], pool_blocks: int, block_size: int, policy: str, *, strict: bool = False
             ) -> list[int]:
    """The expected answer (``strict``: the answer of the ``<`` mistake, for hints)."""
    free, out = pool_blocks, []
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        if (need < free) if strict else (need <= free):
            free -= need
            out.append(i)
        elif policy == "fcfs":
            break
    return out


def _hint(lens: Sequence[int], pool: int, block_size: int, policy: str) -> Callable[[Any], str | None]:
    other = "skip" if policy == "fcfs" else "fcfs"

    def explain(got: Any) -> str | None:
        if not isinstance(got, (list, tuple)):
            return None
        got = list(got)
        if got == admitted(lens, pool, block_size, policy, strict=True):
            return ("a sequence that needs exactly the blocks still free fits (it leaves 0 free): compare with "
                    "`<=`, not `<`")
        if got == admitted(lens, pool, block_size, other):
            if policy == "skip":
                return ("that is what policy='fcfs' admits: with 'skip', a sequence that does not fit is passed "
                        "over and the later ones are still tried")
            return ("that is what policy='skip' admits: with 'fcfs', admission stops at the first sequence that "
                    "does not fit")
        return None

    return explain


def _expect(fn: Any, lens: Sequence[int], pool: int, block_size: int, policy: str | None) -> None:
    args = (list(lens), pool, block_size) + ((policy,) if policy else ())
    expect_equal(fn, args, admitted(lens, pool, block_size, policy or "fcfs"),
                 hint=_hint(lens, pool, block_size, policy or "fcfs"), name="paged_admission", timeout=2)


@_uses_blocks_needed("paged_admission")
def check_paged_admission_fcfs(paged_admission: Any) -> None:
    """policy='fcfs' (and the default) on cases without an exact fit."""
    require_function(paged_admission, "paged_admission")
    for lens, pool, b in _NO_TIES:
        _expect(paged_admission, lens, pool, b, "fcfs")
    expect_equal(paged_admission, (list(SEED_LENS), 128, 16), list(range(13)), name="paged_admission",
                 hint="called without a policy, paged_admission must use policy='fcfs'", timeout=2)


@_uses_blocks_needed("paged_admission")
def check_paged_admission_skip(paged_admission: Any) -> None:
    """policy='skip' on cases without an exact fit."""
    require_function(paged_admission, "paged_admission")
    for lens, pool, b in _NO_TIES:
        _expect(paged_admission, lens, pool, b, "skip")


@_uses_blocks_needed("paged_admission")
def check_paged_admission_boundary(paged_admission: Any) -> None:
    """Exact fits (both policies), then small random cases (seeded), smallest first."""
    require_function(paged_admission, "paged_admission")
    for lens, pool, b in _TIES:
        for policy in ("fcfs", "skip"):
            _expect(paged_admission, lens, pool, b, policy)
    rng = random.Random(2024)
    for size in [1, 2, 3, 4, 6, 10, 30]:
        for _ in range(30):
            b = rng.choice([1, 2, 4, 16])
            lens = [rng.choice([0, 1, b, b + 1, rng.randrange(0, 8 * b)]) for _ in range(size)]
            pool = rng.randrange(0, 3 * size + 3)
            for policy in ("fcfs", "skip"):
                _expect(paged_admission, lens, pool, b, policy)


@_uses_blocks_needed("paged_admission")
def check_paged_admission_errors(paged_admission: Any) -> None:
    """The refusals, and ``lens`` left as it was (a tuple works too): the case "refusals and lens untouched"."""
    require_function(paged_admission, "paged_admission")
    expect_raises(ValueError, paged_admission, ([40], 128, 16, "lifo"), name="paged_admission",
                  why="an unknown policy", timeout=2)
    expect_raises(ValueError, paged_admission, ([40, -1], 128, 16, "skip"), name="paged_admission",
                  why="a negative length", timeout=2)
    expect_raises(ValueError, paged_admission, ([40], -1, 16, "fcfs"), name="paged_admission",
                  why="a negative pool", timeout=2)
    expect_raises(ValueError, paged_admission, ([40], 128, 0, "fcfs"), name="paged_admission",
                  why="block_size 0", timeout=2)
    expect_raises(ValueError, paged_admission, ([300, -1], 1, 16, "fcfs"), name="paged_admission",
                  why="a negative length, after the sequence where FCFS stops: check every length before "
                      "admitting any", timeout=2)
    # The call runs where the learner's code runs (the sandbox under grading), so that a change to the list it
    # was given is seen there: under grading only a copy of the arguments reaches the learner's code.
    seen = drive(drive_paged_admission_keeps_lens, paged_admission, list(SEED_LENS), 100, 16, "skip", timeout=2,
                 name=format_call("paged_admission", (list(SEED_LENS), 100, 16, "skip")))
    if not isinstance(seen, dict) or not (isinstance(seen.get("lens"), list) or "raised" in seen):
        fail(f"{format_call('paged_admission', (list(SEED_LENS), 100, 16, 'skip'))}: the scenario's record is "
             f"incomplete: it came back as {describe(seen, 80)}")
    if "raised" in seen:
        fail(f"{seen['label']} raised {seen['raised']}: {seen['message']}{seen['where']}")
    if seen["lens"] != SEED_LENS:
        fail(f"paged_admission changed its argument lens: {SEED_LENS} became {seen['lens']}. Hint: read lens, do "
             "not write into it (make a list of your own for the blocks each sequence needs)")
    _expect(paged_admission, SEED_LENS, 100, 16, "skip")  # a wrong list answer is named before the tuple's
    expect_equal(paged_admission, (tuple(SEED_LENS), 100, 16, "skip"), admitted(SEED_LENS, 100, 16, "skip"),
                 name="paged_admission", timeout=2,
                 hint="lens may be any sequence, a tuple too: read it, do not call list methods on it")


def drive_paged_admission_keeps_lens(paged_admission: Any, lens: list[int], pool_blocks: int, block_size: int,
                                     policy: str) -> dict[str, Any]:
    """``paged_admission(lens, ...)`` where the learner's code runs: the list ``lens`` after the call, and what
    the call raised (``raised``, ``message``, ``where``) if it did. Computes no answer."""
    label = format_call("paged_admission", (list(lens), pool_blocks, block_size, policy))
    try:
        paged_admission(lens, pool_blocks, block_size, policy)
    except Exception as exc:  # noqa: BLE001 - recorded for the check to report
        return {"label": label, "raised": type(exc).__name__, "message": str(exc), "where": where(exc),
                "lens": list(lens)}
    return {"label": label, "lens": list(lens)}


@_uses_blocks_needed("paged_admission")
def check_paged_admission_hidden(paged_admission: Any, seed: int = 99991) -> None:
    """Random realistic batches (log-normal lengths), both policies."""
    require_function(paged_admission, "paged_admission")
    rng = random.Random(seed)
    for _ in range(150):
        b = rng.choice([8, 16, 32, 64, 3])
        lens = [int(rng.lognormvariate(5.5, 1.0)) for _ in range(rng.randrange(1, 300))]
        pool = rng.randrange(0, 3000)
        for policy in ("fcfs", "skip"):
            _expect(paged_admission, lens, pool, b, policy)
    expect_equal(paged_admission, ([0] * 5, 0, 16, "fcfs"), [0, 1, 2, 3, 4], name="paged_admission", timeout=2)
    expect_raises(ValueError, paged_admission, ([1, 2], 4, 16, "FCFS"), name="paged_admission",
                  why="an unknown policy", timeout=2)
    expect_raises(ValueError, paged_admission, ([-5], 4, 16, "fcfs"), name="paged_admission",
                  why="a negative length", timeout=2)


def waste_reference(lens, b):
    reserved = sum(-(-n // b) * b for n in lens)
    return 0.0 if reserved == 0 else 100.0 * (reserved - sum(lens)) / reserved


def check_blocks_needed_examples(blocks_needed):
    require_function(blocks_needed, "blocks_needed")

    def hint(n, b):
        def explain(got):
            if n % b and got == n // b:
                return (f"{got} is {n} // {b}, rounded down: the {n % b} tokens left over still need a "
                        "block of their own, so round up")
            if n % b == 0 and got == n // b + 1:
                return f"{n} is an exact multiple of {b}: no partly filled block, so no extra block"
            return None
        return explain

    cases = [(40, 16), (0, 16), (1, 16), (16, 16), (17, 16), (32, 16), (512, 16), (420, 16), (5, 1), (1, 256)]
    for n, b in cases:
        expect_equal(blocks_needed, (n, b), -(-n // b), hint=hint(n, b), timeout=2)
    expect_raises(ValueError, blocks_needed, (-1, 16), why="a negative token count", timeout=2)
    expect_raises(ValueError, blocks_needed, (10, 0), why="block_size 0", timeout=2)
    expect_raises(ValueError, blocks_needed, (10, -16), why="a negative block_size", timeout=2)


def check_blocks_needed_random(blocks_needed):
    require_function(blocks_needed, "blocks_needed")
    # Every small case first (so the first failure reported is a small one), then random larger ones.
    cases = [(n, b) for b in range(1, 20) for n in range(0, 3 * b + 2)]
    rng = random.Random(101)
    cases += [(rng.randrange(0, 200_000), rng.choice([1, 2, 3, 7, 8, 16, 32, 100, 256])) for _ in range(300)]
    for n, b in cases:
        expect_equal(blocks_needed, (n, b), -(-n // b), timeout=2)


def check_blocks_needed_hidden(blocks_needed):
    require_function(blocks_needed, "blocks_needed")
    rng = random.Random(7919)
    for _ in range(300):
        b = rng.randrange(1, 600)
        n = rng.choice([0, b, 2 * b, 5 * b - 1, 5 * b + 1, rng.randrange(0, 5_000_000)])
        expect_equal(blocks_needed, (n, b), -(-n // b), timeout=2)
    # numpy integers (what a length array yields) work like ints
    expect_equal(blocks_needed, (np.int64(300), 16), 19, timeout=2)
    expect_equal(blocks_needed, (3, 4096), 1, timeout=2)
    expect_raises(ValueError, blocks_needed, (-100, 1), why="a negative token count", timeout=2)
    expect_raises(ValueError, blocks_needed, (0, 0), why="block_size 0", timeout=2)


@_uses_blocks_needed("contiguous_capacity")
def check_contiguous_capacity_examples(contiguous_capacity):
    require_function(contiguous_capacity, "contiguous_capacity")

    def hint(pool, max_len, b):
        per_seq = -(-max_len // b)
        def explain(got):
            floored = max_len % b and per_seq > 1 and got == pool // (max_len // b)
            tokens = got == pool * b // max_len
            if floored and tokens:  # both mistakes give this count: name both
                return (f"each sequence reserves ceil({max_len} / {b}) = {per_seq} whole blocks, not "
                        f"{max_len // b} (nor {max_len} / {b} = {max_len / b:g} in tokens): round up")
            if floored:
                return (f"each sequence reserves ceil({max_len} / {b}) = {per_seq} blocks, not "
                        f"{max_len // b}: round up")
            if tokens:
                return f"count whole blocks per sequence ({per_seq}), not tokens: a reservation is whole blocks"
            return f"each sequence reserves {per_seq} blocks; {pool} blocks hold {pool // per_seq} of them"
        return explain

    cases = [(128, 512, 16), (0, 512, 16), (31, 512, 16), (32, 512, 16), (64, 500, 16), (62, 500, 16),
             (95, 500, 16), (10, 1, 16), (7, 16, 16), (1000, 2048, 1)]
    for pool, max_len, b in cases:
        want = pool // -(-max_len // b)
        expect_equal(contiguous_capacity, (pool, max_len, b), want, hint=hint(pool, max_len, b), timeout=2)
    expect_raises(ValueError, contiguous_capacity, (-1, 512, 16), why="a negative pool", timeout=2)
    expect_raises(ValueError, contiguous_capacity, (128, 0, 16), why="max_len 0", timeout=2)
    expect_raises(ValueError, contiguous_capacity, (128, 512, 0), why="block_size 0", timeout=2)


@_uses_blocks_needed("contiguous_capacity")
def check_contiguous_capacity_hidden(contiguous_capacity):
    require_function(contiguous_capacity, "contiguous_capacity")
    rng = random.Random(4242)
    for _ in range(300):
        b = rng.choice([1, 2, 8, 16, 32, 64, 128, 256, 5, 13])
        max_len = rng.choice([b, 4 * b, 4 * b + 1, rng.randrange(1, 8192)])
        pool = rng.choice([0, rng.randrange(0, 40), rng.randrange(0, 100_000)])
        want = pool // -(-max_len // b)
        expect_equal(contiguous_capacity, (pool, max_len, b), want, timeout=2)


@_uses_blocks_needed("waste_percent")
def check_waste_percent_examples(waste_percent):
    require_function(waste_percent, "waste_percent")

    def hint(lens, b):
        reserved, used = sum(-(-n // b) * b for n in lens), sum(lens)
        want = waste_reference(lens, b)
        nonempty = [n for n in lens if n]
        mean = sum(waste_reference([n], b) for n in nonempty) / len(nonempty) if nonempty else None
        def explain(got):
            if not isinstance(got, (int, float)) or reserved == 0:
                return None
            if abs(got - (reserved - used) / reserved) < 1e-9:
                return "that is a fraction: return a percentage (multiply by 100)"
            if used and abs(got - 100.0 * (reserved - used) / used) < 1e-6:
                return f"divide by the reserved slots ({reserved}), not by the tokens used ({used})"
            if got == 100 * (reserved - used) // reserved:
                return f"that is 100 * {reserved - used} // {reserved}, rounded down: divide with /, not //"
            if any(got == round(want, digits) for digits in range(4)):
                return (f"that is {describe(want)} rounded: return the exact percentage (the text rounds it only "
                        "to print it)")
            if len(nonempty) > 1 and abs(got - mean) < 1e-6:
                return ("that is the mean of each sequence's percentage: add up the slots of all sequences first "
                        f"({reserved - used} unused of {reserved} reserved), then take the percentage once")
            return f"{reserved} slots reserved, {used} used"
        return explain

    seed = [40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110]
    cases = [([40], 16), ([16, 32], 16), ([], 16), ([0, 0], 16), ([1], 256), ([7, 9], 1), (seed, 16),
             (seed, 256), ([15, 17], 16)]
    for lens, b in cases:
        expect_equal(waste_percent, (list(lens), b), waste_reference(lens, b), hint=hint(lens, b), timeout=2)
    expect_raises(ValueError, waste_percent, ([10, -1], 16), why="a negative length", timeout=2)
    expect_raises(ValueError, waste_percent, ([10], 0), why="block_size 0", timeout=2)


@_uses_blocks_needed("waste_percent")
def check_waste_percent_hidden(waste_percent):
    require_function(waste_percent, "waste_percent")

    rng = random.Random(31337)
    for _ in range(300):
        b = rng.choice([1, 2, 5, 16, 64, 256])
        lens = [rng.choice([0, b, b - 1, rng.randrange(0, 4000)]) for _ in range(rng.randrange(0, 40))]
        expect_equal(waste_percent, (list(lens), b), waste_reference(lens, b), timeout=2)
