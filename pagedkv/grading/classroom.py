"""Grading a class: ``pagedkv grade --class FOLDER --csv FILE``.

``FOLDER`` holds the learners' notebooks, either one folder per learner (``FOLDER/alice/01_fragmentation.ipynb``)
or files named after the learner (``FOLDER/01_fragmentation-alice.ipynb``). Every notebook is graded on its own,
as ``pagedkv grade`` always does (its own worker, one sandbox per exercise: one learner's code can change
neither another's grade nor the repository). The CSV has one row per learner and exercise:
``learner, set, exercise, points, max, status, first failure`` (a set that a learner did not hand in, but others
did, is listed with 0 points and the status ``not submitted``), and the command prints each learner's total.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from pagedkv.grading.output import escape_controls, write_replacing

__all__ = ["CSV_COLUMNS", "class_rows", "learner_of", "learner_totals", "write_csv"]

CSV_COLUMNS = ["learner", "set", "exercise", "points", "max", "status", "first failure"]


def learner_of(notebook: str | Path, folder: str | Path, set_name: str | None = None) -> str:
    """The learner a notebook belongs to: its first folder under ``folder``, else what its file name adds to the
    set's name (``01_fragmentation-alice`` -> ``alice``), else the file name."""
    path = Path(notebook).resolve()
    try:
        rel = path.relative_to(Path(folder).resolve())
    except ValueError:
        rel = Path(path.name)
    if len(rel.parts) > 1:
        return rel.parts[0]
    stem = path.stem
    if set_name and stem.startswith(set_name) and len(stem) > len(set_name) + 1:
        return stem[len(set_name):].lstrip("-_. ") or stem
    return stem


def class_rows(results: list[Any], folder: str | Path) -> list[dict]:
    """One row per learner and exercise (see the module's docstring), sorted by learner, set, notebook order."""
    by_learner: dict[str, dict[str, Any]] = defaultdict(dict)
    exercises_of: dict[str, list[tuple[str, float]]] = {}
    for r in results:
        set_name = Path(r.autograder).stem if r.autograder else "?"
        by_learner[escape_controls(learner_of(r.notebook, folder, set_name))][set_name] = r
        if r.exercises:
            exercises_of.setdefault(set_name, [(e.name, e.possible) for e in r.exercises])
    rows = []
    for learner in sorted(by_learner):
        for set_name in sorted(exercises_of):
            r = by_learner[learner].get(set_name)
            if r is None:
                rows += [{"learner": learner, "set": set_name, "exercise": name, "points": 0.0, "max": possible,
                          "status": "not submitted", "first failure": ""} for name, possible in exercises_of[set_name]]
                continue
            for e in r.exercises:
                rows.append({"learner": learner, "set": set_name, "exercise": e.name, "points": e.score,
                             "max": e.possible, "status": e.status, "first failure": e.message})
    return rows


def write_csv(rows: list[dict], path: str | Path) -> None:
    """The class's CSV at ``path``, written through a temporary file and a rename (never through a symlink)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, "points": f"{row['points']:g}", "max": f"{row['max']:g}"})
    write_replacing(path, out.getvalue())


def learner_totals(rows: list[dict]) -> str:
    """Each learner's points over every set graded for the class."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        totals[row["learner"]][0] += float(row["points"])
        totals[row["learner"]][1] += float(row["max"])
    width = max([len("learner")] + [len(k) for k in totals])
    lines = [f"{'learner':<{width}}  points", f"{'-' * width}  ------"]
    lines += [f"{k:<{width}}  {s:g} / {p:g}" for k, (s, p) in sorted(totals.items())]
    return "\n".join(lines)
