"""Build the exercise sets: ``grading/source/NN_name.ipynb`` -> exercises/, solutions/, grading/autograder/.

Each source notebook is the single source of one exercise set (otter-grader's assign format: solutions and
tests inside; see ``grading/README.md``). For every source, :func:`build_set` runs ``otter assign`` in a
temporary folder and keeps three outputs:

- ``exercises/NN_name.ipynb``: the learner's notebook (otter's student version: stubs, check cells, the
  public tests in its metadata), without outputs;
- ``solutions/NN_name.ipynb``: the completed notebook (otter's autograder version: the solutions, every test
  in its metadata), without outputs;
- ``grading/autograder/NN_name.zip``: what ``otter run`` needs to grade a submission: ``otter_config.json``
  and ``tests/*.py`` with every test, hidden ones included; and ``questions.json``, the questions in notebook
  order with their description, for the score table, the notebook's checks and the sandbox.

Both notebooks are then made the lab's own: otter's init cell (``otter.Notebook("NN_name.ipynb")``, which reads
the tests from the file it names and fails in a renamed copy) becomes ``grader = Checks("NN_name")``
(:mod:`pagedkv.grading.notebook`, which finds the tests by the set's name), a "check everything" section ends
the notebook (``grader.check_all()``, and how to ``grader.reset(name)`` an exercise), and the set's description
(:func:`describe_questions`: each exercise's number, heading, stub and reference symbols) goes into the
notebook's metadata and the zip's ``questions.json``.

The outputs are made byte-for-byte reproducible (cell ids derived from the cells' content, no outputs or
execution counts, zip entries sorted with a fixed date and mode), so ``pagedkv build-exercises --check``
can rebuild into memory and report any committed file that differs: the sign that a source changed and
``./lab exercises`` was not run. A rebuild never overwrites a notebook with someone's work in it: the zip records
the sha256 of the two notebooks it was built with (``GENERATED_FILE``), and a notebook that differs both from
the new build and from that record (a learner's answers, or a notebook opened and saved) is refused, the whole
build writing nothing, unless ``--force`` is given (which keeps a copy under ``.pagedkv/replaced/``).

Otter's Gradescope files (setup.sh, environment.yml, run_autograder) are
left out: they pin otter's own version, which would make the check fail whenever otter is upgraded, and
``otter run`` does not read them (an instructor who wants Gradescope runs ``otter assign`` on the source).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shutil
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # nbformat is imported where it is used: with jsonschema it takes seconds to import, and
    import nbformat  # `pagedkv grade` needs only this module's paths

__all__ = [
    "CHECK_ALL_SOURCE",
    "GENERATED_FILE",
    "QUESTIONS_FILE",
    "SET_NAME",
    "BuiltSet",
    "build_all",
    "build_set",
    "check_source",
    "describe_questions",
    "find_sources",
    "init_cell_source",
    "question_order",
    "repo_root",
]

#: An exercise set's file name: two digits, an underscore, a lowercase name.
SET_NAME = re.compile(r"^\d\d_[a-z0-9_]+$")

#: Files of otter's autograder zip that ``otter run`` does not read (Gradescope image set-up).
_GRADESCOPE_ONLY = {"environment.yml", "setup.sh", "run_autograder", "run_otter.py", "requirements.txt",
                    "requirements.R", "run_autograder.r"}

_ZIP_DATE = (2020, 1, 1, 0, 0, 0)

#: The autograder zip's description of the set, read by the grader and the notebook's checks:
#: ``{"questions": [name, ...], "exercises": {name: {number, heading, stub, reference, points, ...}}}`` (see
#: :func:`describe_questions`); the generated notebooks carry the same under ``metadata["pagedkv"]``.
QUESTIONS_FILE = "questions.json"

#: The autograder zip's record of the notebooks built with it: ``{"exercises/NN_name.ipynb": sha256, ...}``. The
#: next build replaces a notebook only when it is still exactly what this build wrote (see :func:`build_all`).
GENERATED_FILE = "generated.json"

#: The check-all section that ends every generated notebook (markdown, then the code cell).
CHECK_ALL_MARKDOWN = """## Check everything

The cell below runs the public test cases of every exercise in this notebook and lists, per exercise, how many
pass and the points the exercise is worth, then each failing case in full. (`./lab grade` runs the hidden cases
too and gives your points.)

