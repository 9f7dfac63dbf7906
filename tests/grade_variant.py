"""Grade a planted answer end to end: a copy of an exercise notebook with some answer cells replaced."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def grade_variant(tmp_path: Path, name: str, answers: dict[str, str]) -> dict[str, float]:
    """Grade (``pagedkv grade``) a copy of ``exercises/NAME.ipynb`` whose answer cells (found by the name their stub
    defines, a ``def`` or a ``class``, decorated or not) are replaced by ``answers``; the score of each exercise."""
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
                           "--no-progress"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return {e["name"]: e["score"] for e in json.loads((tmp_path / "r.json").read_text())["notebooks"][0]["exercises"]}
