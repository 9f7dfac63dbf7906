"""Run an exercise set's single-source notebook (``grading/source/NN_name.ipynb``) in-process.

The tests of each exercise set use this to check their own test cells quickly (exec, no kernel, no otter):
against the source's answers, against otter's stubs of them, and against answers with one known mistake.
``tests/test_grading.py`` grades the generated notebooks end to end through ``pagedkv grade``.
"""

from __future__ import annotations

import contextlib
import io
import linecache
from pathlib import Path

import nbformat

#: (kind, question, source, hidden) for each code cell; kind is "code", "solution" or "test".
Item = tuple[str, "str | None", str, bool]


def parse_source(path: Path) -> list[Item]:
    nb = nbformat.read(path, as_version=4)
    items: list[Item] = []
    question: str | None = None
    in_solution = in_tests = False
    for cell in nb.cells:
        src = cell.source
        if cell.cell_type == "raw":
            first = src.strip().splitlines()[0] if src.strip() else ""
            if first == "# BEGIN QUESTION":
                question = next(line.split(":", 1)[1].strip() for line in src.splitlines() if line.startswith("name:"))
            elif first == "# END QUESTION":
                question = None
            elif first in ("# BEGIN SOLUTION", "# END SOLUTION"):
                in_solution = first == "# BEGIN SOLUTION"
            elif first in ("# BEGIN TESTS", "# END TESTS"):
                in_tests = first == "# BEGIN TESTS"
            continue
        if cell.cell_type != "code":
            continue
        if in_tests:
            items.append(("test", question, src, "hidden: true" in src.split("# END TEST CONFIG")[0]))
        else:
            items.append(("solution" if in_solution else "code", question, src, False))
    return items


def stub(src: str) -> str:
    """What otter assign leaves of a solution cell in the learner's notebook."""
    from otter.assign.solutions import replace_solutions

    return "\n".join(replace_solutions(src.split("\n"), "python"))


def _compile(code: str, filename: str):
    """compile(), with the source registered in linecache so that inspect.getsource works on what the cell
    defines (Triton's @triton.jit reads its function's source)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    return compile(code, filename, "exec")


class SourceNotebook:
    def __init__(self, path: Path, *, tolerate_cell_errors: bool = False) -> None:
        self.items = parse_source(path)
        self.solutions = {q: src for kind, q, src, _ in self.items if kind == "solution"}
        # A wrong answer may make a demo cell raise; `pagedkv grade` goes on past it, and so may we.
        self.tolerate_cell_errors = tolerate_cell_errors

    def grade(
        self, answers: dict[str, str], only: set[str] | None = None, public_only: bool = False
    ) -> list[tuple[str | None, bool, bool, str]]:
        """Run the cells with ``answers`` in place of the solution cells; one result per test cell:
        (question, hidden, passed, message)."""
        ns: dict = {"__name__": "__main__"}
        results = []
        for n, (kind, q, src, hidden) in enumerate(self.items):
            if kind != "test":
                code = answers.get(q, src) if kind == "solution" else src
                suppress = contextlib.suppress(Exception) if self.tolerate_cell_errors else contextlib.nullcontext()
                with contextlib.redirect_stdout(io.StringIO()), suppress:
                    exec(_compile(code, f"<{kind} cell {n} of {q}: {abs(hash(code))}>"), ns)
                continue
            if (only and q not in only) or (public_only and hidden):
                continue
            try:
                exec(_compile(src, f"<test cell {n} of {q}>"), dict(ns))
            except AssertionError as exc:
                results.append((q, hidden, False, str(exc)))
            else:
                results.append((q, hidden, True, ""))
        return results

    def outcomes(self, question: str, answer: str) -> list[tuple[bool, str]]:
        """Every test cell of ``question`` (hidden ones too), in the source's order, run with ``answer`` in its
        solution cell: (passed, message)."""
        return [(ok, msg) for _, _, ok, msg in self.grade({question: answer}, only={question})]

    def failures(self, question: str, answer: str) -> list[str]:
        """The public test cells of ``question`` run with ``answer`` in its solution cell: their failure messages."""
        return [msg for _, _, ok, msg in self.grade({question: answer}, only={question}, public_only=True) if not ok]


def changed(src: str, old: str, new: str) -> str:
    """``src`` with ``old`` (which must be there) replaced by ``new``: a planted mistake."""
    assert old in src, old
    return src.replace(old, new)