To start an exercise over, run `grader.reset("name")` in any cell, with the exercise's name as its check cell
spells it (`grader.check("name")`): it prints the exercise's code as it was handed out and puts it in a new cell
below, ready to run. Your own cell is left as it is."""
CHECK_ALL_SOURCE = "grader.check_all()"

_OTTER_INIT = "# Initialize Otter"
_CHECK_CALL = re.compile(r'^grader\.check\("([^"]+)"\)\s*$')
_POINTS = re.compile(r"\s*\(\s*\d+(?:\.\d+)?\s+points?\s*\)\s*$")


def init_cell_source(set_name: str) -> str:
    """The first cell of a generated notebook: the checks, found by the set's name (not the file's), so that a
    renamed or moved copy of the notebook checks like the original (otter's own init cell names the file)."""
    return (
        "# The checks of this exercise set (they work in a renamed or moved copy of this notebook too)\n"
        "from pagedkv.grading.notebook import Checks\n\n"
        f'grader = Checks("{set_name}")'
    )


def repo_root() -> Path:
    """The repository this package lives in (an editable install: pagedkv/grading/build.py -> root)."""
    return Path(__file__).resolve().parents[2]


@dataclass
class BuiltSet:
    """The three outputs of one exercise set, as bytes, with where they belong (relative to the root)."""

    name: str
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content


def find_sources(root: Path, names: list[str] | None = None) -> list[Path]:
    """``grading/source/NN_name.ipynb`` files, sorted; ``names`` (``01``, ``1`` or ``01_fragmentation``) selects.
    A name that matches no source raises ValueError, listing the sets that exist."""
    sources = sorted(p for p in (root / "grading" / "source").glob("*.ipynb") if SET_NAME.match(p.stem))
    if names:
        wanted = {n.zfill(2) if n.isdigit() else n: n for n in names}  # 8 -> 08: the number without its zero
        picked = [p for p in sources if p.stem in wanted or p.stem[:2] in wanted]
        found = {p.stem for p in picked} | {p.stem[:2] for p in picked}
        unknown = [typed for key, typed in wanted.items() if key not in found]
        if unknown:
            there = ", ".join(p.stem for p in sources) or "none"
            raise ValueError(f"no exercise source named {', '.join(unknown)} in grading/source/ (the sets: {there})")
        return picked
    return sources


def _normalise_notebook(nb: nbformat.NotebookNode) -> bytes:
    """No outputs, no execution counts, cell ids from the cells' content; nbformat's own JSON layout."""
    import nbformat

    seen: dict[str, int] = {}
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            # otter's init cell, laid out as ruff's isort rule wants (a blank line after the import)
            cell.source = cell.source.replace("import otter\ngrader = ", "import otter\n\ngrader = ")
        cell.metadata.pop("execution", None)
        digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode()).hexdigest()[:10]
        k = seen.get(digest, 0)
        seen[digest] = k + 1
        cell.id = f"c{digest}" + (f"-{k}" if k else "")
    nb.nbformat, nb.nbformat_minor = 4, max(5, int(nb.get("nbformat_minor", 5)))
    nbformat.validate(nb)
    text = nbformat.writes(nb)
    return (text if text.endswith("\n") else text + "\n").encode("utf-8")


def question_order(nb: nbformat.NotebookNode) -> list[str]:
    """The ``name`` of every ``# BEGIN QUESTION`` raw cell of a source notebook, in notebook order."""
    import yaml  # otter's dependency

    names = []
    for cell in nb.cells:
        text = cell.source.lstrip() if cell.cell_type == "raw" else ""
        if text.startswith("# BEGIN QUESTION"):
            config = yaml.safe_load(text.split("\n", 1)[1] if "\n" in text else "") or {}
            if isinstance(config, dict) and isinstance(config.get("name"), str):
                names.append(config["name"])
    return names


