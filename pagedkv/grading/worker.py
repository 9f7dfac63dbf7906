"""Grade one notebook with ``otter run``, in a process of its own: ``python -m pagedkv.grading.worker``.

:mod:`pagedkv.grading.grade` starts one worker per notebook, in a new session, and kills the whole session
when the notebook's time is up, so a learner's infinite loop costs one notebook's timeout and never hangs
the grader. The worker:

- runs otter's non-containerised grading (``otter.run.main``: a temporary copy of the submission, every
  cell executed in a fresh kernel, then every test, hidden ones included);
- bounds each cell: nbconvert's ``ExecutePreprocessor`` (which otter uses) gets a per-cell ``timeout`` with
  ``interrupt_on_timeout``, so a cell that loops forever is interrupted (KeyboardInterrupt in the kernel),
  counts as an error, and the cells after it still run;
- writes the per-test-case results as JSON to ``--out`` (and an ``error`` instead when otter itself
  failed: a notebook that is not JSON, a kernel that died, ...). It never prints a traceback to the user.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from typing import Any

__all__ = ["main"]


def _bound_cells(cell_timeout: float) -> None:
    """Make every ExecutePreprocessor that otter creates interrupt a cell after ``cell_timeout`` seconds.

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

    pre.ExecutePreprocessor = BoundedExecutePreprocessor


def _case_name(question: str, index: int, test_case: Any) -> str:
    name = getattr(test_case, "name", None) or ""
    return name if name and not name.startswith(f"{question} - ") else f"{question} #{index + 1}"


def _results_to_json(results: Any) -> list[dict[str, Any]]:
    questions = []
    for qname, test_file in sorted(results.results.items()):
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
            _bound_cells(args.cell_timeout)
            from otter.run import main as otter_run

            results = otter_run(args.notebook, autograder=args.autograder, output_dir=None, no_logo=True)
        error = results.catastrophic_error
        if error is not None:
            payload = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        else:
            payload = {"ok": True, "questions": _results_to_json(results)}
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
