"""Every lesson (``notebooks/*.ipynb``) and every completed exercise set (``solutions/*.ipynb``) runs top to
bottom without an error, in a fresh kernel, with (a mirror of) the notebook's own folder as the working directory.

Notebooks are found by glob, so a new lesson is tested as soon as it lands. Each cell has a time limit
(``CELL_TIMEOUT``); nothing is written back to the notebooks. In ``solutions/`` the check cells run the
tests too (``grader.check``), so a failing check shows up here as well as in ``test_grading.py``.

The kernels run with ``PAGEDKV_SMALL_WORKLOADS=1``: a lesson whose simulations, sweeps or benchmarks take most of
its run time (lessons 2, 3, 4, 6, 7 and 9) reads it and runs smaller workloads, on which each of its asserts (the
claims its text makes) still holds.
The committed outputs are the full size's (``./lab`` never sets it), so what a reader sees is what a learner's
run prints.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
CELL_TIMEOUT = 600  # seconds per cell (the kernel lesson's interpreter runs are the slowest)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))


def mirror(path: Path, tmp_path: Path) -> Path:
    """A working folder for running ``path`` that writes nothing into the checkout: ``tmp_path`` holds links to
    the checkout's top-level entries and to the files of the notebook's own folder, so relative paths
    (``../benchmarks/results``) read the checkout, while what a notebook writes in its folder (otter's
    ``.OTTER_LOG``, a saved model) stays in ``tmp_path``. Two pytest-xdist workers never share a folder."""
    for entry in ROOT.iterdir():
        if entry.name != path.parent.name and not entry.name.startswith("."):
            (tmp_path / entry.name).symlink_to(entry)
    folder = tmp_path / path.parent.name
    folder.mkdir()
    for entry in path.parent.iterdir():
        if not entry.name.startswith("."):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.slow
@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}/{p.name}" for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGEDKV_SMALL_WORKLOADS", "1")  # the kernel inherits this process's environment
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        allow_errors=False,
        resources={"metadata": {"path": str(mirror(path, tmp_path))}},
    )
    try:
        client.execute()
    except CellExecutionError as exc:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # drop the traceback's colours
        pytest.fail(f"{path.relative_to(ROOT)} failed:\n{plain[-4000:]}", pytrace=False)
    if path.parent.name == "solutions":
        # a check cell that fails does not raise: look at what it displayed
        for cell in nb.cells:
            if cell.cell_type == "code" and "grader.check(" in cell.source:
                text = "".join(
                    str(out.get("data", {}).get("text/plain", "")) + str(out.get("text", "")) for out in cell.outputs
                )
                assert "❌" not in text and "Test case failed" not in text, f"{cell.source}: {text[-2000:]}"


LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LINK = re.compile(r"\]\(([^)\s]+)\)|(?:src|href)=\"([^\"]+)\"")


@pytest.mark.parametrize("path", LESSONS, ids=[p.name for p in LESSONS])
def test_committed_lesson_is_executed_with_no_error_and_its_links_resolve(path: Path):
    """What a reader sees on GitHub: every code cell ran, no error output, every relative link works."""
    nb = nbformat.read(path, as_version=4)
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            for m in LINK.finditer(cell.source):
                link = m.group(1) or m.group(2)
                if re.match(r"(https?:|mailto:|#|attachment:)", link):
                    continue
                if not (path.parent / link.split("#")[0]).exists():
                    problems.append(f"cell {i}: broken link {link}")
        elif cell.cell_type == "code" and cell.source.strip():
            if cell.get("execution_count") is None:
                problems.append(f"cell {i}: not executed")
            problems += [f"cell {i}: error output {o.get('ename')}" for o in cell.outputs if o.output_type == "error"]
    assert not problems, f"{path.name}: " + "; ".join(problems)
