"""Grade a planted answer end to end: a copy of an exercise notebook with some answer cells replaced."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``grade_variant``'s default ``only``: the exercises whose answer cells are replaced.
PLANTED = "planted"


def planted_exercises(name: str, answers: Collection[str]) -> list[str]:
    """The exercises of ``exercises/NAME.ipynb`` whose answer cells define one of ``answers``: each answer cell's
    exercise is the first ``grader.check("...")`` after it."""
    nb = json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())
    found: list[str] = []
    waiting = False
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        m = re.search(r"^(?:def|class) (\w+)", source, re.M)
        if "otter_answer_cell" in cell["metadata"].get("tags", []) and m and m.group(1) in answers:
            waiting = True
        check = re.search(r"""grader\.check\(["'](\w+)["']\)""", source)
        if check and waiting:
            found.append(check.group(1))
            waiting = False
    assert not waiting, f"no grader.check after the last answer cell of {name} planted"
    return list(dict.fromkeys(found))


def grade_variant(tmp_path: Path, name: str, answers: dict[str, str],
                  only: Collection[str] | str | None = PLANTED) -> dict[str, float]:
    """Grade (``pagedkv grade``) a copy of ``exercises/NAME.ipynb`` whose answer cells (found by the name their stub
    defines, a ``def`` or a ``class``, decorated or not) are replaced by ``answers``; the score of each exercise
    graded: ``only`` those (``pagedkv grade --only``), by default the exercises of the replaced cells (the others
    hold the stubs, which score 0 anyway), ``None`` for all of them."""
    if only == PLANTED:
        only = planted_exercises(name, answers)
    nb = json.loads((ROOT / "exercises" / f"{name}.ipynb").read_text())
    left = dict(answers)
    for cell in nb["cells"]:
        m = re.search(r"^(?:def|class) (\w+)", "".join(cell["source"]), re.M)
        if "otter_answer_cell" in cell["metadata"].get("tags", []) and m and m.group(1) in left:
            cell["source"] = left.pop(m.group(1))
    assert not left, f"answer cells not found for {set(left)}"
    (tmp_path / "mallory").mkdir()
    path = tmp_path / "mallory" / f"{name}.ipynb"
    path.write_text(json.dumps(nb))
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", str(path), "--json", str(tmp_path / "r.json"),
                           "--no-progress", *(["--only", ",".join(only)] if only is not None else [])],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    scores = {e["name"]: e["score"] for e in json.loads((tmp_path / "r.json").read_text())["notebooks"][0]["exercises"]}
    assert only is None or list(scores) == [q for q in scores if q in only] and set(scores) == set(only), scores
    return scores
