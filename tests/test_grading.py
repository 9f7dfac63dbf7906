"""The graded-exercise pipeline: build (otter assign), grade (otter run), and the checks' messages.

Grading is slow (about 5 s of CPU per notebook: a kernel, otter's imports), so the module grades everything
it needs in two ``pagedkv grade`` calls made once, side by side:

- every ``solutions/NN.ipynb`` and ``exercises/NN.ipynb`` of every set in ``grading/source/`` (by glob),
  plus set 01 answered wrongly in several ways (floor, FCFS for skip, a hard-coded answer, a function that
  loops, one that raises, an answer cell with a SyntaxError, a garbage return value, binary garbage printed,
  a kernel that exits, a file that is not a notebook), several mistakes per notebook where they do not
  interfere;
- with short time limits: cells that loop (a free cell and an answer cell: interrupted, named in the report,
  the rest still graded) and a notebook that cannot be interrupted (killed at the notebook timeout).

The tests then read the JSON report. Set 01's variants are made from the committed exercise notebook by
replacing its answer cells, so they follow the set as it evolves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedkv.grading import checks, grade, worker
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
LOOPING_CELL = "while True:\n    pass\n" + GOOD["waste_percent"]  # the answer cell loops before its def
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

# Each notebook costs a kernel and otter's imports (about 5 s of CPU), so one notebook carries several
# mistakes, one per exercise (the answers are independent: none calls another).
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    # name: (answers, extra code cells inserted after the set-up cells)
    "floor": (_with(blocks_needed=FLOOR), []),  # the one plausible mistake, alone: partial marks
    "mixed": (  # FCFS where skip was asked; a function that raises; a garbage result; cells that fail
        _with(paged_admission=FCFS_FOR_SKIP, contiguous_capacity=RAISES, waste_percent=GARBAGE),
        ["raise RuntimeError('a learner cell that fails')", GARBAGE_CELL],
    ),
    "loops_and_hardcoded": (_with(blocks_needed=LOOPS, paged_admission=HARDCODED, contiguous_capacity=SYNTAX_ERROR),
                            []),
    "kernel_exits": (GOOD, ["import os\nos._exit(3)"]),
}
QUICK_LIMITS = {  # graded in the second call, with short limits
    "loop_in_cell": (_with(waste_percent=LOOPING_CELL), ["while True:\n    pass"]),
    "uninterruptible": (GOOD, ["import time\nwhile True:\n    try:\n        time.sleep(60)\n    except BaseException:\n"
                               "        pass"]),
}


def make_variant(folder: Path, answers: dict[str, str], extra_cells: list[str]) -> Path:
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
    folder.mkdir(parents=True)
    path = folder / f"{FRAG}.ipynb"
    path.write_text(json.dumps(nb))
    return path


def _pagedkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", *args]


def _snapshot(paths: list[Path]) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Run both grade calls at once; return what each printed and reported."""
    tmp = tmp_path_factory.mktemp("graded")
    variants = {name: make_variant(tmp / name, a, x) for name, (a, x) in VARIANTS.items()}
    (tmp / "not_a_notebook").mkdir()
    (tmp / "not_a_notebook" / f"{FRAG}.ipynb").write_text("{ this is not json")
    variants["not_a_notebook"] = tmp / "not_a_notebook" / f"{FRAG}.ipynb"
    quick = {name: make_variant(tmp / name, a, x) for name, (a, x) in QUICK_LIMITS.items()}

    learner_files = [ROOT / "exercises" / f"{s}.ipynb" for s in SETS] + list(variants.values())
    before = _snapshot([p for p in learner_files if p.is_file()])
    main_paths = [str(ROOT / "solutions" / f"{s}.ipynb") for s in SETS]
    main_paths += [str(ROOT / "exercises" / f"{s}.ipynb") for s in SETS]
    main_paths += [str(p.parent) for p in variants.values()]

    start = time.monotonic()
    calls = {
        "main": (_pagedkv("grade", *main_paths, "--json", str(tmp / "main.json"), "-j", "2"), tmp / "main.json"),
        "quick": (_pagedkv("grade", *[str(p) for p in quick.values()], "--json", str(tmp / "quick.json"),
                           "--timeout", "60", "--cell-timeout", "5", "-j", "2"), tmp / "quick.json"),
    }
    procs = {k: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp)
             for k, (cmd, _) in calls.items()}
    out = {}
    for k, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        report = json.loads(calls[k][1].read_text()) if calls[k][1].is_file() else None
        out[k] = {"rc": proc.returncode, "stdout": stdout.decode(errors="replace"),
                  "stderr": stderr.decode(errors="replace"), "report": report}
    out["seconds"] = time.monotonic() - start
    out["before"] = before
    out["variants"] = {**variants, **quick}
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
    report = graded["quick" if name in QUICK_LIMITS else "main"]["report"]
    return _notebook(report, graded["variants"][name])


