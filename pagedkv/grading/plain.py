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

What arrives from the sandbox is the learner's: it is read with bounds (:data:`MAX_MESSAGE` bytes,
:data:`MAX_ELEMENTS` values, a nesting depth, the whole message within a deadline once it has begun:
:class:`MessageStalled`), and an exception rebuilt from it is marked as the learner's (:func:`from_learner`) and
is never an ``AssertionError``, the type of a check's own failure: a learner's ``AssertionError("... 12/12")``
reads as "your code raised AssertionError: ...", not as the check's verdict. Its message is cut to
:data:`LEARNER_TEXT` characters (:func:`cap_text`).

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
import select
import struct
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

__all__ = ["CASE_MESSAGE", "LEARNER_TEXT", "MAX_ELEMENTS", "MAX_MESSAGE", "Learner", "LearnerError", "LibraryName",
           "MessageStalled", "ProtocolError", "cap_text", "decode", "encode", "exception_info", "from_learner",
           "read_message", "rebuild_exception", "write_message"]

#: The largest message either side accepts (bytes). The largest an honest notebook makes is 3.7 MB (set 02's
#: solution: a scenario's record); every solution graded, 2026-12-08. Reading one costs the worker about 50
#: times its size in memory at worst (a list of empty lists), so this is also what bounds that cost.
MAX_MESSAGE = 32 << 20
#: The most values (JSON arrays, objects and commas: an upper bound) a message may hold. Honest: 0.91 million
#: (the same record of set 02); a list of empty lists of 4 million costs the worker about 0.5 GB to read.
MAX_ELEMENTS = 4_000_000
#: The characters kept of a text that comes from the learner's process (an exception's message, a cell's error).
LEARNER_TEXT = 2000
#: The longest message a test case reports (characters): an honest check's is under 600; longer ones carry the
#: learner's text (a scenario's record quoted), and are cut.
CASE_MESSAGE = 4000

_HEADER = struct.Struct(">Q")
_BUILTIN_EXC = {name: obj for name, obj in vars(__import__("builtins")).items()
                if isinstance(obj, type) and issubclass(obj, BaseException)}
_DEPTH = 64


class ProtocolError(Exception):
    """A message that is not what the protocol says (too long, not JSON, cut short, an unknown tag)."""


class MessageStalled(ProtocolError):
    """A message that began and did not arrive whole before its deadline (or a reader that stopped taking one): the
    other side is stuck or hostile, and the conversation cannot go on."""


def cap_text(text: str, limit: int = LEARNER_TEXT) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut: a learner's 20 MB exception message must
    not end up whole in the table, the CSV and the JSON."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]} ... ({len(text) - limit:,} characters cut)"


