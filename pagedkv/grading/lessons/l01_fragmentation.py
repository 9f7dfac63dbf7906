"""Checks for lesson 1's exercise ``paged_admission`` (``grading/source/01_fragmentation.ipynb``, question 3).

The points follow the parts of the contract, so a learner sees which part is wrong and keeps the points of the
others: the FCFS walk and the skip walk on cases where no sequence fits exactly (1 point each), the boundary
(a sequence that needs exactly the blocks still free fits: ``<=``, not ``<``; 1 point, with a hint that names
it), the refusals and the untouched argument (1 point), and a hidden random sweep (1 point).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.grading.checks import expect_equal, expect_raises, fail, require_function, run

__all__ = [
    "SEED_LENS",
    "admitted",
    "check_paged_admission_boundary",
    "check_paged_admission_errors",
    "check_paged_admission_fcfs",
    "check_paged_admission_hidden",
    "check_paged_admission_skip",
]

#: The lesson's sixteen sequences (a pool of 128 blocks of 16: FCFS admits 13, skip 14).
SEED_LENS = [40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110]

# Cases where no sequence needs exactly the blocks still free when its turn comes (so `<` and `<=` agree).
_NO_TIES = [(SEED_LENS, 128, 16), ([], 128, 16), ([16, 17], 2, 16), ([100, 1, 1], 3, 1), (SEED_LENS, 1000, 16),
            (SEED_LENS, 64, 16), (SEED_LENS, 100, 16), ([10, 20, 30], 10, 4), ([40, 40, 40], 7, 16)]
# Cases where one does: each admits a sequence into exactly the blocks left.
_TIES = [([16, 16], 2, 16), ([17, 16, 1], 2, 16), ([16, 33, 16], 5, 16), ([0, 5, 0], 0, 16), ([32], 2, 16),
         ([5, 100, 3], 1, 8)]


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


def check_paged_admission_fcfs(paged_admission: Any) -> None:
    """policy='fcfs' (and the default) on cases without an exact fit."""
    require_function(paged_admission, "paged_admission")
    for lens, pool, b in _NO_TIES:
        _expect(paged_admission, lens, pool, b, "fcfs")
    expect_equal(paged_admission, (list(SEED_LENS), 128, 16), list(range(13)), name="paged_admission",
                 hint="called without a policy, paged_admission must use policy='fcfs'", timeout=2)


def check_paged_admission_skip(paged_admission: Any) -> None:
    """policy='skip' on cases without an exact fit."""
    require_function(paged_admission, "paged_admission")
    for lens, pool, b in _NO_TIES:
        _expect(paged_admission, lens, pool, b, "skip")


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


def check_paged_admission_errors(paged_admission: Any) -> None:
    """The refusals, and ``lens`` left as it was (a tuple works too)."""
    require_function(paged_admission, "paged_admission")
    expect_raises(ValueError, paged_admission, ([40], 128, 16, "lifo"), name="paged_admission",
                  why="an unknown policy", timeout=2)
    expect_raises(ValueError, paged_admission, ([40, -1], 128, 16, "skip"), name="paged_admission",
                  why="a negative length", timeout=2)
    expect_raises(ValueError, paged_admission, ([40], -1, 16, "fcfs"), name="paged_admission",
                  why="a negative pool", timeout=2)
    expect_raises(ValueError, paged_admission, ([40], 128, 0, "fcfs"), name="paged_admission",
                  why="block_size 0", timeout=2)
    lens = list(SEED_LENS)
    run(paged_admission, (lens, 100, 16, "skip"), name="paged_admission", timeout=2)
    if lens != SEED_LENS:
        fail(f"paged_admission changed its argument lens: {SEED_LENS} became {lens}")
    expect_equal(paged_admission, (tuple(SEED_LENS), 100, 16, "skip"), admitted(SEED_LENS, 100, 16, "skip"),
                 name="paged_admission", timeout=2)


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
