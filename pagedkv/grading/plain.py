"""What crosses between the trusted grader and the sandbox: plain data, as JSON with tagged types (never pickle).

A message is an 8-byte big-endian length and a UTF-8 JSON object. A value is one of:

- ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``: JSON as they are; ``list``: an array;
- ``{"$tuple": [...]}``, ``{"$set": [...]}``, ``{"$frozenset": [...]}``, ``{"$dict": [[k, v], ...]}`` (any
  plain keys), ``{"$bytes": base64}``;
- ``{"$tensor": base64, "dtype": "float32", "shape": [...]}`` (a CPU tensor's values, contiguous) and
  ``{"$dtype": "float16"}`` (a torch dtype);
- ``{"$lib": "module:qualname"}``: a function, class or enum member of the library (``pagedkv.*``), found by
  name in the receiver's own copy (in the sandbox a stubbed reference stays a stub);
- ``{"$learner": name}``: the learner's object of that name in the notebook (trusted side to sandbox only);
- ``{"$exc": {...}}``: an exception, as its type's name, its built-in bases, its message and the learner's line.

Nothing else crosses: no handles, no mirrors, no object rebuilt by running code that arrived in a message. A
value the learner's code made that is none of these (an object whose ``__eq__`` says yes to everything) cannot
be sent, and the test case that asked for it fails saying so.
"""

from __future__ import annotations

import base64
import enum
import importlib
import json
import linecache
import math
import os
import struct
import traceback
import types
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_MESSAGE", "Learner", "LibraryName", "ProtocolError", "decode", "encode", "exception_info",
           "read_message", "rebuild_exception", "write_message"]

#: The largest message either side accepts (bytes): the exercises' tensors are a few MB.
MAX_MESSAGE = 256 << 20

_HEADER = struct.Struct(">Q")
_BUILTIN_EXC = {name: obj for name, obj in vars(__import__("builtins")).items()
                if isinstance(obj, type) and issubclass(obj, BaseException)}
_DEPTH = 64


class ProtocolError(Exception):
    """A message that is not what the protocol says (too long, not JSON, cut short, an unknown tag)."""


class Learner:
    """The learner's object called ``name`` in the notebook graded now: what a test case receives under
    ``pagedkv grade`` in place of the learner's function or class. It stays in the sandbox; the trusted side
    knows only what :meth:`~pagedkv.grading.client.Client.names` said of it (``kind``: "function", "class",
    "other"; ``type_name``; for a class, ``bases`` (library classes by dotted name) and ``own`` (the methods its
    own body defines), and it reaches it only by name: :func:`pagedkv.grading.checks.drive` and calls."""

    __slots__ = ("_client", "bases", "kind", "module", "name", "own", "type_name")

    def __init__(self, client: Any, name: str, info: dict) -> None:
        self._client = client
        self.name = name
        self.kind = str(info.get("kind") or "other")
        self.type_name = str(info.get("type_name") or "object")
        self.module = info.get("module") if isinstance(info.get("module"), str) else None
        self.bases = [str(b) for b in info.get("bases") or []]
        self.own = [str(b) for b in info.get("own") or []]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the learner's function in the sandbox with plain arguments; its plain result comes back."""
        if self.kind not in ("function", "class", "callable"):
            raise TypeError(f"'{self.type_name}' object is not callable")
        return self._client.call(self.name, args, kwargs)

    @property
    def __name__(self) -> str:  # noqa: A003 - what checks print for a function
        return self.name

    def __repr__(self) -> str:
        return f"<your {self.kind} {self.name}>"


class LibraryName(str):
    """A library function or class the learner's code sent back (``module:qualname``): only its name, never the
    object, so that no check can end up running the library's answer on the learner's behalf."""

    __slots__ = ()


# ------------------------------------------------------------------------------------------ framing
def write_message(fd: int, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":"), allow_nan=True).encode("utf-8")
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a message of {len(data)} bytes is over the {MAX_MESSAGE} limit")
    buf = memoryview(_HEADER.pack(len(data)) + data)
    while buf:
        buf = buf[os.write(fd, buf):]


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int) -> dict:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"a message of {n} bytes is over the {MAX_MESSAGE} limit")
    try:
        message = json.loads(_read_exact(fd, n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a message that is not JSON ({exc})") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message that is not a JSON object")
    return message


# ------------------------------------------------------------------------------------------ values
def _library_name(obj: Any) -> str | None:
    """``module:qualname`` of a library function, class or enum member defined at a module's top level."""
    if isinstance(obj, enum.Enum):
        owner = _library_name(type(obj))
        return f"{owner}.{obj.name}" if owner else None
    if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and isinstance(getattr(obj, "fn", None),
                                                                                 types.FunctionType):
        name = _library_name(obj.fn)  # a library @triton.jit function, by its function's name
        module = importlib.import_module(obj.fn.__module__) if name else None
        return name if module is not None and getattr(module, obj.fn.__qualname__, None) is obj else None
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(module, str) and isinstance(qual, str)) or "<locals>" in qual:
        return None
    if not (module == "pagedkv" or module.startswith("pagedkv.")) or module.startswith("pagedkv.grading.") \
            and not module.startswith("pagedkv.grading.lessons"):
        return None
    return f"{module}:{qual}"