def _short(value: Any) -> str:
    """A learner's value quoted in a protocol error, at most 80 characters of its repr."""
    return cap_text(repr(value), 80)


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
        kind = info.get("kind")  # what the sandbox says: bounded here, since messages quote it
        self.kind = kind if kind in ("function", "class", "callable", "namespace") else "other"
        self.type_name = cap_text(info.get("type_name") or "object", 100)
        self.module = cap_text(info["module"], 200) if isinstance(info.get("module"), str) else None
        self.bases = [cap_text(b, 200) for b in list(info.get("bases") or [])[:1000]]
        self.own = [cap_text(b, 200) for b in list(info.get("own") or [])[:10_000]]

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
def _ready(fd: int, write: bool, deadline: float | None) -> bool:
    """Whether ``fd`` can be read (written) before ``deadline`` (``time.monotonic()``; None: wait for ever)."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready = select.select([], [fd], [], left)[1] if write else select.select([fd], [], [], left)[0]
    return bool(ready)


def write_message(fd: int, message: dict, timeout: float | None = None) -> None:
    """Send ``message``; with ``timeout`` (on a non-blocking ``fd``: the trusted side's), the whole of it within
    that many seconds, else :class:`MessageStalled` (the reader stopped reading: a learner's code that took the
    sandbox's end of the pipe)."""
    data = json.dumps(message, separators=(",", ":"), allow_nan=True).encode("utf-8")
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"a message of {len(data)} bytes is over the {MAX_MESSAGE} limit")
    deadline = None if timeout is None else time.monotonic() + timeout
    buf = memoryview(_HEADER.pack(len(data)) + data)
    total = len(buf)
    while buf:
        try:
            buf = buf[os.write(fd, buf):]
        except BlockingIOError:
            if not _ready(fd, True, deadline):
                raise MessageStalled(f"it stopped reading: {total - len(buf)} of the {total} bytes of a message "
                                     f"were taken, then none for {timeout:g} s") from None


def _read_exact(fd: int, n: int, deadline: float | None, what: str) -> bytes:
    chunks = []
    want = n
    while n:
        if deadline is not None and not _ready(fd, False, deadline):
            raise MessageStalled(f"it sent {want - n} of the {want} bytes of {what}, then nothing before the "
                                 "deadline for a whole message")
        try:
            chunk = os.read(fd, min(n, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int, timeout: float | None = None) -> dict:
    """The next message; with ``timeout`` (the trusted side, once the sandbox's answer has begun to arrive), the
    whole of it within that many seconds, else :class:`MessageStalled`: a sandbox that sends a header and stalls
    must not hold the worker until the notebook's own limit. A message over :data:`MAX_MESSAGE` bytes or
    :data:`MAX_ELEMENTS` values is refused before it is parsed."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline, "a message's header"))
    if n > MAX_MESSAGE:
        raise ProtocolError(f"a message of {n} bytes is over the {MAX_MESSAGE} limit")
    data = _read_exact(fd, n, deadline, "a message")
    elements = data.count(b"[") + data.count(b"{") + data.count(b",")
    if elements > MAX_ELEMENTS:
        raise ProtocolError(f"a message of {elements:,} values or more, over the limit of {MAX_ELEMENTS:,}")
    try:
        message = json.loads(data.decode("utf-8"))
    except MemoryError:
        raise ProtocolError(f"a message of {n:,} bytes that the grader has not the memory to read") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"a message that is not JSON ({type(exc).__name__}: {cap_text(exc, 200)})") from None
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
        raise ProtocolError(f"{_short(name)} is not a library name")
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
            raw = t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool and t.numel() else t  # 0-d views no bytes
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


def _distinct_hashes(keys: list[Any]) -> None:
    """Refuse the keys of a set or dict that share their hashes (``k * (2**61 - 1)`` all hash to 0): building it
    would take time quadratic in their number, in C, where no time limit can interrupt it. Counting the distinct
    hashes is linear (a hash is an int that hashes to itself)."""
    if len(keys) > 64:
        try:
            distinct = len({hash(k) for k in keys})
        except TypeError as exc:  # an unhashable key: what set() would raise
            raise ProtocolError(f"an unhashable key ({exc})") from None
        if distinct * 2 < len(keys):
            raise ProtocolError(f"a set or dict of {len(keys):,} keys with {distinct:,} distinct hashes")


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
        if tag != "$tuple":
            _distinct_hashes(items)
        return {"$tuple": tuple, "$set": set, "$frozenset": frozenset}[tag](items)
    if tag == "$dict" and type(body) is list:
        pairs = [(decode(k, learner, depth + 1), decode(v, learner, depth + 1)) for k, v in body]
        _distinct_hashes([k for k, _ in pairs])
        return dict(pairs)
    if tag == "$range" and type(body) is list and len(body) == 3 and all(type(x) is int for x in body) and body[2]:
        values = range(*body)
        if len(values) > MAX_ELEMENTS:  # a range is iterated like the list it stands for
            raise ProtocolError(f"a range of {len(values):,} values, over the limit of {MAX_ELEMENTS:,}")
        return values
    if tag == "$float" and body in ("nan", "inf", "-inf"):
        return float(body)
    if tag == "$bytes" and type(body) is str:
        return base64.b64decode(body)
    if tag == "$dtype" and type(body) is str:
        import torch

        dtype = getattr(torch, body, None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown dtype {_short(body)}")
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
            raise ProtocolError(f"no library object {_short(body)}") from None
    if tag == "$learner" and type(body) is str and learner is not None:
        return learner(body)
    if tag == "$exc" and type(body) is dict:
        return rebuild_exception(body)
    raise ProtocolError(f"a value tagged {_short(tag)} cannot be received here")


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
    """Base of the exceptions rebuilt from the sandbox's whose type is not a built-in one kept as it is (and of
    every ``AssertionError`` the learner's code raised: see :func:`rebuild_exception`)."""


_EXC_TYPES: dict[tuple[str, str], type] = {}
_FROM_LEARNER = "_pagedkv_from_learner"


def from_learner(exc: BaseException) -> bool:
    """Whether ``exc`` was rebuilt from the sandbox's description (the learner's code raised it), rather than
    raised by the grader's own code (a check's ``AssertionError``)."""
    return isinstance(exc, LearnerError) or getattr(exc, _FROM_LEARNER, False) is True


class NotPlainResult(TypeError):
    """What a call of the learner's function returned cannot cross (:func:`encode` refused it): the function
    returned normally, so the check says "returned ..." rather than "raised"."""


def rebuild_exception(info: dict) -> BaseException:
    """An exception made here from :func:`exception_info`'s description: the same type name, a built-in base
    kept (``ValueError`` stays catchable as ``ValueError``), never a ``BaseException`` that is not an
    ``Exception`` (a learner's ``SystemExit`` fails one test case and nothing else), with a last frame that
    reads like the learner's line, so the checks' "(in f, line 3: return x // 0)" works.

    It is the learner's (:func:`from_learner` says so), and never an ``AssertionError``, whatever the
    description says: a check's failure is an ``AssertionError`` whose message is the verdict, so a learner's
    one rebuilt as such would put the learner's text in the verdict's place (a forged "passed", or a formula in
    the class's CSV). It is a :class:`LearnerError` named ``AssertionError`` instead, which a check's
    ``except Exception`` reports as "raised AssertionError: ...". Its message is cut to :data:`LEARNER_TEXT`
    characters, its type's name to 100."""
    name = str(info.get("type") or "Exception")
    bases_named = [b for b in info.get("bases") or [] if isinstance(b, str)]
    builtin = next((_BUILTIN_EXC[b] for b in bases_named if b in _BUILTIN_EXC
                    and issubclass(_BUILTIN_EXC[b], Exception)), None)
    if builtin is not None and issubclass(builtin, AssertionError) or name == "AssertionError":
        builtin = None  # the learner's AssertionError (or a subclass): not the grader's failure type
    message = cap_text(info.get("message") or "")
    if builtin is not None and builtin.__name__ == name:
        exc: BaseException = builtin(message)
        setattr(exc, _FROM_LEARNER, True)
    else:
        key = (name, builtin.__name__ if builtin else "")
        if key not in _EXC_TYPES:
            bases = (builtin, LearnerError) if builtin is not None and builtin is not Exception else (LearnerError,)
            shown = name if name.isidentifier() and len(name) <= 100 else "LearnerError"
            _EXC_TYPES[key] = type(shown, bases, {"__module__": "__main__"})
        exc = _EXC_TYPES[key](message)
    where = info.get("where") or {}
    if not isinstance(where, dict):
        return exc
    fname, line, text = where.get("name"), where.get("line"), cap_text(where.get("text") or "", 200)
    if not (isinstance(fname, str) and fname.isidentifier() and len(fname) <= 100 and type(line) is int
            and 2 <= line < 100_000):
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
