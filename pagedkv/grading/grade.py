"""``pagedkv grade``: grade exercise notebooks headless, each in a worker of its own, with time limits.

For each notebook (files given, or every ``*.ipynb`` under the folders given), the autograder zip is the one
whose name matches the notebook's (``exercises/01_fragmentation.ipynb`` -> ``grading/autograder/
01_fragmentation.zip``; a file such as ``01_fragmentation-alice.ipynb`` matches on its ``NN_`` prefix, and
failing that the assignment name stored in the notebook decides). The notebook is copied to a temporary folder
and graded there by :mod:`pagedkv.grading.worker`, in a session of its own: the learner's code runs only in the
worker's sandboxes (:mod:`pagedkv.grading.sandbox`), the tests and the verdict in the worker. The learner's file
is never opened for writing.

Whatever the notebook does, the outcome is a row per exercise, in the notebook's order: code that raises fails
that exercise's case with the error's message, a call that hangs is interrupted by the check's own time limit, a
test case that waits too long for the learner's code fails as "too slow", a cell that hangs is interrupted by the
per-cell limit (the notebook's row names the cell by its heading and first line), and a notebook still running
at ``timeout`` seconds is stopped, with each of its exercises failed as "timed out". When a function "is not
defined" because the cell defining it raised (a SyntaxError, say) or was interrupted, the failure says so. The
grader itself does not crash on a learner's notebook, and exits 0 when it graded.

The grader reads a notebook file only when it is a regular file of at most ``Limits.notebook_size`` bytes (16
MiB; a learner's notebook is well under 1 MiB), opened without blocking and checked again once open
(:func:`read_notebook`): a named pipe, a device, a socket or an empty file (which is what ``/proc``'s files look
like) is refused unread, so the grader neither hangs on one nor reads a huge file into memory. For a class
(``require_sandbox``), a notebook that is a symbolic link is refused too (the last component is opened with
``O_NOFOLLOW``): it could name a file outside the class folder (another learner's, the solutions, ``/proc/kmsg``).
A refused notebook is listed with every exercise ``refused`` and the reason, like any other result. The path
shown for a notebook, and every message that quotes one, is escaped (:func:`pagedkv.grading.output.
escape_controls`): a file name is the learner's text too.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagedkv.grading.build import QUESTIONS_FILE
from pagedkv.grading.limits import DEFAULT_LIMITS, Limits
from pagedkv.grading.output import escape_controls
from pagedkv.grading.plain import CASE_MESSAGE, cap_text

__all__ = [
    "CaseResult",
    "ExerciseResult",
    "NotebookRefused",
    "UnknownExercise",
    "NotebookResult",
    "find_autograder",
    "display_path",
    "find_notebooks",
    "format_table",
    "grade_notebook",
    "grade_paths",
    "notebook_problem",
    "read_notebook",
    "report_json",
    "unknown_exercises",
]



@dataclass
class CaseResult:
    name: str
    hidden: bool
    points: float
    passed: bool
    message: str  # the failure, as the learner sees it ("" when passed)


@dataclass
class ExerciseResult:
    name: str
    score: float
    possible: float
    status: str  # "passed", "partial", "failed", "refused" (the notebook was not read: NotebookRefused)
    message: str  # the first failure ("" when passed)
    cases: list[CaseResult] = field(default_factory=list)


@dataclass
class NotebookResult:
    notebook: str  # the path as given
    autograder: str | None
    status: str  # "graded", "timeout", "error" (the exercises are then all failed), "refused" (not read)
    score: float
    possible: float
    seconds: float
    message: str = ""  # why it failed; for a graded notebook, the cells interrupted at the per-cell limit ("")
    exercises: list[ExerciseResult] = field(default_factory=list)  # in notebook order
    # the learner's cells that raised or were interrupted: {cell (1-based), first_line, defines, timed_out,
    # seconds, error}
    cells: list[dict] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ finding files
def find_notebooks(paths: Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    """Notebooks named by ``paths`` (files, or folders searched recursively), and the paths that were not
    usable (missing, or not notebooks), as messages.

    Everything named ``*.ipynb`` that is not a folder is a notebook here, a symlink, a named pipe or a device
    too: :func:`grade_notebook` refuses those with the reason, so that they show in the report instead of being
    left out silently. A notebook is listed once however often it is named; a symlink and the file it points to
    are two notebooks (the symlink is refused in a class, so it can never take the place of a learner's file)."""
    found: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        p = Path(raw)
        shown = escape_controls(str(raw))
        if p.is_dir():
            nbs = sorted(
                q for q in p.rglob("*.ipynb")
                if ".ipynb_checkpoints" not in q.parts and (q.is_symlink() or not q.is_dir())
            )
            if not nbs:
                problems.append(f"{shown}: no .ipynb notebooks in this folder")
            found.extend(nbs)
        elif p.suffix == ".ipynb" and (p.is_symlink() or p.exists()):
            found.append(p)
        elif p.is_file():
            problems.append(f"{shown}: not a notebook (.ipynb)")
        else:
            problems.append(f"{shown}: no such file or folder")
    unique: list[Path] = []
    seen: set[Path] = set()
    for p in found:
        key = p.parent.resolve() / p.name  # the folder's symlinks resolved, not the file's own
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique, problems


class NotebookRefused(Exception):
    """A notebook file that the grader does not read (:func:`read_notebook`); the message says why."""


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe (FIFO)", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def _refusal(st: os.stat_result, max_bytes: int) -> str:
    """Why a file of this ``stat`` is not read as a notebook ("" when it is read)."""
    if not stat.S_ISREG(st.st_mode):
        return f"it is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, not a notebook file"
    if st.st_size == 0:
        return "the file is empty (0 bytes)"
    if st.st_size > max_bytes:
        return (f"the file is {st.st_size:,} bytes, over the limit of {max_bytes:,} bytes for a notebook (a "
                "learner's notebook is well under 1 MiB: clear its outputs and hand it in again)")
    return ""


def notebook_problem(path: Path, max_bytes: int = DEFAULT_LIMITS.notebook_size, *,
                     follow_symlinks: bool = True) -> str:
    """Why :func:`read_notebook` would refuse ``path``, from its ``stat`` alone ("" when it would read it)."""
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError as exc:
        return f"cannot read the notebook: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        try:
            target = escape_controls(os.readlink(path))
        except OSError:
            target = "?"
        return (f"it is a symbolic link (to {target}): a class's notebooks are graded only as files of their own "
                "in the class folder")
    return _refusal(st, max_bytes)


def _open_below(root: Path, path: Path, flags: int) -> int:
    """Open ``path`` (lexically below the folder ``root``) one component at a time from ``root``, following no
    symlink on the way (``O_NOFOLLOW`` at every level, each folder opened relative to the last): a folder of the
    class swapped for a symlink after it was listed (to the solutions, say) fails to open instead of being
    followed."""
    parts = path.relative_to(root).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def read_notebook(path: Path, max_bytes: int = DEFAULT_LIMITS.notebook_size, *, follow_symlinks: bool = True,
                  root: Path | None = None) -> bytes:
    """The bytes of the notebook file ``path``, or :class:`NotebookRefused` saying why not: anything but a regular
    file (checked before opening it, so a FIFO or a device is never opened, and again on the open file), an
    empty file (``/proc``'s files are empty to ``stat``, and reading some of them blocks), a file over
    ``max_bytes`` (never read: at most ``max_bytes + 1`` bytes are), and, unless ``follow_symlinks``, a
    symbolic link (opened with ``O_NOFOLLOW``, so one swapped in after the check fails to open); with ``root``
    (the class folder it was found in), no folder between ``root`` and the file may be a symlink either."""
    problem = notebook_problem(path, max_bytes, follow_symlinks=follow_symlinks)
    if problem:
        raise NotebookRefused(problem)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    below = root is not None and not follow_symlinks
    try:
        fd = _open_below(root, path, flags) if below else os.open(path, flags)
    except OSError as exc:
        if below and exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotebookRefused("a folder between the class folder and the notebook is a symbolic link (or became "
                                  "one while the class was graded): a class's notebooks are graded only as files "
                                  "of their own in the class folder") from None
        raise NotebookRefused(f"cannot read the notebook: {exc.strerror}") from None
    try:
        problem = _refusal(os.fstat(fd), max_bytes)
        if problem:
            raise NotebookRefused(problem)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise NotebookRefused(f"cannot read the notebook: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise NotebookRefused(f"the file is over the limit of {max_bytes:,} bytes for a notebook")
    return b"".join(chunks)


def _assignment_name(notebook: Path, max_bytes: int, follow_symlinks: bool) -> str | None:
    try:
        text = read_notebook(notebook, max_bytes, follow_symlinks=follow_symlinks).decode("utf-8", errors="replace")
        meta = json.loads(text).get("metadata", {})
        name = meta.get("otter", {}).get("assignment_name")
        return name if isinstance(name, str) else None
    except Exception:  # noqa: BLE001 - unreadable notebooks are reported when graded
        return None


def find_autograder(notebook: Path, autograder_dir: Path, max_bytes: int = DEFAULT_LIMITS.notebook_size, *,
                    follow_symlinks: bool = True) -> Path | None:
    """The autograder zip for ``notebook``: same name, else same ``NN_`` prefix, else otter's assignment name
    (read only from a notebook that :func:`read_notebook` reads, with the same ``max_bytes`` and
    ``follow_symlinks``)."""
    zips = {z.stem: z for z in sorted(autograder_dir.glob("*.zip"))}
    if notebook.stem in zips:
        return zips[notebook.stem]
    m = re.match(r"^(\d\d)_", notebook.stem)
    if m:
        same = [z for stem, z in zips.items() if stem.startswith(m.group(0))]
        if len(same) == 1:
            return same[0]
    name = _assignment_name(notebook, max_bytes, follow_symlinks)
    if name and name in zips:
        return zips[name]
    return None


def _expected_questions(zip_path: Path) -> list[tuple[str, float]]:
    """(question, points) from the autograder zip's tests, in notebook order, for ordering the exercises and
    reporting a notebook that could not run.

    Reads the test files' ``name`` and ``@test_case(points=...)`` lines without executing them; the order is
    the zip's ``questions.json`` (written by the build), then any other question alphabetically."""
    out = []
    order: list[str] = []
    with zipfile.ZipFile(zip_path) as zf:
        names = zf.namelist()
        if QUESTIONS_FILE in names:
            try:
                listed = json.loads(zf.read(QUESTIONS_FILE)).get("questions", [])
                order = [q for q in listed if isinstance(q, str)]
            except (ValueError, AttributeError):
                order = []
        for entry in sorted(names):
            if not (entry.startswith("tests/") and entry.endswith(".py")):
                continue
            text = zf.read(entry).decode("utf-8", errors="replace")
            name = re.search(r'^name\s*=\s*["\'](.+?)["\']', text, re.M)
            pts = [float(x) for x in re.findall(r"@test_case\(points=([0-9.]+)", text)]
            cases = len(re.findall(r"@test_case\(", text))
            total = sum(pts) if len(pts) == cases else float(cases)
            out.append((name.group(1) if name else Path(entry).stem, total))
    rank = {q: i for i, q in enumerate(order)}
    return sorted(out, key=lambda item: (rank.get(item[0], len(rank)), item[0]))


class UnknownExercise(ValueError):
    """``--only`` named an exercise that a set being graded does not have (raised before any grading)."""


def unknown_exercises(zip_path: Path, only: Iterable[str]) -> str:
    """Why ``only`` does not fit the set of ``zip_path``: the names it does not have, and those it has ("" when
    every name is one of its exercises)."""
    known = [name for name, _ in _expected_questions(zip_path)]
    unknown = [n for n in dict.fromkeys(only) if n not in known]
    if not unknown:
        return ""
    return (f"set {zip_path.stem} has no exercise {', '.join(repr(n) for n in unknown)}; its exercises: "
            f"{', '.join(known)}")


# ------------------------------------------------------------------------------------------ grading
def _clean_message(message: str) -> str:
    """A test case's failure as the learner should read it: otter's "Error at line N in test ..." frame and a
    leading "AssertionError:" removed, whitespace folded."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not re.match(r"^(❌\s*)?Error at line \d+ in test", ln)]
    return escape_controls(_strip_exception_name(" ".join(lines))) or "failed"


def _strip_exception_name(text: str) -> str:
    return re.sub(r"^AssertionError:\s*", "", text)


def _cell_trouble(cell: dict) -> str:
    """What happened to a learner's cell, from the worker's report: 'raised SyntaxError: ... (line 3)'."""
    if cell.get("timed_out"):
        if "could not be interrupted" in str(cell.get("error") or ""):
            return (f"was still running after {float(cell.get('seconds') or 0):g} s and did not stop when "
                    "interrupted (an infinite loop that catches KeyboardInterrupt?), so it was left out")
        return f"was interrupted after {float(cell.get('seconds') or 0):g} s (an infinite loop?)"
    return f"raised {cell.get('error') or 'an error'}"


def _cell_name(cell: dict) -> str:
    """A cell as the learner finds it in JupyterLab: the heading it sits under and its first line, with its
    number (every cell counted from 1, markdown too) last: 'the cell under "3. paged_admission" that starts
    `while True:` (cell 16)'."""
    section = str(cell.get("section") or "")
    first = str(cell.get("first_line") or "")
    where = f' under "{section}"' if section else ""
    return f"the cell{where} that starts `{first}` (cell {cell.get('cell')})"


def _explain_undefined(message: str, cells: list[dict]) -> str:
    """'X is not defined: run the cell ...' becomes 'X is not defined: the cell defining X (cell 5) raised
    SyntaxError: invalid syntax (line 3)' when a cell that defines X raised or was interrupted: the learner did
    run it, and the cell's own error is what to fix."""
    m = re.search(r"\b([A-Za-z_]\w*) is not defined\b", message)
    if not m:
        return message
    name = m.group(1)
    culprits = [c for c in cells if name in (c.get("defines") or [])]
    if not culprits:
        return message
    cell = culprits[-1]
    section = str(cell.get("section") or "")
    where = f' under "{section}"' if section else ""
    return (f"{message[: m.start()]}{name} is not defined: the cell defining {name}{where} (cell {cell.get('cell')}) "
            + _cell_trouble(cell))


def _interrupted_note(cells: list[dict]) -> str:
    """The notebook row's note on cells stopped by the per-cell time limit ('' when there were none)."""
    notes = [f"{_cell_name(c)} {_cell_trouble(c)}" for c in cells if c.get("timed_out")]
    if not notes:
        return ""
    return "; ".join(notes) + ("; the cells after it still ran" if len(notes) == 1 else "; the other cells still ran")


def _exercise_from_json(q: dict, cells: list[dict] | None = None) -> ExerciseResult:
    cells = cells or []
    cases = [
        CaseResult(
            name=c["name"],
            hidden=c["hidden"],
            points=c["points"],
            passed=c["passed"],
            message="" if c["passed"] else cap_text(_explain_undefined(_clean_message(c["message"]), cells),
                                                    CASE_MESSAGE),
        )
        for c in q["cases"]
    ]
    score, possible = float(q["score"]), float(q["possible"])
    failed = [c for c in cases if not c.passed]
    status = "passed" if not failed else ("partial" if score > 0 else "failed")
    message = ""
    if failed:
        first = failed[0]
        message = ("(hidden case) " if first.hidden else "") + first.message
    return ExerciseResult(q["name"], score, possible, status, message, cases)


def _all_failed(expected: list[tuple[str, float]], message: str, status: str = "failed") -> list[ExerciseResult]:
    return [ExerciseResult(name, 0.0, pts, status, message) for name, pts in expected]


def _kill_session(proc: subprocess.Popen) -> None:
    """Stop a worker: SIGTERM first (it then kills its sandbox and everything the learner's code started), then
    its whole session."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def grade_notebook(
    notebook: Path,
    autograder: Path,
    limits: Limits = DEFAULT_LIMITS,
    *,
    shown_as: str | None = None,
    require_sandbox: bool = False,
    only: Iterable[str] | None = None,
    follow_symlinks: bool | None = None,
    root: Path | None = None,
) -> NotebookResult:
    """Grade one notebook against one autograder zip, on a copy, within ``limits.timeout`` seconds
    (``require_sandbox``: fail it rather than grade it without bubblewrap). ``only``: grade those exercises
    alone (:class:`UnknownExercise` for a name the set does not have); the others are left out of the result,
    its ``possible`` too, and their checks never run. The notebook is read by :func:`read_notebook` (at most
    ``limits.notebook_size`` bytes; a symlink only if ``follow_symlinks``, by default when not
    ``require_sandbox``, i.e. not for a class; and, with ``root``, through no symlinked folder below ``root``);
    one it refuses is ``refused``, with the reason."""
    timeout = limits.timeout
    start = time.monotonic()
    label = shown_as or escape_controls(str(notebook))
    if follow_symlinks is None:
        follow_symlinks = not require_sandbox
    expected = _expected_questions(autograder)
    if only is not None:
        only = list(dict.fromkeys(only))
        problem = unknown_exercises(autograder, only)
        if problem:
            raise UnknownExercise(problem)
        expected = [(name, pts) for name, pts in expected if name in only]
    possible = sum(p for _, p in expected)

    def failed(status: str, message: str) -> NotebookResult:
        return NotebookResult(label, str(autograder), status, 0.0, possible, time.monotonic() - start, message,
                              _all_failed(expected, message, "refused" if status == "refused" else "failed"))

    try:
        data = read_notebook(notebook, limits.notebook_size, follow_symlinks=follow_symlinks, root=root)
    except NotebookRefused as exc:
        return failed("refused", f"not graded: {exc}")
    with tempfile.TemporaryDirectory(prefix="pagedkv-grade-") as tmp:
        work = Path(tmp)
        copy = work / "submission" / escape_controls(notebook.name)  # printable: the worker's argv, its messages
        copy.parent.mkdir()
        try:
            copy.write_bytes(data)
        except OSError as exc:
            return failed("error", f"cannot copy the notebook: {exc}")
        out = work / "result.json"
        log_path = work / "worker.log"
        cmd = [
            sys.executable, "-m", "pagedkv.grading.worker",
            "--autograder", str(autograder.resolve()), "--notebook", str(copy), "--out", str(out),
            "--limits", limits.to_json(), *(["--require-sandbox"] if require_sandbox else []),
            *(["--only", json.dumps(only)] if only is not None else []),
        ]
        # the same string hashes in the worker and its sandboxes (builtin_hash answers must match)
        env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg", PYTHONHASHSEED="0")
        with open(log_path, "wb") as log:
            from pagedkv.grading.sandbox import same_hashes, sweep_stale

            proc = subprocess.Popen(cmd, cwd=work, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, preexec_fn=same_hashes)  # noqa: PLW1509
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                return failed("timeout", f"timed out: the notebook was still running after {timeout:g} s")
            finally:
                if proc.poll() is None:
                    _kill_session(proc)
                sweep_stale()  # a worker killed (here, or by the OOM killer) cannot remove its sandboxes' cgroups
        if not out.is_file():
            tail = log_path.read_bytes()[-600:].decode("utf-8", errors="replace").strip().splitlines()
            last = tail[-1] if tail else f"exit status {proc.returncode}"
            return failed("error", f"the grader's worker stopped without a result ({last[:200]})")
        try:
            payload = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return failed("error", f"unreadable grading result: {exc}")

    if not payload.get("ok"):
        return failed("error", payload.get("error") or "grading failed")
    cells = [{k: escape_controls(v) if isinstance(v, str) else v for k, v in c.items()}
             for c in payload.get("cells") or [] if isinstance(c, dict)]
    exercises = [_exercise_from_json(q, cells) for q in payload["questions"]]
    seen = {e.name for e in exercises}
    exercises += _all_failed([(n, p) for n, p in expected if n not in seen], "not graded (its test never ran)")
    rank = {name: i for i, (name, _) in enumerate(expected)}  # notebook order (the zip's questions.json)
    exercises.sort(key=lambda e: (rank.get(e.name, len(rank)), e.name))
    score = sum(e.score for e in exercises)
    possible = sum(e.possible for e in exercises)
    return NotebookResult(label, str(autograder), "graded", score, possible, time.monotonic() - start,
                          _interrupted_note(cells), exercises, cells)


def grade_paths(
    paths: Iterable[str | Path],
    *,
    autograder_dir: Path,
    limits: Limits = DEFAULT_LIMITS,
    require_sandbox: bool = False,
    jobs: int | None = None,
    on_result: Callable[[NotebookResult], None] | None = None,
    only: Iterable[str] | None = None,
    follow_symlinks: bool | None = None,
) -> tuple[list[NotebookResult], list[str]]:
    """Grade every notebook found under ``paths`` (``jobs`` at a time); return the results, in the order
    found, and the problems (paths skipped, notebooks without an autograder). ``only``: the exercises to grade
    (:func:`grade_notebook`); a name that one of the sets found does not have raises :class:`UnknownExercise`
    before any notebook is graded. ``follow_symlinks``: grade a notebook that is a symlink (by default only when
    not ``require_sandbox``, which ``--class`` sets: a class's symlinks are refused)."""
    if follow_symlinks is None:
        follow_symlinks = not require_sandbox
    paths = list(paths)
    notebooks, problems = find_notebooks(paths)
    work: list[tuple[Path, Path]] = []
    for nb in notebooks:
        zip_path = find_autograder(nb, autograder_dir, limits.notebook_size, follow_symlinks=follow_symlinks)
        if zip_path is None:
            why = notebook_problem(nb, limits.notebook_size, follow_symlinks=follow_symlinks)
            problems.append(f"{escape_controls(str(nb))}: " + (
                f"not graded: {why} (and its file name names no set, so it has no row in a class's CSV)" if why else
                f"no autograder zip for it in {autograder_dir} (expected {escape_controls(nb.stem)}.zip)"))
        else:
            work.append((nb, zip_path))
    if only is not None:
        only = list(dict.fromkeys(only))
        refused = [p for p in dict.fromkeys(unknown_exercises(z, only) for _, z in work) if p]
        if refused:
            raise UnknownExercise("; ".join(refused))
    if jobs is None:
        jobs = max(1, min(len(work), os.cpu_count() or 1, 4))

    folders = [Path(p) for p in paths if Path(p).is_dir()]  # as the instructor named them (a symlink too)

    def one(item: tuple[Path, Path]) -> NotebookResult:
        nb, zip_path = item
        root = next((f for f in folders if nb.is_relative_to(f)), None)  # the folder it was found in
        try:
            result = grade_notebook(nb, zip_path, limits, shown_as=escape_controls(str(nb)),
                                    require_sandbox=require_sandbox, only=only, follow_symlinks=follow_symlinks,
                                    root=root)
        except Exception as exc:  # noqa: BLE001 - never let one notebook stop the others
            result = NotebookResult(escape_controls(str(nb)), str(zip_path), "error", 0.0, 0.0, 0.0,
                                    escape_controls(f"grading failed: {type(exc).__name__}: {exc}"))
        if on_result is not None:
            on_result(result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, work))
    return results, problems


# ------------------------------------------------------------------------------------------ reporting
def _fmt_points(x: float) -> str:
    return f"{x:g}"


def display_path(path: str) -> str:
    """The path relative to the working folder when it is inside it, else as given (a symlink's own path, never
    its target's)."""
    try:
        return str((Path(path).parent.resolve() / Path(path).name).relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def _clip(text: str, width: int | None) -> str:
    text = escape_controls(" ".join(text.split()))
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


def format_table(results: list[NotebookResult], message_width: int | None = None) -> str:
    """The score table: one row per exercise, a total per notebook and overall. The first failure is shown
    whole (its hint is the point of it), unless ``message_width`` asks for a cut."""
    rows = [("notebook", "exercise", "points", "status", "first failure")]
    for r in results:
        name = escape_controls(display_path(r.notebook))
        for e in r.exercises:
            rows.append((name, e.name, f"{_fmt_points(e.score)}/{_fmt_points(e.possible)}", e.status,
                         _clip(e.message, message_width)))
        total_status = r.status if r.status != "graded" else f"graded in {r.seconds:.0f} s"
        rows.append((name, "TOTAL", f"{_fmt_points(r.score)}/{_fmt_points(r.possible)}", total_status,
                     _clip(r.message, message_width)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
        if k == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 13)
    score = sum(r.score for r in results)
    possible = sum(r.possible for r in results)
    lines.append(f"\nscore: {_fmt_points(score)} / {_fmt_points(possible)}")
    return "\n".join(line.rstrip() for line in lines)


def report_json(results: list[NotebookResult]) -> dict:
    """``{"score": float, "possible": float, "notebooks": [...]}`` (each notebook: its exercises and cases)."""
    return {
        "score": float(sum(r.score for r in results)),
        "possible": float(sum(r.possible for r in results)),
        "notebooks": [asdict(r) for r in results],
    }
