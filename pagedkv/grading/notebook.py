"""The checks inside an exercise notebook: ``grader.check("name")``, ``grader.check_all()``, ``grader.reset("name")``.

Every generated exercise notebook starts with::

    from pagedkv.grading.notebook import Checks

    grader = Checks("01_fragmentation")

:class:`Checks` finds the set's tests by the set's name, never by the notebook's file name, so a copy of the
notebook renamed (``01_fragmentation-alice.ipynb``) or moved to another folder checks exactly like the original
(otter's own ``otter.Notebook("01_fragmentation.ipynb")`` reads the tests from the notebook file it names, and
fails in a copy). The tests come from the set's autograder zip (``grading/autograder/NN_name.zip``, written by
``pagedkv build-exercises``), where the lab is installed from its repository; elsewhere, from the public tests
that the generated notebook carries in its own metadata, when the notebook's file can be found (Jupyter's
``JPY_SESSION_NAME``, VS Code's ``__vsc_ipynb_file__``, or the only notebook of the set in the working folder).

In the notebook only the public cases run, and a check never raises: it prints, per exercise, its number and
heading as the notebook shows them, each case passed or failed, and each failure's whole message (the call,
what came back, what was expected, the hint). Under otter's grading (``otter run``), a check is handed to otter,
which records it as before.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.grading import build
from pagedkv.grading.build import QUESTIONS_FILE

__all__ = ["CaseOutcome", "CheckResult", "CheckSummary", "Checks", "Exercise", "SetInfo", "load_set", "run_test_file"]


@dataclass
class Exercise:
    """One exercise of a set, as the learner's notebook shows it."""

    name: str  # the question's name: what grader.check("...") takes
    number: int | None = None  # as in the heading, "## 2. ..."
    heading: str = ""  # the heading without its "## " and points: "2. `get_new_blocks` and `free_blocks`"
    stub: str = ""  # the learner's answer cell(s) as generated: what reset() brings back
    reference: list[str] = field(default_factory=list)  # library symbols that answer it (see grading/README.md)
    points: float | None = None  # what the grader awards for it, hidden cases included (the heading says the same)

    @property
    def title(self) -> str:
        return f"Exercise {self.heading}" if self.heading else f"Exercise `{self.name}`"


@dataclass
class SetInfo:
    """What the checks need of a set: its exercises in notebook order, and each exercise's test file."""

    name: str
    exercises: list[Exercise]
    tests: dict[str, str]  # question -> otter test file source
    where: str  # where they were read from (for messages)

    def exercise(self, question: str) -> Exercise:
        for e in self.exercises:
            if e.name == question:
                return e
        return Exercise(question)


@dataclass
class CaseOutcome:
    name: str
    points: float
    passed: bool
    message: str


@dataclass
class CheckResult:
    """What ``grader.check`` returns: shown as plain text in the notebook."""

    exercise: Exercise
    cases: list[CaseOutcome]
    problem: str = ""  # why no case could run

    @property
    def passed(self) -> bool:
        return not self.problem and bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def score(self) -> float:
        return sum(c.points for c in self.cases if c.passed)

    @property
    def possible(self) -> float:
        return sum(c.points for c in self.cases)

    def status(self) -> str:
        """``2/2 public cases pass; the grader also runs hidden cases for the full 3 points``: how many public
        cases pass, and what the exercise is worth (its heading's points, what ``pagedkv grade`` awards)."""
        n = len(self.cases)
        text = f"{sum(c.passed for c in self.cases)}/{n} " + ("public case passes" if n == 1 else "public cases pass")
        total = self.exercise.points
        if total is None or total <= self.possible:
            total = total if total is not None else self.possible
            return text + f" ({_points(total)})"
        return text + f"; the grader also runs hidden cases for the full {_points(total)}"

    def __repr__(self) -> str:
        title = self.exercise.title
        if self.problem:
            return f"{title}: cannot check it: {self.problem}"
        if self.passed:
            return f"{title}: {self.status()} ✅"
        lines = [f"{title}: {self.status()}"]
        shown: dict[str, str] = {}  # message -> the case that showed it first
        for c in self.cases:
            if c.passed:
                lines.append(f"  ✅ {c.name}")
            elif c.message in shown:  # several cases stopped at the same first failure: show it once
                lines.append(f"  ❌ {c.name}: same cause as {shown[c.message]!r} above")
            else:
                shown[c.message] = c.name
                lines.append(f"  ❌ {c.name}: {c.message}")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's display of a returned value
        p.text(repr(self))


