"""The graded-exercise pipeline: build, grade (the learner's code in sandboxes, the verdict outside), the checks.

Grading is slow (a sandbox per exercise: a process that runs the notebook's cells, then the tests run in the
trusted worker against it), so the module grades everything it needs in four ``pagedkv grade`` calls made once,
side by side:

- ``main``: every ``solutions/NN.ipynb`` and ``exercises/NN.ipynb`` of every set in ``grading/source/`` (by glob),
  plus set 01 answered wrongly in several ways (floor in a renamed copy in another folder, FCFS for skip, a
  hard-coded answer, a function that loops, one that raises, an answer cell with a SyntaxError, a garbage return
  value, binary garbage printed, a cell that ends the process, files that are not notebooks);
- ``class``: a class folder (``--class --csv``) of two learners: one whose notebook attacks the grader (issue 9
  §3: patched check helpers and otter runner, an ``__import__`` hook, the library's reference wrapped or read
  from the repository, writes into the repository, processes that try to outlive grading, a 6 GB allocation),
  one whose functions misbehave (§4: SystemExit, KeyboardInterrupt, the interval timer switched off, a loop
  that ignores interrupts);
- ``quick``: cells that loop (interrupted, named, the rest graded) or cannot be interrupted (left out, the rest
  graded), with a 5 s cell limit;
- ``slow``: a correct function too slow for a 3 s budget per test case (0.5 s per call).

Every limit that decides a verdict is either generous (the point is "it finished") or far from the behaviour
tested (a loop that never ends, 11 calls of 0.5 s against 3 s), so no verdict depends on the machine's load.
The tests then read the JSON reports and the CSV.
"""

from __future__ import annotations

import csv
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grade_variant import grade_variant

from pagedkv.grading import checks, classroom, grade, plain, progress, worker
from pagedkv.grading.build import find_sources, question_order

ROOT = Path(__file__).resolve().parents[1]
SETS = [p.stem for p in find_sources(ROOT)]
FRAG = "01_fragmentation"

# --------------------------------------------------------------------------------------------- set 01 answers
GOOD = {
    "blocks_needed": (
        "def blocks_needed(num_tokens, block_size):\n"
        "    if num_tokens < 0 or block_size < 1:\n"
        "        raise ValueError('bad input')\n"
        "    return -(-num_tokens // block_size)\n"
    ),
    "contiguous_capacity": (
        "def contiguous_capacity(pool_blocks, max_len, block_size):\n"
        "    if pool_blocks < 0 or max_len < 1 or block_size < 1:\n"
        "        raise ValueError('bad input')\n"
        "    return pool_blocks // -(-max_len // block_size)\n"
    ),
    "paged_admission": (
        "def paged_admission(lens, pool_blocks, block_size, policy='fcfs'):\n"
        "    if policy not in ('fcfs', 'skip') or pool_blocks < 0 or block_size < 1 or min(lens, default=0) < 0:\n"
        "        raise ValueError('bad input')\n"
        "    free, out = pool_blocks, []\n"
        "    for i, n in enumerate(lens):\n"
        "        need = -(-n // block_size)\n"
        "        if need <= free:\n"
        "            free -= need\n"
        "            out.append(i)\n"
        "        elif policy == 'fcfs':\n"
        "            break\n"
        "    return out\n"
    ),
    "waste_percent": (
        "def waste_percent(lens, block_size):\n"
        "    if block_size < 1 or min(lens, default=0) < 0:\n"
        "        raise ValueError('bad input')\n"
        "    reserved = sum(-(-n // block_size) * block_size for n in lens)\n"
        "    return 0.0 if reserved == 0 else 100.0 * (reserved - sum(lens)) / reserved\n"
    ),
}


def _with(**changes: str) -> dict[str, str]:
    return {**GOOD, **changes}


FLOOR = GOOD["blocks_needed"].replace("-(-num_tokens // block_size)", "num_tokens // block_size")
FCFS_FOR_SKIP = GOOD["paged_admission"].replace("elif policy == 'fcfs':", "else:")
HARDCODED = (
    "def paged_admission(lens, pool_blocks, block_size, policy='fcfs'):\n"
    "    return list(range(13)) if policy == 'fcfs' else list(range(13)) + [14]\n"
)
LOOPS = (
    "def blocks_needed(num_tokens, block_size):\n"
    "    while True:\n"
    "        try:\n"
    "            num_tokens += 1\n"
    "        except Exception:\n"
    "            pass\n"
)
RAISES = "def contiguous_capacity(pool_blocks, max_len, block_size):\n    return pool_blocks // 0\n"
SYNTAX_ERROR = "def contiguous_capacity(pool_blocks, max_len, block_size):\n    blocks = -(-max_len // block_size\n" \
    "    return pool_blocks // blocks\n"
# the answer cell loops before its def; it sleeps in the loop (the free cell beside it loops on the CPU, and a
# second 10 s of spinning would only take a core from the rest of the suite)
LOOPING_CELL = "while True:\n    __import__('time').sleep(1)\n" + GOOD["waste_percent"]
GARBAGE = (
    "class Weird:\n"
    "    def __repr__(self):\n"
    "        raise RuntimeError('no repr')\n"
    "    def __eq__(self, other):\n"
    "        raise RuntimeError('no eq')\n"
    "def waste_percent(lens, block_size):\n"
    "    print('\\x1b[31m' + 'garbage ' * 2000)\n"
    "    return Weird()\n"
)
GARBAGE_CELL = "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 50)\nsys.stdout.flush()\nprint('\\udcff' * 10)"

# Each notebook costs a sandbox per exercise, so one notebook carries several mistakes, one per exercise (the
# answers are independent: none calls another).
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    # name: (answers, extra code cells inserted after the set-up cells)
    "mixed": (  # FCFS where skip was asked; a function that raises; a garbage result; cells that fail
        _with(paged_admission=FCFS_FOR_SKIP, contiguous_capacity=RAISES, waste_percent=GARBAGE),
        ["raise RuntimeError('a learner cell that fails')", GARBAGE_CELL],
    ),
    "loops_and_hardcoded": (_with(blocks_needed=LOOPS, paged_admission=HARDCODED, contiguous_capacity=SYNTAX_ERROR),
                            []),
    "kernel_exits": (GOOD, ["import os\nos._exit(3)"]),
}
QUICK_LIMITS = {  # graded with a 10 s cell limit (the other cells take well under a second)
    "loop_in_cell": (_with(waste_percent=LOOPING_CELL), ["while True:\n    pass"]),
    "uninterruptible": (GOOD, ["import time\nwhile True:\n    try:\n        time.sleep(60)\n    except BaseException:\n"
                               "        pass"]),
}
SLOW_WASTE = (  # correct, 0.2 s of CPU per call (the checks allow 2 s per call): the hidden case's 300 calls use
    # 60 s of CPU, far past a 10 s CPU budget per test case, whatever the machine's load; the public case's 11 calls
    # and the other exercises' cases use far less
    "def waste_percent(lens, block_size):\n"
    "    import time\n"
    "    t = time.process_time()\n"
    "    while time.process_time() - t < 0.2:\n"
    "        pass\n"
    "    if block_size < 1 or min(lens, default=0) < 0:\n"
    "        raise ValueError('bad input')\n"
    "    reserved = sum(-(-n // block_size) * block_size for n in lens)\n"
    "    return 0.0 if reserved == 0 else 100.0 * (reserved - sum(lens)) / reserved\n"
)

