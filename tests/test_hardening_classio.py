"""Grading a class: what a learner controls besides the code (file names, the kind of file, its size) must not
change another learner's grade, forge the printed table or the CSV, crash or hang the grader.

Routes (the red team's H4-H7): a file ``01_fragmentation_alice.ipynb`` that replaced alice's grade; a newline in a
file name that printed a line of its own; a CSV cell read as a formula by a spreadsheet; a file name that is not
UTF-8 and crashed the CSV; a notebook that is a symlink (to ``/proc/kmsg``: the grader hung; to the solutions:
graded full marks), a named pipe, or 30 MB (read whole to find its set's name).
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest

from pagedkv.grading import classroom, grade
from pagedkv.grading.limits import Limits
from pagedkv.grading.output import escape_controls
from pagedkv.grading.sandbox import bwrap_problem

ROOT = Path(__file__).resolve().parents[1]
FRAG = "01_fragmentation"
ZIP = ROOT / "grading" / "autograder" / f"{FRAG}.zip"
EVIL_NAME = "=HYPERLINK(\"evil.example\",\"x\")\nalice  12 of 12\t<- fake"  # no "/": a file name


def _result(path: str, scores: list[tuple[str, float]], message: str = "why") -> grade.NotebookResult:
    exercises = [grade.ExerciseResult(n, s, 2.0, "passed" if s == 2 else "failed", "" if s == 2 else message)
                 for n, s in scores]
    return grade.NotebookResult(path, f"grading/autograder/{FRAG}.zip", "graded", sum(s for _, s in scores),
                                2.0 * len(scores), 1.0, "", exercises)


def _csv(rows: list[dict], tmp_path: Path) -> tuple[str, list[dict]]:
    classroom.write_csv(rows, tmp_path / "grades.csv")
    text = (tmp_path / "grades.csv").read_bytes().decode("utf-8")  # strict: the CSV is UTF-8
    return text, list(csv.DictReader(io.StringIO(text)))


def _no_hang(fn, *args, seconds: float = 60.0, **kwargs):
    """``fn(*args, **kwargs)`` in a thread: a failure, not a hung test run, when it blocks."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__} blocked (still running after {seconds:g} s)"
    if "error" in out:
        raise out["error"]
    return out["value"]


# ------------------------------------------------------------------------------------------ H4: who is the learner
def test_learner_names_are_read_strictly_from_file_names():
    assert classroom.learner_of(f"c/{FRAG}-alice.ipynb", "c", FRAG) == "alice"
    assert classroom.learner_of(f"c/{FRAG}-anne-marie.ipynb", "c", FRAG) == "anne-marie"
    assert classroom.learner_of(f"c/alice/{FRAG}_v2.ipynb", "c", FRAG) == "alice"
    assert classroom.learner_of(f"c/alice/{FRAG}-bob.ipynb", "c", FRAG) == "alice"  # the folder decides
    # not "<set>-<learner>.ipynb": a learner named after the file, "./NAME.ipynb", which no folder and no
    # "<set>-<learner>" file can be named: never alice (a planted "alice.ipynb" zeroed her set as a duplicate)
    for name in (f"{FRAG}_alice", f"{FRAG}.alice", f"{FRAG} alice", f"{FRAG}-", FRAG, "alice"):
        assert classroom.learner_of(f"c/{name}.ipynb", "c", FRAG) == f"./{name}.ipynb"


