"""The trusted grader's end of the conversation with one sandbox: plain data out, plain data back.

The worker (:mod:`pagedkv.grading.worker`) runs a test case here, in the trusted process, with
:class:`~pagedkv.grading.plain.Learner` names in place of the learner's functions and classes. A test case can
do two things with them, each one request to the sandbox (:mod:`pagedkv.grading.sandbox_main`):

- call a learner's function with plain arguments (:meth:`Client.call`): the plain result comes back;
- run a scenario (:meth:`Client.drive`, what :func:`pagedkv.grading.checks.drive` sends): a ``drive_*``
  function of a lesson module that drives the learner's class or function there and returns what it saw.

The comparison with the expected answer happens here, with this process's checks, which nothing in the
notebook can reach. Every wait for the sandbox is bounded: a test case's CPU budget (:class:`TooSlow`), the
checks' per-call ``timeout`` (SIGALRM here), and after an interrupt a grace period, after which the sandbox is
declared dead (:class:`SandboxDied`). Once an answer has begun to arrive, the whole of it must arrive within
:attr:`~pagedkv.grading.limits.Limits.message_timeout` seconds (and a request must be taken within as long): a
sandbox that sends part of a message and stalls is killed and declared dead, instead of holding the worker until
the notebook's own limit.
"""

from __future__ import annotations

import contextlib
import select
import time
from typing import Any

from pagedkv.grading.limits import WALL_FACTOR
from pagedkv.grading.plain import (
    Learner,
    MessageStalled,
    ProtocolError,
    decode,
    encode,
    read_message,
    rebuild_exception,
    write_message,
)
from pagedkv.grading.sandbox import Sandbox

__all__ = ["Client", "NeedsLibrary", "SandboxDied", "TooSlow"]

_GRACE = 10.0  # seconds the sandbox has to answer after an interrupt


class TooSlow(BaseException):  # noqa: N818 - a BaseException, like CallTimeout: `except Exception` cannot eat it
    """A test case ran past its budget while the learner's code was running."""


class SandboxDied(BaseException):  # noqa: N818
    """The sandbox process ended or stopped answering."""


