"""A learner who replaces a set's scenarios scores what the untouched stub scores: 0.

A scenario (a ``drive_*`` function of the set's lesson module) runs where the learner's code runs, found there by
its name, so a notebook cell can put anything in its place (``L.drive_remove_skipped = lambda *a, **k: []``).
What it returns is only compared by the check (in the worker) with the library's record of the same scenario; a
check that compared nothing when the record was empty, or of another shape, passed. Each test grades, end to end
(``pagedkv grade``), the untouched exercise notebook of a set plus one cell, right after the set-up cell, that
replaces every ``drive_*`` function of that set's lesson module by one returning: ``[]``; a record shaped like
the scenario's own, run on the stub, with every container in it emptied and every failure taken out ("hollow");
the scenario's plain arguments, echoed ("echo"). Every exercise must score 0. Set 07's checks get the same
records, and ``{}`` and ``None``, in-process.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETS = sorted(p.stem for p in (ROOT / "grading" / "source").glob("*.ipynb"))
# folder: mode. ``{}`` and ``None`` fail the same shape checks as ``[]`` (the in-process test of set 07 below
# tries all five); a grade run costs seconds per exercise, so end to end the three that reach furthest.
MODES = {"list": "[]", "hollow": "hollow", "echo": "echo"}
#: Set 06 runs none of the notebook's cells while it grades a kernel (pagedkv.grading.kernel_source), so no cell can
#: replace a scenario there; set 07's checks are tried in-process (test_set07_forged_records_fail), as a grade run
#: of its engine cases takes over a minute.
END_TO_END = [n for n in SETS if n[:2] not in ("06", "07")]

# The cell a forging learner adds: every drive_* of the lesson module replaced (MODULE and MODE filled in).
FORGE = '''
import importlib as _importlib

_L = _importlib.import_module({module!r})
_MODE = {mode!r}
_FAILURES = {{"raised", "failed", "timeout", "message", "where", "label", "refused", "kinds", "value_error", "none",
             "returned", "unreadable", "corrupt", "during", "shape", "bad_blocks", "out_of_blocks"}}


def _hollow(value, depth=0):
    if isinstance(value, dict):
        return {{k: _hollow(v, depth + 1) for k, v in value.items() if k not in _FAILURES}}
    if isinstance(value, (list, tuple)):
        return [_hollow(v, depth + 1) for v in value] if depth == 0 else []
    if isinstance(value, str):
        return ""
    return value


def _forged(original):
    def drive(*args, **kwargs):
        if _MODE == "hollow":
            try:
                record = original(*args, **kwargs)
            except Exception:
                record = []
            return _hollow(record)
        if _MODE == "echo":
            return [a for a in args if not callable(a)][-1]
        return eval(_MODE)
    return drive


for _name in [n for n in dir(_L) if n.startswith("drive_")]:
    setattr(_L, _name, _forged(getattr(_L, _name)))
'''


def lesson_module(name: str) -> str:
    """The lesson module of the set ``NN_name`` (``pagedkv.grading.lessons.lNN_...``)."""
    folder = ROOT / "pagedkv" / "grading" / "lessons"
    (path,) = folder.glob(f"l{name[:2]}_*.py")
    return f"pagedkv.grading.lessons.{path.stem}"


def scenarios(name: str) -> list[str]:
    module = importlib.import_module(lesson_module(name))
    return [n for n in dir(module) if n.startswith("drive_") and callable(getattr(module, n))]


def forged_notebook(folder: Path, name: str, mode: str) -> Path:
    """``exercises/NAME.ipynb`` with the forging cell after its first code cell (the set-up: ``grader = ...``)."""
    nb = json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())
    first = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": FORGE.format(module=lesson_module(name), mode=mode)}
    nb["cells"].insert(first + 1, cell)
    path = folder / f"{name}.ipynb"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.parametrize("name", [n for n in SETS if not scenarios(n)])
def test_sets_without_scenarios_have_nothing_to_forge(name):
    """Sets 05, 09 and 10 call the learner's functions on plain data only: no scenario, no record to forge."""
    assert scenarios(name) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in END_TO_END if scenarios(n)])
def test_forged_scenarios_score_zero(tmp_path, name):
    paths = [forged_notebook(tmp_path / folder, name, mode) for folder, mode in MODES.items()]
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", *map(str, paths), "--json", str(report),
                           "--no-progress", "--quiet", "-j", "2"], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    scored = {}
    for nb in json.loads(report.read_text())["notebooks"]:
        mode = Path(nb["notebook"]).parent.name
        for ex in nb["exercises"]:
            for case in ex["cases"]:
                if case["passed"]:
                    scored.setdefault(mode, []).append(f"{ex['name']}: {case['name']}")
    assert not scored, f"forged scenarios passed cases of {name}: {scored}"


# --------------------------------------------------------------------------------------------------------
# Records shaped right but hollow, checked in-process (the checks are the same under grading)
# --------------------------------------------------------------------------------------------------------
def test_set03_reads_compare_every_request_of_the_library():
    """A view without the requests' reads compared nothing (check_reads looped over the learner's requests)."""
    from pagedkv.grading.lessons.l03_prefix_caching import check_reads

    want = {"tables": {"p": [1, 2], "c": [1, 3]}, "reads": {"p": [1, 2, 3, 4, 5], "c": [1, 2, 3, 4, 6]}, "free": 9}
    check_reads(want, want, 4, "the library's own view")
    with pytest.raises(AssertionError, match="the scenario's record is incomplete"):
        check_reads({"tables": {}, "reads": {}, "free": 9}, want, 4, "a hollow view")