def test_a_second_notebook_for_a_learner_and_set_replaces_nothing_and_is_reported():
    results = [_result(f"c/alice/{FRAG}.ipynb", [("a", 2.0), ("b", 2.0)]),
               _result(f"c/{FRAG}-alice.ipynb", [("a", 0.0), ("b", 0.0)]),  # planted beside it
               _result(f"c/{FRAG}_alice.ipynb", [("a", 0.0), ("b", 0.0)]),  # another separator: not alice's
               _result(f"c/{FRAG}-bob.ipynb", [("a", 2.0), ("b", 0.0)])]
    rows = classroom.class_rows(results, "c")
    alice = [r for r in rows if r["learner"] == "alice"]
    assert [(r["exercise"], r["points"], r["max"], r["status"]) for r in alice] == [
        ("a", 0.0, 2.0, "duplicate submission"), ("b", 0.0, 2.0, "duplicate submission")]
    for r in alice:  # both notebooks named, with what each scored: neither silently dropped
        assert f"c/alice/{FRAG}.ipynb (this exercise 2/2, the set 4/4)" in r["first failure"]
        assert f"c/{FRAG}-alice.ipynb (this exercise 0/2, the set 0/4)" in r["first failure"]
        assert "none counted" in r["first failure"]
    assert {r["learner"] for r in rows} == {"alice", "bob", f"./{FRAG}_alice.ipynb"}
    assert [(r["points"], r["status"]) for r in rows if r["learner"] == "bob"] == [(2.0, "passed"), (0.0, "failed")]
    totals = classroom.learner_totals(rows)
    assert re.search(rf"^alice +0 / 4  \(duplicate submission of {FRAG}: not counted, see the CSV\)$", totals, re.M)
    assert "bob" in totals and "2 / 4" in totals


# ------------------------------------------------------------------------------------------ H5: lines and cells
def test_newlines_and_tabs_from_a_learner_are_escaped_wherever_printed(tmp_path):
    assert escape_controls("a\nb\tc\r\u2028d") == "a\\x0ab\\x09c\\x0d\\u2028d"
    results = [_result(f"c/{FRAG}-{EVIL_NAME}.ipynb", [("a", 0.0)], message="boom\nalice  a  2/2  passed"),
               _result(f"c/{FRAG}-bob.ipynb", [("a", 2.0)])]
    rows = classroom.class_rows(results, "c")
    totals = classroom.learner_totals(rows)
    table = grade.format_table(results)
    for printed in (totals, table):
        assert "\t" not in printed and "\r" not in printed
        assert not any(line.startswith("alice") for line in printed.splitlines()), printed
    assert len(totals.splitlines()) == 4  # header, rule, two learners
    assert len(table.splitlines()) == 2 + 4 + 2  # header, rule, two rows per notebook, blank, score
    text, read = _csv(rows, tmp_path)
    assert len(text.splitlines()) == 3 and "\t" not in text


def test_csv_cells_a_spreadsheet_would_run_as_formulas_get_a_quote(tmp_path):
    rows = [{"learner": learner, "set": FRAG, "exercise": "a", "points": 0.0, "max": 2.0, "status": "failed",
             "first failure": message}
            for learner, message in (("=cmd|' /C calc'!A0", "+1+1"), ("@SUM(A1:A9)", "-2+3"), ("\tx", "\r=1+1"),
                                     ("bob", "=HYPERLINK(\"http://evil.example\",\"x\")"), ("carol", "fine = ok"))]
    _, read = _csv(rows, tmp_path)
    for row in read:
        for key in ("learner", "first failure"):
            assert not row[key].startswith(("=", "+", "-", "@", "\t", "\r")), row
    assert [r["learner"] for r in read] == ["'=cmd|' /C calc'!A0", "'@SUM(A1:A9)", "\\x09x", "bob", "carol"]
    assert [r["first failure"] for r in read] == ["'+1+1", "'-2+3", "\\x0d=1+1",
                                                  "'=HYPERLINK(\"http://evil.example\",\"x\")", "fine = ok"]
    assert [r["points"] for r in read] == ["0"] * 5


def test_every_csv_cell_is_quoted_for_spreadsheets_that_split_on_semicolons(tmp_path):
    """Red team, second pass: "x;=1+2" was written bare, and a spreadsheet that splits on ";" read "=1+2" as a
    cell of its own, a formula. Quoted, it stays one cell of text."""
    rows = [{"learner": "x;=1+2;=cmd|' -C calc'!A0", "set": FRAG, "exercise": "a", "points": 0.0, "max": 2.0,
             "status": "failed", "first failure": "a;=1"}]
    classroom.write_csv(rows, tmp_path / "g.csv")
    line = (tmp_path / "g.csv").read_text(encoding="utf-8").splitlines()[1]
    assert line.startswith('"x;=1+2;=cmd|\' -C calc\'!A0","') and line.endswith('"a;=1"'), line


