"""The sandbox: the only process that runs a learner's code while a notebook is graded.

Started by :mod:`pagedkv.grading.sandbox` from a throwaway copy of the library (the exercise's reference symbols
replaced by stubs), as another user where the grader runs as root, with memory and CPU limits, in a session of
its own. It reads requests from one pipe and answers on another (:mod:`pagedkv.grading.plain`: JSON, never
pickle); the learner's prints go to a log nobody reads. It does what the trusted grader asks:

- ``exec``: run one of the notebook's code cells in the notebook's namespace (``__main__``);
- ``names``: what the test parameters name: a plain value, or a description of the learner's function, class
  or object (kind, type, for a class its library bases and its own names), never the object itself;
- ``call``: call the learner's function of that name with plain arguments;
- ``drive``: run a scenario (a ``drive_*`` function of a lesson module, from this copy of the library) on plain
  arguments and the learner's objects named in them;
- ``bind`` / ``restore``: put library functions in place of some of the learner's names for one test case.

Every answer is plain data, or an exception as its type's name, message and the learner's line. Whatever
happens here, the trusted side only sees the answers: nothing the learner's code does in this process can
change how those answers are judged.
"""

from __future__ import annotations

import builtins
import linecache
import os
import sys
import time
import traceback
from typing import Any

from pagedkv.grading.plain import (
    NotPlainResult,
    ProtocolError,
    decode,
    encode,
    exception_info,
    read_message,
    write_message,
)

__all__ = ["main"]

_MISSING = object()


#: The lesson modules' folder in this copy of the library, and the tools to run one, taken when this module is
#: imported: before any cell of the learner's runs.
_LESSONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lessons")
_CODE: dict[str, Any] = {}
_compile, _exec, _open, _module_type = compile, exec, open, type(sys)


def _fresh_scenario(name: str) -> Any:
    """The scenario ``pagedkv.grading.lessons.lNN_x:drive_y``, from a fresh copy of its lesson module, made
    from the read-only file for this request: a cell that replaced the scenario, or a helper it calls
    (``L.drive_... = lambda ...: {...}``, ``L.marks = ...``), in the module that the notebook imported changes
    nothing here. (The learner's process can still patch what the module imports: the checks compare what comes
    back, whole, with the library's record.)"""
    module, _, qual = name.partition(":")
    short = module.rpartition(".")[2]
    if module != f"pagedkv.grading.lessons.{short}" or not short.isidentifier() or not qual.startswith("drive_") \
            or "." in qual:
        raise ProtocolError(f"{name!r} is not a scenario")
    path = os.path.join(_LESSONS, f"{short}.py")
    if module not in _CODE:
        with _open(path, encoding="utf-8") as f:
            _CODE[module] = _compile(f.read(), path, "exec")
    fresh = _module_type(module)
    fresh.__file__ = path
    _exec(_CODE[module], fresh.__dict__)
    return getattr(fresh, qual)


