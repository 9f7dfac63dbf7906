"""Helpers for exercise tests: call the learner's code safely, and say exactly what went wrong.

Every test in ``grading/source/NN_name.ipynb`` uses these so that a failure reads the same way everywhere:
the call that failed, what came back, what was expected, and a hint when the mistake is a known one::

    blocks_needed(40, 16) returned 2, expected 3. Hint: 40 tokens fill 2 blocks of 16 and spill 8 into a third

A learner's function that raises, hangs or returns the wrong type never breaks the test itself: each ends
as an ``AssertionError`` (which otter reports as that test case failing, with this message), so the check
cell in the notebook and ``pagedkv grade`` show the same text. A call that runs longer than ``timeout``
seconds is interrupted (SIGALRM, in the kernel's main thread) and reported as a probable infinite loop; under
``pagedkv grade`` those are CPU seconds (:data:`cpu_clock`), so that a loaded machine fails no correct call.

Nothing here imports the learner's code or the reference answers; tests pass the learner's function in.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import re
import signal
import sysconfig
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedkv.utils import is_int  # the lab's one integer predicate: the checks of every set use it on answers

__all__ = [
    "DEFAULT_TIMEOUT",
    "STUB_NOTE",
    "CallTimeout",
    "all_came_back",
    "describe",
    "drive",
    "expect_close",
    "expect_equal",
    "expect_raises",
    "fail",
    "format_call",
    "is_int",
    "learner_class",
    "require_function",
    "run",
    "scenario_records",
    "time_limit",
    "where",
]

#: Seconds one call of the learner's code may take before it counts as an infinite loop.
DEFAULT_TIMEOUT = 5.0

#: What a failure adds when the learner's function returned None where a value was expected.
STUB_NOTE = "Is the function still the stub (...), or is a `return` missing?"

Hint = str | Callable[[Any], str | None] | None
_SIZED = (list, tuple, dict, set, str, bytes)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.BuiltinMethodType)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


class CallTimeout(BaseException):
    """Raised inside a learner's call that ran past its time limit.

    A BaseException (like KeyboardInterrupt), so that a learner's ``except Exception`` cannot swallow it.
    """


def fail(message: str) -> None:
    """Fail the current test case with ``message`` (shown to the learner verbatim)."""
    raise AssertionError(message)


def _function_name(value: Any) -> str | None:
    """``builtin_hash``, ``BlockPool.free_blocks``: the qualified name of a function or method (without the
    ``outer.<locals>.`` of a nested one), or None for anything else."""
    if not isinstance(value, _FUNCTIONS):
        return None
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return name.rsplit("<locals>.", 1)[-1] if isinstance(name, str) and name else None


def describe(value: Any, limit: int = 160) -> str:
    """``repr(value)``, shortened to about ``limit`` characters (long lists keep their first and last items
    and say how many there are). A function is shown by its qualified name (``builtin_hash``), and memory
    addresses (``<Foo object at 0x7f...>``) are left out, so that a message reads the same on every run."""
    name = _function_name(value)
    if name is not None:
        return name
    try:
        text = repr(value)
    except Exception as exc:  # a learner's object whose __repr__ raises
        return f"<{type(value).__name__} whose repr raised {type(exc).__name__}>"
    if not isinstance(value, (str, bytes)):
        text = _ADDRESS.sub(">", text)
    if len(text) <= limit:
        return text
    if isinstance(value, (list, tuple)) and len(value) > 3:
        open_, close = ("[", "]") if isinstance(value, list) else ("(", ")")
        tail = ", ".join(describe(v, 20) for v in value[-2:])
        head: list[str] = []
        for v in value[:-2]:
            item = describe(v, 20)
            if len(", ".join(head + [item])) + len(tail) + 30 > limit:
                break
            head.append(item)
        return f"{open_}{''.join(h + ', ' for h in head)}..., {tail}{close} ({len(value)} items)"
    text = text[: limit - 20] + " ... " + text[-12:]
    if isinstance(value, _SIZED):
        text += f" ({len(value)} items)"
    return text


def format_call(name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> str:
    """``name(arg, ..., key=value)`` as the learner would have typed it (long arguments shortened)."""
    parts = [describe(a, 100) for a in args]
    parts += [f"{k}={describe(v, 100)}" for k, v in (kwargs or {}).items()]
    return f"{name}({', '.join(parts)})"


def require_function(fn: Any, name: str) -> None:
    """Fail unless ``fn`` (the learner's ``name``, as otter passed it in) is a function."""
    from pagedkv.grading.plain import Learner

    if fn is None:
        fail(f"{name} is not defined: run the cell that defines it (and the cells above it) first")
    if isinstance(fn, Learner) and fn.kind == "other" or not isinstance(fn, Learner) and not callable(fn):
        kind = fn.type_name if isinstance(fn, Learner) else type(fn).__name__
        fail(f"{name} should be a function, but it is {describe(fn)} ({kind})")
    module = (fn.module if isinstance(fn, Learner) else getattr(fn, "__module__", None)) or ""
    if module.startswith("pagedkv."):
        fail(
            f"{name} is the library's reference ({module}.{name}); write your own in the answer cell "
            "instead of importing it"
        )


def learner_class(cls: Any, name: str, base: type, methods: Sequence[str] = ()) -> Any:
    """Fail unless ``cls`` (the learner's ``name``) is a class, a subclass of the library's ``base``, whose own
    body (not the library's) defines each of ``methods``; returns it. It reads the real class in a check cell,
    and under ``pagedkv grade`` what the sandbox said of it (:class:`~pagedkv.grading.plain.Learner`)."""
    from pagedkv.grading.plain import Learner

    if cls is None:
        fail(f"{name} is not defined: run the cell that defines it (and the cells above) first")
    if isinstance(cls, Learner):
        is_class, is_sub, own = cls.kind == "class", f"{base.__module__}.{base.__qualname__}" in cls.bases, cls.own
    else:
        is_class = isinstance(cls, type)
        is_sub = is_class and issubclass(cls, base)
        own = [m for m in methods if is_class and not (getattr(getattr(cls, m, None), "__module__", "") or "")
               .startswith("pagedkv.")]
    if not (is_class and is_sub):
        fail(f"{name} should be a subclass of {base.__name__}, got {describe(cls)}")
    for meth in methods:
        if meth not in own:
            fail(f"{name}.{meth} is the library's: define it in your class")
    return cls


#: The clock a time limit counts, set by the grading worker (:mod:`pagedkv.grading.worker`): CPU seconds of the
#: worker and of the sandbox running the learner's code, so that a busy machine never turns a correct call into
#: "did not return" (code that sleeps is stopped at :data:`~pagedkv.grading.limits.WALL_FACTOR` times the
#: limit in wall-clock seconds). None, as in a notebook's check cell: the limit counts wall-clock seconds.
cpu_clock: Callable[[], float] | None = None
_POLL = 0.1  # seconds between two looks at the CPU clock


_LIMITS: list[Callable[[], bool]] = []  # the enclosing limits' "has my time run out?", innermost last


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str = "the call") -> Iterator[None]:
    """Interrupt the block with :class:`CallTimeout` after ``seconds`` (main thread on POSIX only; elsewhere
    the block simply runs unbounded and the grader's per-notebook timeout is the backstop): CPU seconds under
    grading (:data:`cpu_clock`), wall-clock seconds otherwise. A limit inside another one leaves the outer one
    running: when the inner block ends after the outer limit's time ran out, the outer one fires then (a loop of
    short limited calls cannot outlive the limit around it)."""
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return
    from pagedkv.grading.limits import WALL_FACTOR

    clock = cpu_clock
    wall_start = time.monotonic()
    cpu_start = clock() if clock is not None else 0.0
    fired: list[bool] = []

    def over() -> bool:
        if clock is None:
            return time.monotonic() - wall_start >= seconds
        return clock() - cpu_start >= seconds or time.monotonic() - wall_start >= WALL_FACTOR * seconds

    def on_alarm(signum: int, frame: Any) -> None:
        if fired or (clock is not None and not over()):
            return  # still within the limit: the timer looks again in _POLL seconds
        fired.append(True)
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise CallTimeout(f"{what} did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    if clock is None:
        outer = signal.setitimer(signal.ITIMER_REAL, float(seconds))
    else:
        outer = signal.setitimer(signal.ITIMER_REAL, min(float(seconds), _POLL), _POLL)
    _LIMITS.append(over)
    try:
        yield
    finally:
        _LIMITS.pop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer[0] > 0:  # an enclosing limit's timer: running again, less the time spent here
            if _LIMITS and _LIMITS[-1]():  # its time ran out while this one ran: it fires now
                previous(signal.SIGALRM, None)
            left = outer[0] - (time.monotonic() - wall_start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer[1])


_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_LIBRARY = str(Path(__file__).resolve().parents[1]) + os.sep  # this library (the sandbox's copy, in a sandbox)


def own_frame(frames: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame not in Python's own library, an installed package (torch, transformers) or this
    library: the learner's line that made a library call fail ("in allocate_slots, line 9: new =
    manager.block_pool.get_new_blocks(n)"), not the line inside the library that raised."""
    for frame in reversed(frames):
        name = frame.filename
        if not (name.startswith(_INSTALLED) or "site-packages" in name or "dist-packages" in name
                or name.startswith(_LIBRARY)):
            return frame
    last = frames[-1] if frames else None
    return None if last is None or f"{os.sep}grading{os.sep}" in last.filename else last


def statement_text(frame: traceback.FrameSummary) -> str:
    """The frame's statement as one line: a statement spread over several lines is read whole from the
    source where it can be, else its first line is marked as cut (``raise ValueError(…``)."""
    first = (frame.line or "").strip()
    end = getattr(frame, "end_lineno", None)
    if not first or end is None or frame.lineno is None or end <= frame.lineno:
        return first
    lines = [linecache.getline(frame.filename, n).strip() for n in range(frame.lineno, end + 1)]
    whole = " ".join(ln for ln in lines if ln)
    if lines[0] == first and all(lines) and len(whole) <= 200:
        return whole
    return first + " …"


def _where(exc: BaseException) -> str:
    """' (in paged_attention, line 3: return n // b)' for the learner's innermost frame, when it is known."""
    last = own_frame(traceback.extract_tb(exc.__traceback__))
    if last is None:
        return ""
    code = statement_text(last)
    return f" (in {last.name}, line {last.lineno}: {code})" if code else f" (in {last.name}, line {last.lineno})"


def _label(fn: Any, name: str | None, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> str:
    """How a message shows the call: ``name`` as it is when it is a whole call already (a check's own text,
    ``remove_skipped_blocks(manager, 'r', 5)``: shown once, not followed by the arguments again), else
    ``name(arg, ...)``."""
    if name is not None and "(" in name:
        return name
    return format_call(name or getattr(fn, "__name__", "function"), args, kwargs)


def run(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """Call ``fn(*args, **kwargs)`` and return its result; a raise or a hang becomes a test failure that
    names the call."""
    label = _label(fn, name, args, kwargs)
    try:
        with time_limit(timeout, label):
            return fn(*args, **(kwargs or {}))
    except CallTimeout:
        fail(f"{label} did not return within {timeout:g} s: is there an infinite loop?")
    except Exception as exc:
        if type(exc).__name__ == "NotPlainResult":  # it returned, but what it returned cannot reach the grader
            fail(f"{label} returned a value the grader cannot receive: {exc}")
        fail(f"{label} raised {type(exc).__name__}: {exc}{_where(exc)}")


def _mismatch(got: Any, expected: Any, rel: float, abs_tol: float) -> str | None:
    """Why ``got`` is not ``expected`` (None when it is). Ints must be ints, lists must be sequences."""
    if isinstance(expected, bool) or expected is None:
        return None if got is expected else "wrong value"
    if isinstance(expected, int):
        if not is_int(got):
            return f"expected an int, got {type(got).__name__}"
        return None if int(got) == expected else "wrong value"
    if isinstance(expected, float):
        if not isinstance(got, (int, float)) and not is_int(got) and type(got).__module__ != "numpy":
            return f"expected a number, got {type(got).__name__}"
        try:
            value = float(got)
        except Exception:
            return f"expected a number, got {type(got).__name__}"
        return None if math.isclose(value, expected, rel_tol=rel, abs_tol=abs_tol) else "wrong value"
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"expected a {type(expected).__name__}, got {type(got).__name__}"
        if len(got) != len(expected):
            return f"{len(got)} items instead of {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            why = _mismatch(g, e, rel, abs_tol)
            if why is not None:
                return f"item {i} is {describe(g, 40)}, expected {describe(e, 40)}"
        return None
    return None if got == expected else "wrong value"


def _hint_text(hint: Hint, got: Any) -> str:
    if hint is None:
        return ""
    text = hint(got) if callable(hint) else hint
    return f" Hint: {text}." if text and not text.endswith((".", "!", "?")) else (f" Hint: {text}" if text else "")


def expect_equal(
    fn: Callable[..., Any],
    args: Sequence[Any],
    expected: Any,
    *,
    kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    hint: Hint = None,
    rel: float = 1e-9,
    abs_tol: float = 1e-9,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """Call ``fn`` and fail unless it returns ``expected`` (ints as ints, floats within ``rel``/``abs_tol``,
    lists item by item). ``hint`` is a string, or a function of the wrong result that returns one (or None).
    Returns what ``fn`` returned."""
    label = _label(fn, name, args, kwargs)
    got = run(fn, args, kwargs, name=name, timeout=timeout)
    why = _mismatch(got, expected, rel, abs_tol)
    if why is None:
        return got
    message = f"{label} returned {describe(got)}, expected {describe(expected)}"
    if got is None and expected is not None:
        message += f". {STUB_NOTE}"
    elif why != "wrong value":
        message += f" ({why})"
    if type(expected) is int and isinstance(got, float) and got == expected:  # the right value, the wrong type
        hint_text = " Hint: the right value, but a float: a count is an int (divide with //, not /)"
    else:
        hint_text = _hint_text(hint, got)
    if hint_text and not message.endswith((".", "?")):
        message += "."
    fail(message + hint_text)
    return got  # unreachable


def expect_close(
    fn: Callable[..., Any], args: Sequence[Any], expected: float, *, rel: float = 1e-6, abs_tol: float = 1e-9,
    **options: Any,
) -> Any:
    """:func:`expect_equal` for floats, with a looser default tolerance."""
    return expect_equal(fn, args, float(expected), rel=rel, abs_tol=abs_tol, **options)


def expect_raises(
    exc_type: type[BaseException],
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    kwargs: Mapping[str, Any] | None = None,
    name: str | None = None,
    why: str = "",
    timeout: float | None = DEFAULT_TIMEOUT,
) -> None:
    """Fail unless ``fn(*args)`` raises ``exc_type``; ``why`` says what was wrong with the input."""
    label = _label(fn, name, args, kwargs)
    reason = f" ({why})" if why else ""
    try:
        with time_limit(timeout, label):
            got = fn(*args, **(kwargs or {}))
    except CallTimeout:
        fail(f"{label} did not return within {timeout:g} s: is there an infinite loop?")
    except exc_type:
        return
    except Exception as exc:
        fail(f"{label} raised {type(exc).__name__}: {exc}, expected {exc_type.__name__}{reason}{_where(exc)}")
    else:
        fail(f"{label} returned {describe(got)}, expected it to raise {exc_type.__name__}{reason}")


def where(exc: BaseException) -> str:
    """' (in f, line 3: return x // 0)': the learner's line an exception came from, for a scenario's record of a
    step that raised (:func:`drive`)."""
    return _where(exc)


def drive(scenario: Callable[..., Any], *args: Any, uses: Sequence[str] = (), timeout: float = 30.0,
          name: str | None = None) -> Any:
    """``scenario(*args)``, run where the learner's code runs, and its result as plain data.

    A check that drives the learner's class, or calls the learner's function on library objects, does it
    through a *scenario*: a module-level function ``drive_*`` of its lesson module (``pagedkv.grading.lessons``)
    that builds the objects, makes the calls and returns what it saw as plain data (numbers, strings, lists,
    tuples, dicts, sets, bytes, tensors, dtypes: :mod:`pagedkv.grading.plain`), never a verdict. The check then
    runs the same scenario on the reference, here, and compares.

    - In a check cell (the notebook's kernel) ``args`` hold the learner's real objects and the scenario runs
      here.
    - Under ``pagedkv grade`` the learner's objects are :class:`~pagedkv.grading.plain.Learner` names: the
      scenario runs in the sandbox, from a fresh copy of its lesson module in the sandbox's copy of the library
      (a cell that replaced it there changes nothing), with the learner's objects in place of the names; only
      plain data crosses, both ways. Check what comes back with :func:`scenario_records` and
      :func:`all_came_back`: the learner's process could still have shaped it.

    ``uses``: library symbols (dotted, ``pagedkv.kv_cache_manager.KVCacheManager._cache_blocks``) the scenario
    composes with the learner's code that may be this exercise's reference; the grader then runs it in a
    sandbox where they are the library's (the part under test stays hidden). An exception the scenario lets out
    is raised here (rebuilt, with the learner's line: :func:`where`); a scenario still running after
    ``timeout`` seconds (CPU seconds under grading) fails the test case."""
    from pagedkv.grading.plain import Learner, decode, encode

    label = name or f"{getattr(scenario, '__name__', 'the scenario')}(...)"
    qual = getattr(scenario, "__qualname__", "")
    if not getattr(scenario, "__module__", "").startswith("pagedkv.grading.lessons") or "." in qual:
        raise TypeError(f"{label}: a scenario is a module-level function of a pagedkv.grading.lessons module")
    learners = [a for a in args if isinstance(a, Learner)]
    if learners:
        return learners[0]._client.drive(f"{scenario.__module__}:{qual}", args, uses=list(uses), timeout=timeout,
                                         label=label)
    for arg in args:  # what grading could send: plain data, library names, and the learner's own objects
        if not _learners_own(arg):
            encode(arg)
    try:
        with time_limit(timeout, label):
            result = scenario(*args)
    except CallTimeout:
        fail(f"{label} did not finish within {timeout:g} s: is there an infinite loop?")
    return decode(encode(result))  # what grading would see: plain data only


def scenario_records(records: Any, label: str = "", *, at_most: int | None = None,
                     unit: str = "records") -> list[dict]:
    """``records``, a scenario's list as it came back (:func:`drive`), when it is one: a list of dicts, no more
    than ``at_most`` (a shorter one ends at a call that raised or ran out of time, which fails its step; count
    them after the comparisons with :func:`all_came_back`). Anything else fails the case, saying what came back:
    the scenario runs where the learner's code runs, and a record of another shape did not come from it as the
    check wrote it."""
    if not isinstance(records, list) or (at_most is not None and len(records) > at_most) \
            or not all(isinstance(r, dict) for r in records):
        expected = f"{at_most} {unit}" if at_most is not None else f"a list of {unit}"
        fail(f"{label + ': ' if label else ''}the scenario's record is incomplete: it came back as "
             f"{describe(records, 80)}, expected {expected}")
    return records


def all_came_back(records: list, expected: int, unit: str, label: str = "") -> None:
    """After the comparisons: fail unless ``records`` held all ``expected`` records. A scenario stops early only
    at a call that raised or ran out of time, whose record (its last) has failed the case already; a list cut
    short otherwise came from a scenario that did not run as the check wrote it, and a check compares nothing
    that is not there."""
    if len(records) != expected:
        fail(f"{label + ': ' if label else ''}the scenario's record is incomplete: {len(records)} of {expected} "
             f"{unit} came back")


def _learners_own(value: Any) -> bool:
    """A function, class or object the learner's notebook made (it stays in the learner's process)."""
    module = getattr(value, "__module__", None) if isinstance(value, (type, types.FunctionType)) \
        else type(value).__module__
    return not isinstance(module, str) or not module.startswith(("pagedkv", "builtins", "torch", "numpy"))