def _points(x: float) -> str:
    return f"{x:g} point" + ("" if x == 1 else "s")


def _case_label(question: str, func_name: str) -> str:
    """``test_paged_admission_boundary`` -> ``boundary``; what the learner reads next to ✅ / ❌."""
    label = func_name.removeprefix("test_")
    label = label.removeprefix(question + "_") if label != question else label
    return label.replace("_", " ") or func_name


def run_test_file(source: str, question: str, env: dict[str, Any], *, include_hidden: bool = False
                  ) -> list[CaseOutcome]:
    """Run the test cases of one otter test file (``@test_case`` functions) against the namespace ``env``.

    Each case's parameters are looked up by name in ``env`` (``env`` itself for a parameter named ``env``), as
    otter does. A case fails when it raises; its message is the exception's text, with no test-file line
    numbers. A KeyboardInterrupt (the learner pressed stop) is not caught."""
    from otter.test_files import test_case

    namespace: dict[str, Any] = {"__name__": f"pagedkv_checks_{question}"}
    exec(compile(source, f"<tests of {question}>", "exec"), namespace)  # defines the cases; runs nothing
    outcomes = []
    for value in list(namespace.values()):
        if not isinstance(value, test_case) or (value.hidden and not include_hidden):
            continue
        label = _case_label(question, getattr(value.test_func, "__name__", "case"))
        try:
            value.call_func(env)
        except AssertionError as exc:
            outcomes.append(CaseOutcome(label, float(value.points or 0), False, str(exc) or "failed"))
        except Exception as exc:  # noqa: BLE001 - a check that breaks on odd learner code still reports
            outcomes.append(CaseOutcome(label, float(value.points or 0), False, f"{type(exc).__name__}: {exc}"))
        else:
            outcomes.append(CaseOutcome(label, float(value.points or 0), True, ""))
    return outcomes


def _exercises_from_json(data: dict[str, Any]) -> list[Exercise]:
    described = data.get("exercises") or {}
    out = []
    for name in data.get("questions") or []:
        info = described.get(name) or {}
        points = info.get("points")
        out.append(Exercise(name, info.get("number"), info.get("heading") or "", info.get("stub") or "",
                            list(info.get("reference") or []),
                            float(points) if isinstance(points, (int, float)) and points > 0 else None))
    return out


def _from_zip(path: Path, set_name: str) -> SetInfo:
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        data = json.loads(zf.read(QUESTIONS_FILE)) if QUESTIONS_FILE in names else {}
        tests = {n[len("tests/"):-len(".py")]: zf.read(n).decode("utf-8") for n in names
                 if n.startswith("tests/") and n.endswith(".py")}
    exercises = _exercises_from_json(data) or [Exercise(q) for q in sorted(tests)]
    return SetInfo(set_name, exercises, tests, str(path))


def _notebook_candidates(set_name: str) -> list[Path]:
    """Where the running notebook's file may be (for its embedded tests when the zip is not there)."""
    found: list[Path] = []
    main = sys.modules.get("__main__")
    for value in (getattr(main, "__vsc_ipynb_file__", None), getattr(main, "__session__", None),
                  os.environ.get("JPY_SESSION_NAME")):
        if isinstance(value, str) and value.endswith(".ipynb"):
            found.append(Path(value))
    found += sorted(Path.cwd().glob(f"{set_name[:3]}*.ipynb"))
    return found


def _from_notebook(path: Path, set_name: str) -> SetInfo | None:
    try:
        meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    except (OSError, ValueError):
        return None
    otter_meta = meta.get("otter") or {}
    if otter_meta.get("assignment_name") != set_name or not isinstance(otter_meta.get("tests"), dict):
        return None
    data = meta.get("pagedkv") or {}
    exercises = _exercises_from_json(data) or [Exercise(q) for q in otter_meta["tests"]]
    return SetInfo(set_name, exercises, dict(otter_meta["tests"]), str(path))


def load_set(set_name: str) -> SetInfo:
    """The set's exercises and tests: from its autograder zip, else from the notebook's own metadata."""
    zip_path = build.repo_root() / "grading" / "autograder" / f"{set_name}.zip"
    if zip_path.is_file():
        return _from_zip(zip_path, set_name)
    for candidate in _notebook_candidates(set_name):
        info = _from_notebook(candidate, set_name)
        if info is not None:
            return info
    raise FileNotFoundError(
        f"the tests of {set_name} are not where they should be ({zip_path}); run `pagedkv build-exercises` in the "
        "lab's repository, or open the notebook from it"
    )