def resolve(name: str) -> Any:
    """The library object ``module:qualname`` names, in this process's copy of the library."""
    module, _, qual = str(name).partition(":")
    if _library_name(types.SimpleNamespace(__module__=module, __qualname__=qual or "?")) is None or not qual:
        raise ProtocolError(f"{name!r} is not a library name")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


#: The plain types a subclass of which crosses as the plain value, read with the base type's own methods (an
#: override of ``items`` or ``__iter__`` changes nothing): what a check in the notebook compares it as.
_BASES: tuple[tuple[type, Callable[[Any], Any]], ...] = (
    (dict, lambda v: dict(dict.items(v))), (list, lambda v: list(list.__iter__(v))),
    (tuple, lambda v: tuple(tuple.__iter__(v))), (set, lambda v: set(set.__iter__(v))),
    (frozenset, lambda v: frozenset(frozenset.__iter__(v))), (str, str.__str__), (int, int.__int__),
    (float, float.__float__),
)


def encode(value: Any, learner_names: dict[int, str] | None = None, depth: int = 0) -> Any:  # noqa: C901
    """``value`` as JSON-able plain data; ``TypeError`` naming what cannot cross. ``learner_names`` maps the
    ``id`` of a :class:`Learner` to its name (only the trusted side sends them)."""
    if depth > _DEPTH:
        raise TypeError("a value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"$float": repr(value)}
    if kind is list:
        return [encode(v, learner_names, depth + 1) for v in value]
    if kind in (tuple, set, frozenset):
        items = sorted(value, key=repr) if kind is not tuple else value
        return {f"${kind.__name__}": [encode(v, learner_names, depth + 1) for v in items]}
    if kind is dict:
        return {"$dict": [[encode(k, learner_names, depth + 1), encode(v, learner_names, depth + 1)]
                          for k, v in value.items()]}
    if kind is bytes:
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if kind is Learner:
        return {"$learner": value.name}
    module = getattr(kind, "__module__", "") or ""
    if module.startswith("numpy") and hasattr(value, "item") and getattr(value, "shape", None) == ():
        return encode(value.item(), learner_names, depth)  # a numpy scalar: its Python value
    if module.startswith("torch"):
        import torch

        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.Tensor) and kind in (torch.Tensor, torch.nn.Parameter):
            t = value.detach().to("cpu").contiguous()
            raw = t.view(torch.uint8) if t.dtype != torch.bool and t.numel() else t
            data = raw.numpy().tobytes() if t.numel() else b""
            return {"$tensor": base64.b64encode(data).decode("ascii"), "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape)}
    name = _library_name(value)
    if name is not None and (isinstance(value, (type, types.FunctionType, enum.Enum)) or
                             type(value).__name__ in ("JITFunction", "InterpretedFunction")):
        return {"$lib": name}
    if kind is range:
        return {"$range": [value.start, value.stop, value.step]}
    for base, plain_value in _BASES:  # a subclass (OrderedDict, a namedtuple, an IntEnum) crosses as its base type
        if isinstance(value, base):
            return encode(plain_value(value), learner_names, depth)
    raise TypeError(f"a {kind.__name__} cannot be sent between the grader and your code's process (only plain "
                    "data: numbers, strings, lists, tuples, dicts, sets, ranges, bytes, tensors)")


def decode(value: Any, learner: Any = None, depth: int = 0) -> Any:  # noqa: C901
    """The value :func:`encode` made; ``learner(name)`` gives the learner's object for ``{"$learner": name}``
    (the sandbox's side; on the trusted side it is None and such a tag is refused)."""
    if depth > _DEPTH:
        raise ProtocolError("a value nested too deeply")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [decode(v, learner, depth + 1) for v in value]
    if type(value) is not dict or len(value) == 0:
        raise ProtocolError("a value of an unknown shape")
    tag = next(iter(value))
    body = value[tag]
    if tag in ("$tuple", "$set", "$frozenset") and type(body) is list:
        items = [decode(v, learner, depth + 1) for v in body]
        return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](items)
    if tag == "$dict" and type(body) is list:
        return {decode(k, learner, depth + 1): decode(v, learner, depth + 1) for k, v in body}
    if tag == "$range" and type(body) is list and len(body) == 3 and all(type(x) is int for x in body) and body[2]:
        return range(*body)
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and type(body) is str:
        return base64.b64decode(body)
    if tag == "$dtype" and type(body) is str:
        import torch

        dtype = getattr(torch, body, None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown dtype {body!r}")
        return dtype
    if tag == "$tensor" and type(body) is str:
        import torch

        dtype = getattr(torch, str(value.get("dtype")), None)
        shape = [int(s) for s in value.get("shape") or []]
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError("a tensor of an unknown dtype")
        data = bytearray(base64.b64decode(body))
        if not math.prod(shape):
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(data, dtype=torch.uint8 if dtype != torch.bool else torch.bool)
        return (flat.view(dtype) if dtype != torch.bool else flat).reshape(shape).clone()
    if tag == "$lib" and type(body) is str and learner is None:  # from the sandbox: an enum member, or a name
        obj = decode(value, lambda name: None, depth)
        return obj if isinstance(obj, enum.Enum) else LibraryName(body)
    if tag == "$lib" and type(body) is str:
        module, _, qual = body.partition(":")
        head, _, member = qual.rpartition(".")
        try:
            return resolve(body)
        except AttributeError:
            if head:  # an enum member: module:Class.MEMBER
                owner = resolve(f"{module}:{head}")
                if isinstance(owner, type) and issubclass(owner, enum.Enum):
                    return owner[member]
            raise ProtocolError(f"no library object {body!r}") from None
    if tag == "$learner" and type(body) is str and learner is not None:
        return learner(body)
    if tag == "$exc" and type(body) is dict:
        return rebuild_exception(body)
    raise ProtocolError(f"a value tagged {tag!r} cannot be received here")


# ------------------------------------------------------------------------------------------ exceptions
def exception_info(exc: BaseException) -> dict:
    """What the other side needs to re-raise ``exc``: its type's name, its built-in bases, the message, and the
    learner's line it came from (the innermost frame outside Python's library, installed packages and this
    library)."""
    from pagedkv.grading.checks import own_frame, statement_text

    bases = [c.__name__ for c in type(exc).__mro__ if _BUILTIN_EXC.get(c.__name__) is c]
    try:  # str(KeyError("k")) is "'k'": send the key itself, so the rebuilt KeyError reads the same
        if isinstance(exc, KeyError) and len(exc.args) == 1 and type(exc).__str__ is KeyError.__str__:
            message = str(exc.args[0])
        else:
            message = str(exc)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        message = f"<{type(exc).__name__} whose str() raised>"
    last = own_frame(traceback.extract_tb(exc.__traceback__))
    where = None if last is None else {"name": last.name, "line": last.lineno, "text": statement_text(last)}
    return {"type": type(exc).__name__, "bases": bases, "message": message[:4000], "where": where}


class LearnerError(Exception):
    """Base of the exceptions rebuilt from the sandbox's."""


_EXC_TYPES: dict[tuple[str, str], type] = {}


class NotPlainResult(TypeError):
    """What a call of the learner's function returned cannot cross (:func:`encode` refused it): the function
    returned normally, so the check says "returned ..." rather than "raised"."""


def rebuild_exception(info: dict) -> BaseException:
    """An exception made here from :func:`exception_info`'s description: the same type name, a built-in base
    kept (``ValueError`` stays catchable as ``ValueError``), never a ``BaseException`` that is not an
    ``Exception`` (a learner's ``SystemExit`` fails one test case and nothing else), with a last frame that
    reads like the learner's line, so the checks' "(in f, line 3: return x // 0)" works."""
    name = str(info.get("type") or "Exception")
    builtin = next((_BUILTIN_EXC[b] for b in info.get("bases") or [] if b in _BUILTIN_EXC
                    and issubclass(_BUILTIN_EXC[b], Exception)), None)
    if builtin is not None and builtin.__name__ == name:
        exc: BaseException = builtin(str(info.get("message") or ""))
    else:
        key = (name, builtin.__name__ if builtin else "")
        if key not in _EXC_TYPES:
            bases = (builtin, LearnerError) if builtin is not None and builtin is not Exception else (LearnerError,)
            _EXC_TYPES[key] = type(name if name.isidentifier() else "LearnerError", bases, {"__module__": "__main__"})
        exc = _EXC_TYPES[key](str(info.get("message") or ""))
    where = info.get("where") or {}
    fname, line, text = where.get("name"), where.get("line"), str(where.get("text") or "")
    if not (isinstance(fname, str) and fname.isidentifier() and type(line) is int and 2 <= line < 100_000):
        return exc
    filename = f"<learner code: {fname}>"
    lines = ["\n"] * (line - 1) + [text.replace("\n", " ") + "\n"]
    linecache.cache[filename] = (len(lines), None, lines, filename)
    scope: dict[str, Any] = {}
    exec(compile("\n" * (line - 2) + f"def {fname}(e):\n raise e\n", filename, "exec"), scope)  # noqa: S102
    try:
        scope[fname](exc)
    except BaseException as raised:  # noqa: BLE001
        tb = raised.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return raised.with_traceback(tb)
    return exc
