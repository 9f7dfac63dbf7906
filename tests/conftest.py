"""Shared test set-up: Triton runs in its interpreter on the CPU unless a CUDA GPU is present."""

from __future__ import annotations

import os
import sys

# One thread per test process, children included (notebook kernels, grading workers, engine processes): the
# suite runs one pytest-xdist worker more than the cores, so torch's and OpenBLAS's own thread pools (one thread
# per core each) would only take turns, and their waiting threads spin. Set before numpy or torch is first
# loaded; a value of one's own (OMP_NUM_THREADS=4 pytest ...) is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# nbformat imports jsonschema, which builds a grammar for IRI strings with lark when `rfc3987_syntax` is
# installed (JupyterLab's jupyter-events brings it): about 2.5 CPU-seconds in every test process, each xdist
# worker included, for a format ("iri") that no notebook schema uses. A None entry makes that optional import
# fail, so jsonschema leaves the "iri" format unchecked; notebook validation is the same.
sys.modules.setdefault("rfc3987_syntax", None)

# No per-example deadline anywhere: CI machines are shared, and a slow example is not a wrong one.
settings.register_profile("lab", deadline=None)
settings.load_profile("lab")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing or broken: no GPU
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    # Must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def llama():
    """Lesson 7's tiny seeded Llama (2 layers, GQA: 4 query heads, 2 KV heads; no download), one per test module:
    the engine tests' model. Tests that change its generation config put it back."""
    from pagedkv.engine.tiny_models import tiny_model

    return tiny_model("llama")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the chunks are cut from what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = long_poles_first(items, _worksteal_workers(config))
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found: torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _no_asyncio_loop_left_running(request: pytest.FixtureRequest) -> None:
    """Fail at set-up, naming the cause, when an earlier test in this process left an asyncio loop marked as
    running in this thread (as Playwright's sync API does while it is alive): the test's own ``asyncio.run``
    would otherwise fail with "cannot be called from a running event loop", for a reason that is not its own."""
    import asyncio

    if asyncio._get_running_loop() is not None and "browser" not in request.fixturenames:
        pytest.fail("an earlier test in this process left an asyncio loop marked as running in this thread "
                    "(is a Playwright sync API, or another fixture that runs a loop, still alive?)")


# ------------------------------------------------------------------------------------------ the order of the tests
# `./lab test` runs pytest-xdist's worksteal scheduler: it cuts the collection into one contiguous chunk per worker
# (chunk i gets len(left) // (workers left) items), each worker runs its chunk in order, and a worker that runs out
# steals the second half of the longest queue. A long test that starts late is then the run's tail, with the other
# worker idle. So the long poles go first, dealt over the chunks (longest first, each to the chunk with the fewest
# seconds so far), and the rest keeps its order behind them (a module's tests together, so that a module-scoped
# fixture is set up once per chunk): what is left to steal at the end is short. The seconds only order the tests
# (a wrong one costs balance, never a verdict): a run on 2 cores, `pytest -n auto --durations=100`, rounded
# (2026-12-03, a machine where `import torch` takes 3 s).
LONG_POLE_SECONDS = {
    "graded": 200,  # tests/test_grading.py's module fixture (four `pagedkv grade` calls): its tests move together
    "notebooks/09_serving_online.ipynb": 50, "notebooks/04_scheduling.ipynb": 44,
    "notebooks/10_tensor_parallelism.ipynb": 43, "notebooks/06_paged_attention_kernel.ipynb": 40,
    "notebooks/00_primer.ipynb": 27, "notebooks/02_block_pool.ipynb": 21, "notebooks/07_serving_engine.ipynb": 20,
    "notebooks/03_prefix_caching.ipynb": 17, "notebooks/08_hybrid_models.ipynb": 14,
    "tests/test_kernels.py::test_kernels_compile_for_a_gpu_without_one": 33,
    "tests/test_grading_hidden.py::test_set05_no_other_copy_of_an_answer_scores": 25,
    "tests/test_kv_faithful_fuzz.py::test_fuzz_thousands_of_runs": 24,
    "tests/test_tensor_parallel.py::test_no_orphan_after_a_failing_test": 16,
    "tests/test_tensor_parallel.py::test_ctrl_c_and_a_dead_worker": 13,
}
NOTEBOOK_SECONDS = 8  # a notebook not listed above
SLOW_SECONDS = 3  # any other test marked slow


def _worksteal_workers(config: pytest.Config) -> int:
    """How many xdist workers cut this collection into chunks (1: no xdist, or another scheduler)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or config.getoption("dist", "no") != "worksteal":
        return 1
    return int(workerinput.get("workercount", 1))


def _own_wide_fixtures(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-, package- or session-scoped fixture of this suite's (moved on its own, it
    would set that fixture up on another worker too)."""
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for d in defs:
            if d.scope != "function" and str(d.baseid).startswith("tests"):
                return True
    return False


def _seconds(item: pytest.Item) -> float | None:
    """The item's known seconds (None: it is not a long pole, it stays where it is)."""
    callspec = getattr(item, "callspec", None)
    if "notebooks" in item.keywords and callspec is not None:
        return LONG_POLE_SECONDS.get(callspec.id, NOTEBOOK_SECONDS)
    if item.nodeid in LONG_POLE_SECONDS:
        return LONG_POLE_SECONDS[item.nodeid]
    if "slow" in item.keywords and not _own_wide_fixtures(item):
        return SLOW_SECONDS
    return None


def long_poles_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """``items`` reordered for ``workers`` worksteal chunks: in each chunk its long poles, longest first, then
    its share of the rest in the collection's order. The same items, and the same order in every worker (xdist
    checks that the workers' collections agree)."""
    units: list[tuple[float, int, list[pytest.Item]]] = []  # (seconds, first position, items)
    graded = [item for item in items if "graded" in getattr(item, "fixturenames", ())]
    if graded:
        units.append((LONG_POLE_SECONDS["graded"], items.index(graded[0]), graded))
    moved = {id(item) for item in graded}
    for i, item in enumerate(items):
        seconds = None if id(item) in moved else _seconds(item)
        if seconds is not None:
            units.append((seconds, i, [item]))
            moved.add(id(item))
    rest = [item for item in items if id(item) not in moved]
    sizes, left = [], len(items)
    for w in range(workers):  # what WorkStealingScheduling.check_schedule sends each idle worker first
        sizes.append(left // (workers - w))
        left -= sizes[-1]
    chunks: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for seconds, _, unit in sorted(units, key=lambda u: (-u[0], u[1])):
        fits = [c for c in range(workers) if len(chunks[c]) + len(unit) <= sizes[c]] or list(range(workers))
        c = min(fits, key=lambda c: (load[c], c))
        chunks[c] += unit
        load[c] += seconds
    for c in range(workers):
        take = max(0, sizes[c] - len(chunks[c]))
        chunks[c] += rest[:take]
        rest = rest[take:]
    chunks[-1] += rest
    return [item for chunk in chunks for item in chunk]