class Server:
    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in, self.fd_out = fd_in, fd_out
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        try:
            from IPython.display import display

            self.ns["display"] = display
        except Exception:  # noqa: BLE001 - optional
            pass
        self.saved: dict[str, Any] = {}  # the learner's names that ``bind`` replaced, for ``restore``

    @staticmethod
    def is_plain(value: Any) -> bool:
        """Whether ``value`` can cross as it is (else the trusted side gets a description of it)."""
        try:
            encode(value)
        except TypeError:
            return False
        return True

    @staticmethod
    def describe(value: Any) -> dict:
        """What the trusted side may know of a learner's function, class or object (never the object)."""
        from pagedkv.grading.plain import _library_name

        module = getattr(value, "__module__", None)
        info: dict[str, Any] = {"type_name": type(value).__name__,
                                "module": module if isinstance(module, str) else None}
        if isinstance(value, type):
            library = [k for k in value.__mro__ if _library_name(k) is not None]
            info.update(kind="class", bases=[f"{k.__module__}.{k.__qualname__}" for k in library],
                        own=sorted({str(n) for k in value.__mro__ if k is not object and k not in library
                                    for n in vars(k)}))
        elif callable(value):
            import types

            plain_function = isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType))
            info["kind"] = "function" if plain_function else "callable"
        else:
            info["kind"] = "other"
        return info

    # ------------------------------------------------------------------ cells
    def run_cell(self, number: int, source: str) -> dict:
        filename = f"<cell {number}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            code = compile(source, filename, "exec")
            exec(code, self.ns)  # noqa: S102 - this process exists to run the learner's cells
        except BaseException as exc:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the cell failed
            return {"error": self.cell_error(exc, filename)}
        finally:
            sys.stdout.flush()
        return {}

    @staticmethod
    def cell_error(exc: BaseException, filename: str) -> str:
        name = type(exc).__name__
        try:
            text = " ".join(str(exc).split())
        except Exception:  # noqa: BLE001
            text = ""
        line = None
        if isinstance(exc, SyntaxError):
            text = " ".join(str(exc.msg or "").split())
            line = exc.lineno
        else:
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
            line = frames[0].lineno if frames else None
        out = f"{name}: {text[:200]}" if text else name
        return out + (f" (line {line})" if line else "")

    # ------------------------------------------------------------------ requests
    def learner(self, name: str) -> Any:
        return self.ns.get(name)

    def handle(self, msg: dict) -> Any:  # noqa: C901 - one branch per request
        op = msg.get("op")
        if op == "exec":
            return self.run_cell(int(msg["number"]), str(msg["source"]))
        if op == "names":
            out = {}
            for name in msg.get("names") or []:
                name = str(name)
                if name == "env":
                    out[name] = {"learner": {"kind": "namespace", "type_name": "dict"}}
                elif name in self.ns:
                    value = self.ns[name]
                    out[name] = {"value": value} if not callable(value) and self.is_plain(value) \
                        else {"learner": self.describe(value)}
            return {"value": encode(out)}
        if op == "call":
            fn = self.ns.get(str(msg.get("name")))
            if fn is None:
                raise NameError(f"name {msg.get('name')!r} is not defined")
            args = decode(msg.get("args") or [], self.learner)
            kwargs = decode(msg.get("kwargs") or {"$dict": []}, self.learner)
            result = fn(*args, **kwargs)
            try:
                return {"value": encode(result)}
            except TypeError as exc:
                raise NotPlainResult(str(exc)) from None
        if op == "drive":
            from pagedkv.grading import checks

            name = str(msg.get("scenario"))
            scenario = _fresh_scenario(name)
            args = decode(msg.get("args") or [], self.learner)
            checks.cpu_clock = time.process_time  # the scenario's limit counts this process's CPU seconds
            with checks.time_limit(float(msg.get("timeout") or 30.0), name.partition(":")[2]):
                result = scenario(*args)
            return {"value": encode(result)}
        if op == "bind":
            for name, value in decode(msg.get("values") or {"$dict": []}, self.learner).items():
                self.saved.setdefault(str(name), self.ns.get(str(name), _MISSING))
                self.ns[str(name)] = value
            return {"value": None}
        if op == "restore":
            for name, value in self.saved.items():
                if value is _MISSING:
                    self.ns.pop(name, None)
                else:
                    self.ns[name] = value
            self.saved.clear()
            return {"value": None}
        raise ProtocolError(f"unknown request {op!r}")

    def serve(self) -> None:
        while True:
            try:
                msg = read_message(self.fd_in)
            except KeyboardInterrupt:  # an interrupt that came after the answer: nothing to stop
                continue
            except (EOFError, ProtocolError):
                return
            try:
                reply = self.handle(msg)
            except BaseException as exc:  # noqa: BLE001 - the learner's code raised: an answer, not a crash
                reply = {"raised": exception_info(exc)}
            self.reply(reply)

    def reply(self, reply: dict) -> None:
        while True:
            try:
                write_message(self.fd_out, reply)
                return
            except KeyboardInterrupt:  # a late interrupt; the trusted side is waiting for this answer
                continue
            except (TypeError, ValueError, ProtocolError) as exc:
                reply = {"raised": exception_info(TypeError(f"cannot send the result: {exc}"))}


def main() -> None:
    fd_in, fd_out = int(sys.argv[1]), int(sys.argv[2])
    profile = os.environ.get("PAGEDKV_SANDBOX_PROFILE")  # a developer's switch: where to dump a cProfile
    if not profile:
        Server(fd_in, fd_out).serve()
        return
    import cProfile

    cProfile.runctx("Server(fd_in, fd_out).serve()", globals(), locals(), profile)


if __name__ == "__main__":
    main()
