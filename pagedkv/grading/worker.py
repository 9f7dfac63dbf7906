"""Grade one notebook: ``python -m pagedkv.grading.worker`` (trusted; it never runs a learner's code itself).

:mod:`pagedkv.grading.grade` starts one worker per notebook, in a session of its own, and stops it when the
notebook's time is up. The worker:

1. reads the notebook (refusing files that are not notebooks) and the set's autograder zip (the tests, hidden
   ones included, and ``questions.json``: the exercises in order, each one's reference symbols);
2. for **each exercise on its own** (with ``--only``, each of those named: the others' sandboxes are never
   started), starts a sandbox (:mod:`pagedkv.grading.sandbox`: a copy of the library
   without that exercise's reference, another user, limits, the repository hidden) and has it run the
   notebook's code cells in order (otter's and the checks' cells left out), each under the per-cell time
   limit: a cell still running is interrupted (and, if it will not stop, its process killed and the
   notebook run again without it), and reported with its number, first line, the names it defines and its
   error;
3. runs the exercise's test cases *here*, with :class:`~pagedkv.grading.plain.Learner` names in place of the
   learner's functions and classes (:mod:`pagedkv.grading.client`): the learner's code runs in the sandbox,
   called with plain data or driven by a scenario there, and the comparison happens here. Each case has a
   time budget; a case that exceeds it, or whose calls end the sandbox, fails alone, with a message that says
   so;
4. kills the sandbox and everything it started, and goes on with the next exercise;
5. writes ``{"ok": true, "questions": [...], "cells": [...]}`` (or ``{"ok": false, "error": ...}``) to ``--out``.

The worker parses what the sandboxes send, so it runs under a memory limit of its own (``RLIMIT_DATA``,
:attr:`Limits.worker_memory`): a learner's reply that would blow it up makes an allocation fail here (a
``MemoryError``: that test case fails, the sandboxes are closed as usual) instead of exhausting the machine.
It keeps its sandboxes' folders next to ``--out`` (``pagedkv grade``'s temporary folder for the notebook, which
``pagedkv grade`` removes even when the worker was killed). Every message of a case or a cell that can carry
the learner's text is cut to a bounded length (:func:`pagedkv.grading.plain.cap_text`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import json
import os
import re
import resource
import signal
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.grading.limits import DEFAULT_LIMITS, Limits
from pagedkv.grading.plain import CASE_MESSAGE, LEARNER_TEXT, cap_text, from_learner

__all__ = ["defined_names", "load_tests", "main", "notebook_cells"]

#: The longest heading a message names a cell by (characters): the notebook's markdown is the learner's text.
SECTION = 120

_DEFINES = re.compile(r"^(?:async\s+def|def|class)\s+([A-Za-z_]\w*)|^([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)", re.M)
_CHECK_NAMES = {"grader", "otter", "Checks"}


def defined_names(source: str) -> list[str]:
    """The names a cell defines at its top level (``def``, ``class``, ``name = ...``), found by pattern so that
    a cell that does not parse still has them."""
    return sorted({m.group(1) or m.group(2) for m in _DEFINES.finditer(source)})


# ------------------------------------------------------------------------------------------ the notebook
class NotANotebook(ValueError):
    pass


def notebook_cells(path: Path) -> list[tuple[int, str, str]]:
    """(number, source, section) of each code cell, numbered over all cells from 1, ``section`` the last
    markdown heading above it (what JupyterLab's table of contents shows); :class:`NotANotebook` otherwise."""
    data = path.read_bytes()
    try:
        nb = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise NotANotebook("the file is not a readable notebook (not valid .ipynb JSON)") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotANotebook("the file is not a notebook (JSON, but without a list of cells)")
    out = []
    section = ""
    for i, cell in enumerate(nb["cells"]):
        if not isinstance(cell, dict):
            raise NotANotebook(f"the file is not a notebook (cell {i + 1} is not an object)")
        source = cell.get("source", "")
        if isinstance(source, list):
            source = "".join(str(s) for s in source)
        if cell.get("cell_type") == "markdown":
            for line in str(source).splitlines():
                m = re.match(r"^#{1,6}\s+(.*\S)\s*$", line)
                if m:
                    section = cap_text(re.sub(r"\s*\(\d+(\.\d+)?\s+points?\)\s*$", "", m.group(1)), SECTION)
                    break
        if cell.get("cell_type") != "code":
            continue
        out.append((i + 1, str(source), section))
    return out


def _mentions_checks(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in _CHECK_NAMES:
            return True
        if isinstance(sub, (ast.Import, ast.ImportFrom)):
            mod = getattr(sub, "module", None) or ""
            names = [a.name for a in sub.names]
            if mod.startswith(("otter", "pagedkv.grading.notebook")) or any(n.startswith("otter") for n in names) \
                    or "pagedkv.grading.notebook" in names:
                return True
    return False


def without_checks(source: str) -> str:
    """The cell without the statements that belong to the in-notebook checks (``import otter``, ``grader = ...``,
    ``grader.check("x")``): grading runs the tests itself. A cell that does not parse is left as it is."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(True)
    drop = [(n.lineno, n.end_lineno or n.lineno) for n in tree.body if _mentions_checks(n)]
    if not drop:
        return source
    for start, end in reversed(drop):
        lines[start - 1:end] = ["pass\n"] + ["\n"] * (end - start)
    return "".join(lines)


# ------------------------------------------------------------------------------------------ the tests
@dataclass
class Case:
    name: str
    points: float
    hidden: bool
    func: Any


@dataclass
class Question:
    name: str
    cases: list[Case] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)
    kernel: bool = False  # its stub is a @triton.jit function: graded from the notebook's kernels alone

    def names(self) -> set[str]:
        """The notebook names its tests read (their parameters, less otter's ``env``)."""
        return {p for case in self.cases for p in inspect.signature(case.func).parameters} - {"env"}


def load_tests(zip_path: Path) -> list[Question]:
    """The set's questions in notebook order, with their test cases (the zip's ``tests/*.py``, defined here: the
    test files are the course's code, read from the trusted zip) and reference symbols."""
    from pagedkv.grading.sandbox import expand_classes, lesson_checks

    questions: dict[str, Question] = {}
    order: list[str] = []
    described: dict[str, Any] = {}
    sources: list[str] = []
    with zipfile.ZipFile(zip_path) as zf:
        names = zf.namelist()
        if "questions.json" in names:
            with contextlib.suppress(ValueError, AttributeError):
                info = json.loads(zf.read("questions.json"))
                order = [q for q in info.get("questions", []) if isinstance(q, str)]
                described = info.get("exercises") or {}
        for entry in sorted(names):
            if not (entry.startswith("tests/") and entry.endswith(".py")):
                continue
            source = zf.read(entry).decode("utf-8")
            sources.append(source)
            cases: list[Case] = []

            def test_case(name: str | None = None, points: float | None = None, hidden: bool = False,
                          success_message: str | None = None, failure_message: str | None = None,
                          _cases: list[Case] = cases) -> Any:
                def register(func: Any) -> Any:
                    _cases.append(Case(name or func.__name__, float(points or 0), bool(hidden), func))
                    return func
                return register

            source = re.sub(r"^from otter\.test_files import test_case\s*$", "", source, flags=re.M)
            namespace: dict[str, Any] = {"__name__": f"pagedkv_tests_{Path(entry).stem}", "test_case": test_case}
            exec(compile(source, f"<tests/{Path(entry).name}>", "exec"), namespace)  # noqa: S102 - trusted zip
            qname = str(namespace.get("name") or Path(entry).stem)
            info = described.get(qname) if isinstance(described.get(qname), dict) else {}
            questions[qname] = Question(qname, cases, expand_classes(str(r) for r in info.get("reference") or []),
                                        "@triton.jit" in str(info.get("stub") or ""))
    checks = lesson_checks(sources)  # hidden in every exercise of the set
    for q in questions.values():
        q.reference[:] = sorted(set(q.reference) | set(checks))
    rank = {q: i for i, q in enumerate(order)}
    return sorted(questions.values(), key=lambda q: (rank.get(q.name, len(rank)), q.name))


def private_helpers(methods: set[str], refs: list[str]) -> set[str]:
    """The private methods among ``refs`` that the library ``methods`` call on ``self`` (``BlockPool.get_new_blocks``
    calls ``self._maybe_evict_cached_block``), transitively: a check that composes the learner's class with the
    library's other part gets that part whole, and the learner's own methods still find the helpers hidden when
    the exercise lists them."""
    import importlib
    import textwrap

    wanted, todo = set(), list(methods)
    while todo:
        symbol = todo.pop()
        module_name, cls_name, _ = symbol.rsplit(".", 2) if symbol.count(".") >= 2 else ("", "", "")
        try:
            func = getattr(getattr(importlib.import_module(module_name), cls_name), symbol.rsplit(".", 1)[1])
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (ImportError, AttributeError, OSError, TypeError, ValueError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr.startswith("_"):
                helper = f"{module_name}.{cls_name}.{node.attr}"
                if helper in refs and helper not in wanted and helper not in methods:
                    wanted.add(helper)
                    todo.append(helper)
    return wanted


# ------------------------------------------------------------------------------------------ grading
_CURRENT: dict[str, Any] = {}


class Grader:
    def __init__(self, cells: list[tuple[int, str, str]], limits: Limits, *, notebook: Path | None = None,
                 require_sandbox: bool = False) -> None:
        self.cells = [(n, without_checks(src), src) for n, src, _ in cells]
        self.sections = {n: section for n, _, section in cells}
        self.limits = limits
        self.cell_timeout = min(limits.cell_timeout, limits.timeout)
        self.case_timeout = min(limits.case_timeout, limits.timeout)
        self.notebook = notebook
        self.require_sandbox = require_sandbox
        self.reports: dict[int, dict] = {}
        self.skip: set[int] = set()
        self.program: str | None = None  # the current exercise's kernel program (None: run the notebook's cells)
        self.upto: int | None = None  # the last cell to run for the current exercise (None: all of them)

    def _report(self, number: int, original: str, **what: Any) -> None:
        if number in self.reports:
            return
        first = next((ln.strip() for ln in original.splitlines() if ln.strip()), "")
        what["error"] = cap_text(what.get("error") or "", LEARNER_TEXT)  # what the sandbox said: the learner's
        self.reports[number] = {"cell": number, "section": self.sections.get(number, ""),
                                "first_line": first[:80], "defines": defined_names(original),
                                "timed_out": False, "seconds": float(self.cell_timeout), **what}

    def open(self, references: list[str], program: str | None = None) -> Any:
        """A sandbox that has run the notebook's cells (or, for a kernel exercise, only ``program``: the learner's
        ``@triton.jit`` functions, :mod:`pagedkv.grading.kernel_source`); restarts (without the culprit) when a
        cell kills it."""
        from pagedkv.grading.client import Client
        from pagedkv.grading.sandbox import Sandbox

        if program is not None:
            sandbox = Sandbox(references=references, limits=self.limits, require=self.require_sandbox)
            sandbox.start()
            _CURRENT["sandbox"] = sandbox
            client = Client(sandbox, references)
            _CURRENT["client"] = client
            with contextlib.suppress(BaseException):  # a failure shows in the cases ("... is not defined")
                client.exec_cell(0, program, self.cell_timeout)
            return client
        for _attempt in range(4):
            sandbox = Sandbox(references=references, limits=self.limits, notebook=self.notebook,
                              require=self.require_sandbox)
            sandbox.start()
            _CURRENT["sandbox"] = sandbox
            client = Client(sandbox, references)
            _CURRENT["client"] = client
            died_at = None
            for number, source, original in self.cells:
                if self.upto is not None and number > self.upto:
                    break
                if number in self.skip or not source.strip():
                    continue
                try:
                    result = client.exec_cell(number, source, self.cell_timeout)
                except BaseException as exc:  # noqa: BLE001 - SandboxDied: the cell ended the process
                    self._report(number, original, error=f"ended the notebook's process ({exc})")
                    died_at = number
                    break
                if result.get("timed_out"):
                    self._report(number, original, timed_out=True, error=str(result.get("error") or ""))
                    self.skip.add(number)  # the next exercises' sandboxes leave it out: it would loop again
                    if client.dead is not None:
                        died_at = number
                        break
                elif result.get("error"):
                    if "is not available while grading" not in str(result["error"]):
                        self._report(number, original, error=str(result["error"]))
            if died_at is None:
                return client
            self.skip.add(died_at)
            sandbox.close()
        return client

    def last_cell_for(self, q: Question) -> int | None:
        """The last cell an exercise needs: its check cell (``grader.check("name")``), or a later cell that defines
        one of the names its tests read; None when neither is found (then every cell runs). An exercise is judged
        on the notebook as far as its own check, as its check cell judges it in a Run All: the cells below it
        (a later exercise's set-up, a model built for it) do not slow it down or fail it."""
        check = re.compile(r"\.check\(\s*[\"']" + re.escape(q.name) + r"[\"']")
        names = q.names()
        found = [n for n, _, original in self.cells if check.search(original)
                 or names & set(defined_names(original))]
        return max(found) if found else None

    def grade_question(self, q: Question) -> dict:
        """Each test case against a sandbox without the exercise's reference; a case that composes the learner's
        class with the library's other part (:class:`~pagedkv.grading.client.NeedsLibrary`) runs again in one
        where that part is the library's (the part under test is a stub in both)."""
        from pagedkv.grading.kernel_source import kernel_program

        wanted = sorted(q.names())
        kernel = kernel_program([original for _, _, original in self.cells], wanted, kernel=q.kernel)
        if kernel is not None and kernel.problems:
            name, why = next(iter(kernel.problems.items()))
            message = f"{name} cannot be graded as a Triton kernel: {why}"
            cases = [{"name": c.name, "hidden": c.hidden, "points": c.points, "passed": False, "message": message}
                     for c in q.cases]
            return {"name": q.name, "score": 0.0, "possible": float(sum(c.points for c in q.cases)), "cases": cases}
        self.program = kernel.source if kernel is not None else None
        clients: dict[frozenset[str], Any] = {}
        cases = []
        try:
            for case in q.cases:
                refs = list(q.reference)
                needed: set[str] = set()
                for _attempt in range(2):  # once more at most, with the library part that one composition needs
                    result = self.run_case(case, refs, clients)
                    if isinstance(result, set) and needed:
                        # A second composition: the library part of each would be in reach of the learner's
                        # methods in the other (super() in the learner's lookup finds the library's lookup).
                        result = (False, f"the test case composes the learner's class with the library's "
                                         f"{', '.join(sorted(needed))} and also with {', '.join(sorted(result))}: "
                                         "a sandbox holding both would hand either answer to the learner's code, "
                                         "so the case cannot be graded (the course must split it in two)")
                    elif isinstance(result, set):
                        needed = result | private_helpers(result, refs)
                        refs = [r for r in refs if r not in needed]
                        continue
                    break
                passed, message = result
                cases.append({"name": case.name, "hidden": case.hidden, "points": case.points, "passed": passed,
                              "message": message})
        finally:
            for client in clients.values():
                client.sandbox.close()
        score = sum(c["points"] for c in cases if c["passed"])
        return {"name": q.name, "score": float(score), "possible": float(sum(c["points"] for c in cases)),
                "cases": cases}

    def run_case(self, case: Case, refs: list[str], clients: dict) -> tuple[bool, str] | set[str]:
        from pagedkv.grading.client import NeedsLibrary, SandboxDied, TooSlow

        key = frozenset(refs)
        client = clients.get(key)
        if client is None or client.dead is not None:
            if client is not None:
                client.sandbox.close()
            client = clients[key] = self.open(refs, self.program)
        _CURRENT["client"] = client
        _CURRENT["sandbox"] = client.sandbox
        params = list(inspect.signature(case.func).parameters)
        message = ""
        client.start_case(self.case_timeout)
        try:
            found = client.names(params)
            kwargs = {p: found.get(p) for p in params}
            case.func(**kwargs)
            passed = True
        except NeedsLibrary as exc:
            client.end_case()
            return exc.names
        except AssertionError as exc:
            passed, message = False, str(exc) or "failed"
        except TooSlow as exc:
            passed, message = False, str(exc)
        except SandboxDied as exc:  # the check went on after a failure, or the learner's code ended its process
            why = str(exc)
            passed, message = False, why if "did not return within" in why or why.startswith("your code") else \
                f"your code ended the process that runs it: {why}"
        except Exception as exc:  # noqa: BLE001 - a check that breaks on odd learner code still reports
            if from_learner(exc):  # the learner's exception that the check let through (never an AssertionError)
                from pagedkv.grading.checks import where

                message = f"your code raised {type(exc).__name__}: {exc}{where(exc)}"
            elif isinstance(exc, MemoryError):
                message = (f"the grader ran out of memory (its limit: {self.limits.worker_memory / (1 << 30):g} GiB) "
                           "handling what your code sent back: is a result far larger than it should be?")
            else:
                message = f"{type(exc).__name__}: {exc}"
            passed = False
        except BaseException as exc:  # noqa: BLE001 - CallTimeout escaping a check, KeyboardInterrupt
            if isinstance(exc, KeyboardInterrupt) and _CURRENT.get("stopping"):
                raise
            passed, message = False, f"{type(exc).__name__}: {exc}"
        finally:
            client.end_case()
        return passed, cap_text(message, CASE_MESSAGE)


def _cpu_clock() -> float:
    """CPU seconds of this worker and of the sandbox running the learner's code now: what the checks' per-call
    time limits count while grading (:data:`pagedkv.grading.checks.cpu_clock`)."""
    sandbox = _CURRENT.get("sandbox")
    running = sandbox is not None and sandbox.fd_to != -1  # a closed one's pid may be another process's by now
    return time.process_time() + (sandbox.cpu_seconds() if running else 0.0)


def grade(notebook: Path, autograder: Path, limits: Limits, *, require_sandbox: bool = False,
          only: list[str] | None = None) -> dict:
    """The notebook's grade; ``only``: the exercises to grade (``pagedkv grade --only``), the others' sandboxes
    never started, each named one still graded alone, in a sandbox of its own that runs the whole notebook."""
    from pagedkv.grading import checks

    checks.cpu_clock = _cpu_clock  # a check's `timeout=2` counts CPU seconds: no verdict depends on the load
    try:
        cells = notebook_cells(notebook)
    except NotANotebook as exc:
        return {"ok": False, "error": str(exc)}
    except OSError as exc:
        return {"ok": False, "error": f"cannot read the notebook: {exc.strerror}"}
    questions = load_tests(autograder)
    if only is not None:
        unknown = sorted(set(only) - {q.name for q in questions})
        if unknown:  # pagedkv grade checks first; a worker started by hand says it too
            return {"ok": False, "error": f"no exercise {', '.join(unknown)} in this set (its exercises: "
                                          f"{', '.join(q.name for q in questions)})"}
        questions = [q for q in questions if q.name in set(only)]
    grader = Grader(cells, limits, notebook=notebook, require_sandbox=require_sandbox)
    results = []
    for i, q in enumerate(questions):  # the last one runs every cell, so that each cell's trouble is reported
        grader.upto = grader.last_cell_for(q) if i < len(questions) - 1 else None
        results.append(grader.grade_question(q))
    return {"ok": True, "questions": results, "cells": [grader.reports[k] for k in sorted(grader.reports)]}


def _on_term(signum: int, frame: Any) -> None:
    """Stopped by the grader (the notebook's time is up): end the sandbox and everything it started first."""
    _CURRENT["stopping"] = True
    from pagedkv.grading.sandbox import close_all

    with contextlib.suppress(BaseException):
        close_all()
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.grading.worker")
    parser.add_argument("--autograder", required=True)
    parser.add_argument("--notebook", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--limits", type=Limits.from_json, default=DEFAULT_LIMITS, help="a Limits as JSON")
    parser.add_argument("--require-sandbox", action="store_true", help="refuse to grade without bubblewrap")
    parser.add_argument("--only", type=json.loads, default=None, help="the exercises to grade, a JSON list")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)  # the soft limit only: each sandbox sets its own
    soft = args.limits.worker_memory if hard == resource.RLIM_INFINITY else min(args.limits.worker_memory, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    # The sandboxes' folders go beside --out: pagedkv grade removes that folder even if this process is killed.
    tempfile.tempdir = str(Path(args.out).resolve().parent)
    start = time.monotonic()
    try:
        payload = grade(Path(args.notebook), Path(args.autograder), args.limits,
                        require_sandbox=args.require_sandbox, only=args.only)
    except BaseException as exc:  # noqa: BLE001 - report, never a traceback to the user
        payload = {"ok": False, "error": f"grading failed: {type(exc).__name__}: {str(exc)[:300]}"}
    payload["seconds"] = time.monotonic() - start
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
