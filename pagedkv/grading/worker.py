"""Grade one notebook with ``otter run``, in a process of its own: ``python -m pagedkv.grading.worker``.

:mod:`pagedkv.grading.grade` starts one worker per notebook, in a new session, and kills the whole session
when the notebook's time is up, so a learner's infinite loop costs one notebook's timeout and never hangs
the grader. The worker:

- runs otter's non-containerised grading (``otter.run.main``: a temporary copy of the submission, every
  cell executed in a fresh kernel, then every test, hidden ones included);
- bounds each cell: nbconvert's ``ExecutePreprocessor`` (which otter uses) gets a per-cell ``timeout`` with
  ``interrupt_on_timeout``, so a cell that loops forever is interrupted (KeyboardInterrupt in the kernel),
  counts as an error, and the cells after it still run;
- watches each of the learner's cells as it runs (the cells are numbered first, in their metadata, so that
  the cells otter inserts are told apart): a cell that raised, or that was interrupted at the time limit, is
  reported with its number, its first line, the names it defines and its error, so that the grader can tell
  the learner why a function "is not defined" (the cell defining it raised a SyntaxError, or looped);
- writes the per-test-case results, and those cell reports, as JSON to ``--out`` (and an ``error`` instead
  when otter itself failed: a notebook that is not JSON, a kernel that died, ...). It never prints a traceback
  to the user.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from typing import Any

__all__ = ["main"]


#: The metadata key holding a learner's cell's number (1-based, every cell counted, as the file has them).
CELL_KEY = "pagedkv_cell"

#: Reports on the learner's cells that raised or were interrupted, filled while otter runs the notebook.
_CELL_REPORTS: list[dict[str, Any]] = []

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DEFINES = re.compile(r"^(?:async\s+def|def|class)\s+([A-Za-z_]\w*)|^([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)", re.M)


def number_cells(notebook: str) -> bool:
    """Write each cell's number (1-based) into its metadata, under :data:`CELL_KEY`, in place; False (and the
    file untouched) when the file is not a readable v4 notebook (otter then reports what is wrong with it)."""
    try:
        with open(notebook, encoding="utf-8") as f:
            nb = json.load(f)
        cells = nb["cells"]
        for i, cell in enumerate(cells):
            meta = cell.setdefault("metadata", {})
            if not isinstance(meta, dict):
                return False
            meta[CELL_KEY] = i + 1
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    with open(notebook, "w", encoding="utf-8") as f:
        json.dump(nb, f)
    return True


def defined_names(source: str) -> list[str]:
    """The names a cell defines at its top level (``def``, ``class``, ``name = ...``), found by pattern so that
    a cell that does not parse still has them."""
    return sorted({m.group(1) or m.group(2) for m in _DEFINES.finditer(source)})


def error_text(output: dict[str, Any]) -> str:
    """``SyntaxError: invalid syntax (line 3)`` from a cell's error output: the exception and the line of the
    cell where it happened (IPython's file names such as ``3918070085.py`` left out)."""
    ename = str(output.get("ename") or "Exception")
    evalue = " ".join(str(output.get("evalue") or "").split())
    m = re.search(r"\s*\((?:[^()]*\.py|<[^<>]*>), line (\d+)\)$", evalue)  # SyntaxError and friends
    line = None
    if m:
        evalue, line = evalue[: m.start()], m.group(1)
    else:
        frames = _ANSI.sub("", "\n".join(str(t) for t in output.get("traceback") or []))
        first = re.search(r"Cell In\[\d+\], line (\d+)", frames)  # the outermost frame: the cell itself
        line = first.group(1) if first else None
    text = f"{ename}: {evalue[:200]}" if evalue else ename
    return text + (f" (line {line})" if line else "")


def _report_cell(cell: Any, timed_out: bool, timeout: float) -> None:
    number = (cell.get("metadata") or {}).get(CELL_KEY)
    if cell.get("cell_type") != "code" or not isinstance(number, int):
        return  # not a code cell, or one otter inserted
    errors = [o for o in cell.get("outputs") or [] if o.get("output_type") == "error"]
    if not (errors or timed_out):
        return
    source = str(cell.get("source") or "")
    first_line = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
    _CELL_REPORTS.append(
        {
            "cell": number,
            "first_line": first_line[:80],
            "defines": defined_names(source),
            "timed_out": bool(timed_out),
            "seconds": float(timeout),
            "error": error_text(errors[0]) if errors else "",
        }
    )


def _bound_cells(cell_timeout: float) -> None:
    """Make every ExecutePreprocessor that otter creates interrupt a cell after ``cell_timeout`` seconds, and
    report the learner's cells that raised or were interrupted (in :data:`_CELL_REPORTS`).

    otter builds ``ExecutePreprocessor(config=...)`` inside ``otter.execute.grade_notebook`` after importing
    it from ``nbconvert.preprocessors``; replacing that name with a subclass whose defaults are bounded is the
    narrowest hook (otter 7 exposes no option for it).
    """
    import nbconvert.preprocessors as pre

    base = pre.ExecutePreprocessor
    if getattr(base, "_pagedkv_bounded", False):
        return

    class BoundedExecutePreprocessor(base):  # type: ignore[misc, valid-type]
        _pagedkv_bounded = True

        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self.timeout = int(max(1, cell_timeout))
            self.interrupt_on_timeout = True
            self.iopub_timeout = 10
            self._pagedkv_timed_out = False

        async def _async_handle_timeout(self, timeout: int, cell: Any = None) -> Any:
            self._pagedkv_timed_out = True  # nbclient interrupts the kernel; the cell ends in KeyboardInterrupt
            return await super()._async_handle_timeout(timeout, cell)

        def preprocess_cell(self, cell: Any, resources: Any, index: int) -> Any:
            self._pagedkv_timed_out = False
            try:
                return super().preprocess_cell(cell, resources, index)
            finally:
                _report_cell(cell, self._pagedkv_timed_out, self.timeout)

    pre.ExecutePreprocessor = BoundedExecutePreprocessor


def _case_name(question: str, index: int, test_case: Any) -> str:
    name = getattr(test_case, "name", None) or ""
    return name if name and not name.startswith(f"{question} - ") else f"{question} #{index + 1}"


def _results_to_json(results: Any) -> list[dict[str, Any]]:
    questions = []
    for qname, test_file in results.results.items():  # pagedkv.grading.grade puts them in notebook order
        cases = []
        for i, tcr in enumerate(test_file.test_case_results):
            tc = tcr.test_case
            cases.append(
                {
                    "name": _case_name(qname, i, tc),
                    "hidden": bool(tc.hidden),
                    "points": float(tc.points or 0),
                    "passed": bool(tcr.passed),
                    "message": str(tcr.message or ""),
                }
            )
        questions.append(
            {
                "name": qname,
                "score": float(test_file.score),
                "possible": float(test_file.possible),
                "cases": cases,
            }
        )
    return questions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.grading.worker")
    parser.add_argument("--autograder", required=True)
    parser.add_argument("--notebook", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cell-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)

    payload: dict[str, Any]
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            number_cells(args.notebook)
            _bound_cells(args.cell_timeout)
            from otter.run import main as otter_run

            results = otter_run(args.notebook, autograder=args.autograder, output_dir=None, no_logo=True)
        error = results.catastrophic_error
        if error is not None:
            payload = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        else:
            payload = {"ok": True, "questions": _results_to_json(results), "cells": _CELL_REPORTS}
    except BaseException as exc:  # noqa: BLE001 - a learner's notebook may break otter in any way
        payload = {"ok": False, "error": _explain(exc, log.getvalue())}
    payload["log_tail"] = log.getvalue()[-4000:]
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, args.out)
    return 0


def _explain(exc: BaseException, log: str) -> str:
    name = type(exc).__name__
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    if name == "DeadKernelError":
        return "the notebook's kernel died while the notebook ran (did a cell call exit() or run out of memory?)"
    if name in {"NotJSONError", "JSONDecodeError"} or "Notebook does not appear to be JSON" in str(exc):
        return "the file is not a readable notebook (not valid .ipynb JSON)"
    if name == "OtterRuntimeError":
        return f"otter refused the submission: {first}"
    if name == "ValidationError":
        return f"the file is not a valid notebook: {first[:200]}"
    return f"grading failed: {name}: {first[:300]}"


if __name__ == "__main__":
    sys.exit(main())