def _otter_grading() -> bool:
    """True while otter's grader runs the notebook (``otter run``): it records the checks itself."""
    otter = sys.modules.get("otter")
    notebook = getattr(otter, "Notebook", None)
    return bool(getattr(notebook, "_grading_mode", False))


class Checks:
    """The notebook's ``grader``: ``check(name)``, ``check_all()`` and ``reset(name)`` for one exercise set."""

    def __init__(self, set_name: str) -> None:
        self.set_name = set_name
        self._info: SetInfo | None = None
        self._problem = ""
        try:
            self._info = load_set(set_name)
        except Exception as exc:  # noqa: BLE001 - the notebook must still run; each check says why
            self._problem = str(exc)

    @property
    def exercises(self) -> list[Exercise]:
        return list(self._info.exercises) if self._info else []

    def _exercise(self, question: str) -> Exercise:
        return self._info.exercise(question) if self._info else Exercise(question)

    def check(self, question: str, global_env: dict[str, Any] | None = None) -> Any:
        """Run exercise ``question``'s public test cases against the notebook's variables; never raises."""
        env = global_env if global_env is not None else sys._getframe(1).f_globals
        if _otter_grading():
            import otter

            return otter.Notebook().check(question, env)
        exercise = self._exercise(question)
        if self._info is None:
            return CheckResult(exercise, [], self._problem)
        source = self._info.tests.get(question)
        if source is None:
            known = ", ".join(e.name for e in self._info.exercises)
            return CheckResult(exercise, [], f"{self.set_name} has no exercise named {question!r} (it has {known})")
        try:
            cases = run_test_file(source, question, env)
        except Exception as exc:  # noqa: BLE001 - a broken test file is reported, not raised
            return CheckResult(exercise, [], f"its tests could not be loaded ({type(exc).__name__}: {exc})")
        if not cases:
            return CheckResult(exercise, [], "it has no public test case (only hidden ones: `pagedkv grade` runs them)")
        return CheckResult(exercise, cases)

    def check_all(self, global_env: dict[str, Any] | None = None) -> CheckSummary:
        """Every exercise's public cases, in notebook order, and the points they are worth."""
        env = global_env if global_env is not None else sys._getframe(1).f_globals
        if _otter_grading():
            return CheckSummary(self.set_name, [])
        results = [self.check(e.name, env) for e in self.exercises]
        return CheckSummary(self.set_name, results, self._problem)

    def reset(self, question: str) -> None:
        """Bring exercise ``question``'s answer cell back as it was handed out: printed, and (in Jupyter) put in a
        new cell below this one, ready to run. Nothing of yours is deleted."""
        exercise = self._exercise(question)
        if not exercise.stub:
            names = ", ".join(e.name for e in self.exercises) or "none found"
            print(f"no stub for {question!r} in {self.set_name} (its exercises: {names})")
            return
        print(f"{exercise.title}, as handed out (run it to start the exercise over):\n")
        print(exercise.stub)
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:  # pragma: no cover - IPython comes with Jupyter
            shell = None
        if shell is not None and hasattr(shell, "set_next_input"):
            shell.set_next_input(exercise.stub, replace=False)

    def __repr__(self) -> str:
        return f"Checks({self.set_name!r})"


@dataclass
class CheckSummary:
    """What ``grader.check_all()`` returns: one line per exercise, then each failing exercise in full."""

    set_name: str
    results: list[CheckResult]
    problem: str = ""

    def __repr__(self) -> str:
        if self.problem:
            return f"{self.set_name}: cannot check it: {self.problem}"
        if not self.results:
            return f"{self.set_name}: checked by the grader"
        lines = [f"{self.set_name}, public cases (the points are each exercise's, as the grader awards them):"]
        for r in self.results:
            status = f"cannot check it: {r.problem}" if r.problem else r.status() + (" ✅" if r.passed else "")
            lines.append(f"  {r.exercise.title}: {status}")
        failing = [r for r in self.results if not r.passed and not r.problem]
        if failing:
            lines.append("")
            lines += [repr(r) for r in failing]
        else:
            lines.append("\nEvery public case passes. `./lab grade` adds the hidden cases and gives your points.")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))