# ------------------------------------------------------------------- issue 9 §3: attacks on the grader itself
REPO = str(ROOT)
SLEEP_MARKS = ("4242.25", "4243.25")  # the processes that try to outlive grading sleep this long
ATTACK_CELLS = [
    # patch the check helpers, otter's test runner, and the import machinery
    "import pagedkv.grading.checks as C\n"
    "for _n in ('expect_equal', 'expect_raises', 'require_function', 'fail', 'run', 'expect_close'):\n"
    "    setattr(C, _n, lambda *a, **k: None)\n"
    "try:\n"
    "    import otter.test_files.exception_test as _et\n"
    "    _et.ExceptionTestFile.run = lambda self, *a, **k: None\n"
    "except Exception:\n"
    "    pass\n",
    "import builtins\n"
    "_real_import = builtins.__import__\n"
    "def _hook(name, *a, **k):\n"
    "    m = _real_import(name, *a, **k)\n"
    "    for _n in ('expect_equal', 'expect_raises', 'require_function', 'fail', 'run'):\n"
    "        if hasattr(m, _n):\n"
    "            setattr(m, _n, lambda *a, **k: None)\n"
    "    return m\n"
    "builtins.__import__ = _hook\n",
    # write into the repository: the autograder zip (one submission changing everyone's grades), a new file
    "import pathlib\n"
    f"for _t in [{REPO!r} + '/grading/autograder/{FRAG}.zip', {REPO!r} + '/pwned-by-a-learner.txt',\n"
    f"           {REPO!r} + '/exercises/{FRAG}.ipynb']:\n"
    "    try:\n"
    "        pathlib.Path(_t).write_bytes(b'pwned')\n"
    "    except Exception:\n"
    "        pass\n",
    # processes that try to outlive grading: a new session, and a double fork into one
    "import subprocess, sys\n"
    f"subprocess.Popen(['sleep', '{SLEEP_MARKS[0]}'], start_new_session=True)\n"
    "subprocess.Popen([sys.executable, '-c', 'import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n"
    f"    time.sleep({SLEEP_MARKS[1]})'], start_new_session=True)\n",
    # what the sandbox can do, reported through the cell's error (which the JSON report carries)
    "import json, os\n"
    "obs = {}\n"
    "try:\n"
    "    _x = bytearray(6 * 2**30)\n"
    "    obs['alloc6g'] = 'ok'\n"
    "    del _x\n"
    "except MemoryError:\n"
    "    obs['alloc6g'] = 'MemoryError'\n"
    "try:\n"
    f"    open({REPO!r} + '/pagedkv/fragmentation.py').read(10)\n"
    "    obs['repo'] = 'readable'\n"
    "except OSError as e:\n"
    "    obs['repo'] = type(e).__name__\n"
    "try:\n"
    "    from pagedkv.fragmentation import blocks_needed as _r\n"
    "    _r(40, 16)\n"
    "    obs['ref'] = 'callable'\n"
    "except RuntimeError:\n"
    "    obs['ref'] = 'stub'\n"
    "obs['root'] = os.getuid() == 0\n"
    "raise RuntimeError('OBS ' + json.dumps(obs, sort_keys=True))\n",
]
WRAPS_REFERENCE = (  # the library's answer, wrapped in a def
    "from pagedkv.fragmentation import blocks_needed as _reference\n"
    "def blocks_needed(num_tokens, block_size):\n"
    "    return _reference(num_tokens, block_size)\n"
)
READS_REFERENCE = (  # the library's source, read from the repository and run
    "def contiguous_capacity(pool_blocks, max_len, block_size):\n"
    "    ns = {}\n"
    f"    exec(open({REPO!r} + '/pagedkv/fragmentation.py').read(), ns)\n"
    "    return ns['contiguous_capacity'](pool_blocks, max_len, block_size)\n"
)
STEALS = (  # issue 19: find the --class folder from the grader's command line in /proc, or by walking the
    # filesystem, and take another learner's paged_admission
    "def paged_admission(lens, pool_blocks, block_size, policy='fcfs'):\n"
    "    import json, os\n"
    "    found = []\n"
    "    for p in os.listdir('/proc'):\n"
    "        try:\n"
    "            args = open(f'/proc/{p}/cmdline', 'rb').read().split(b'\\0')\n"
    "        except OSError:\n"
    "            continue\n"
    "        found += [a.decode() for a in args if a.endswith(b'class') or a.endswith(b'.ipynb')]\n"
    "    found.append('/')\n"
    "    for top in found:\n"
    "        for d, subs, files in os.walk(top):\n"
    "            subs[:] = [s for s in subs if s not in ('usr', 'proc', 'sys', '.venv', '.pyenv', 'site-packages')]\n"
    "            for f in files:\n"
    "                if not f.endswith('.ipynb'):\n"
    "                    continue\n"
    "                try:\n"
    "                    cells = json.load(open(os.path.join(d, f)))['cells']\n"
    "                except Exception:\n"
    "                    continue\n"
    "                for c in cells:\n"
    "                    src = ''.join(c.get('source', ''))\n"
    "                    if src.startswith('def paged_admission') and '...' not in src and 'found' not in src:\n"
    "                        ns = {}\n"
    "                        exec(src, ns)\n"
    "                        return ns['paged_admission'](lens, pool_blocks, block_size, policy)\n"
)
ATTACK_TARGETS = [f"grading/autograder/{FRAG}.zip", "pwned-by-a-learner.txt", f"exercises/{FRAG}.ipynb"]

# ------------------------------------------------------------------- issue 9 §4: functions that misbehave
MISBEHAVING = {
    "blocks_needed": "def blocks_needed(num_tokens, block_size):\n    raise SystemExit(3)\n",
    "contiguous_capacity": "def contiguous_capacity(pool_blocks, max_len, block_size):\n    raise KeyboardInterrupt\n",
    # correct, but switches off the interval timer and SIGINT on every call: no bearing on the verdict
    "paged_admission": GOOD["paged_admission"].replace(
        "    if policy not in",
        "    import signal\n    signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    if policy not in", 1),
    # loops and ignores interrupts: the per-call limit stops the case, the process is replaced
    "waste_percent": "def waste_percent(lens, block_size):\n    import signal\n"
                     "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    while True:\n        pass\n",
}


def make_variant(folder: Path, answers: dict[str, str], extra_cells: list[str], name: str = f"{FRAG}.ipynb") -> Path:
    """A copy of exercises/01_fragmentation.ipynb with its answer cells replaced (matched by the name of
    the function they define) and ``extra_cells`` inserted after the first two code cells."""
    nb = json.loads((ROOT / "exercises" / f"{FRAG}.ipynb").read_text())
    replaced = set()
    for cell in nb["cells"]:
        if "otter_answer_cell" in cell["metadata"].get("tags", []):
            m = re.match(r"\s*def (\w+)", "".join(cell["source"]))
            if m and m.group(1) in answers:
                cell["source"] = answers[m.group(1)]
                replaced.add(m.group(1))
    assert replaced == set(answers), f"answer cells not found for {set(answers) - replaced}"
    code_cells = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    at = code_cells[1] + 1
    for k, src in enumerate(extra_cells):
        nb["cells"].insert(at + k, {"cell_type": "code", "id": f"extra-{k}", "metadata": {}, "source": src,
                                    "outputs": [], "execution_count": None})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(nb))
    return path


def _pagedkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", *args]


def _snapshot(paths: list[Path]) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def _porcelain(paths: list[str]) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *paths], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout


def _sleepers() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, timeout=60).stdout
    return [ln for ln in out.splitlines() if any(mark in ln for mark in SLEEP_MARKS)]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """What the four grade calls printed and reported, graded once per run. Under pytest-xdist a worker that steals
    some of this module's tests reads the first worker's result (written under the run's shared temporary folder,
    a lock around it) instead of grading all of it again beside that worker."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _grade_all(tmp_path_factory)
    from filelock import FileLock  # torch's dependency

    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its workers
    with FileLock(str(shared / "graded.lock")):
        result = shared / "graded.pickle"
        if result.is_file():
            return pickle.loads(result.read_bytes())
        out = _grade_all(tmp_path_factory)
        result.write_bytes(pickle.dumps(out))
        return out


def _grade_all(tmp_path_factory) -> dict:
    """Run the four grade calls at once; return what each printed and reported."""
    tmp = tmp_path_factory.mktemp("graded")
    variants = {name: make_variant(tmp / name, a, x) for name, (a, x) in VARIANTS.items()}
    variants["renamed_floor"] = make_variant(tmp / "elsewhere" / "deeper", _with(blocks_needed=FLOOR), [],
                                             name=f"{FRAG}-alice.ipynb")
    (tmp / "not_a_notebook").mkdir()
    for name, data in (("not_json", b"{ this is not json"), ("json_list", b"[1, 2, 3]"),
                       ("binary", bytes(range(256)) * 8)):
        (tmp / "not_a_notebook" / name).mkdir()
        variants[name] = tmp / "not_a_notebook" / name / f"{FRAG}.ipynb"
        variants[name].write_bytes(data)
    quick = {name: make_variant(tmp / name, a, x) for name, (a, x) in QUICK_LIMITS.items()}
    slow = make_variant(tmp / "slow", {"waste_percent": SLOW_WASTE}, [])
    klass = tmp / "class"
    variants["alice"] = make_variant(klass / "alice", GOOD, [])  # whose answers mallory tries to take
    variants["attacks"] = make_variant(klass / "mallory", {"blocks_needed": WRAPS_REFERENCE, "paged_admission": STEALS,
                                                           "contiguous_capacity": READS_REFERENCE}, ATTACK_CELLS)
    variants["misbehaving"] = make_variant(klass, MISBEHAVING, [], name=f"{FRAG}-bob.ipynb")

    learner_files = [ROOT / "exercises" / f"{s}.ipynb" for s in SETS] + list(variants.values())
    before = _snapshot([p for p in learner_files if p.is_file()])
    porcelain_before = _porcelain(ATTACK_TARGETS)
    main_paths = [str(ROOT / "solutions" / f"{s}.ipynb") for s in SETS]
    main_paths += [str(ROOT / "exercises" / f"{s}.ipynb") for s in SETS]
    main_paths += [str(variants[k].parent) for k in VARIANTS]
    main_paths += [str(tmp / "elsewhere"), str(tmp / "not_a_notebook")]

    start = time.monotonic()
    long = ["--timeout", "1800", "--no-progress"]
    calls = {
        "main": (_pagedkv("grade", *main_paths, "--json", str(tmp / "main.json"), "-j", "2", *long), tmp / "main.json"),
        "class": (_pagedkv("grade", "--class", str(klass), "--csv", str(tmp / "class.csv"), "--json",
                           str(tmp / "class.json"), "-j", "1", *long), tmp / "class.json"),
        "quick": (_pagedkv("grade", *[str(p) for p in quick.values()], "--json", str(tmp / "quick.json"),
                           "--cell-timeout", "10", "-j", "2", *long), tmp / "quick.json"),
        "slow": (_pagedkv("grade", str(slow), "--json", str(tmp / "slow.json"), "--case-timeout", "10", "-j", "1",
                          *long), tmp / "slow.json"),
    }
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp)
             for k, (cmd, _) in calls.items()}
    out = {}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=3600)
        report = json.loads(calls[k][1].read_text()) if calls[k][1].is_file() else None
        out[k] = {"rc": proc.returncode, "stdout": stdout.decode(errors="replace"),
                  "stderr": stderr.decode(errors="replace"), "report": report}
    out["seconds"] = time.monotonic() - start
    out["before"] = before
    out["porcelain"] = (porcelain_before, _porcelain(ATTACK_TARGETS))
    out["sleepers"] = _sleepers()
    out["csv"] = list(csv.DictReader(open(tmp / "class.csv", encoding="utf-8"))) if (tmp / "class.csv").is_file() \
        else None
    out["variants"] = {**variants, **quick, "slow": slow}
    return out


def _notebook(report: dict, path: Path | str) -> dict:
    resolved = Path(path).resolve()
    for nb in report["notebooks"]:
        if Path(nb["notebook"]).resolve() == resolved:
            return nb
    raise AssertionError(f"{path} not in the report: {[nb['notebook'] for nb in report['notebooks']]}")


def _exercise(nb: dict, name: str) -> dict:
    for ex in nb["exercises"]:
        if ex["name"] == name:
            return ex
    raise AssertionError(f"no exercise {name} in {nb['notebook']}")


def _variant(graded, name: str) -> dict:
    key = ("quick" if name in QUICK_LIMITS else "class" if name in ("attacks", "misbehaving")
           else "slow" if name == "slow" else "main")
    return _notebook(graded[key]["report"], graded["variants"][name])


# --------------------------------------------------------------------------------------------- the grade calls
@pytest.mark.slow
def test_grade_calls_exit_zero_without_traceback(graded):
    for key in ("main", "class", "quick", "slow"):
        call = graded[key]
        assert call["rc"] == 0, f"{key}: exit {call['rc']}\n{call['stderr'][-2000:]}"
        assert "Traceback" not in call["stdout"] + call["stderr"], call["stdout"][-3000:] + call["stderr"][-3000:]
        assert call["report"] is not None
    print(f"the four grade calls took {graded['seconds']:.0f} s")


@pytest.mark.slow
def test_json_report_shape(graded):
    report = graded["main"]["report"]
    assert set(report) == {"score", "possible", "notebooks"}
    assert isinstance(report["score"], float) and isinstance(report["possible"], float)
    assert report["score"] == pytest.approx(sum(nb["score"] for nb in report["notebooks"]))
    assert report["possible"] == pytest.approx(sum(nb["possible"] for nb in report["notebooks"]))
    for nb in report["notebooks"]:
        assert {"notebook", "autograder", "status", "score", "possible", "seconds", "message", "exercises",
                "cells"} <= set(nb)
        for ex in nb["exercises"]:
            assert {"name", "score", "possible", "status", "message", "cases"} <= set(ex)
            assert ex["status"] in {"passed", "partial", "failed"}
            for case in ex["cases"]:
                assert {"name", "hidden", "points", "passed", "message"} <= set(case)


@pytest.mark.slow
@pytest.mark.parametrize("name", SETS)
def test_solution_scores_full_marks(graded, name):
    assert (ROOT / "solutions" / f"{name}.ipynb").is_file(), f"solutions/{name}.ipynb is missing: run ./lab exercises"
    nb = _notebook(graded["main"]["report"], ROOT / "solutions" / f"{name}.ipynb")
    failures = [(e["name"], e["message"]) for e in nb["exercises"] if e["status"] != "passed"]
    assert nb["status"] == "graded" and not failures, f"{nb['message']} {failures}"
    assert nb["possible"] > 0 and nb["score"] == nb["possible"]
    # every exercise has at least one hidden case
    for ex in nb["exercises"]:
        assert any(c["hidden"] for c in ex["cases"]), f"{name}: exercise {ex['name']} has no hidden test case"
    assert nb["cells"] == [], f"{name}: cells of the solution raised: {nb['cells']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", SETS)
def test_exercises_are_listed_in_notebook_order(graded, name):
    """The JSON and the table list a set's exercises as the notebook has them (02: free_queue first)."""
    import nbformat

    order = question_order(nbformat.read(ROOT / "grading" / "source" / f"{name}.ipynb", as_version=4))
    assert order and order != sorted(order) or name != "02_block_pool", "set 02 no longer tests the order"
    for folder in ("solutions", "exercises"):
        nb = _notebook(graded["main"]["report"], ROOT / folder / f"{name}.ipynb")
        assert [ex["name"] for ex in nb["exercises"]] == order, folder
    rows = [ln.split()[1] for ln in graded["main"]["stdout"].splitlines()
            if ln.split() and ln.split()[0].endswith(f"solutions/{name}.ipynb")]
    assert rows == order + ["TOTAL"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SETS)
def test_untouched_exercise_scores_zero_without_traceback(graded, name):
    assert (ROOT / "exercises" / f"{name}.ipynb").is_file(), f"exercises/{name}.ipynb is missing: run ./lab exercises"
    nb = _notebook(graded["main"]["report"], ROOT / "exercises" / f"{name}.ipynb")
    assert nb["status"] == "graded", nb["message"]
    assert nb["possible"] > 0 and nb["score"] == 0
    for ex in nb["exercises"]:
        assert ex["status"] == "failed" and ex["message"], ex
        assert "Traceback" not in ex["message"]
    # the demo cells after the stubs print a message instead of raising; no cell loops
    for cell in nb["cells"]:
        assert cell["error"].startswith("AssertionError") and not cell["timed_out"], f"{name}: {cell}"


@pytest.mark.slow
def test_learner_files_are_not_modified(graded):
    for path, (data, mtime) in graded["before"].items():
        assert path.read_bytes() == data, f"{path} was modified by grading"
        assert path.stat().st_mtime_ns == mtime, f"{path} was rewritten by grading"


@pytest.mark.slow
def test_table_lists_every_exercise_and_never_cuts_a_message(graded):
    table = graded["main"]["stdout"]
    assert re.search(r"notebook\s+exercise\s+points\s+status\s+first failure", table)
    for ex in ("blocks_needed", "contiguous_capacity", "paged_admission", "waste_percent"):
        assert ex in table
    assert re.search(r"score: [\d.]+ / [\d.]+", table)
    assert "…" not in table
    for nb in graded["main"]["report"]["notebooks"]:
        for ex in nb["exercises"]:
            if ex["message"]:
                assert " ".join(ex["message"].split()) in table, ex["message"]
            assert not re.search(r"Error at line \d+ in test", ex["message"])


# --------------------------------------------------------------------------------------------- set 01, wrong answers
@pytest.mark.slow
def test_renamed_copy_in_another_folder_grades_like_the_original(graded):
    nb = _variant(graded, "renamed_floor")
    assert nb["status"] == "graded" and nb["autograder"].endswith(f"{FRAG}.zip")
    assert nb["cells"] == [], nb["cells"]  # no false cell errors: the checks' cells are not the learner's
    assert 0 < nb["score"] < nb["possible"]
    ex = _exercise(nb, "blocks_needed")
    assert ex["score"] == 0
    assert "blocks_needed(40, 16) returned 2, expected 3" in ex["message"]
    assert "rounded down" in ex["message"]
    assert all(e["status"] == "passed" for e in nb["exercises"] if e["name"] != "blocks_needed")


