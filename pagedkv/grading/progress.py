"""A learner's progress: the last score of each exercise set, kept in ``.pagedkv/progress.json``.

Every ``pagedkv grade`` records, per set, the score of the learner's own notebooks it graded: those in the
repository's ``exercises/`` folder, nothing else (not ``solutions/``, not a class's submissions, with or without
``--class``, not a copy elsewhere); :func:`progress_table` reads it back as the per-set table the
course index shows, and :func:`grade_notebook_here` grades the notebook it is called from (in a separate process
and its sandboxes, exactly as ``pagedkv grade``) and prints the same score table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PROGRESS_FILE", "Progress", "find_this_notebook", "grade_notebook_here", "is_learners_own",
           "progress_table", "record_progress"]

#: Where the progress is kept, relative to the repository root (``.gitignore`` lists ``.pagedkv/``).
PROGRESS_FILE = Path(".pagedkv") / "progress.json"


def _root() -> Path:
    from pagedkv.grading.build import repo_root

    return repo_root()


def _set_name(autograder: str | None) -> str | None:
    return Path(autograder).stem if autograder else None


def record_progress(results: list[Any], *, root: Path | None = None, now: float | None = None) -> Path | None:
    """Merge the graded notebooks' per-set scores into ``.pagedkv/progress.json``; returns the file (None when
    nothing was the learner's own). Only a notebook directly in ``root/exercises/`` is the learner's: one in
    ``solutions/``, in a class folder graded as one learner (``./lab grade submissions/``) or anywhere else would
    put someone else's score in the learner's table, so it is skipped."""
    root = (root or _root()).resolve()
    entries = {}
    for r in results:
        name = _set_name(r.autograder)
        if not name or r.possible <= 0 or not is_learners_own(r.notebook, root):
            continue
        entries[name] = {
            "notebook": str(r.notebook), "score": r.score, "possible": r.possible, "status": r.status,
            "graded_at": time.strftime("%Y-%m-%d %H:%M", time.localtime(now)),
            "exercises": [{"name": e.name, "score": e.score, "possible": e.possible, "status": e.status}
                          for e in r.exercises],
        }
    if not entries:
        return None
    path = root / PROGRESS_FILE
    data = _read(path)
    data.setdefault("sets", {}).update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def is_learners_own(notebook: str | Path, root: Path | None = None) -> bool:
    """Whether ``notebook`` is one the progress table counts: directly in the repository's ``exercises/``."""
    root = (root or _root()).resolve()
    return Path(notebook).resolve().parent == (root / "exercises").resolve()


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) and isinstance(data.get("sets", {}), dict) else {}
    except (OSError, ValueError):
        return {}


@dataclass
class Progress:
    """The per-set summary: ``rows`` are (set, points, possible, exercises passed, of, last graded)."""

    rows: list[tuple[str, float | None, float | None, int, int, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{'exercise set':<28} {'points':>9}  {'exercises passed':<17} last graded",
                 f"{'-' * 28} {'-' * 9}  {'-' * 17} {'-' * 16}"]
        for name, score, possible, passed, total, when in self.rows:
            points = f"{score:g}/{possible:g}" if score is not None else "-"
            ex = f"{passed} of {total}" if total else "not graded yet"
            lines.append(f"{name:<28} {points:>9}  {ex:<17} {when}")
        done = [r for r in self.rows if r[1] is not None]
        if done:
            lines.append(f"\n{len(done)} of {len(self.rows)} sets graded; {sum(r[1] for r in done):g} of "
                         f"{sum(r[2] for r in done):g} points in those")
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def progress_table(root: Path | None = None, *, echo: bool = False) -> Progress:
    """Every exercise set (``grading/source/*.ipynb``), with its last grade from ``.pagedkv/progress.json``
    ("not graded yet" otherwise). In a notebook, the returned value displays as the table; ``echo`` prints it."""
    root = (root or _root()).resolve()
    data = _read(root / PROGRESS_FILE).get("sets", {})
    names = sorted({p.stem for p in (root / "grading" / "source").glob("*.ipynb")
                    if re.match(r"^\d\d_", p.stem)} | set(data))
    rows = []
    for name in names:
        entry = data.get(name)
        if not isinstance(entry, dict):
            rows.append((name, None, None, 0, 0, ""))
            continue
        exercises = [e for e in entry.get("exercises") or [] if isinstance(e, dict)]
        rows.append((name, float(entry.get("score") or 0), float(entry.get("possible") or 0),
                     sum(e.get("status") == "passed" for e in exercises), len(exercises),
                     str(entry.get("graded_at") or "")))
    table = Progress(rows)
    if echo:
        print(table)
    return table


def find_this_notebook(namespace: dict | None = None) -> Path | None:
    """The notebook file of the running kernel: Jupyter's ``JPY_SESSION_NAME``, IPython's ``__session__`` (and
    VS Code's ``__vsc_ipynb_file__``) in the user's namespace, else the only ``NN_*.ipynb`` in the working folder."""
    candidates: list[str] = []
    if os.environ.get("JPY_SESSION_NAME"):
        candidates.append(os.environ["JPY_SESSION_NAME"])
    if namespace is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
            namespace = shell.user_ns if shell is not None else {}
        except Exception:  # noqa: BLE001 - not in IPython
            namespace = {}
    for key in ("__session__", "__vsc_ipynb_file__"):
        value = namespace.get(key)
        if isinstance(value, str):
            candidates.append(value)
    for c in candidates:
        p = Path(c)
        if p.suffix == ".ipynb" and p.is_file():
            return p
    local = sorted(Path.cwd().glob("[0-9][0-9]_*.ipynb"))
    return local[0] if len(local) == 1 else None


def grade_notebook_here(path: str | Path | None = None, *, timeout: float = 600.0) -> list[dict]:
    """Grade this notebook's saved file (or ``path``) as ``pagedkv grade`` does: in another process, the
    learner's code in sandboxes; print the score table and return the notebooks' JSON entries. Save the
    notebook first: the file on disk is what is graded."""
    notebook = Path(path) if path else find_this_notebook()
    if notebook is None:
        print("Cannot tell which notebook this is: call grade_notebook_here('NN_name.ipynb') with its file name.")
        return []
    with tempfile.TemporaryDirectory(prefix="pagedkv-here-") as tmp:
        out = Path(tmp) / "grade.json"
        proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", str(notebook), "--json", str(out),
                               "--quiet"], capture_output=True, text=True, timeout=timeout)
        print(proc.stdout.rstrip() or proc.stderr.rstrip())
        if not out.is_file():
            return []
        return json.loads(out.read_text(encoding="utf-8")).get("notebooks", [])
