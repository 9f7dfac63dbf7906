"""The generated exercise notebooks: checks that work from any file name and folder, whole messages that name
the exercise as the notebook shows it, a check-all cell, reset to the stub, and the per-exercise description
(heading, stub, reference symbols) that the grader reads from ``questions.json``."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import shutil
import textwrap
import zipfile
from pathlib import Path

import nbformat
import pytest

from pagedkv.grading import notebook as nbchecks
from pagedkv.grading.build import CHECK_ALL_SOURCE, QUESTIONS_FILE, SET_NAME, init_cell_source

ROOT = Path(__file__).resolve().parents[1]
SETS = sorted(p.stem for p in (ROOT / "grading" / "source").glob("*.ipynb") if SET_NAME.match(p.stem))
BUILT = [s for s in SETS if (ROOT / "grading" / "autograder" / f"{s}.zip").is_file()]


def _description(name: str) -> dict:
    with zipfile.ZipFile(ROOT / "grading" / "autograder" / f"{name}.zip") as zf:
        return json.loads(zf.read(QUESTIONS_FILE))


def _resolve(dotted: str) -> object:
    """``pagedkv.block_pool.BlockPool.free_blocks`` -> the object (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if inspect.isfunction(obj):  # a function nested in a function (a factory's inner ``run``): its def
                obj = next(n for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(obj))))
                           if isinstance(n, ast.FunctionDef) and n.name == attr)
            else:
                obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


@pytest.mark.parametrize("name", BUILT)
def test_generated_notebooks_check_by_set_name_and_end_with_check_all(name: str) -> None:
    for folder in ("exercises", "solutions"):
        nb = nbformat.read(ROOT / folder / f"{name}.ipynb", as_version=4)
        first = nb.cells[0]
        assert first.source == init_cell_source(name)
        assert f"{name}.ipynb" not in first.source and "otter.Notebook" not in first.source
        assert nb.cells[-1].source == CHECK_ALL_SOURCE and nb.cells[-2].cell_type == "markdown"
        assert 'grader.reset("' in nb.cells[-2].source
        assert nb.metadata["pagedkv"] == _description(name)


@pytest.mark.parametrize("name", BUILT)
def test_every_exercise_is_described_and_its_reference_symbols_exist(name: str) -> None:
    if name.startswith("06"):
        pytest.importorskip("triton")
    data = _description(name)
    assert data["questions"] and set(data["questions"]) == set(data["exercises"])
    numbers = [data["exercises"][q]["number"] for q in data["questions"] if data["exercises"][q]["number"]]
    assert numbers == sorted(set(numbers)), numbers  # headings "## 1. ...", "## 2. ...", in notebook order
    for q in data["questions"]:
        info = data["exercises"][q]
        assert info["heading"] and "points)" not in info["heading"], info["heading"]
        assert "..." in info["stub"] and "# BEGIN SOLUTION" not in info["stub"]
        for symbol in info["reference"]:
            if "/" in symbol:  # a library file (a compiled op's source), emptied in the sandbox's copy
                assert (ROOT / symbol).is_file(), symbol
            else:
                assert _resolve(symbol) is not None, symbol