@pytest.mark.slow
def test_fcfs_where_skip_was_asked_scores_partial_with_message(graded):
    nb = _variant(graded, "mixed")
    ex = _exercise(nb, "paged_admission")
    assert ex["status"] == "partial" and 0 < ex["score"] < ex["possible"]
    assert "'skip') returned [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], expected [0, 1" in ex["message"]
    assert "that is what policy='fcfs' admits" in ex["message"]
    assert _exercise(nb, "blocks_needed")["status"] == "passed"
    assert 0 < nb["score"] < nb["possible"]


@pytest.mark.slow
def test_hard_coded_seed_answer_fails(graded):
    ex = _exercise(_variant(graded, "loops_and_hardcoded"), "paged_admission")
    assert ex["score"] < ex["possible"]
    assert "paged_admission(" in ex["message"] and "returned [0, 1, 2" in ex["message"]


@pytest.mark.slow
def test_infinite_loop_in_a_function_fails_that_exercise(graded):
    nb = _variant(graded, "loops_and_hardcoded")
    assert nb["status"] == "graded"
    ex = _exercise(nb, "blocks_needed")
    assert ex["score"] == 0 and "did not return within" in ex["message"] and "infinite loop" in ex["message"]
    assert _exercise(nb, "waste_percent")["status"] == "passed"


def _cell_number(path: Path, source: str) -> int:
    """The 1-based number of the cell of ``path`` whose source is ``source``."""
    cells = json.loads(path.read_text())["cells"]
    return next(i + 1 for i, c in enumerate(cells) if "".join(c["source"]) == source)


@pytest.mark.slow
def test_infinite_loop_in_a_cell_is_interrupted_named_and_the_rest_graded(graded):
    nb = _variant(graded, "loop_in_cell")
    assert nb["status"] == "graded", nb["message"]
    free = _cell_number(graded["variants"]["loop_in_cell"], "while True:\n    pass")
    answer = _cell_number(graded["variants"]["loop_in_cell"], LOOPING_CELL)
    # the notebook's row names every interrupted cell as JupyterLab shows it: its heading and first line
    assert (f'the cell under "Exercises, lesson 1: fragmentation" that starts `while True:` (cell {free}) was '
            "interrupted after 10 s (an infinite loop?)") in nb["message"], nb["message"]
    assert (f'the cell under "4. `waste_percent(lens, block_size)`: internal fragmentation under paging" that starts '
            f"`while True:` (cell {answer}) was interrupted after 10 s") in nb["message"], nb["message"]
    # the answer cell that looped before its def: its exercise says so, instead of "run the cell"
    ex = _exercise(nb, "waste_percent")
    assert ex["score"] == 0
    assert ex["message"].endswith(f"(cell {answer}) was interrupted after 10 s (an infinite loop?)"), ex["message"]
    assert "waste_percent is not defined: the cell defining waste_percent under" in ex["message"]
    # the rest is graded
    assert all(e["status"] == "passed" for e in nb["exercises"] if e["name"] != "waste_percent")
    assert nb["score"] == nb["possible"] - ex["possible"]
    assert "was interrupted after 10 s" in graded["quick"]["stdout"]


@pytest.mark.slow
def test_uninterruptible_cell_is_left_out_and_the_rest_graded(graded):
    nb = _variant(graded, "uninterruptible")
    assert nb["status"] == "graded", nb["message"]
    assert "did not stop when interrupted" in nb["message"], nb["message"]
    assert nb["score"] == nb["possible"] > 0
    assert [c["cell"] for c in nb["cells"] if c["timed_out"]] == \
        [_cell_number(graded["variants"]["uninterruptible"], QUICK_LIMITS["uninterruptible"][1][0])]


@pytest.mark.slow
def test_syntax_error_in_an_answer_cell_is_passed_on(graded):
    nb = _variant(graded, "loops_and_hardcoded")
    ex = _exercise(nb, "contiguous_capacity")
    cell = _cell_number(graded["variants"]["loops_and_hardcoded"], SYNTAX_ERROR)
    assert ex["score"] == 0
    assert ex["message"].startswith("contiguous_capacity is not defined: the cell defining contiguous_capacity "
                                    f'under "2. `contiguous_capacity(pool_blocks, max_len, block_size)`" (cell {cell}) '
                                    "raised SyntaxError: "), ex["message"]
    assert ex["message"].endswith("(line 2)"), ex["message"]
    assert ".py" not in ex["message"] and "run the cell" not in ex["message"]
    assert any(c["cell"] == cell and "contiguous_capacity" in c["defines"] for c in nb["cells"])


@pytest.mark.slow
def test_code_that_raises_fails_with_the_error_and_its_line(graded):
    nb = _variant(graded, "mixed")
    ex = _exercise(nb, "contiguous_capacity")
    assert ex["score"] == 0
    assert "contiguous_capacity(128, 512, 16) raised ZeroDivisionError" in ex["message"]
    assert "(in contiguous_capacity, line 2: return pool_blocks // 0)" in ex["message"], ex["message"]
    assert _exercise(nb, "blocks_needed")["status"] == "passed"


@pytest.mark.slow
def test_garbage_output_and_return_value_fail_cleanly(graded):
    nb = _variant(graded, "mixed")
    assert nb["status"] == "graded"
    ex = _exercise(nb, "waste_percent")
    assert ex["score"] == 0 and "a Weird cannot be sent between the grader and your code's process" in ex["message"]
    assert _exercise(nb, "blocks_needed")["status"] == "passed"


@pytest.mark.slow
def test_a_cell_that_ends_the_process_is_left_out_and_the_rest_graded(graded):
    nb = _variant(graded, "kernel_exits")
    assert nb["status"] == "graded" and nb["score"] == nb["possible"] == 12, nb
    cell = _cell_number(graded["variants"]["kernel_exits"], "import os\nos._exit(3)")
    assert [c["cell"] for c in nb["cells"]] == [cell]
    assert "exited with status 3" in nb["cells"][0]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["not_json", "json_list", "binary"])
def test_files_that_are_not_notebooks_are_failures_not_crashes(graded, name):
    nb = _variant(graded, name)
    assert nb["status"] == "error" and nb["score"] == 0 and nb["possible"] == 12
    assert "not a notebook" in nb["message"] or "not a readable notebook" in nb["message"], nb["message"]
    assert "Error:" not in nb["message"] and "Traceback" not in nb["message"]


# --------------------------------------------------------------------------------------------- issue 9 §3, §4
@pytest.mark.slow
def test_attacks_leave_the_score_where_the_untouched_copy_is(graded):
    untouched = _notebook(graded["main"]["report"], ROOT / "exercises" / f"{FRAG}.ipynb")
    attacked = _variant(graded, "attacks")
    assert attacked["status"] == "graded", attacked["message"]
    assert attacked["score"] == untouched["score"] == 0
    assert [e["score"] for e in attacked["exercises"]] == [e["score"] for e in untouched["exercises"]]
    assert "not available while grading" in _exercise(attacked, "blocks_needed")["message"]
    reads = _exercise(attacked, "contiguous_capacity")["message"]
    assert "raised FileNotFoundError" in reads or "raised PermissionError" in reads, reads


@pytest.mark.slow
def test_attacks_leave_the_repository_unchanged(graded):
    before, after = graded["porcelain"]
    assert before == after, f"the attacks changed the repository:\n{before}\n->\n{after}"
    assert not (ROOT / "pwned-by-a-learner.txt").exists()
    assert b"pwned" != (ROOT / "grading" / "autograder" / f"{FRAG}.zip").read_bytes()


@pytest.mark.slow
def test_processes_started_by_the_learner_do_not_outlive_grading(graded):
    assert graded["sleepers"] == [], graded["sleepers"]


@pytest.mark.slow
def test_the_sandbox_refuses_6_gb_hides_the_repository_and_the_reference(graded):
    attacked = _variant(graded, "attacks")
    obs = [c["error"] for c in attacked["cells"] if "OBS " in c["error"]]
    assert len(obs) == 1, attacked["cells"]
    seen = json.loads(obs[0].split("OBS ", 1)[1].rsplit(" (line", 1)[0])
    assert seen["alloc6g"] == "MemoryError", seen
    assert seen["ref"] == "stub", seen  # the first exercise's sandbox: blocks_needed is a stub there
    assert seen["root"] is False and seen["repo"] == "FileNotFoundError", seen  # not in the sandbox's filesystem


@pytest.mark.slow
def test_each_misbehaving_function_fails_alone_with_what_happened(graded):
    nb = _variant(graded, "misbehaving")
    assert nb["status"] == "graded", nb["message"]
    assert "raised SystemExit" in _exercise(nb, "blocks_needed")["message"]
    assert "raised KeyboardInterrupt" in _exercise(nb, "contiguous_capacity")["message"]
    ex = _exercise(nb, "paged_admission")  # correct, however it treats the timers
    assert ex["status"] == "passed", ex["message"]
    loops = _exercise(nb, "waste_percent")
    assert loops["score"] == 0 and "did not return within" in loops["message"], loops["message"]
    assert "EOFError" not in json.dumps(nb)