# --------------------------------------------------------------------------------------------- the grade calls
@pytest.mark.slow
def test_grade_calls_exit_zero_without_traceback(graded):
    for key in ("main", "quick"):
        call = graded[key]
        assert call["rc"] == 0, f"{key}: exit {call['rc']}\n{call['stderr'][-2000:]}"
        assert "Traceback" not in call["stdout"] + call["stderr"], call["stdout"][-3000:] + call["stderr"][-3000:]
        assert call["report"] is not None
    print(f"both grade calls took {graded['seconds']:.0f} s")


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
    # the demo cells after the stubs print a message instead of raising (only the checks' own probes fail, with
    # an AssertionError that says what is wrong); no cell loops
    for cell in nb["cells"]:
        assert cell["error"].startswith("AssertionError") and not cell["timed_out"], f"{name}: {cell}"


@pytest.mark.slow
def test_learner_files_are_not_modified(graded):
    for path, (data, mtime) in graded["before"].items():
        assert path.read_bytes() == data, f"{path} was modified by grading"
        assert path.stat().st_mtime_ns == mtime, f"{path} was rewritten by grading"


@pytest.mark.slow
def test_table_lists_every_exercise(graded):
    table = graded["main"]["stdout"]
    assert re.search(r"notebook\s+exercise\s+points\s+status\s+first failure", table)
    for ex in ("blocks_needed", "contiguous_capacity", "paged_admission", "waste_percent"):
        assert ex in table
    assert re.search(r"score: [\d.]+ / [\d.]+", table)


# --------------------------------------------------------------------------------------------- set 01, wrong answers
@pytest.mark.slow
def test_floor_instead_of_ceil_scores_partial_with_message(graded):
    nb = _variant(graded, "floor")
    assert 0 < nb["score"] < nb["possible"]
    ex = _exercise(nb, "blocks_needed")
    assert ex["score"] == 0
    assert "blocks_needed(40, 16) returned 2, expected 3" in ex["message"]
    assert "rounded down" in ex["message"]
    assert _exercise(nb, "paged_admission")["status"] == "passed"


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
    assert ex["score"] == 0
    assert "paged_admission([], 128, 16, 'fcfs') returned [0, 1, 2" in ex["message"]


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
    # the notebook's row names every interrupted cell
    assert f"cell {free} (`while True:`) was interrupted after 5 s (an infinite loop?)" in nb["message"]
    assert f"cell {answer} (`while True:`) was interrupted after 5 s" in nb["message"]
    # the answer cell that looped before its def: its exercise says so, instead of "run the cell"
    ex = _exercise(nb, "waste_percent")
    assert ex["score"] == 0
    assert ex["message"].endswith(f"waste_percent is not defined: the cell defining waste_percent (cell {answer}) "
                                  "was interrupted after 5 s (an infinite loop?)"), ex["message"]
    # the rest is graded
    assert all(e["status"] == "passed" for e in nb["exercises"] if e["name"] != "waste_percent")
    assert nb["score"] == nb["possible"] - ex["possible"]
    assert "was interrupted after 5 s" in graded["quick"]["stdout"]


@pytest.mark.slow
def test_syntax_error_in_an_answer_cell_is_passed_on(graded):
    nb = _variant(graded, "loops_and_hardcoded")
    ex = _exercise(nb, "contiguous_capacity")
    cell = _cell_number(graded["variants"]["loops_and_hardcoded"], SYNTAX_ERROR)
    assert ex["score"] == 0
    assert ex["message"].startswith(f"contiguous_capacity is not defined: the cell defining contiguous_capacity "
                                    f"(cell {cell}) raised SyntaxError: "), ex["message"]
    assert ex["message"].endswith("(line 2)"), ex["message"]  # the line of the cell, not IPython's file name
    assert ".py" not in ex["message"] and "run the cell" not in ex["message"]
    assert any(c["cell"] == cell and "contiguous_capacity" in c["defines"] for c in nb["cells"])


@pytest.mark.slow
def test_uninterruptible_notebook_times_out_as_failures(graded):
    nb = _variant(graded, "uninterruptible")
    assert nb["status"] == "timeout" and nb["score"] == 0 and nb["possible"] > 0
    assert "timed out" in nb["message"]
    assert all(ex["status"] == "failed" and "timed out" in ex["message"] for ex in nb["exercises"])
    assert nb["seconds"] < 90


@pytest.mark.slow
def test_code_that_raises_fails_with_the_error(graded):
    nb = _variant(graded, "mixed")
    ex = _exercise(nb, "contiguous_capacity")
    assert ex["score"] == 0
    assert "contiguous_capacity(128, 512, 16) raised ZeroDivisionError" in ex["message"]
    assert _exercise(nb, "blocks_needed")["status"] == "passed"