def test_a_check_names_the_exercise_and_shows_the_whole_message() -> None:
    checks = nbchecks.Checks("01_fragmentation")

    def blocks_needed(num_tokens, block_size):  # floor instead of ceil
        if num_tokens < 0 or block_size < 1:
            raise ValueError("bad input")
        return num_tokens // block_size

    result = checks.check("blocks_needed", {"blocks_needed": blocks_needed})
    text = repr(result)
    assert text.startswith("Exercise 1. `blocks_needed(num_tokens, block_size)`: 0/2 public cases pass; the grader "
                           "also runs hidden cases for the full 3 points")
    assert "blocks_needed(40, 16) returned 2, expected 3" in text and "rounded down" in text
    assert "Error at line" not in text and "cell " not in text
    assert not result.passed and result.possible == 2

    def good(num_tokens, block_size):
        if num_tokens < 0 or block_size < 1:
            raise ValueError("bad input")
        return -(-num_tokens // block_size)

    assert checks.check("blocks_needed", {"blocks_needed": good}).passed
    unknown = repr(checks.check("no_such_exercise", {}))
    assert "has no exercise named 'no_such_exercise'" in unknown


def test_a_long_hint_is_never_cut() -> None:
    """The int64 hint of set 06 was cut at 300 characters in the grade table; in the notebook nothing is cut."""
    source = '''
from otter.test_files import test_case

@test_case(points=1, hidden=False)
def test_long(x):
    raise AssertionError("start " + "word " * 200 + "END")
'''
    (case,) = nbchecks.run_test_file(source, "long", {"x": 1})
    assert not case.passed and case.message.endswith("END") and len(case.message) > 1000


def test_check_all_lists_every_exercise_in_order() -> None:
    summary = nbchecks.Checks("01_fragmentation").check_all({})
    text = repr(summary)
    order = [text.index(f"Exercise {n}.") for n in range(1, 5)]
    assert order == sorted(order)
    assert "0/2 public cases pass; the grader also runs hidden cases for the full 3 points" in text
    assert "0/4 public cases pass; the grader also runs hidden cases for the full 5 points" in text  # paged_admission
    assert "is not defined" in text


def test_reset_prints_the_stub_and_offers_it_as_the_next_cell(capsys, monkeypatch) -> None:
    offered = []

    class Shell:
        def set_next_input(self, text, replace=False):
            offered.append((text, replace))

    monkeypatch.setattr("IPython.get_ipython", lambda: Shell())
    nbchecks.Checks("01_fragmentation").reset("waste_percent")
    out = capsys.readouterr().out
    assert "def waste_percent(lens, block_size: int) -> float:" in out and "    ..." in out
    assert offered and offered[0][1] is False and offered[0][0].startswith("def waste_percent(")
    nbchecks.Checks("01_fragmentation").reset("nope")
    assert "no stub for 'nope'" in capsys.readouterr().out


def test_checks_fall_back_to_the_notebooks_own_metadata(tmp_path, monkeypatch) -> None:
    """Without the repository's zip (the lab installed elsewhere), the public tests embedded in the notebook
    are used; the notebook is found through Jupyter's JPY_SESSION_NAME, whatever its name."""
    copy = tmp_path / "somewhere" / "my renamed copy.ipynb"
    copy.parent.mkdir()
    shutil.copyfile(ROOT / "exercises" / "01_fragmentation.ipynb", copy)
    monkeypatch.setattr("pagedkv.grading.build.repo_root", lambda: tmp_path)  # no grading/autograder there
    monkeypatch.setenv("JPY_SESSION_NAME", str(copy))
    checks = nbchecks.Checks("01_fragmentation")
    assert checks._info is not None and checks._info.where == str(copy)
    text = repr(checks.check("waste_percent", {}))
    assert text.startswith("Exercise 4.") and "waste_percent is not defined" in text
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.chdir(tmp_path)
    assert "cannot check it" in repr(nbchecks.Checks("01_fragmentation").check("waste_percent", {}))


@pytest.mark.slow
@pytest.mark.notebooks
def test_a_renamed_copy_in_another_folder_checks_like_the_original(tmp_path) -> None:
    """Executed in a fresh kernel: otter's init cell named the file and failed here (every check a NameError)."""
    from nbclient import NotebookClient

    outputs = {}
    for folder, new_name in (("solutions", "my-copy.ipynb"), ("exercises", "01_fragmentation-alice.ipynb")):
        where = tmp_path / folder
        where.mkdir()
        shutil.copyfile(ROOT / folder / "01_fragmentation.ipynb", where / new_name)
        nb = nbformat.read(where / new_name, as_version=4)
        NotebookClient(nb, timeout=300, allow_errors=True, resources={"metadata": {"path": str(where)}}).execute()
        errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert not errors, [(o.ename, o.evalue) for o in errors]
        outputs[folder] = [
            "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in c.outputs)
            for c in nb.cells if c.cell_type == "code" and c.source.startswith("grader.")
        ]
    solution, untouched = outputs["solutions"], outputs["exercises"]
    assert len(solution) == 5 and all("pass" in t and "✅" in t for t in solution[:4]), solution
    assert "Every public case passes" in solution[4]
    assert all(t.startswith(f"Exercise {n}.") for n, t in enumerate(untouched[:4], 1)), untouched
    assert all("❌" in t and "still the stub" in t for t in untouched[:4])


@pytest.mark.parametrize("name", BUILT)
def test_headings_state_the_points_the_grader_awards(name: str) -> None:
    """The learner reads "(3 points)" in the heading, the check cell and the grade table: one number."""
    for q, info in _description(name)["exercises"].items():
        assert info["heading_points"] == info["points"] > info["public_points"] > 0, (q, info)


def _learner_names(nb: nbformat.NotebookNode) -> set[str]:
    names: set[str] = set()
    for cell in nb.cells:
        if cell.cell_type == "code" and "otter_answer_cell" in (cell.metadata.get("tags") or []):
            tree = ast.parse(cell.source)
            names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


def _guarded(stmt: ast.stmt) -> bool:
    """A try whose handlers catch every Exception (as the try-it cells do: they print instead of raising)."""
    if not isinstance(stmt, ast.Try):
        return False
    caught = {ast.unparse(h.type) if h.type is not None else "BaseException" for h in stmt.handlers}
    return bool(caught & {"Exception", "BaseException"})


@pytest.mark.parametrize("name", [s for s in BUILT if not s.startswith("06")])
def test_every_try_it_cell_catches_a_wrong_answer(name: str) -> None:
    """A wrong answer must not stop Run All: every statement outside the answer and check cells that uses one
    of the learner's functions or classes sits in a try/except Exception that prints (set 06: its own test)."""
    nb = nbformat.read(ROOT / "exercises" / f"{name}.ipynb", as_version=4)
    learner = _learner_names(nb)
    assert learner
    unguarded = []
    for n, cell in enumerate(nb.cells):
        tags = cell.metadata.get("tags") or []
        if cell.cell_type != "code" or "otter_answer_cell" in tags or cell.source.startswith("grader."):
            continue
        for stmt in ast.parse(cell.source).body:
            if isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)) or _guarded(stmt):
                continue
            used = {x.id for x in ast.walk(stmt) if isinstance(x, ast.Name)} & learner
            if used:
                unguarded.append((n, sorted(used), ast.unparse(stmt).splitlines()[0]))
    assert not unguarded, unguarded