# ------------------------------------------------------------------------------------------ H6: names not UTF-8
def test_a_file_name_that_is_not_utf8_is_written_and_printed_not_crashed_on(tmp_path):
    name = os.fsdecode(f"c/{FRAG}-mal".encode() + b"\xff\xfe" + b"ory.ipynb")  # what os.listdir gives
    results = [_result(name, [("a", 0.0)], message="raised ValueError: \udcff\ud800")]
    rows = classroom.class_rows(results, "c")
    text, read = _csv(rows, tmp_path)
    assert read[0]["learner"] == "mal\\xff\\xfeory" and read[0]["first failure"] == "raised ValueError: \\xff\\ud800"
    for printed in (classroom.learner_totals(rows), grade.format_table(results)):
        printed.encode("utf-8")  # what print() does with a UTF-8 terminal: no UnicodeEncodeError
        assert "mal\\xff\\xfeory" in printed


# ------------------------------------------------------------------------------------------ H7: what is read
def test_notebooks_that_are_not_plain_files_are_refused_unread(tmp_path):
    good = tmp_path / "good.ipynb"
    shutil.copyfile(ROOT / "exercises" / f"{FRAG}.ipynb", good)
    fifo = tmp_path / "fifo.ipynb"
    os.mkfifo(fifo)  # nothing ever writes: reading it would block forever
    link = tmp_path / "link.ipynb"
    link.symlink_to(good)
    empty = tmp_path / "empty.ipynb"
    empty.touch()
    big = tmp_path / "big.ipynb"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB to stat, nothing on disk
    assert _no_hang(grade.read_notebook, good) == good.read_bytes()
    assert _no_hang(grade.read_notebook, link) == good.read_bytes()  # your own notebooks: a symlink is fine
    cases = {fifo: "it is a named pipe (FIFO), not a notebook file", empty: "the file is empty (0 bytes)",
             big: "the file is 67,108,864 bytes, over the limit of 16,777,216 bytes for a notebook",
             tmp_path: "it is a folder", Path("/proc/self/status"): "the file is empty (0 bytes)"}
    for path, why in cases.items():
        with pytest.raises(grade.NotebookRefused, match=r"^" + why.replace("(", r"\(").replace(")", r"\)")):
            _no_hang(grade.read_notebook, path)
    with pytest.raises(grade.NotebookRefused, match=r"^it is a symbolic link \(to .*good.ipynb\)"):
        _no_hang(grade.read_notebook, link, follow_symlinks=False)
    with pytest.raises(grade.NotebookRefused, match="over the limit of 1,000 bytes"):
        grade.read_notebook(good, 1000)
    # finding a set by the name stored in the notebook reads nothing of one that is too big
    tracemalloc.start()
    try:
        assert grade.find_autograder(big, ZIP.parent) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak:,} bytes allocated to look at a 64 MiB notebook"


def test_a_class_notebook_that_is_a_symlink_or_a_pipe_gets_a_refused_row_not_a_grade(tmp_path):
    klass = tmp_path / "class"
    (klass / "sym").mkdir(parents=True)
    (klass / "sym" / f"{FRAG}.ipynb").symlink_to(ROOT / "solutions" / f"{FRAG}.ipynb")
    (klass / f"{FRAG}-zed.ipynb").symlink_to(ROOT / "solutions" / f"{FRAG}.ipynb")
    (klass / "mallory").mkdir()
    os.mkfifo(klass / "mallory" / f"{FRAG}.ipynb")
    found, problems = grade.find_notebooks([klass])
    assert len(found) == 3 and not problems  # listed, so that they get a row
    results, problems = _no_hang(grade.grade_paths, [klass], autograder_dir=ZIP.parent, require_sandbox=True)
    assert not problems
    assert [(r.status, r.score) for r in results] == [("refused", 0.0)] * 3
    rows = classroom.class_rows(results, klass)
    assert {r["learner"] for r in rows} == {"sym", "zed", "mallory"} and {r["status"] for r in rows} == {"refused"}
    by = {r["learner"]: r["first failure"] for r in rows}
    assert by["sym"].startswith("not graded: it is a symbolic link (to ") and "solutions" in by["sym"]
    assert by["mallory"] == "not graded: it is a named pipe (FIFO), not a notebook file"
    assert all(r["points"] == 0 for r in rows)