def describe_questions(source_nb: nbformat.NotebookNode, student_nb: nbformat.NotebookNode) -> dict:
    """``{"questions": [...], "exercises": {name: {"number", "heading", "stub", "reference", "points",
    "public_points", "heading_points"}}}``.

    From the source: each question's heading (its first markdown heading, without the "## " and the points:
    what JupyterLab's table of contents shows), the number it starts with, and the library symbols that answer
    it (``reference:`` in the ``# BEGIN QUESTION`` cell, a list of dotted names such as
    ``pagedkv.fragmentation.blocks_needed``; the grader makes them unreachable from the learner's code). From
    the learner's notebook: the answer cells as handed out, which ``grader.reset(name)`` brings back. The
    points: what the grader awards (the sum of every test case's ``points:``, hidden ones included), what the
    public cases are worth, and what the heading says ("(3 points)"; None without); a test checks they agree."""
    import yaml  # otter's dependency

    exercises: dict[str, dict] = {}
    order: list[str] = []
    current: str | None = None
    for cell in source_nb.cells:
        text = cell.source.lstrip()
        if cell.cell_type == "raw" and text.startswith("# BEGIN QUESTION"):
            config = yaml.safe_load(text.split("\n", 1)[1] if "\n" in text else "") or {}
            name = config.get("name") if isinstance(config, dict) else None
            if not isinstance(name, str):
                current = None
                continue
            reference = config.get("reference") or []
            if isinstance(reference, str):
                reference = [reference]
            current = name
            order.append(name)
            exercises[name] = {"number": None, "heading": "", "stub": "",
                               "reference": [str(r) for r in reference], "points": 0.0, "public_points": 0.0,
                               "heading_points": None}
        elif cell.cell_type == "raw" and text.startswith("# END QUESTION"):
            current = None
        elif current and cell.cell_type == "code" and text.startswith('""" # BEGIN TEST CONFIG'):
            block = text.split('""" # END TEST CONFIG', 1)[0].removeprefix('""" # BEGIN TEST CONFIG')
            case = yaml.safe_load(block) or {}
            points = float(case.get("points") or 0) if isinstance(case, dict) else 0.0
            exercises[current]["points"] += points
            if not (isinstance(case, dict) and case.get("hidden")):
                exercises[current]["public_points"] += points
        elif current and cell.cell_type == "markdown" and not exercises[current]["heading"]:
            for line in cell.source.splitlines():
                m = re.match(r"^#+\s+(.*\S)\s*$", line)
                if m:
                    stated = _POINTS.search(m.group(1))
                    if stated:
                        exercises[current]["heading_points"] = float(re.findall(r"\d+(?:\.\d+)?",
                                                                                 stated.group(0))[0])
                    heading = _POINTS.sub("", m.group(1))
                    exercises[current]["heading"] = heading
                    number = re.match(r"^(\d+)[.)]\s", heading)
                    exercises[current]["number"] = int(number.group(1)) if number else None
                    break
    answers: list[str] = []
    for cell in student_nb.cells:
        if cell.cell_type != "code":
            continue
        if "otter_answer_cell" in (cell.metadata.get("tags") or []):
            answers.append(cell.source)
            continue
        m = _CHECK_CALL.match(cell.source.strip())
        if m:
            if m.group(1) in exercises and answers:
                exercises[m.group(1)]["stub"] = "\n\n\n".join(answers)
            answers = []
    return {"questions": order, "exercises": exercises}


def _finish_notebook(nb: nbformat.NotebookNode, set_name: str, description: dict) -> nbformat.NotebookNode:
    """otter's notebook made ours: the init cell finds the checks by the set's name, the set's description is
    in the metadata (for the checks when the zip is not at hand), and a check-all section ends it."""
    import nbformat

    locked = {"deletable": False, "editable": False}
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith(_OTTER_INIT):
            cell.source = init_cell_source(set_name)
            break
    else:
        nb.cells.insert(0, nbformat.v4.new_code_cell(init_cell_source(set_name), metadata=dict(locked)))
    nb.metadata["pagedkv"] = description
    nb.cells.append(nbformat.v4.new_markdown_cell(CHECK_ALL_MARKDOWN, metadata=dict(locked)))
    nb.cells.append(nbformat.v4.new_code_cell(CHECK_ALL_SOURCE, metadata=dict(locked)))
    return nb