def test_set03_cached_table_must_be_the_librarys_length():
    """An empty table with the expected count of cached blocks (a constant of the check) compared nothing."""
    from pagedkv.grading.lessons.l03_prefix_caching import expect_cached

    want = {"table": [(1, 11, True), (2, 12, True), (3, None, False)], "num_cached": 2, "nothing": False,
            "hashes": [11, 12]}
    expect_cached(want, want, 2, "the library's own view", "a")
    with pytest.raises(AssertionError, match="the scenario's record is incomplete"):
        expect_cached({"table": [], "num_cached": 2, "nothing": False, "hashes": []}, want, 2, "a hollow view", "a")


def test_set03_read_does_not_parse_a_huge_text():
    """A 1 MB observation text is shown by its length, not parsed (ast.literal_eval takes ~200 bytes a char)."""
    import tracemalloc

    from pagedkv.grading.lessons.l03_prefix_caching import _read

    text = "[" + "[]," * 350_000 + "[]]"
    tracemalloc.start()
    try:
        shown = _read(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20_000_000, peak
    assert "characters" in repr(shown)
    assert _read(repr(([1, 2], {3: [4]}))) == ([1, 2], {3: [4]})


def test_set02_state_texts_are_bounded():
    from pagedkv.grading.lessons.l02_block_pool import STATE_LIMIT, _unpack

    (case,) = _unpack([{"state": "[" + "[]," * STATE_LIMIT + "[]]", "steps": [{"state": "[[1, 2], [0, 0]]"}]}])
    assert "unreadable" in case["state"]
    assert case["steps"][0]["state"] == [[1, 2], [0, 0]]


# --------------------------------------------------------------------------------------------------------
# Set 07: prepare_inputs' numbers are ints (1.0 == 1 in Python)
# --------------------------------------------------------------------------------------------------------
def _prepare_inputs(number):
    """The solution's prepare_inputs, with ``number`` applied to positions, slots and seq_lens."""
    from pagedkv.engine.model_runner import ModelInputs

    def prepare_inputs(scheduler_output, token_ids, block_size):
        req_ids = list(scheduler_output.num_scheduled_tokens)
        partial = scheduler_output.partial_prefill_req_ids or set()
        out = ModelInputs(req_ids, [], [], [], [], [], [0], [], [])
        for rid in req_ids:
            n = scheduler_output.num_scheduled_tokens[rid]
            start = scheduler_output.num_computed_tokens[rid]
            table = list(scheduler_output.block_tables[rid])
            for p in range(start, start + n):
                out.input_ids.append(token_ids[rid][p])
                out.positions.append(number(p))
                out.slot_mapping.append(number(table[p // block_size] * block_size + p % block_size))
            out.block_tables.append(table)
            out.seq_lens.append(number(start + n))
            out.query_start_loc.append(out.query_start_loc[-1] + n)
            if rid not in partial:
                out.sample_req_ids.append(rid)
                out.logits_indices.append(out.query_start_loc[-1] - 1)
        return out

    return prepare_inputs


def test_set07_prepare_inputs_floats_fail():
    from pagedkv.grading.lessons.l07_serving_engine import check_prepare_inputs_example, check_prepare_inputs_random

    check_prepare_inputs_example(_prepare_inputs(int))
    check_prepare_inputs_random(_prepare_inputs(int))
    for check in (check_prepare_inputs_example, check_prepare_inputs_random):
        with pytest.raises(AssertionError, match=r"positions is .*entry \[0\] is 0\.0 \(a float\), expected the int 0"):
            check(_prepare_inputs(float))


def _hollow(value, depth=0):
    """What the forging cell's "hollow" mode makes of a record (see FORGE)."""
    failures = {"raised", "failed", "timeout", "message", "where", "label", "refused", "kinds", "value_error", "none",
                "returned", "unreadable", "corrupt", "during", "shape", "bad_blocks", "out_of_blocks"}
    if isinstance(value, dict):
        return {k: _hollow(v, depth + 1) for k, v in value.items() if k not in failures}
    if isinstance(value, (list, tuple)):
        return [_hollow(v, depth + 1) for v in value] if depth == 0 else []
    return "" if isinstance(value, str) else value


@pytest.mark.parametrize("mode", ["list", "dict", "none", "echo", "hollow"])
@pytest.mark.parametrize("check", ["check_prepare_inputs_example", "check_prepare_inputs_random",
                                   "check_prepare_inputs_hidden", "check_attention_random_steps",
                                   "check_attention_writes_the_cache", "check_attention_hidden"])
def test_set07_forged_records_fail(monkeypatch, check, mode):
    """Set 07's checks with every scenario record forged, as a cell under grading could forge it, on the stub."""
    from pagedkv.grading.lessons import l07_serving_engine as l07

    real_drive = l07.drive

    def forged(scenario, *args, **kwargs):
        if mode == "hollow":
            try:
                return _hollow(real_drive(scenario, *args, **kwargs))
            except AssertionError:
                return []
        if mode == "echo":
            return [a for a in args if not callable(a)][-1]
        return {"list": [], "dict": {}, "none": None}[mode]

    def stub(*args, **kwargs):
        ...

    monkeypatch.setattr(l07, "drive", forged)
    with pytest.raises(AssertionError):
        getattr(l07, check)(stub)