def test_the_limit_on_a_notebook_size_is_a_grading_limit():
    assert Limits().notebook_size == 16 << 20
    assert Limits.from_json(Limits(notebook_size=1 << 20).to_json()).notebook_size == 1 << 20
    with pytest.raises(ValueError, match="notebook_size"):
        Limits(notebook_size=0)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.skipif(bwrap_problem() is not None, reason=f"--class needs a sandbox: {bwrap_problem()}")
def test_class_of_hostile_file_names_grades_everyone_and_writes_the_csv(tmp_path):
    """``pagedkv grade --class`` on the red team's folder, made smaller: every learner's row, a CSV that opens."""
    klass = tmp_path / "class"
    (klass / "alice").mkdir(parents=True)
    stub = ROOT / "exercises" / f"{FRAG}.ipynb"
    shutil.copyfile(stub, klass / "alice" / f"{FRAG}.ipynb")
    shutil.copyfile(stub, klass / f"{FRAG}_alice.ipynb")  # once alice's, replacing her row
    evil = os.fsencode(klass) + f"/{FRAG}-{EVIL_NAME}".encode() + b"\xff.ipynb"
    shutil.copyfile(stub, evil)
    (klass / "mallory").mkdir()
    os.mkfifo(klass / "mallory" / f"{FRAG}.ipynb")  # the grader used to hang on it
    (klass / f"{FRAG}-sym.ipynb").symlink_to(ROOT / "solutions" / f"{FRAG}.ipynb")
    with open(klass / f"{FRAG}-big.ipynb", "wb") as f:
        f.truncate(32 << 20)
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", "--class", str(klass), "--csv",
                           str(tmp_path / "grades.csv"), "--only", "blocks_needed", "-j", "2"],
                          capture_output=True, timeout=600, cwd=tmp_path)
    stdout = proc.stdout.decode("utf-8")
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    rows = list(csv.DictReader(open(tmp_path / "grades.csv", encoding="utf-8")))
    evil_learner = "'" + escape_controls(EVIL_NAME) + "\\xff"
    assert {(r["learner"], r["status"]) for r in rows} == {
        ("alice", "failed"), (f"./{FRAG}_alice.ipynb", "failed"), (evil_learner, "failed"), ("mallory", "refused"),
        ("sym", "refused"), ("big", "refused")}
    totals = stdout.split("\nlearner ")[-1].splitlines()
    assert len(totals) == 2 + 6 and not any(line.startswith("alice  12") for line in totals), stdout


def test_a_class_folder_swapped_for_a_symlink_is_not_followed(tmp_path):
    """Red team, second pass: a learner who can write the class folder while it is graded turned their folder
    into a symlink to the solutions after the listing, and the stub scored 12/12 (O_NOFOLLOW guards the file's
    own name only). Below the class folder, every folder is now opened without following a symlink."""
    klass = tmp_path / "class"
    (klass / "alice").mkdir(parents=True)
    (klass / "alice" / f"{FRAG}.ipynb").write_text("{}")
    assert grade.read_notebook(klass / "alice" / f"{FRAG}.ipynb", follow_symlinks=False, root=klass) == b"{}"
    (klass / "mallory").symlink_to(klass / "alice")  # as if swapped in after the listing
    with pytest.raises(grade.NotebookRefused, match="a folder between the class folder and the notebook is a "):
        grade.read_notebook(klass / "mallory" / f"{FRAG}.ipynb", follow_symlinks=False, root=klass)
    # self-study (or no root): a folder symlink is followed, as before
    assert grade.read_notebook(klass / "mallory" / f"{FRAG}.ipynb") == b"{}"