def _normalise_zip(path: Path, description: dict, generated: dict[str, str]) -> bytes:
    """Otter's autograder zip, rewritten reproducibly: only what ``otter run`` reads, sorted, fixed dates; plus
    ``QUESTIONS_FILE``, the questions in notebook order (otter's own files name them only alphabetically, and
    ``pagedkv grade`` lists exercises as the learner meets them), and ``GENERATED_FILE``, the sha256 of the
    notebooks built with it. ``otter run`` ignores both."""
    out = io.BytesIO()
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        entries = {name: src.read(name) for name in src.namelist()
                   if not name.endswith("/") and name not in _GRADESCOPE_ONLY}
        entries[QUESTIONS_FILE] = (json.dumps(description, indent=2) + "\n").encode()
        entries[GENERATED_FILE] = (json.dumps(generated, indent=2, sort_keys=True) + "\n").encode()
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            info.create_system = 3  # unix, whatever the building machine
            data = entries[name]
            if name == "otter_config.json":  # stable key order and layout
                data = (json.dumps(json.loads(data), indent=2, sort_keys=True) + "\n").encode()
            dst.writestr(info, data)
    return out.getvalue()


def check_source(source: Path) -> None:
    """The rules otter does not enforce but the grader relies on (see grading/README.md): the first cell is
    the raw ``# ASSIGNMENT CONFIG`` cell, its ``name`` is the file's stem (the grader matches notebooks to
    zips by name and otter refuses a submission whose stored name differs), tests are exception-based."""
    import nbformat
    import yaml  # otter's dependency

    nb = nbformat.read(source, as_version=4)
    first = nb.cells[0] if nb.cells else None
    if first is None or first.cell_type != "raw" or not first.source.lstrip().startswith("# ASSIGNMENT CONFIG"):
        raise ValueError(f"{source.name}: the first cell must be a raw cell starting with '# ASSIGNMENT CONFIG'")
    config = yaml.safe_load(first.source) or {}
    if config.get("name") != source.stem:
        raise ValueError(f"{source.name}: ASSIGNMENT CONFIG name is {config.get('name')!r}; it must be {source.stem!r}")
    if (config.get("tests") or {}).get("ok_format") is not False:
        raise ValueError(
            f"{source.name}: set 'tests: ok_format: false' in ASSIGNMENT CONFIG (otter's default OK format turns a "
            "def test_... cell into a doctest that never calls it, so it passes whatever the learner writes)"
        )
    if config.get("export_cell", True) is not False:
        raise ValueError(f"{source.name}: set 'export_cell: false' (the export cell zips a submission for upload)")


def build_set(source: Path) -> BuiltSet:
    """Run ``otter assign`` on one source notebook and return its three outputs (nothing is written)."""
    import nbformat
    from otter.assign import main as otter_assign  # heavy import (pandas, ...): only when building

    source = source.resolve()
    check_source(source)
    name = source.stem
    with tempfile.TemporaryDirectory(prefix=f"pagedkv-assign-{name}-") as tmp:
        dist = Path(tmp) / "dist"
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                otter_assign(str(source), str(dist), no_pdfs=True, no_run_tests=True)
        except Exception as exc:
            raise RuntimeError(
                f"otter assign failed on {source.name}: {type(exc).__name__}: {exc}\n{log.getvalue()[-3000:]}"
            ) from exc
        student = dist / "student" / f"{name}.ipynb"
        solution = dist / "autograder" / f"{name}.ipynb"
        zips = sorted((dist / "autograder").glob("*.zip"))
        if not (student.is_file() and solution.is_file() and len(zips) == 1):
            raise RuntimeError(f"otter assign on {source.name} did not produce the expected files in {dist}")
        built = BuiltSet(name)
        student_nb = nbformat.read(student, as_version=4)
        description = describe_questions(nbformat.read(source, as_version=4), student_nb)
        built.files[f"exercises/{name}.ipynb"] = _normalise_notebook(_finish_notebook(student_nb, name, description))
        solution_nb = _finish_notebook(nbformat.read(solution, as_version=4), name, description)
        built.files[f"solutions/{name}.ipynb"] = _normalise_notebook(solution_nb)
        generated = {rel: hashlib.sha256(data).hexdigest() for rel, data in built.files.items()}
        built.files[f"grading/autograder/{name}.zip"] = _normalise_zip(zips[0], description, generated)
    return built


