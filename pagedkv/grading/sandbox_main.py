"""The sandbox: the only process that runs a learner's code while a notebook is graded.

Started by :mod:`pagedkv.grading.sandbox` from a throwaway copy of the library (the exercise's reference symbols
replaced by stubs), as another user where the grader runs as root, with memory and CPU limits, in a session of
its own. It reads requests from one pipe and answers on another (:mod:`pagedkv.grading.wire`: JSON, never
pickle); the learner's prints go to a log nobody reads. It does what the trusted grader asks:

- ``exec``: run one of the notebook's code cells in the notebook's namespace (``__main__``);
- ``names``: the values the test parameters name (plain data, or handles to the learner's functions/classes);
- ``call`` / ``getattr`` / ``setattr`` / ``getitem`` / ``setitem`` / ``len`` / ``iter`` / ``next`` / ``repr`` /
  ``str`` / ``bool`` / ``contains``: on a handle, for the trusted side's proxies;
- ``launch``: launch a library Triton kernel here (a check's harness) with a learner's ``@triton.jit`` function
  among its arguments, the output tensors written back;
- ``reset``: forget the handles and mirrored objects of the previous test case.

Whatever happens here, the trusted side only sees the answers: nothing the learner's code does in this process
can change how those answers are judged.
"""

from __future__ import annotations

import builtins
import linecache
import os
import sys
import traceback
from typing import Any

from pagedkv.grading.wire import Codec, ProtocolError, exception_info, read_message, write_message

__all__ = ["main"]


