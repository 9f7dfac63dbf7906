"""Nothing a learner runs destroys their work or mixes another's scores into theirs (issue 21, items 1 and 2).

- ``./lab exercises`` (``pagedkv build-exercises``) never replaces a notebook that differs from what it would
  generate unless that notebook is exactly what the last build wrote (a source changed, nobody touched it); a
  learner's answers are refused, the whole build writes nothing and the message names ``--force``, which keeps
  a copy;
- ``pagedkv grade`` records progress only for notebooks in the learner's own ``exercises/``: not a class folder
  graded without ``--class``, not ``solutions/``, not a copy elsewhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from pagedkv.grading import grade, progress
from pagedkv.grading.build import build_all

ROOT = Path(__file__).resolve().parents[1]
FRAG = "01_fragmentation"


def _copy_set(tmp_path: Path, name: str = FRAG) -> Path:
    for rel in (f"grading/source/{name}.ipynb", f"grading/autograder/{name}.zip", f"exercises/{name}.ipynb",
                f"solutions/{name}.ipynb"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, tmp_path / rel)
    return tmp_path


def _answer(path: Path) -> bytes:
    """The learner's work: the first answer cell filled in, the notebook saved."""
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "otter_answer_cell" in (c.metadata.get("tags") or []))
    cell.source = cell.source.replace("...", "return -(-num_tokens // block_size)  # my answer", 1)
    nbformat.write(nb, path)
    return path.read_bytes()


def _edit_source(root: Path, name: str = FRAG) -> None:
    """An instructor's edit to the set's source: one more sentence in its first markdown cell."""
    source = root / "grading" / "source" / f"{name}.ipynb"
    nb = json.loads(source.read_text())
    md = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    md["source"] = "".join(md["source"]) + "\n\nA sentence the instructor added."
    source.write_text(json.dumps(nb, indent=1))


def _build(root: Path, **kw) -> tuple[int, str]:
    lines: list[str] = []
    rc = build_all(root, [FRAG], echo=lines.append, **kw)
    return rc, "\n".join(lines)


@pytest.mark.slow
def test_exercises_refuses_to_replace_a_learners_answers_and_names_force(tmp_path):
    root = _copy_set(tmp_path)
    mine = _answer(root / "exercises" / f"{FRAG}.ipynb")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    rc, out = _build(root)  # the learner runs `./lab exercises 01`, the sources unchanged
    assert rc == 1 and f"exercises/{FRAG}.ipynb" in out and "--force" in out and "grader.reset" in out, out
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before, "nothing may be written"
    _edit_source(root)  # a source change does not make it replaceable either, and then too nothing is written
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    rc, out = _build(root)
    assert rc == 1 and "Nothing was written" in out, out
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    # --force replaces it and keeps the learner's copy
    rc, out = _build(root, force=True)
    assert rc == 0, out
    assert (root / "exercises" / f"{FRAG}.ipynb").read_bytes() != mine
    kept = list((root / ".pagedkv" / "replaced").rglob(f"exercises/{FRAG}.ipynb"))
    assert len(kept) == 1 and kept[0].read_bytes() == mine and str(kept[0].relative_to(root)) in out


@pytest.mark.slow
def test_exercises_replaces_what_the_last_build_wrote_when_the_source_changed(tmp_path):
    """The instructor's regeneration needs no --force: the untouched notebooks are what the committed zip
    records; after the rebuild the new zip records the new notebooks, so a second edit rebuilds as well."""
    root = _copy_set(tmp_path)
    for _ in range(2):
        _edit_source(root)
        old = (root / "exercises" / f"{FRAG}.ipynb").read_bytes()
        rc, out = _build(root)
        assert rc == 0 and f"wrote      exercises/{FRAG}.ipynb" in out, out
        new = (root / "exercises" / f"{FRAG}.ipynb").read_bytes()
        assert new != old and b"A sentence the instructor added." in new
        assert not (root / ".pagedkv").exists()
    assert _build(root, check=True)[0] == 0


def _result(path: Path, set_name: str, score: float) -> grade.NotebookResult:
    return grade.NotebookResult(str(path), f"grading/autograder/{set_name}.zip", "graded", score, 12.0, 1.0, "",
                                [grade.ExerciseResult("blocks_needed", score, 12.0, "passed", "")])


def test_progress_is_only_the_learners_own_exercises(tmp_path):
    (tmp_path / "grading" / "source").mkdir(parents=True)
    (tmp_path / "grading" / "source" / f"{FRAG}.ipynb").write_text("{}")
    path = tmp_path / progress.PROGRESS_FILE
    # `./lab grade submissions/` (a class graded without --class): no learner's own notebook, nothing written
    others = [_result(tmp_path / "submissions" / who / f"{FRAG}.ipynb", FRAG, s) for who, s in (("ann", 3), ("bo", 0))]
    elsewhere = _result(tmp_path.parent / f"{FRAG}.ipynb", FRAG, 5.0)
    solution = _result(tmp_path / "solutions" / f"{FRAG}.ipynb", FRAG, 12.0)
    assert progress.record_progress([*others, elsewhere, solution], root=tmp_path) is None
    assert not path.exists()
    # the learner's own notebook is recorded; a later class run leaves it as it is
    assert progress.record_progress([_result(tmp_path / "exercises" / f"{FRAG}.ipynb", FRAG, 12.0)],
                                    root=tmp_path) == path
    recorded = path.read_bytes()
    assert progress.record_progress(others, root=tmp_path) is None
    assert path.read_bytes() == recorded
    assert json.loads(recorded)["sets"][FRAG]["score"] == 12.0


def test_grading_a_class_folder_as_one_learner_says_so_and_records_nothing(tmp_path, monkeypatch, capsys):
    """``./lab grade submissions/`` (00_index once told instructors to): the total is one learner's, so the
    command says to use --class, and the instructor's own progress stays as it was."""
    from pagedkv import cli

    (tmp_path / "grading" / "autograder").mkdir(parents=True)
    (tmp_path / "submissions").mkdir()
    mine = tmp_path / progress.PROGRESS_FILE
    mine.parent.mkdir()
    mine.write_text('{"sets": {"01_fragmentation": {"score": 12.0, "possible": 12.0}}}\n')
    before = mine.read_bytes()
    results = [_result(tmp_path / "submissions" / who / f"{FRAG}.ipynb", FRAG, s) for who, s in (("ann", 3), ("bo", 0))]
    monkeypatch.setattr(grade, "grade_paths", lambda paths, **kw: (results, []))
    monkeypatch.setattr(progress, "_root", lambda: tmp_path)
    zips = tmp_path / "grading" / "autograder"
    rc = cli.main(["grade", str(tmp_path / "submissions"), "--autograder-dir", str(zips)])
    err = capsys.readouterr().err
    assert rc == 0 and "--class FOLDER --csv FILE" in err, err
    assert mine.read_bytes() == before
