"""Grading a class: ``pagedkv grade --class FOLDER --csv FILE``.

``FOLDER`` holds the learners' notebooks, either one folder per learner (``FOLDER/alice/01_fragmentation.ipynb``)
or files named after the learner (``FOLDER/01_fragmentation-alice.ipynb``). Every notebook is graded on its own,
as ``pagedkv grade`` always does (its own worker, one sandbox per exercise: one learner's code can change
neither another's grade nor the repository). The CSV has one row per learner and exercise:
``learner, set, exercise, points, max, status, first failure`` (a set that a learner did not hand in, but others
did, is listed with 0 points and the status ``not submitted``), and the command prints each learner's total.

Who a notebook belongs to (:func:`learner_of`) is read strictly: the learner's folder, or for a file directly in
``FOLDER`` the text after the set's full name and one ``-`` (``01_fragmentation-alice.ipynb`` is alice's; so is
``01_fragmentation-anne-marie.ipynb`` anne-marie's). A file named otherwise (``01_fragmentation_alice.ipynb``,
``alice.ipynb``) is listed under its own name as learner, with ``./`` before it (``./alice.ipynb``: no folder and no
``<set>-<learner>`` file has that name), so that it never counts as another learner's work; the instructor sees it
in the totals and renames it.

Two notebooks or more of one set for one learner (``alice/01_fragmentation.ipynb`` and
``01_fragmentation-alice.ipynb``, or ``alice/01_fragmentation (1).ipynb`` beside the first) are all graded, and
none is counted: each exercise's row has 0 points, the status ``duplicate submission`` and, as its first failure,
every such notebook with its points, so that the instructor removes all but one and grades again. The grader
cannot tell which one the learner meant, and counting any of them would let a file planted beside a learner's
replace that learner's grade.

Refused notebooks (a symlink, a named pipe, a device, an empty file, one over the size limit: see
:mod:`pagedkv.grading.grade`) are listed like the others, every exercise with the status ``refused`` and the
reason. What a learner controls (file and folder names, messages) is escaped (:func:`pagedkv.grading.output.
escape_controls`: one printable line, encodable as UTF-8) wherever it is printed or written, and a CSV cell
that a spreadsheet would read as a formula (one starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage
return: OWASP's rule) is written with a leading ``'``.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from pagedkv.grading.output import escape_controls, write_replacing

__all__ = ["CSV_COLUMNS", "DUPLICATE", "class_rows", "csv_cell", "learner_of", "learner_totals", "write_csv"]

CSV_COLUMNS = ["learner", "set", "exercise", "points", "max", "status", "first failure"]
#: The status of every row of a learner's set handed in more than once.
DUPLICATE = "duplicate submission"
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def learner_of(notebook: str | Path, folder: str | Path, set_name: str | None = None) -> str:
    """The learner a notebook belongs to (escaped: printable, one line): its first folder under ``folder``,
    else what its file name adds to the set's full name and one ``-`` (``01_fragmentation-alice`` -> ``alice``),
    else ``./`` and its file name (``./alice.ipynb``: a name that no folder and no ``<set>-<learner>`` file
    gives, so that such a file is never counted as another learner's work, nor makes theirs a duplicate)."""
    path = Path(escape_controls(str(notebook)))
    base = Path(escape_controls(str(folder)))
    rel = None
    # as found under the folder (grade_paths keeps the folder's spelling), else with the folders' symlinks resolved
    # (not the file's own: a symlink's target is not who it belongs to)
    for p, b in ((path, base), (path.parent.resolve() / path.name, base.resolve())):
        try:
            rel = p.relative_to(b)
            break
        except ValueError:
            continue
    if rel is not None and len(rel.parts) > 1:
        return rel.parts[0]
    stem = path.name.removesuffix(".ipynb")
    prefix = f"{set_name}-"
    if set_name and stem.startswith(prefix) and len(stem) > len(prefix):
        return stem[len(prefix):]
    return f"./{path.name}"


def _points(x: float) -> str:
    return f"{x:g}"


def _duplicate_note(learner: str, set_name: str, name: str, results: list[Any]) -> str:
    """The first failure of a duplicate's row for exercise ``name``: every notebook and its points."""
    parts = []
    for r in results:
        e = next((e for e in r.exercises if e.name == name), None)
        mine = f"this exercise {_points(e.score)}/{_points(e.possible)}, " if e is not None else ""
        parts.append(f"{escape_controls(str(r.notebook))} ({mine}the set {_points(r.score)}/{_points(r.possible)}"
                     f"{', ' + r.status if r.status != 'graded' else ''})")
    return (f"{len(results)} notebooks of {set_name} for {learner}, none counted (remove all but one and grade "
            f"again): " + "; ".join(parts))


def class_rows(results: list[Any], folder: str | Path) -> list[dict]:
    """One row per learner and exercise (see the module's docstring), sorted by learner, set, notebook order;
    a set handed in more than once has ``DUPLICATE`` rows, 0 points each, that name every notebook."""
    by_learner: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    exercises_of: dict[str, list[tuple[str, float]]] = {}
    for r in results:
        set_name = Path(r.autograder).stem if r.autograder else "?"
        by_learner[learner_of(r.notebook, folder, set_name)][set_name].append(r)
        if r.exercises:
            exercises_of.setdefault(set_name, [(e.name, e.possible) for e in r.exercises])
    rows = []
    for learner in sorted(by_learner):
        for set_name in sorted(exercises_of):
            handed_in = by_learner[learner].get(set_name, [])
            if not handed_in:
                rows += [{"learner": learner, "set": set_name, "exercise": name, "points": 0.0, "max": possible,
                          "status": "not submitted", "first failure": ""} for name, possible in exercises_of[set_name]]
            elif len(handed_in) > 1:
                rows += [{"learner": learner, "set": set_name, "exercise": name, "points": 0.0, "max": possible,
                          "status": DUPLICATE, "first failure": _duplicate_note(learner, set_name, name, handed_in)}
                         for name, possible in exercises_of[set_name]]
            else:
                rows += [{"learner": learner, "set": set_name, "exercise": e.name, "points": e.score,
                          "max": e.possible, "status": e.status, "first failure": e.message}
                         for e in handed_in[0].exercises]
    return rows


def csv_cell(value: Any) -> str:
    """``value`` as a CSV cell: escaped (:func:`escape_controls`), and with a leading ``'`` when a spreadsheet
    would read it as a formula (``=HYPERLINK(...)``, ``+1``, ``-1``, ``@SUM(...)``)."""
    text = escape_controls(str(value))
    return f"'{text}" if text.startswith(_FORMULA_STARTS) else text


def write_csv(rows: list[dict], path: str | Path) -> None:
    """The class's CSV at ``path``, written through a temporary file and a rename (never through a symlink);
    every cell made safe by :func:`csv_cell`."""
    out = io.StringIO()
    # every cell quoted: a spreadsheet that splits on ";" (many locales) keeps "x;=1+2" one cell, not a formula
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, quoting=csv.QUOTE_ALL)
    writer.writeheader()
    for row in rows:
        cells = {**row, "points": _points(row["points"]), "max": _points(row["max"])}
        writer.writerow({k: csv_cell(v) for k, v in cells.items()})
    write_replacing(path, out.getvalue())


def learner_totals(rows: list[dict]) -> str:
    """Each learner's points over every set graded for the class (a duplicate submission's sets noted: they
    count 0 until all but one notebook is removed)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    duplicates: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        learner = escape_controls(str(row["learner"]))
        totals[learner][0] += float(row["points"])
        totals[learner][1] += float(row["max"])
        if row["status"] == DUPLICATE:
            duplicates[learner].add(str(row["set"]))
    width = max([len("learner")] + [len(k) for k in totals])
    lines = [f"{'learner':<{width}}  points", f"{'-' * width}  ------"]
    for k, (s, p) in sorted(totals.items()):
        note = f"  (duplicate submission of {', '.join(sorted(duplicates[k]))}: not counted, see the CSV)" \
            if duplicates[k] else ""
        lines.append(f"{k:<{width}}  {s:g} / {p:g}{note}")
    return "\n".join(lines)