def _orphans(root: Path, names: set[str]) -> list[str]:
    """Generated-looking files whose source is gone."""
    found = []
    for folder, suffix in (("exercises", ".ipynb"), ("solutions", ".ipynb"), ("grading/autograder", ".zip")):
        for p in sorted((root / folder).glob(f"*{suffix}")):
            if SET_NAME.match(p.stem) and p.stem not in names:
                found.append(f"{folder}/{p.name}")
    return found


def _last_built(root: Path, name: str) -> dict[str, str]:
    """The sha256 of the notebooks the committed zip of set ``name`` was built with ({} without a record)."""
    try:
        with zipfile.ZipFile(root / "grading" / "autograder" / f"{name}.zip") as zf:
            data = json.loads(zf.read(GENERATED_FILE))
        return data if isinstance(data, dict) else {}
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return {}


def build_all(root: Path | None = None, names: list[str] | None = None, *, check: bool = False,
              force: bool = False, echo=print) -> int:
    """Build every exercise set (or those in ``names``). With ``check``, write nothing and report the
    committed files that differ from a fresh build. Returns a process exit status: 0 when all is well.

    A notebook on disk that differs from the new build is replaced only when it is exactly what the last build
    wrote (its sha256 is in the set's zip, ``GENERATED_FILE``): a source changed, nobody touched the notebook.
    Any other (a learner's answers, a notebook opened and saved) is refused, and then nothing at all is
    written (exit status 1), unless ``force``: then a copy of each is kept under ``.pagedkv/replaced/``."""
    root = (root or repo_root()).resolve()
    sources = find_sources(root, names)
    if not sources:
        echo(f"no exercise sources in {root / 'grading' / 'source'} (expected NN_name.ipynb)")
        return 0
    stale: list[str] = []
    plan: list[tuple[str, bytes | None]] = []  # (file, its new content; None: unchanged), in build order
    changed: list[str] = []  # notebooks that differ from both the new build and the last one: someone's work
    for source in sources:
        built = build_set(source)
        last = _last_built(root, built.name)
        for rel, data in built.files.items():
            path = root / rel
            current = path.read_bytes() if path.is_file() else None
            own = current is not None and rel.endswith(".ipynb") and (
                last.get(rel) != hashlib.sha256(current).hexdigest())
            if current == data:
                plan.append((rel, None))
            elif check and not own:
                stale.append(rel + ("" if current is not None else " (missing)"))
            else:
                if own:
                    changed.append(rel)
                plan.append((rel, data))
    if changed and check:
        echo("These notebooks have changes of their own (your answers, or the notebook was opened and saved): they "
             "differ from what the last build wrote, and `./lab exercises` would not replace them without --force:")
        for rel in changed:
            echo(f"  {rel}")
    if changed and not force and not check:
        echo("Not rebuilding: these notebooks have changes of their own (your answers, or the notebook was "
             "opened and saved), and a rebuild would replace them:")
        for rel in changed:
            echo(f"  {rel}")
        echo("Nothing was written. To start one exercise over, run grader.reset(\"name\") in its notebook. "
             "To replace the notebooks anyway (an instructor regenerating after editing grading/source/), add "
             "--force: `./lab exercises --force` keeps a copy of each under .pagedkv/replaced/.")
        return 1
    if changed:
        backup = root / ".pagedkv" / "replaced" / time.strftime("%Y%m%d-%H%M%S")
        for rel in changed:
            (backup / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, backup / rel)
            echo(f"  kept a copy of {rel} in {(backup / rel).relative_to(root)}")
    for rel, data in [] if check else plan:
        if data is None:
            echo(f"  unchanged  {rel}")
            continue
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        echo(f"  wrote      {rel}")
    orphans = [] if names else _orphans(root, {s.stem for s in sources})
    if check:
        problems = stale + [f"{o} (no grading/source/{Path(o).stem}.ipynb)" for o in orphans]
        if changed and not problems:
            return 1
        if problems:
            echo("Generated exercise files are stale; run `./lab exercises` (pagedkv build-exercises):")
            for p in problems:
                echo(f"  {p}")
            return 1
        echo(f"exercise files up to date ({len(sources)} set{'s' if len(sources) != 1 else ''})")
        return 0
    for o in orphans:
        echo(f"  warning: {o} has no source in grading/source/ (left as it is)")
    return 0