@pytest.mark.slow
def test_slow_but_correct_function_fails_alone_saying_how_slow(graded):
    nb = _variant(graded, "slow")
    ex = _exercise(nb, "waste_percent")
    assert ex["score"] < ex["possible"]  # the public case's 11 calls fit the budget; the hidden case's do not
    # Which limit fires first depends on how busy the machine is (the CPU budget, or on a machine far too busy the
    # wall-clock bound of 5x it); the verdict and a message that names the limit that fired do not.
    m = re.search(r"too slow: this test case's calls of your code used ([\d.]+) s of CPU time \(and waited ([\d.]+) s "
                  r"in all\), past the limit of (?:10 s of CPU time|50 s of waiting) for one test case(?: \(the limit "
                  r"of 10 s of CPU time not reached yet\))? \((\d+) calls? of your code, ([\d.]+) (m?s) per call "
                  r"on average, the slowest ([\d.]+) s\)", ex["message"])
    assert m, ex["message"]
    assert float(m.group(1)) >= 10 or float(m.group(2)) >= 50, ex["message"]
    assert int(m.group(3)) >= 1 and float(m.group(6)) >= 0.2
    assert all("too slow" not in e["message"] for e in nb["exercises"] if e["name"] != "waste_percent")


@pytest.mark.slow
def test_notebook_still_running_at_its_timeout_fails_every_exercise(tmp_path):
    nb = make_variant(tmp_path / "sleeps", GOOD, ["import time\ntime.sleep(600)"])
    proc = subprocess.run(_pagedkv("grade", str(nb), "--timeout", "8", "--cell-timeout", "900", "--json",
                                   str(tmp_path / "r.json"), "--no-progress"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())["notebooks"][0]
    assert report["status"] == "timeout" and report["score"] == 0 and report["possible"] == 12
    assert all(ex["status"] == "failed" and "timed out" in ex["message"] for ex in report["exercises"])


@pytest.mark.slow
def test_class_csv_has_a_row_per_learner_and_exercise(graded):
    rows = graded["csv"]
    assert rows is not None and list(rows[0]) == classroom.CSV_COLUMNS
    assert sorted({r["learner"] for r in rows}) == ["alice", "bob", "mallory"]
    assert len(rows) == 12 and {r["set"] for r in rows} == {FRAG}
    assert all(r["points"] == r["max"] for r in rows if r["learner"] == "alice")
    bob = {r["exercise"]: r for r in rows if r["learner"] == "bob"}
    assert bob["paged_admission"]["points"] == bob["paged_admission"]["max"] == "5"
    assert "SystemExit" in bob["blocks_needed"]["first failure"]
    assert "bob" in graded["class"]["stdout"] and "mallory" in graded["class"]["stdout"]


def test_grade_without_an_autograder_says_so(tmp_path):
    nb = tmp_path / "99_unknown.ipynb"
    nb.write_text("{}")
    proc = subprocess.run(_pagedkv("grade", str(nb), str(tmp_path / "missing")), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no autograder zip" in proc.stderr and "no such file or folder" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_grade_says_when_a_notebook_is_left_out_of_progress_or_of_a_class_layout(tmp_path):
    """A notebook graded outside exercises/ is not counted by the course index's progress table, and a class
    folder's file that fits neither layout is listed as a learner of its own: both said so only in the docs."""
    copy = tmp_path / "mine" / f"{FRAG}.ipynb"
    copy.parent.mkdir()
    shutil.copy(ROOT / "exercises" / f"{FRAG}.ipynb", copy)
    proc = subprocess.run(_pagedkv("grade", str(copy)), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "not in exercises/, so the course index's progress table leaves it out" in proc.stderr, proc.stderr
    assert "graded mine/01_fragmentation.ipynb: 0/12" in proc.stderr  # relative, as the table shows it
    klass = tmp_path / "class"
    klass.mkdir()
    shutil.copy(ROOT / "exercises" / f"{FRAG}.ipynb", klass / f"{FRAG}_alice.ipynb")
    proc = subprocess.run(_pagedkv("grade", "--class", str(klass), "--csv", str(tmp_path / "c.csv")),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"./{FRAG}_alice.ipynb fit neither layout of a class folder" in proc.stderr, proc.stderr
    assert "progress table" not in proc.stderr


# --------------------------------------------------------------------------------------------- build
@pytest.mark.slow
def test_build_check_passes_on_committed_files():
    proc = subprocess.run(_pagedkv("build-exercises", "--check"), capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
def test_build_check_fails_when_a_generated_file_is_stale(tmp_path):
    for rel in ("grading/source", "grading/autograder", "exercises", "solutions"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    source = tmp_path / "grading" / "source" / f"{FRAG}.ipynb"
    nb = json.loads(source.read_text())
    md = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    md["source"] = "".join(md["source"]) + "\n\nAn edit to the source that nobody rebuilt."
    source.write_text(json.dumps(nb, indent=1))
    proc = subprocess.run(_pagedkv("build-exercises", "--check", "--root", str(tmp_path), FRAG),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"exercises/{FRAG}.ipynb" in proc.stdout and "./lab exercises" in proc.stdout
    # building fixes it, and the check then passes: the build is reproducible
    assert subprocess.run(_pagedkv("build-exercises", "--root", str(tmp_path), FRAG), capture_output=True,
                          timeout=300).returncode == 0
    again = subprocess.run(_pagedkv("build-exercises", "--check", "--root", str(tmp_path), FRAG),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout


@pytest.mark.slow
def test_build_check_names_a_notebook_with_answers_as_such(tmp_path):
    """``--check`` on a learner's notebook with answers in it said "stale; run ./lab exercises", and that command
    then refused to write: it says the notebook has changes of its own, as the rebuild does."""
    from pagedkv.grading.build import build_all

    for rel in ("grading/source", "grading/autograder", "exercises", "solutions"):
        shutil.copytree(ROOT / rel, tmp_path / rel)
    make_variant(tmp_path / "exercises", GOOD, [])  # exercises/01_fragmentation.ipynb, answered
    lines: list[str] = []
    assert build_all(tmp_path, [FRAG], check=True, echo=lines.append) == 1
    text = "\n".join(lines)
    assert "changes of their own" in text and f"exercises/{FRAG}.ipynb" in text, text
    assert "stale" not in text, text


def test_generated_exercises_are_clean():
    """Committed learner notebooks carry no outputs; every set has its three generated files."""
    for name in SETS:
        for rel in (f"exercises/{name}.ipynb", f"solutions/{name}.ipynb", f"grading/autograder/{name}.zip"):
            assert (ROOT / rel).is_file(), f"{rel} is missing: run ./lab exercises"
        for folder in ("exercises", "solutions"):
            nb = json.loads((ROOT / folder / f"{name}.ipynb").read_text())
            for cell in nb["cells"]:
                if cell["cell_type"] == "code":
                    assert cell["outputs"] == [] and cell["execution_count"] is None, f"{folder}/{name}"
        learner = json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())
        assert any("grader.check(" in "".join(c["source"]) for c in learner["cells"]), f"{name}: no check cells"
        assert not any("# BEGIN SOLUTION" in "".join(c["source"]) for c in learner["cells"])


# --------------------------------------------------------------------------------------------- the checks helpers
def test_expect_equal_names_the_call_and_both_values():
    with pytest.raises(AssertionError, match=r"^f\(40, 16\) returned 2, expected 3\. Hint: round up\.$"):
        checks.expect_equal(lambda n, b: n // b, (40, 16), 3, name="f", hint="round up")
    with pytest.raises(AssertionError, match=r"returned None, expected 3\. Is the function still the stub"):
        checks.expect_equal(lambda n, b: None, (40, 16), 3, name="f")
    with pytest.raises(AssertionError, match=r"returned 3\.0, expected 3 \(expected an int, got float\)"):
        checks.expect_equal(lambda n, b: 3.0, (40, 16), 3, name="f")
    # the right value as a float: the hint says so, not the set's hint for a wrong value
    with pytest.raises(AssertionError, match=r"\(expected an int, got float\)\. Hint: the right value, but a float"):
        checks.expect_equal(lambda n, b: 3.0, (40, 16), 3, name="f", hint="one too many")
    assert checks.expect_equal(lambda: [1, 2], (), [1, 2]) == [1, 2]
    checks.expect_close(lambda: 1 / 3, (), 0.333333333)


def test_run_turns_a_hang_into_a_failure_even_through_except_exception():
    def spin():
        while True:
            try:
                pass
            except Exception:
                pass

    with pytest.raises(AssertionError, match=r"spin\(\) did not return within 0\.3 s: is there an infinite loop\?"):
        checks.run(spin, timeout=0.3)


def test_run_reports_the_exception_and_the_line():
    def broken(x):
        return x // 0

    with pytest.raises(AssertionError, match=r"broken\(1\) raised ZeroDivisionError: .* \(in broken, line \d+: "
                                             r"return x // 0\)"):
        checks.run(broken, (1,))

    def shapes(x):
        return torch.einsum("ij,jk->ik", x, x[:2])  # fails inside torch: the learner's line is reported

    import torch

    with pytest.raises(AssertionError, match=r"\(in shapes, line \d+: return torch.einsum"):
        checks.run(shapes, (torch.zeros(3, 4),))
    info = plain.exception_info(pytest.raises(RuntimeError, shapes, torch.zeros(3, 4)).value)
    assert info["where"]["name"] == "shapes" and "einsum" in info["where"]["text"]


def test_expect_raises_and_require_function():
    checks.expect_raises(ValueError, int, ("x",))
    with pytest.raises(AssertionError, match=r"returned 3, expected it to raise ValueError \(a string\)"):
        checks.expect_raises(ValueError, lambda s: 3, ("x",), why="a string")
    with pytest.raises(AssertionError, match="is not defined"):
        checks.require_function(None, "f")
    with pytest.raises(AssertionError, match="should be a function"):
        checks.require_function(3, "f")
    from pagedkv.fragmentation import blocks_needed

    with pytest.raises(AssertionError, match="library's reference"):
        checks.require_function(blocks_needed, "blocks_needed")


def test_describe_names_functions_without_addresses():
    from pagedkv.kv_cache_utils import builtin_hash

    class Pool:
        def free(self):
            pass

    def local():
        pass

    assert checks.describe(builtin_hash) == "builtin_hash"
    assert checks.describe(len) == "len"
    assert checks.describe(Pool().free) == "Pool.free"
    assert checks.describe(local) == "local"
    assert checks.format_call("hash_chain", ([1, 2], 16, builtin_hash)) == "hash_chain([1, 2], 16, builtin_hash)"
    assert re.fullmatch(r"\[<[\w.<>]*Pool object>\]", checks.describe([Pool()]))  # no "at 0x7f..."
    assert checks.describe("at 0x1f>") == "'at 0x1f>'"


def test_describe_shortens_long_values():
    text = checks.describe(list(range(1000)), 60)
    assert text.startswith("[0, 1, 2") and text.endswith("998, 999] (1000 items)") and len(text) < 90

    class NoRepr:
        def __repr__(self):
            raise RuntimeError

    assert "repr raised" in checks.describe(NoRepr())


@pytest.mark.skipif(os.name != "posix", reason="the per-call time limit uses SIGALRM")
def test_time_limit_restores_the_previous_handler():
    import signal

    before = signal.getsignal(signal.SIGALRM)
    timer = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's, where it runs: left running, not cancelled
    with checks.time_limit(1.0):
        pass
    assert signal.getsignal(signal.SIGALRM) == before
    after = signal.getitimer(signal.ITIMER_REAL)
    assert (after[0] > 0) == (timer[0] > 0) and after[0] <= timer[0] and after[1] == timer[1]


@pytest.mark.skipif(os.name != "posix", reason="the per-call time limit uses SIGALRM")
def test_a_loop_of_short_limited_calls_cannot_outlive_the_limit_around_it(monkeypatch):
    """A scenario bounds each learner call and the whole scenario; the inner limits re-arm the outer one's timer
    when they end, so without care a loop of short calls would never let the outer one fire. Driven by a
    stand-in clock that advances a tick per call: no assertion here depends on how fast the machine is."""
    ticks = [0.0]

    def clock() -> float:
        return ticks[0]

    monkeypatch.setattr(checks, "cpu_clock", clock)
    calls = 0
    with pytest.raises(checks.CallTimeout, match="the scenario did not finish within 3 s"):
        with checks.time_limit(3, "the scenario"):
            while calls < 1000:
                with checks.time_limit(5, "one call"):
                    calls += 1
                    ticks[0] += 0.5
    assert calls == 6


@pytest.mark.skipif(os.name != "posix", reason="the per-call time limit uses SIGALRM")
def test_time_limit_counts_cpu_seconds_under_grading(monkeypatch):
    """Under ``pagedkv grade`` a check's ``timeout=2`` counts CPU seconds (the worker's clock), so a busy machine
    fails no correct call; code that sleeps is stopped at WALL_FACTOR times the limit. Driven by a stand-in
    clock: no assertion here depends on how fast the machine is."""
    import signal

    cpu = [0.0]
    timer = signal.getitimer(signal.ITIMER_REAL)
    monkeypatch.setattr(checks, "cpu_clock", lambda: cpu[0])
    with checks.time_limit(100.0):  # no CPU used: waiting (here, sleeping) is not what the limit counts
        time.sleep(0.35)
    with pytest.raises(checks.CallTimeout, match="did not finish within 100 s"):
        with checks.time_limit(100.0, "f(1)"):
            for _ in range(2000):  # the clock passes the limit: interrupted at the next look, 0.1 s later
                cpu[0] += 1.0
                time.sleep(0.01)
    cpu[0] = 0.0
    with pytest.raises(checks.CallTimeout):  # an inner limit leaves the outer one running
        with checks.time_limit(100.0):
            with checks.time_limit(50.0):
                pass
            for _ in range(2000):
                cpu[0] += 1.0
                time.sleep(0.01)
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer[0] > 0)


# --------------------------------------------------------------------------------------------- grader internals
def test_autograder_zip_lists_questions_in_notebook_order():
    import nbformat

    for name in SETS:
        order = question_order(nbformat.read(ROOT / "grading" / "source" / f"{name}.ipynb", as_version=4))
        expected = grade._expected_questions(ROOT / "grading" / "autograder" / f"{name}.zip")
        assert [q for q, _ in expected] == order, name




def test_worker_finds_cells_names_and_sections(tmp_path):
    assert worker.defined_names("def f(x):\n    return x +\nclass A:\n    y = 1\nN: int = 3\nM == 2\n") == \
        ["A", "N", "f"]
    nb = tmp_path / "a.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": ["## 2. `f(x)` (3 points)\n", "text"]},
                                        {"cell_type": "code", "metadata": {}, "source": "x = 1"}],
                              "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert worker.notebook_cells(nb) == [(2, "x = 1", "2. `f(x)`")]
    # the in-notebook checks are left out of the graded run, whatever the file's name
    src = 'from pagedkv.grading.notebook import Checks\n\ngrader = Checks("01_fragmentation")\nx = 1\n'
    assert worker.without_checks(src).splitlines()[-1] == "x = 1" and "Checks" not in worker.without_checks(src)
    assert worker.without_checks('grader.check("f")').strip() == "pass"
    assert worker.without_checks("def f(:\n") == "def f(:\n"


@pytest.mark.parametrize("data, why", [(b"[1, 2]", "not a notebook"), (bytes(range(256)), "not a readable notebook"),
                                       (b'{"cells": [3]}', "not a notebook")])
def test_worker_refuses_files_that_are_not_notebooks(tmp_path, data, why):
    nb = tmp_path / "x.ipynb"
    nb.write_bytes(data)
    with pytest.raises(worker.NotANotebook, match=why):
        worker.notebook_cells(nb)


def test_grade_explains_undefined_names_by_the_cell_that_failed():
    cells = [{"cell": 5, "section": "1. `f`", "first_line": "def f(x):", "defines": ["f"], "timed_out": False,
              "seconds": 60.0, "error": "SyntaxError: invalid syntax (line 3)"},
             {"cell": 9, "section": "", "first_line": "while True:", "defines": ["g"], "timed_out": True,
              "seconds": 60.0, "error": "KeyboardInterrupt"}]
    explain = grade._explain_undefined
    assert explain("f is not defined: run the cell that defines it (and the cells above it) first", cells) == \
        'f is not defined: the cell defining f under "1. `f`" (cell 5) raised SyntaxError: invalid syntax (line 3)'
    assert explain("g is not defined: run the cell", cells).endswith("(cell 9) was interrupted after 60 s (an "
                                                                     "infinite loop?)")
    assert explain("h is not defined: run the cell", cells) == "h is not defined: run the cell"
    assert grade._interrupted_note(cells) == ("the cell that starts `while True:` (cell 9) was interrupted after 60 s "
                                              "(an infinite loop?); the cells after it still ran")
    assert grade._clean_message("❌ Error at line 26 in test blocks_needed:\nAssertionError: f(1) returned 2") == \
        "f(1) returned 2"


def test_plain_data_round_trips_without_pickle():
    import numpy as np
    import torch

    from pagedkv.kv_cache_utils import builtin_hash
    from pagedkv.request import RequestStatus

    values = [None, True, 3, -2**70, 1.5, float("inf"), "x", b"\x00\xff", [1, (2, 3)], {(1, 2): {"a": {3}}},
              frozenset({1}), (), torch.float16, RequestStatus.WAITING]
    for v in values:
        got = plain.decode(json.loads(json.dumps(plain.encode(v))))
        assert got == v and type(got) is type(v), (v, got)
    assert plain.decode(plain.encode(np.int64(7))) == 7
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1::2]  # a strided view crosses as its values
    back = plain.decode(json.loads(json.dumps(plain.encode(t))))
    assert back.tolist() == t.tolist() and back.is_contiguous() and back.dtype == torch.float32
    for scalar in (torch.tensor(3), torch.tensor(2.5, dtype=torch.bfloat16), torch.tensor(True)):  # 0-d tensors
        back = plain.decode(json.loads(json.dumps(plain.encode(scalar))))
        assert back.shape == () and back.dtype == scalar.dtype and back.item() == scalar.item()
    for bad in (lambda: 1, object(), np.arange(3), torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="cannot be sent"):
            plain.encode(bad)

    # A subclass of a plain type crosses as its plain value, read with the base type's own methods; a range as a
    # range (what a check in the notebook would have compared).
    import collections
    import enum

    class Sneaky(dict):
        def items(self):
            return [("forged", 1)]

    class Colour(enum.IntEnum):
        RED = 1

    point = collections.namedtuple("point", "x y")
    for v, want in ((collections.OrderedDict(a=1), {"a": 1}), (collections.defaultdict(list, b=[2]), {"b": [2]}),
                    (point(1, 2), (1, 2)), (Colour.RED, 1), (Sneaky(real=2), {"real": 2}),
                    (range(1, 9, 3), range(1, 9, 3))):
        got = plain.decode(json.loads(json.dumps(plain.encode(v))))
        assert got == want and type(got) is type(want), (v, got)
    with pytest.raises(plain.ProtocolError):
        plain.decode({"$range": [0, 5, 0]})

    class Liar:  # an object that says yes to every comparison never reaches a check
        def __eq__(self, other):
            return True

    with pytest.raises(TypeError, match="cannot be sent"):
        plain.encode([Liar()])
    # A library function reaches the sandbox by name; one the sandbox sends back arrives as its name only, so no
    # check can be made to run the library's answer on the learner's behalf.
    sent = plain.encode(builtin_hash)
    assert sent == {"$lib": "pagedkv.kv_cache_utils:builtin_hash"}
    assert plain.decode(sent, lambda name: None) is builtin_hash
    came_back = plain.decode(sent)
    assert isinstance(came_back, plain.LibraryName) and not callable(came_back)
    for forged in ({"$learner": "f"}, {"$m": 1}, {"$h": 1}, {"x": 1}, {"$lib": "os:system"}):
        with pytest.raises(plain.ProtocolError):
            plain.decode(forged)


def test_a_scenario_runs_where_the_learners_code_runs_and_returns_plain_data():
    from pagedkv.grading.lessons import l01_fragmentation as l01

    def mine(n, b):
        return -(-n // b)

    with pytest.raises(TypeError, match="module-level function of a pagedkv.grading.lessons module"):
        checks.drive(mine, 3)
    assert l01 is not None


def test_exceptions_cross_with_their_type_and_the_learners_line():
    exc = plain.rebuild_exception({"type": "ValueError", "bases": ["ValueError", "Exception", "BaseException"],
                             "message": "bad", "where": {"name": "f", "line": 3, "text": "raise ValueError('bad')"}})
    assert type(exc) is ValueError and str(exc) == "bad"
    with pytest.raises(AssertionError, match=r"raised ValueError: bad \(in f, line 3: raise ValueError\('bad'\)\)"):
        checks.run(lambda: (_ for _ in ()).throw(exc), name="g")
    exit_ = plain.rebuild_exception({"type": "SystemExit", "bases": ["SystemExit", "BaseException"], "message": "3"})
    assert isinstance(exit_, Exception) and type(exit_).__name__ == "SystemExit"
    odd = plain.rebuild_exception({"type": "PoolError", "bases": ["KeyError", "LookupError", "Exception"],
                                   "message": "x"})
    assert isinstance(odd, KeyError) and type(odd).__name__ == "PoolError"


def test_a_key_error_crosses_with_one_pair_of_quotes():
    def crossed(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as raised:  # noqa: BLE001 - as the sandbox catches it
            return plain.rebuild_exception(json.loads(json.dumps(plain.exception_info(raised))))

    key = crossed(KeyError("head_dim"))
    assert type(key) is KeyError and str(key) == str(KeyError("head_dim")) == "'head_dim'"
    with pytest.raises(AssertionError, match=r"raised KeyError: 'head_dim' \(in "):
        checks.run(lambda: (_ for _ in ()).throw(key), name="kv_page_bytes")
    assert str(crossed(KeyError(3))) == "'3'" and plain.exception_info(KeyError("a", "b"))["message"] == "('a', 'b')"

    class Missing(KeyError):
        def __str__(self) -> str:
            return "no such block"

    assert plain.exception_info(Missing("x"))["message"] == "no such block"  # its own message, as it is


def test_sandbox_stubs_the_reference_in_its_copy(tmp_path):
    from pagedkv.grading import sandbox

    missing = sandbox.copy_library(tmp_path, ["pagedkv.fragmentation.blocks_needed",
                                              "pagedkv.block_pool.BlockPool.get_new_blocks", "pagedkv.nope.x"])
    assert missing == ["pagedkv.nope.x"]
    text = (tmp_path / "pagedkv" / "fragmentation.py").read_text()
    assert "is not available while grading" in text and "-(-" not in text.split("def blocks_needed")[1][:400]
    assert not list(tmp_path.rglob("__pycache__"))
    pool = (tmp_path / "pagedkv" / "block_pool.py").read_text()
    assert "def get_new_blocks" in pool and "not available while grading" in pool


def test_every_exercise_hides_its_lessons_checks():
    """A check that computes its expected values inline would hand them to a learner's function that runs it with
    recording stand-ins for expect_equal (set 01 scored 2/2 that way): every check of the set's lesson module is
    hidden in the sandbox of every exercise of the set."""
    checks = {f"pagedkv.grading.lessons.l04_scheduling.{n}" for n in (
        "grade_hook", "grade_select_victim", "check_hook", "check_select_victim_cases", "example_scenarios",
        "public_scenarios", "example_victim_cases", "random_victim_cases")}
    for q in worker.load_tests(ROOT / "grading" / "autograder" / "04_scheduling.zip"):
        assert checks <= set(q.reference), (q.name, checks - set(q.reference))


@pytest.mark.slow
def test_the_engines_cache_write_is_hidden_with_the_attention_answer(tmp_path):
    """Set 07: writing the cache is half of ``paged_attention``; the engine's own ``write_kv_torch`` is hidden
    with it (attending through ``ref_paged_prefill_attention`` is what the exercise suggests)."""
    scores = grade_variant(tmp_path, "07_serving_engine", {"paged_attention": (
        "def paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):\n"
        "    from pagedkv.attention import ref_paged_prefill_attention\n"
        "    from pagedkv.engine.attention import write_kv_torch\n"
        "    meta = kwargs['pagedkv_metadata']\n"
        "    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))\n"
        "    kc, vc = meta.kv_caches[module.layer_idx]\n"
        "    write_kv_torch(k, v, kc, vc, meta.slot_mapping)\n"
        "    out = ref_paged_prefill_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc,\n"
        "                                      scaling)\n"
        "    return out[None], None\n")})
    assert scores["paged_attention"] == 0, scores


# --------------------------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("args, message", [
    (["--timeout", "-5"], "--timeout must be a positive number"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--cell-timeout", "0"], "--cell-timeout must be a positive number"),
    (["--json", "/nonexistent/dir/x.json"], "does not exist"),
    (["--csv", "x.csv"], "--csv goes with --class"),
    (["--class", "/nonexistent/class"], "no such folder"),
])
def test_grade_refuses_bad_options_before_grading(tmp_path, args, message):
    proc = subprocess.run(_pagedkv("grade", str(ROOT / "exercises" / f"{FRAG}.ipynb"), *args), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "graded " not in proc.stderr  # refused before any notebook was graded


@pytest.mark.parametrize("only", ["blocks_needed,nope", "", "Blocks_Needed"])
def test_grade_only_refuses_an_unknown_exercise_before_grading(tmp_path, only):
    """``--only`` with a name the set does not have: exit 2 naming the set's exercises, nothing graded, no report."""
    report = tmp_path / "r.json"
    proc = subprocess.run(_pagedkv("grade", str(ROOT / "exercises" / f"{FRAG}.ipynb"), "--only", only, "--json",
                                   str(report)), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "graded " not in proc.stderr and not report.exists()
    if only:
        assert f"set {FRAG} has no exercise '{only.split(',')[-1]}'" in proc.stderr, proc.stderr
        assert "its exercises: blocks_needed, contiguous_capacity, paged_admission, waste_percent" in proc.stderr
    else:
        assert "--only needs exercise names" in proc.stderr


def test_worker_grades_only_the_named_exercises(monkeypatch):
    """The worker leaves the other exercises' checks out: their sandboxes (each a whole run of the notebook) never
    start. A name the set does not have is an error, not a grade."""
    asked = []
    monkeypatch.setattr(worker.Grader, "grade_question", lambda self, q: asked.append(q.name) or
                        {"name": q.name, "score": 0.0, "possible": 1.0, "cases": []})
    zip_path = ROOT / "grading" / "autograder" / f"{FRAG}.zip"
    nb = ROOT / "exercises" / f"{FRAG}.ipynb"
    out = worker.grade(nb, zip_path, worker.DEFAULT_LIMITS, only=["waste_percent", "blocks_needed"])
    assert out["ok"] and asked == ["blocks_needed", "waste_percent"], (out, asked)  # in notebook order
    wrong = worker.grade(nb, zip_path, worker.DEFAULT_LIMITS, only=["blocks_needed", "nope"])
    assert not wrong["ok"] and "no exercise nope" in wrong["error"] and asked == ["blocks_needed", "waste_percent"]


@pytest.mark.slow
def test_grade_only_scores_the_named_exercises_as_a_full_grade_does(graded, tmp_path):
    """``--only``: the named exercises alone in the report, scored exactly as the whole notebook's grade scored
    them (a partial one, a passed one), the totals theirs only."""
    nb = make_variant(tmp_path / "mixed", *VARIANTS["mixed"])
    proc = subprocess.run(_pagedkv("grade", str(nb), "--only", "paged_admission", "--only", "blocks_needed",
                                   "--json", str(tmp_path / "r.json"), "--no-progress"),
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    [only] = json.loads((tmp_path / "r.json").read_text())["notebooks"]
    full = {ex["name"]: ex for ex in _variant(graded, "mixed")["exercises"]}
    assert [ex["name"] for ex in only["exercises"]] == ["blocks_needed", "paged_admission"]  # notebook order
    assert only["exercises"] == [full["blocks_needed"], full["paged_admission"]]
    assert only["exercises"][1]["status"] == "partial"
    assert (only["score"], only["possible"]) == (sum(ex["score"] for ex in only["exercises"]),
                                                 sum(ex["possible"] for ex in only["exercises"]))
    assert "contiguous_capacity" not in proc.stdout and "waste_percent" not in proc.stdout


def test_class_rows_list_missing_sets_and_learners():
    def result(path, set_name, scores):
        exercises = [grade.ExerciseResult(n, s, 2.0, "passed" if s == 2 else "failed", "" if s == 2 else "why")
                     for n, s in scores]
        return grade.NotebookResult(path, f"grading/autograder/{set_name}.zip", "graded", sum(s for _, s in scores),
                                    2.0 * len(scores), 1.0, "", exercises)

    results = [result("c/alice/01_fragmentation.ipynb", FRAG, [("a", 2.0), ("b", 0.0)]),
               result("c/02_block_pool-bob.ipynb", "02_block_pool", [("q", 2.0)]),
               result("c/alice/02_block_pool.ipynb", "02_block_pool", [("q", 0.0)])]
    rows = classroom.class_rows(results, "c")
    assert [(r["learner"], r["set"], r["exercise"], r["points"], r["status"]) for r in rows] == [
        ("alice", FRAG, "a", 2.0, "passed"), ("alice", FRAG, "b", 0.0, "failed"),
        ("alice", "02_block_pool", "q", 0.0, "failed"),
        ("bob", FRAG, "a", 0.0, "not submitted"), ("bob", FRAG, "b", 0.0, "not submitted"),
        ("bob", "02_block_pool", "q", 2.0, "passed")]
    assert "alice" in classroom.learner_totals(rows) and "2 / 6" in classroom.learner_totals(rows)


def test_progress_is_recorded_per_set_and_shown(tmp_path):
    (tmp_path / "grading" / "source").mkdir(parents=True)
    for name in (FRAG, "02_block_pool"):
        (tmp_path / "grading" / "source" / f"{name}.ipynb").write_text("{}")
    mine = grade.NotebookResult(str(tmp_path / "exercises" / f"{FRAG}.ipynb"), f"x/{FRAG}.zip", "graded", 5.0, 12.0,
                                1.0, "", [grade.ExerciseResult("blocks_needed", 3.0, 3.0, "passed", ""),
                                          grade.ExerciseResult("waste_percent", 2.0, 9.0, "partial", "why")])
    theirs = grade.NotebookResult(str(tmp_path / "solutions" / "02_block_pool.ipynb"), "x/02_block_pool.zip",
                                  "graded", 9.0, 9.0, 1.0, "", [])
    path = progress.record_progress([mine, theirs], root=tmp_path)
    assert path == tmp_path / ".pagedkv" / "progress.json"
    data = json.loads(path.read_text())
    assert list(data["sets"]) == [FRAG] and data["sets"][FRAG]["score"] == 5.0  # solutions/ is not progress
    table = progress.progress_table(tmp_path)
    text = str(table)
    assert re.search(rf"{FRAG}\s+5/12\s+1 of 2", text) and re.search(r"02_block_pool\s+-\s+not graded yet", text)
    assert "1 of 2 sets graded" in text


def test_grade_notebook_here_finds_the_notebook(tmp_path, monkeypatch):
    nb = tmp_path / f"{FRAG}-copy.ipynb"
    nb.write_text("{}")
    monkeypatch.setenv("JPY_SESSION_NAME", str(nb))
    assert progress.find_this_notebook({}) == nb
    monkeypatch.delenv("JPY_SESSION_NAME")
    assert progress.find_this_notebook({"__session__": str(nb)}) == nb
    monkeypatch.chdir(tmp_path)
    assert progress.find_this_notebook({}) == nb  # the only NN_*.ipynb here


@pytest.mark.parametrize("name", SETS)
def test_every_set_ends_by_saying_how_to_grade_it(name):
    """issue 21: every exercise notebook ends with a "Done?" section giving the command that grades it."""
    nb = json.loads((ROOT / "grading" / "source" / f"{name}.ipynb").read_text())
    last = "".join(nb["cells"][-1]["source"])
    assert nb["cells"][-1]["cell_type"] == "markdown" and last.startswith("## Done?"), last[:80]
    assert f"./lab grade exercises/{name}.ipynb" in last


def _library_functions() -> dict[str, object]:
    """Every function and method the library defines (outside its grading, parity and server code), by dotted
    name."""
    import importlib
    import inspect
    import pkgutil

    import pagedkv

    out: dict[str, object] = {}
    for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        if info.name.startswith(("pagedkv.grading", "pagedkv.parity", "pagedkv.entrypoints")):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module that needs what this machine lacks (a GPU): not an answer here
            continue
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                out[f"{module.__name__}.{name}"] = obj
            elif inspect.isclass(obj):
                out.update({f"{module.__name__}.{name}.{m}": f for m, f in vars(obj).items() if inspect.isfunction(f)})
    return out


def test_every_library_function_shaped_like_an_answer_is_hidden():
    """The set's ``reference:`` list is the only declaration of what is hidden while an exercise is graded: a
    walk over the library finds every function named like an exercise's answer, or taking the same parameters,
    and each must be in that exercise's list (so it is a stub in the sandbox)."""
    import inspect

    library = _library_functions()
    assert len(library) > 300
    missing = []
    for name in SETS:
        nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
        stubs = {}
        for cell in nb["cells"]:
            if "otter_answer_cell" in cell["metadata"].get("tags", []):
                for m in re.finditer(r"^def (\w+)\(([^)]*)\)", "".join(cell["source"]), re.M):
                    stubs[m.group(1)] = [p.split(":")[0].split("=")[0].strip() for p in m.group(2).split(",")
                                         if p.strip() and not p.strip().startswith("*") and p.strip() != "self"]
        for q in worker.load_tests(ROOT / "grading" / "autograder" / f"{name}.zip"):
            for param in {p for c in q.cases for p in inspect.signature(c.func).parameters} & set(stubs):
                for dotted, fn in library.items():
                    try:
                        same = [p for p in inspect.signature(fn).parameters if p != "self"] == stubs[param]
                    except (TypeError, ValueError):
                        same = False
                    if (dotted.rsplit(".", 1)[1] == param or (same and len(stubs[param]) >= 2)) \
                            and dotted not in q.reference:
                        missing.append(f"{name} {q.name}: {dotted}")
    assert not missing, missing