def test_a_set_is_picked_by_its_number_with_or_without_the_zero(tmp_path) -> None:
    from pagedkv.grading.build import find_sources

    folder = tmp_path / "grading" / "source"
    folder.mkdir(parents=True)
    for name in ("01_fragmentation", "08_hybrid_models", "10_tensor_parallelism"):
        (folder / f"{name}.ipynb").write_text("{}")
    picked = {n: [p.stem for p in find_sources(tmp_path, [n])] for n in ("8", "08", "08_hybrid_models", "1", "10")}
    assert picked == {"8": ["08_hybrid_models"], "08": ["08_hybrid_models"], "08_hybrid_models": ["08_hybrid_models"],
                      "1": ["01_fragmentation"], "10": ["10_tensor_parallelism"]}


def test_an_unknown_set_name_lists_the_sets_that_exist(tmp_path, capsys) -> None:
    import pagedkv.cli as cli

    folder = tmp_path / "grading" / "source"
    folder.mkdir(parents=True)
    for name in ("01_fragmentation", "08_hybrid_models"):
        (folder / f"{name}.ipynb").write_text("{}")
    assert cli.main(["build-exercises", "--root", str(tmp_path), "--check", "8", "88", "hybrid"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("pagedkv build-exercises: no exercise source named 88, hybrid in grading/source/ "
                           "(the sets: 01_fragmentation, 08_hybrid_models)")
    assert not any((tmp_path / d).exists() for d in ("exercises", "solutions")), "a refused build wrote nothing"