@pytest.mark.slow
def test_garbage_output_and_return_value_fail_cleanly(graded):
    nb = _variant(graded, "mixed")
    assert nb["status"] == "graded"
    ex = _exercise(nb, "waste_percent")
    assert ex["score"] == 0 and "expected a number, got Weird" in ex["message"]
    assert _exercise(nb, "blocks_needed")["status"] == "passed"


@pytest.mark.slow
def test_kernel_exit_and_unreadable_file_are_failures_not_crashes(graded):
    dead = _variant(graded, "kernel_exits")
    assert dead["status"] == "error" and "kernel died" in dead["message"] and dead["score"] == 0
    assert len(dead["exercises"]) == 4 and dead["possible"] == 11
    broken = _variant(graded, "not_a_notebook")
    assert broken["status"] == "error" and "not a readable notebook" in broken["message"]


def test_grade_without_an_autograder_says_so(tmp_path):
    nb = tmp_path / "99_unknown.ipynb"
    nb.write_text("{}")
    proc = subprocess.run(_pagedkv("grade", str(nb), str(tmp_path / "missing")), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "no autograder zip" in proc.stderr and "no such file or folder" in proc.stderr
    assert "Traceback" not in proc.stderr


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
    assert checks.expect_equal(lambda: [1, 2], (), [1, 2]) == [1, 2]
    checks.expect_close(lambda: 1 / 3, (), 0.333333333)


def test_run_turns_a_hang_into_a_failure_even_through_except_exception():
    def spin():
        while True:
            try:
                pass
            except Exception:
                pass

    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"spin\(\) did not return within 0\.3 s: is there an infinite loop\?"):
        checks.run(spin, timeout=0.3)
    assert time.monotonic() - start < 5


def test_run_reports_the_exception_and_the_line():
    def broken(x):
        return x // 0

    with pytest.raises(AssertionError, match=r"broken\(1\) raised ZeroDivisionError: .* \(in broken, line \d+: "
                                             r"return x // 0\)"):
        checks.run(broken, (1,))


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
    with checks.time_limit(1.0):
        pass
    assert signal.getsignal(signal.SIGALRM) == before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


# --------------------------------------------------------------------------------------------- grader internals
def test_autograder_zip_lists_questions_in_notebook_order():
    import nbformat

    for name in SETS:
        order = question_order(nbformat.read(ROOT / "grading" / "source" / f"{name}.ipynb", as_version=4))
        expected = grade._expected_questions(ROOT / "grading" / "autograder" / f"{name}.zip")
        assert [q for q, _ in expected] == order, name


def test_worker_reports_cells_by_their_own_error():
    assert worker.defined_names("def f(x):\n    return x +\nclass A:\n    y = 1\nN: int = 3\nM == 2\n") == \
        ["A", "N", "f"]
    assert worker.error_text({"ename": "SyntaxError", "evalue": "invalid syntax (3918070085.py, line 3)"}) == \
        "SyntaxError: invalid syntax (line 3)"
    frames = ["\x1b[31mNameError\x1b[39m Traceback", "\x1b[36mCell In[4]\x1b[39m, line 2\n  x = y",
              "Cell In[2], line 9"]
    assert worker.error_text({"ename": "NameError", "evalue": "name 'y' is not defined", "traceback": frames}) == \
        "NameError: name 'y' is not defined (line 2)"
    cells = [{"cell": 5, "first_line": "def f(x):", "defines": ["f"], "timed_out": False, "seconds": 60.0,
              "error": "SyntaxError: invalid syntax (line 3)"},
             {"cell": 9, "first_line": "while True:", "defines": ["g"], "timed_out": True, "seconds": 60.0,
              "error": "KeyboardInterrupt"}]
    explain = grade._explain_undefined
    assert explain("f is not defined: run the cell that defines it (and the cells above it) first", cells) == \
        "f is not defined: the cell defining f (cell 5) raised SyntaxError: invalid syntax (line 3)"
    assert explain("g is not defined: run the cell", cells).endswith("(cell 9) was interrupted after 60 s (an "
                                                                     "infinite loop?)")
    assert explain("h is not defined: run the cell", cells) == "h is not defined: run the cell"
    assert explain("f(1) raised NameError: name 'f' is not defined", cells).endswith("name 'f' is not defined")
    assert grade._interrupted_note(cells) == \
        "cell 9 (`while True:`) was interrupted after 60 s (an infinite loop?); the cells after it still ran"


def test_worker_numbers_cells_and_leaves_broken_files_alone(tmp_path):
    nb = tmp_path / "a.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": "x"}, {"cell_type": "code",
                                                                                     "metadata": {}, "source": ""}],
                              "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    assert worker.number_cells(str(nb))
    assert [c["metadata"][worker.CELL_KEY] for c in json.loads(nb.read_text())["cells"]] == [1, 2]
    broken = tmp_path / "b.ipynb"
    broken.write_text("{ not json")
    assert not worker.number_cells(str(broken)) and broken.read_text() == "{ not json"