class Server:
    def __init__(self, fd_in: int, fd_out: int) -> None:
        self.fd_in, self.fd_out = fd_in, fd_out
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        try:
            from IPython.display import display

            self.ns["display"] = display
        except Exception:  # noqa: BLE001 - optional
            pass
        self.handles: dict[int, Any] = {}
        self.handle_ids: dict[int, int] = {}
        self.next_handle = 0
        self.roots: list[Any] = []  # what this request's code could reach: target, arguments, result
        self.codec = Codec("s", export=self.export, import_handle=None, exported=self.handles.__getitem__)

    # ------------------------------------------------------------------ handles
    def export(self, obj: Any) -> dict:
        hid = self.handle_ids.get(id(obj))
        if hid is None or self.handles.get(hid) is not obj:
            self.next_handle += 1
            hid = self.next_handle
            self.handles[hid] = obj
            self.handle_ids[id(obj)] = hid
        name = getattr(obj, "__name__", None) if isinstance(obj, type) or callable(obj) else None
        module = getattr(obj, "__module__", None)
        if isinstance(obj, type):
            from pagedkv.grading.wire import is_library_module, qualified_name

            base = next((qualified_name(k) for k in obj.__mro__ if is_library_module(k.__module__)
                         and qualified_name(k) is not None), None)
            own = sorted({str(n) for k in obj.__mro__ if not is_library_module(k.__module__) for n in vars(k)})
            return {"$h": hid, "type": type(obj).__name__, "callable": True, "is_class": True,
                    "module": module if isinstance(module, str) else None, "name": obj.__name__,
                    "library_base": base, "own_names": own}
        return {"$h": hid, "type": type(obj).__name__, "type_module": type(obj).__module__, "callable": callable(obj),
                "module": module if isinstance(module, str) else None,
                "is_class": isinstance(obj, type), "name": name if isinstance(name, str) else None}

    @staticmethod
    def plain(value: Any, depth: int = 0) -> bool:
        if value is None or type(value) in (bool, int, float, str, bytes):
            return True
        if depth < 8 and type(value) in (list, tuple, set, frozenset):
            return all(Server.plain(v, depth + 1) for v in value)
        if depth < 8 and type(value) is dict:
            return all(Server.plain(k, depth + 1) and Server.plain(v, depth + 1) for k, v in value.items())
        return False

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
    def handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "exec":
            return self.run_cell(int(msg["number"]), str(msg["source"]))
        if op == "reset":
            self.handles.clear()
            self.handle_ids.clear()
            self.codec.clear()
            return {}
        for hid in msg.get("release") or []:  # handles the trusted side no longer holds
            obj = self.handles.pop(int(hid), None)
            if obj is not None and self.handle_ids.get(id(obj)) == int(hid):
                del self.handle_ids[id(obj)]
        self.codec.load_storages(msg.get("storages") or {})
        self.codec.apply_mirror_states(msg.get("mirrors") or {})
        self.roots = []
        if op == "names":
            out = {}
            for name in msg["names"]:
                if name == "env":
                    out[name] = self.export(self.ns)
                elif name in self.ns:
                    value = self.ns[name]
                    out[name] = self.codec.encode(value) if self.plain(value) else self.export(value)
            return {"value": {"$dict": [[k, v] for k, v in out.items()]}}
        target = self.handles.get(int(msg.get("h", 0))) if "h" in msg else None
        if "h" in msg and int(msg["h"]) not in self.handles:
            raise ProtocolError("unknown handle")
        if "m" in msg:  # a mirrored learner object (a subclass of a library class): its methods run here
            target = self.codec.mirrors.get(str(msg["m"]))
            if target is None:
                raise ProtocolError("unknown mirrored object")
        roots = self.roots

        def decode(value: Any) -> Any:
            out = self.codec.decode(value)
            roots.append(out)
            return out

        roots.append(target)
        if op == "call":
            result = target(*decode(msg.get("args") or []), **decode(msg.get("kwargs") or {"$dict": []}))
        elif op == "getattr":
            result = getattr(target, str(msg["name"]))
        elif op == "setattr":
            setattr(target, str(msg["name"]), decode(msg["value"]))
            result = None
        elif op == "getitem":
            result = target[decode(msg["key"])]
        elif op == "setitem":
            target[decode(msg["key"])] = decode(msg["value"])
            result = None
        elif op == "len":
            result = len(target)
        elif op == "iter":
            result = self.export(iter(target))
            return {"value": result}
        elif op == "next":
            result = next(target)
        elif op == "repr":
            result = repr(target)
        elif op == "str":
            result = str(target)
        elif op == "bool":
            result = bool(target)
        elif op == "contains":
            result = decode(msg["item"]) in target
        elif op == "subclass":  # a check's subclass of the learner's class (its other methods the library's)
            ns = decode(msg.get("namespace") or {"$dict": []})
            bases = tuple(decode(msg.get("bases") or []))
            result = type(str(msg["name"]), bases, dict(ns))
            return {"value": self.export(result)}
        elif op == "launch":
            from pagedkv.grading.wire import resolve_name

            kernel = resolve_name(str(msg["kernel"]))
            grid = tuple(int(g) for g in decode(msg["grid"]))
            result = kernel[grid](*decode(msg.get("args") or []), **decode(msg.get("kwargs") or {"$dict": []}))
            result = None
        else:
            raise ProtocolError(f"unknown request {op!r}")
        roots.append(result)
        return {"value": self.codec.encode(result)}

    def serve(self) -> None:
        while True:
            try:
                msg = read_message(self.fd_in)
            except KeyboardInterrupt:  # an interrupt that came after the answer: nothing to stop
                continue
            except (EOFError, ProtocolError):
                return
            self.codec.begin()
            try:
                reply = self.handle(msg)
            except BaseException as exc:  # noqa: BLE001 - the learner's code raised: an answer, not a crash
                reply = {"raised": exception_info(exc)}
            if msg.get("op") not in ("exec", "reset"):
                try:
                    reply["mirrors"] = self.codec.mirror_states(self.roots)
                    reply["writeback"] = {sid: self.codec._encode_storage_bytes(t)
                                          for sid, t in self.codec.received_storages.items()}
                    reply["storages"] = self.codec.storages()
                except BaseException as exc:  # noqa: BLE001 - an object the wire cannot carry
                    reply = {"raised": exception_info(TypeError(f"cannot send the result back: {exc}"))}
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