class NeedsLibrary(BaseException):  # noqa: N818
    """A scenario composes the learner's code with library symbols that this sandbox has as stubs (``uses`` of
    :func:`~pagedkv.grading.checks.drive`); the worker runs the test case again in a sandbox where those are
    the library's."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(", ".join(sorted(names)))
        self.names = set(names)


class Client:
    """Talks to one :class:`~pagedkv.grading.sandbox.Sandbox`; see the module's docstring."""

    def __init__(self, sandbox: Sandbox, references: list[str]) -> None:
        self.sandbox = sandbox
        self.references = set(references)
        self.message_timeout = sandbox.limits.message_timeout
        self.dead: str | None = None
        self.deadline: float | None = None  # the current test case's budget (None between cases)
        self.budget = 0.0
        self._cpu_start = 0.0
        self.calls, self.call_seconds, self.function_seconds, self.slowest = 0, 0.0, 0.0, 0.0

    # ------------------------------------------------------------------ test cases
    def start_case(self, budget: float) -> None:
        """A new test case: ``budget`` CPU seconds of the learner's process, all the case's requests together, or
        :data:`WALL_FACTOR` times that in wall-clock seconds of waiting for it. CPU time is what the learner's
        code costs whatever else the machine is doing, so a loaded machine does not turn a correct answer into a
        "too slow" one; the wall-clock bound stops code that sleeps."""
        self.budget = budget
        self.deadline = budget
        self.calls, self.call_seconds, self.function_seconds, self.slowest = 0, 0.0, 0.0, 0.0
        self._cpu_start = self.sandbox.cpu_seconds()

    def cpu_spent(self) -> float:
        """CPU seconds the learner's process has used since the test case began."""
        return max(0.0, self.sandbox.cpu_seconds() - self._cpu_start)

    def _over_budget(self) -> bool:
        return self.deadline is not None and (self.cpu_spent() >= self.budget
                                              or self.call_seconds >= WALL_FACTOR * self.budget)

    def end_case(self) -> None:
        self.deadline = None
        if self.dead is None:
            with contextlib.suppress(BaseException):
                self._exchange({"op": "restore"}, timeout=_GRACE)

    def too_slow_message(self) -> str:
        avg = self.function_seconds / self.calls if self.calls else 0.0

        def secs(x: float) -> str:
            return f"{x:.2f} s" if x >= 0.01 else f"{x * 1000:.2f} ms"

        cpu = self.cpu_spent()
        if cpu >= self.budget:
            limit = f"past the limit of {self.budget:g} s of CPU time for one test case"
        else:  # the wall-clock bound fired first: code that sleeps or waits (or a machine far too busy)
            limit = (f"past the limit of {WALL_FACTOR * self.budget:g} s of waiting for one test case (the limit of "
                     f"{self.budget:g} s of CPU time not reached yet)")
        return (f"too slow: this test case's calls of your code used {cpu:.1f} s of CPU time (and "
                f"waited {self.call_seconds:.1f} s in all), {limit} ({self.calls} "
                f"call{'s' if self.calls != 1 else ''} of your code, {secs(avg)} per call on average, the slowest "
                f"{secs(self.slowest)}); a call is correct only if it is also fast enough: look for repeated work "
                "(a loop over all blocks inside a loop, a sleep)")

    # ------------------------------------------------------------------ requests
    def exec_cell(self, number: int, source: str, timeout: float) -> dict:
        """Run one cell; ``{"error": text}``, ``{"timed_out": True, ...}``, or ``{}``."""
        start = time.monotonic()
        try:
            return self._exchange({"op": "exec", "number": number, "source": source}, timeout=timeout)
        except TimeoutError:
            return {"timed_out": True, "seconds": time.monotonic() - start,
                    "error": "KeyboardInterrupt" if self.dead is None else "could not be interrupted"}

    def names(self, names: list[str]) -> dict[str, Any]:
        """The notebook's values for ``names``: a plain value as it is, a function, class or other object as a
        :class:`~pagedkv.grading.plain.Learner`; a name the notebook does not define is left out."""
        found = self.request("names", names=list(names))
        out: dict[str, Any] = {}
        for name in names:
            entry = found.get(name) if isinstance(found, dict) else None
            if isinstance(entry, dict) and "learner" in entry and isinstance(entry["learner"], dict):
                out[name] = Learner(self, name, entry["learner"])
            elif isinstance(entry, dict) and "value" in entry:
                out[name] = entry["value"]
        return out

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        """The learner's function ``name`` called with plain ``args`` and ``kwargs``."""
        return self.request("call", name=name, args=list(args), kwargs=dict(kwargs))

    def drive(self, scenario: str, args: tuple, *, uses: list[str], timeout: float, label: str) -> Any:
        """Run the scenario ``module:qualname`` on ``args`` in the sandbox; its plain record comes back. A
        scenario that composes the learner's code with symbols this sandbox has as stubs asks the worker for
        another sandbox (:class:`NeedsLibrary`)."""
        stubbed = set(uses) & self.references
        if stubbed:
            raise NeedsLibrary(stubbed)
        try:
            return self.request("drive", scenario=scenario, args=list(args), timeout=float(timeout))
        except Exception as exc:
            if type(exc).__name__ == "CallTimeout":
                raise AssertionError(f"{label} did not finish within {timeout:g} s: is there an infinite loop?"
                                     ) from None
            raise

    def bind(self, names: dict[str, Any]) -> None:
        """Put library functions in place of the learner's names for the rest of the test case (the earlier
        exercises' references: :mod:`pagedkv.grading.lessons.depends`); :meth:`restore` (and the end of the case)
        puts the learner's back."""
        self.request("bind", values=names)

    def restore(self) -> None:
        self.request("restore")

    def request(self, op: str, **fields: Any) -> Any:
        if self.dead is not None:
            raise SandboxDied(self.dead)
        if self._over_budget():
            raise TooSlow(self.too_slow_message())
        msg: dict[str, Any] = {"op": op}
        for key, value in fields.items():
            msg[key] = value if key in ("name", "names", "scenario", "timeout") else encode(value)
        timeout = None if self.deadline is None else max(0.0, WALL_FACTOR * self.budget - self.call_seconds)
        start = time.monotonic()
        try:
            reply = self._exchange(msg, timeout=timeout, budgeted=self.deadline is not None)
        except TimeoutError:
            self._count(start, op)
            raise TooSlow(self.too_slow_message()) from None
        self._count(start, op)
        if "raised" in reply:
            if not isinstance(reply["raised"], dict):
                raise ProtocolError("a malformed exception")
            raise rebuild_exception(reply["raised"])
        return decode(reply.get("value"))

    def _count(self, start: float, op: str) -> None:
        spent = time.monotonic() - start
        self.call_seconds += spent
        if op in ("call", "drive"):
            self.calls += 1
            self.function_seconds += spent
            self.slowest = max(self.slowest, spent)

    def _exchange(self, msg: dict, *, timeout: float | None, budgeted: bool = False) -> dict:
        """Send ``msg`` and wait for the answer; on a timeout (or an exception raised here while waiting, such
        as the checks' SIGALRM), interrupt the learner's code and wait for its answer so the conversation stays
        in step; if none comes within the grace period, the sandbox is dead."""
        try:
            write_message(self.sandbox.fd_to, msg, timeout=self.message_timeout)
        except OSError as exc:
            self._die(f"the learner's process {self.sandbox.exit_description()} ({exc.strerror})")
        except MessageStalled as exc:
            self._kill(f"your code's process did not take the grader's request ({exc})")
        try:
            if not self._wait(timeout, budgeted):
                self._interrupt_and_drain()
                raise TimeoutError
            return self._read()
        except BaseException as exc:
            if isinstance(exc, (TimeoutError, SandboxDied)):
                raise
            # interrupted here (CallTimeout from the checks' time limit, Ctrl-C): stop the learner's call too
            self._interrupt_and_drain()
            if self.dead is not None and type(exc).__name__ == "CallTimeout":
                what = str(exc).replace("did not finish within", "did not return within")
                self.dead = (f"{what}: is there an infinite loop? It ignored the interrupt too, so its process was "
                             "killed")
            raise

    def _wait(self, timeout: float | None, budgeted: bool = False) -> bool:
        """Wait for the sandbox's answer: False after ``timeout`` wall-clock seconds, or (``budgeted``: a test
        case's request) once the case has used its CPU budget, looked at every 0.2 s."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            if budgeted:
                left = 0.2 if left is None else min(left, 0.2)
            ready, _, _ = select.select([self.sandbox.fd_from], [], [], left)
            if ready:
                return True
            if end is not None and time.monotonic() >= end:
                return False
            if budgeted and self.cpu_spent() >= self.budget:
                return False

    def _read(self) -> dict:
        try:
            return read_message(self.sandbox.fd_from, timeout=self.message_timeout)
        except (EOFError, OSError):
            with contextlib.suppress(Exception):
                self.sandbox.proc.wait(timeout=2)
            self._die(f"the learner's process {self.sandbox.exit_description()}")
        except MessageStalled as exc:
            self._kill(f"your code's process began an answer and stopped in the middle of it ({exc}; "
                       f"{self.message_timeout:g} s allowed)")
        except ProtocolError as exc:
            self._kill(f"your code's process sent the grader a message it does not accept ({exc})")
        raise AssertionError("unreachable")

    def _kill(self, why: str) -> None:
        """The conversation is out of step for good: kill the sandbox now (its CPU and memory are freed, and the
        next test case starts a fresh one) and declare it dead."""
        self.sandbox.close()
        self._die(f"{why}, so it was killed")

    def _interrupt_and_drain(self) -> None:
        self.sandbox.interrupt()
        if self._wait(_GRACE):
            with contextlib.suppress(SandboxDied):
                self._read()
            return
        self.sandbox.close()
        self.dead = "the learner's code did not stop when interrupted, so its process was killed"

    def _die(self, why: str) -> None:
        self.dead = why
        raise SandboxDied(why)
