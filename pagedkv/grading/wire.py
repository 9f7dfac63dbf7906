"""What crosses between the trusted grader and the sandbox: plain data, as JSON with tagged types (never pickle).

Both ends of :mod:`pagedkv.grading.remote` (the trusted grader) and :mod:`pagedkv.grading.sandbox_main` (the
process that ran the learner's cells) speak this. A message is an 8-byte big-endian length and a UTF-8 JSON
object. Values are encoded by :class:`Codec`:

- ``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``: JSON as they are; ``list``: a JSON array;
- ``{"$tuple": [...]}``, ``{"$set": [...]}``, ``{"$frozenset": [...]}``, ``{"$dict": [[k, v], ...]}`` (any keys),
  ``{"$bytes": base64}``, ``{"$deque": [...], "maxlen": n}``, ``{"$odict": [[k, v], ...]}``, ``{"$slice": [a, b, c]}``;
- ``{"$np": dtype, "shape": [...], "data": base64}`` (a numpy array), ``{"$npv": dtype, "v": value}`` (a numpy
  scalar); ``{"$tensor": storage id, "dtype", "shape", "stride", "offset", "device"}`` with the storage's bytes
  once per message under the message's ``storages`` (so views keep sharing memory, and a padded view keeps its
  padding: an out-of-bounds read lands in it, as it would in the trusted process);
- ``{"$enum": "module:Qualname", "name": member}``, ``{"$ref": "module:qualname"}``: a class, function or enum
  member of the library (``pagedkv.*``), found by name on the other side (from the trusted side, a library
  ``@triton.jit`` function too);
- ``{"$m": id}``: an instance of a library class, *mirrored*: each side keeps its own object for the id, and
  each message carries the state (``__dict__`` and slots) of the mirrored objects that changed since the last
  one, under ``mirrors``; the receiver updates its object in place (no code of the object's class runs);
- ``{"$h": id, ...}``: an object of the sender's that stays where it is (the learner's function, class or
  object): the receiver gets a handle whose attribute reads, calls, ``len``, iteration and indexing are
  requests to the sender; ``{"$r": id}``: one of the receiver's own handles, sent back;
- ``{"$exc": {...}}``: an exception (type name, the names of its built-in bases, message, where it was raised).

No value is ever rebuilt by running code that arrived in a message: a library class is resolved by name in the
receiver's own copy of the library, and its instances are made with ``object.__new__``.
"""

from __future__ import annotations

import base64
import collections
import collections.abc
import enum
import functools
import importlib
import itertools
import json
import os
import re
import struct
import sys
import types
from collections.abc import Callable
from typing import Any

from pagedkv.grading.checks import own_frame, statement_text

__all__ = ["MAX_MESSAGE", "Codec", "ProtocolError", "read_message", "write_message"]

#: The largest message either side accepts (bytes): the exercises' tensors are a few MB; a learner's function that
#: returns more fails its test case (the worker never holds more than this of the learner's making).
MAX_MESSAGE = 256 << 20

_HEADER = struct.Struct(">Q")
_BUILTIN_EXCEPTIONS = {name: obj for name, obj in vars(__import__("builtins")).items()
                       if isinstance(obj, type) and issubclass(obj, BaseException)}


_REMOTE: list[type] = []


def _remote_base() -> type:
    """The trusted side's handle class (:class:`pagedkv.grading.remote.RemoteObject`), found once."""
    if not _REMOTE:
        try:
            from pagedkv.grading.remote import RemoteObject
        except ImportError:  # the sandbox's copy: it never holds handles
            return type(None)
        _REMOTE.append(RemoteObject)
    return _REMOTE[0]


_SCALARS = {int, float, str, bytes, bool, type(None)}
_JSON_SCALARS = {int, float, str, bool, type(None)}  # sent as they are
_SEQUENCES = {list, tuple, collections.deque}
_MAPPINGS = {dict, collections.OrderedDict, collections.defaultdict}
_DEEP = _SEQUENCES | _MAPPINGS | {set, frozenset}
_FLAT_CONTAINERS = _SEQUENCES | {set, frozenset}
_GETTERS: dict[type, Any] = {}


def _getter(cls: type, slots: tuple[str, ...]) -> Any:
    g = _GETTERS.get(cls)
    if g is None:
        import operator

        g = _GETTERS[cls] = operator.attrgetter(*slots)
    return g


_FLAT: set[type] = set(_SCALARS)  # value types whose fingerprint is their identity alone (no contents, no version)


def _watched(kinds: set[type]) -> bool:
    """Whether any of ``kinds`` needs more than its identity in a fingerprint (a container, a tensor); the others
    join :data:`_FLAT`, so that the next fingerprint skips them with one set difference."""
    found = False
    for kind in kinds:
        if kind in _DEEP or kind.__module__ == "torch":
            found = True
        elif "_pagedkv_handle" not in vars(kind):  # not a stand-in for a learner's class (kept only while used)
            _FLAT.add(kind)
    return found


class _Identity:
    """Compares by the identity of the object it holds (a fingerprint must not call a learner's ``__eq__``)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class ProtocolError(Exception):
    """A message that is not what the protocol says (too long, not JSON, cut short)."""


def write_message(fd: int, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes is over the {MAX_MESSAGE} limit")
    buf = memoryview(_HEADER.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


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
        raise ProtocolError(f"message of {n} bytes is over the {MAX_MESSAGE} limit")
    try:
        message = json.loads(_read_exact(fd, n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a message that is not JSON ({exc})") from exc
    if not isinstance(message, dict):
        raise ProtocolError("a message that is not a JSON object")
    return message


def qualified_name(obj: Any) -> str | None:
    """``module:qualname`` of a class or function, or None when it has none."""
    module = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qual, str) or "<locals>" in qual:
        return None
    return f"{module}:{qual}"


def resolve_name(name: str) -> Any:
    """The object named ``module:qualname``, imported in this process (library names only)."""
    module, _, qual = name.partition(":")
    if not is_library_module(module) or not qual:
        raise ProtocolError(f"{name!r} is not a library name")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def library_jit_name(value: Any) -> str | None:
    """``module:qualname`` of a library ``@triton.jit`` function (a Triton ``JITFunction``, or an
    ``InterpretedFunction`` under ``TRITON_INTERPRET=1``) defined at the top of its module, else None."""
    kind = type(value)
    if kind.__name__ not in ("JITFunction", "InterpretedFunction") or not kind.__module__.startswith("triton."):
        return None
    fn = getattr(value, "fn", None)
    name = qualified_name(fn) if isinstance(fn, types.FunctionType) else None
    if name is None or not is_library_module(fn.__module__) or "." in fn.__qualname__:
        return None
    module = sys.modules.get(fn.__module__)
    return name if module is not None and getattr(module, fn.__qualname__, None) is value else None


def is_library_module(module: Any) -> bool:
    """The library and the lessons' checks (``pagedkv.grading.lessons``): code both sides have, whose objects
    are mirrored and whose names may cross; never the grader's own machinery."""
    if not isinstance(module, str) or not (module == "pagedkv" or module.startswith("pagedkv.")):
        return False
    return not module.startswith("pagedkv.grading") or module.startswith("pagedkv.grading.lessons")


_BUILTIN_BASES: dict[type, type | None] = {}


def _builtin_base(cls: type) -> type | None:
    """deque, list, dict or set when ``cls`` (a library class) is built on one (``FCFSRequestQueue(deque)``);
    found once per class (the fingerprints ask for every mirrored object of every message)."""
    try:
        return _BUILTIN_BASES[cls]
    except KeyError:
        pass
    found = None
    if cls not in (collections.deque, list, dict, set):
        found = next((k for k in (collections.deque, list, dict, set) if issubclass(cls, k)), None)
    _BUILTIN_BASES[cls] = found
    return found


def _new(cls: type) -> Any:
    """An empty instance of ``cls`` made without running its ``__init__``."""
    builtin = _builtin_base(cls)
    return builtin.__new__(cls) if builtin is not None else object.__new__(cls)


def _library_base(cls: type, *, exact: bool) -> type | None:
    """The library class an instance of ``cls`` is mirrored as: ``cls`` itself when it is the library's; on the
    trusted side (``exact`` False) also a test's own subclass of a library class, as its first library base
    (the sandbox gets the library class with the same state; its changes come back into the test's object)."""
    for klass in (cls,) if exact else cls.__mro__:
        if klass is object:
            return None
        if is_library_module(getattr(klass, "__module__", None)) and qualified_name(klass) is not None:
            return klass
    return None


def exception_info(exc: BaseException) -> dict:
    """What the other side needs to re-raise ``exc``: its type's name, its built-in bases, the message, where."""
    import traceback

    bases = [c.__name__ for c in type(exc).__mro__ if _BUILTIN_EXCEPTIONS.get(c.__name__) is c]
    try:
        # str(KeyError("k")) is "'k'" (the key's repr): send the key itself, or the KeyError rebuilt from the
        # message on the other side would read "'k'" inside another pair of quotes
        if isinstance(exc, KeyError) and len(exc.args) == 1 and type(exc).__str__ is KeyError.__str__:
            message = str(exc.args[0])
        else:
            message = str(exc)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        message = f"<{type(exc).__name__} whose str() raised>"
    where = None
    last = own_frame(traceback.extract_tb(exc.__traceback__))
    if last is not None:
        where = {"name": last.name, "line": last.lineno, "text": statement_text(last),
                 "file": last.filename}
    return {"type": type(exc).__name__, "bases": bases, "message": message[:4000], "where": where}


class Codec:
    """Encodes and decodes values for one side of the connection.

    ``side`` is ``"t"`` (the trusted grader) or ``"s"`` (the sandbox): it prefixes the mirror ids this side
    creates. ``export`` turns a local object that must stay here into a handle id; ``import_handle`` turns a
    handle description from the other side into a local proxy; ``exported`` maps one of this side's handle ids
    back to its object; ``resolve`` finds a library name (the trusted side passes one that refuses the
    exercise's reference symbols).
    """

    def __init__(self, side: str, *, export: Callable[[Any], dict] | None,
                 import_handle: Callable[[dict], Any] | None, exported: Callable[[int], Any] | None,
                 resolve: Callable[[str], Any] = resolve_name,
                 make_mirror: Callable[[type, str], Any] | None = None) -> None:
        self.side = side
        self._export = export
        self._import_handle = import_handle
        self._exported = exported
        self._resolve = resolve
        self._make_mirror = make_mirror
        self.mirrors: dict[str, Any] = {}  # id -> object
        self._mirror_ids: dict[int, str] = {}  # id(object) -> id
        self._last_state: dict[str, Any] = {}  # id -> the fingerprint of the state last sent or received
        self._counter = 0
        self._new: list[str] = []  # mirrored objects registered since the last mirror_states
        self._mirrored: set[type] = set()  # classes whose instances encode as mirrors (found by encode)
        self._storages: dict[int, tuple[str, Any]] = {}  # while encoding: storage pointer -> (id, tensor)
        self._storage_out: dict[str, dict] = {}
        self.received_storages: dict[str, Any] = {}  # while decoding: storage id -> tensor (flat, uint8)

    # -------------------------------------------------------------- mirrors
    def clear(self) -> None:
        self._mirrored.clear()
        self._new.clear()
        self.mirrors.clear()
        self._mirror_ids.clear()
        self._last_state.clear()

    def _mirror_id(self, obj: Any) -> str:
        mid = self._mirror_ids.get(id(obj))
        if mid is None:
            self._counter += 1
            mid = f"{self.side}{self._counter}"
            self.mirrors[mid] = obj
            self._mirror_ids[id(obj)] = mid
            self._new.append(mid)
        return mid

    _SLOTS: dict[type, tuple[str, ...]] = {}
    #: per class: whether its instances have a ``__dict__``, its slots, a getter of them, its built-in base
    _LAYOUTS: dict[type, tuple[bool, tuple[str, ...], Any, type | None]] = {}

    @classmethod
    def _slot_names(cls, klass: type) -> tuple[str, ...]:
        names = cls._SLOTS.get(klass)
        if names is None:
            found: list[str] = []
            for k in klass.__mro__:
                slots = getattr(k, "__slots__", ()) or ()
                for slot in (slots,) if isinstance(slots, str) else slots:
                    if slot not in ("__dict__", "__weakref__") and slot not in found:
                        found.append(slot)
            names = cls._SLOTS[klass] = tuple(found)
        return names

    @classmethod
    def _state(cls, obj: Any) -> dict[str, Any]:
        state = dict(getattr(obj, "__dict__", {}) or {})
        builtin = _builtin_base(type(obj))
        if builtin is not None:  # a library class built on deque, list, dict or set: its items are state too
            state["__items__"] = list(builtin.items(obj)) if builtin is dict else list(builtin.__iter__(obj))
        for slot in cls._slot_names(type(obj)):
            if slot not in state:
                try:
                    state[slot] = object.__getattribute__(obj, slot)
                except AttributeError:
                    pass
        return state

    @classmethod
    def _fp(cls, v: Any, depth: int = 0) -> Any:
        """A cheap fingerprint of a container's contents (equal fingerprints mean nothing to send): a shallow
        copy, deeper only when it holds containers. Objects inside count as themselves (a mirrored object's own
        state is fingerprinted separately), tensors by storage and version."""
        t = type(v)
        if t in _SCALARS:
            return v
        if t in _SEQUENCES:
            if depth < 6 and not _DEEP.isdisjoint(map(type, v)):
                return (t, tuple(map(functools.partial(cls._fp, depth=depth + 1), v)))
            items = tuple(v)
            return (t, tuple(map(id, items)), items)  # the items held: no id reused while it is compared
        if t in _MAPPINGS:
            pairs = tuple(v.items())  # held, as above
            flat_keys, flat_values = _DEEP.isdisjoint(map(type, v)), _DEEP.isdisjoint(map(type, v.values()))
            if depth < 6 and not (flat_keys and flat_values):  # a dict of dicts (BlockPool's hash -> blocks)
                deeper = functools.partial(cls._fp, depth=depth + 1)
                return (t, tuple(map(id if flat_keys else deeper, v)), tuple(map(deeper, v.values())), pairs)
            return (t, tuple(map(id, v)), tuple(map(id, v.values())), pairs)
        if t in (set, frozenset):
            items = tuple(v)
            return (t, frozenset(map(id, items)), items)
        if t.__module__ == "torch":
            return ("tensor", id(v), getattr(v, "_version", None))
        if t is itertools.count:
            return ("count", repr(v))
        return _Identity(v)

    def _values(self, obj: Any) -> tuple[tuple, list]:
        """A mirrored object's attribute names (of its ``__dict__``) and the values of its state: ``__dict__``,
        slots and, for a library class built on a container, its items (as one list, last)."""
        cls = type(obj)
        layout = self._LAYOUTS.get(cls)
        if layout is None:
            slots = self._slot_names(cls)
            layout = self._LAYOUTS[cls] = (bool(getattr(cls, "__dictoffset__", 1)), slots,
                                           _getter(cls, slots) if slots else None, _builtin_base(cls))
        has_dict, slots, getter, builtin = layout
        d = getattr(obj, "__dict__", None) if has_dict else None
        keys: tuple = ()
        values: list = []
        if d:
            keys, values = tuple(d), list(d.values())
        if getter is not None:
            try:
                got = getter(obj)
                values += got if len(slots) > 1 else (got,)
            except AttributeError:  # a slot not set yet: by name, the set ones
                state = self._state(obj)
                keys += tuple(k for k in slots if k in state)
                values += [state[k] for k in slots if k in state]
        if builtin is not None:
            values.append(list(builtin.items(obj)) if builtin is dict else list(builtin.__iter__(obj)))
        return keys, values

    def _fingerprint(self, obj: Any, keys_values: tuple[tuple, list] | None = None) -> Any:
        """Equal fingerprints mean the object's state has not changed: the same attribute names, the very same
        value objects (by ``id``: the fingerprint holds the values, so no id can be reused while it is kept),
        containers among them with the same contents, tensors at the same version. Never calls a value's ``__eq__``."""
        keys, values = keys_values if keys_values is not None else self._values(obj)
        deep: tuple = ()
        kinds = set(map(type, values)) - _FLAT
        if kinds and _watched(kinds):  # containers (their contents), tensors (their versions)
            deep = tuple(self._fp(x) for x in values if type(x) in _DEEP or type(x).__module__ == "torch")
        return (keys, tuple(map(id, values)), deep, values)

    def reachable(self, roots: list[Any], fingerprints: dict[str, Any] | None = None) -> list[str]:
        """The mirrored objects reachable from ``roots``: through containers, mirrored objects' state, and other
        objects' ``__dict__`` (the learner's objects, on the sandbox's side); never through code or modules.
        ``fingerprints`` receives each one's :meth:`_fingerprint`, taken on the way."""
        seen: set[int] = set()
        found: list[str] = []
        stack = list(roots)
        pop, extend, mark = stack.pop, stack.extend, seen.add
        mirror_ids, mirrors, scalars = self._mirror_ids, self.mirrors, _SCALARS
        while stack:
            v = pop()
            t = type(v)
            if t in scalars or id(v) in seen:
                continue
            mark(id(v))
            if t in _FLAT_CONTAINERS:
                if not scalars.issuperset(map(type, v)):  # a list of token ids holds nothing to visit
                    extend(v)
                continue
            if t in _MAPPINGS:
                if not scalars.issuperset(map(type, v)):
                    extend(v.keys())
                if not scalars.issuperset(map(type, v.values())):
                    extend(v.values())
                continue
            mid = mirror_ids.get(id(v))
            if mid is not None and mirrors.get(mid) is v:
                found.append(mid)
                keys_values = self._values(v)
                extend(keys_values[1])
                if fingerprints is not None:
                    fingerprints[mid] = self._fingerprint(v, keys_values)
                continue
            if t is types.MethodType:
                stack.append(v.__self__)
                continue
            if isinstance(v, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)) or \
                    t.__module__ == "torch":
                continue
            try:
                d = object.__getattribute__(v, "__dict__")
            except AttributeError:
                continue
            if type(d) is dict:
                extend(d.values())
        return found

    def mirror_states(self, roots: list[Any] | None = None) -> dict[str, dict]:
        """The states of the mirrored objects that changed since they last crossed (new ones included): all of
        them, or those reachable from ``roots`` (what the message's code could have reached)."""
        out: dict[str, dict] = {}
        done: set[str] = set()
        fingerprints: dict[str, Any] = {}
        todo = list(self.mirrors) if roots is None else self.reachable(roots, fingerprints)
        while todo:
            for mid in todo:
                done.add(mid)
                obj = self.mirrors[mid]
                fp = fingerprints.get(mid)
                if fp is None:
                    fp = self._fingerprint(obj)
                if self._last_state.get(mid) != fp:
                    self._last_state[mid] = fp
                    entry = {"class": qualified_name(_library_base(type(obj), exact=False) or type(obj)),
                             "state": {k: self.encode(v) for k, v in self._state(obj).items()}}
                    if self._export is not None and not is_library_module(type(obj).__module__):
                        entry["learner_class"] = self._export(type(obj))  # its methods stay here
                    out[mid] = entry
            todo = [mid for mid in self._new if mid not in done]
            self._new.clear()
        return out

    def apply_mirror_states(self, states: dict) -> None:
        if not isinstance(states, dict):
            raise ProtocolError("mirrors is not an object")
        for mid, entry in states.items():
            if mid not in self.mirrors:
                if "learner_class" in entry and self._import_handle is not None:
                    cls = self._import_handle(entry["learner_class"])
                else:
                    cls = self._resolve(str(entry.get("class")))
                if not isinstance(cls, type):
                    raise ProtocolError(f"{entry.get('class')} is not a class")
                obj = self._make_mirror(cls, mid) if self._make_mirror else _new(cls)
                self.mirrors[mid] = obj
                self._mirror_ids[id(obj)] = mid
        for mid, entry in states.items():
            obj = self.mirrors[mid]
            state = {str(k): self.decode(v) for k, v in (entry.get("state") or {}).items()}
            slots = set(self._slot_names(type(obj)))
            if hasattr(obj, "__dict__"):
                obj.__dict__.clear()
            builtin = _builtin_base(type(obj))
            if builtin is not None:
                items = state.pop("__items__", [])
                builtin.clear(obj)
                if builtin is dict:
                    dict.update(obj, items)
                elif builtin is collections.deque:
                    collections.deque.extend(obj, items)
                else:
                    builtin.__init__(obj, items)
            for k, v in state.items():
                if k in slots or not hasattr(obj, "__dict__"):
                    object.__setattr__(obj, k, v)
                else:
                    obj.__dict__[k] = v
        for mid in states:
            self._last_state[mid] = self._fingerprint(self.mirrors[mid])

    # -------------------------------------------------------------- tensors
    def begin(self) -> None:
        self._storages = {}
        self._storage_out = {}

    def storages(self) -> dict[str, dict]:
        return self._storage_out

    def _encode_tensor(self, t: Any) -> dict:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._storages:
            sid = f"{self.side}{len(self._storages) + 1}"
            self._storages[key] = (sid, t)
            import torch

            flat = torch.empty(0, dtype=torch.uint8).set_(storage.cpu() if t.device.type != "cpu" else storage)
            self._storage_out[sid] = {"nbytes": storage.nbytes(),
                                      "data": base64.b64encode(flat.numpy().tobytes()).decode("ascii")}
        sid = self._storages[key][0]
        return {"$tensor": sid, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "stride": list(t.stride()), "offset": t.storage_offset(), "device": t.device.type,
                "grad": bool(t.requires_grad)}

    @staticmethod
    def _encode_storage_bytes(flat: Any) -> dict:
        """A received storage (flat uint8), sent back after a call: the tensors written in place."""
        return {"nbytes": int(flat.numel()), "data": base64.b64encode(flat.numpy().tobytes()).decode("ascii")}

    def write_back(self, storages: dict) -> None:
        """Copy the storages the other side sent back into the tensors this side had sent (in-place writes)."""
        if not storages:
            return
        import numpy as np
        import torch

        by_sid = {sid: t for sid, t in self._storages.values()}
        for sid, entry in (storages or {}).items():
            t = by_sid.get(sid)
            if t is None:
                raise ProtocolError("a storage written back that was never sent")
            data = base64.b64decode(entry["data"])
            storage = t.untyped_storage()
            if len(data) != storage.nbytes():
                raise ProtocolError("a storage written back with the wrong length")
            new = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))
            flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            flat.copy_(new)

    def load_storages(self, storages: dict) -> None:
        self.received_storages = {}
        if not storages:
            return
        import numpy as np
        import torch

        for sid, entry in (storages or {}).items():
            data = base64.b64decode(entry["data"])
            if len(data) != int(entry["nbytes"]):
                raise ProtocolError("a tensor storage of the wrong length")
            self.received_storages[sid] = torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.uint8))

    def _decode_tensor(self, v: dict) -> Any:
        import torch

        flat = self.received_storages.get(v["$tensor"])
        if flat is None:
            raise ProtocolError("a tensor whose storage was not sent")
        dtype = getattr(torch, str(v["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown dtype {v['dtype']!r}")
        base = flat.view(dtype) if flat.numel() % dtype.itemsize == 0 else flat[: flat.numel() // dtype.itemsize
                                                                               * dtype.itemsize].view(dtype)
        t = base.as_strided([int(x) for x in v["shape"]], [int(x) for x in v["stride"]], int(v["offset"]))
        if v.get("device") == "cuda" and torch.cuda.is_available():
            t = t.cuda()
        return t

    # -------------------------------------------------------------- values
    def encode(self, value: Any) -> Any:  # noqa: C901 - one branch per type
        kind = type(value)
        if kind in _JSON_SCALARS:
            return value
        if kind in self._mirrored:  # a class whose instances were mirrored before (the branch below)
            return {"$m": self._mirror_id(value)}
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int) and type(value) is int:
            return value
        if isinstance(value, float) and type(value) is float:
            return value
        if type(value) is list:
            return [self.encode(v) for v in value]
        if type(value) is tuple:
            return {"$tuple": [self.encode(v) for v in value]}
        if type(value) is dict:
            return {"$dict": [[self.encode(k), self.encode(v)] for k, v in value.items()]}
        if type(value) is set:
            return {"$set": [self.encode(v) for v in value]}
        if type(value) is frozenset:
            return {"$frozenset": [self.encode(v) for v in value]}
        if type(value) is bytes:
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if type(value) is collections.OrderedDict:
            return {"$odict": [[self.encode(k), self.encode(v)] for k, v in value.items()]}
        if type(value) is collections.deque:
            return {"$deque": [self.encode(v) for v in value], "maxlen": value.maxlen}
        if type(value) is collections.defaultdict and value.default_factory in (list, int, set, dict, float):
            return {"$ddict": [[self.encode(k), self.encode(v)] for k, v in value.items()],
                    "factory": value.default_factory.__name__}
        if type(value) is itertools.count:  # a queue's tie-breaker (PriorityRequestQueue._seq)
            m = re.fullmatch(r"count\((-?\d+)(?:, (-?\d+))?\)", repr(value))
            if m:
                return {"$count": int(m.group(1)), "step": int(m.group(2) or 1)}
        if type(value) is range:
            return {"$range": [value.start, value.stop, value.step]}
        if isinstance(value, (types.GeneratorType, collections.abc.Iterator)) and self._export is None:
            # an iterator the test hands the learner's code: its items, as an iterator again on the other side
            return {"$iter": [self.encode(v) for v in value]}
        if type(value) is slice:
            return {"$slice": [self.encode(value.start), self.encode(value.stop), self.encode(value.step)]}
        if isinstance(value, BaseException) and self._export is None:
            return {"$exc": exception_info(value)}
        module = type(value).__module__
        if module == "torch" and type(value).__name__ in ("Tensor", "Parameter"):
            return self._encode_tensor(value.detach())
        if module == "torch" and type(value).__name__ == "dtype":
            return {"$dtype": str(value).removeprefix("torch.")}
        if module == "numpy" and type(value).__name__ == "ndarray" and value.dtype.kind in "biuf":
            return {"$np": value.dtype.str, "shape": list(value.shape),
                    "data": base64.b64encode(value.tobytes()).decode("ascii")}
        if module == "numpy" and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0 and \
                value.dtype.kind in "biuf":
            return {"$npv": value.dtype.str, "v": value.item()}
        if isinstance(value, enum.Enum) and is_library_module(type(value).__module__):
            return {"$enum": qualified_name(type(value)), "name": value.name}
        remote = _remote_base()
        if isinstance(value, remote):
            return {"$r": value._pagedkv_handle_id}
        if isinstance(value, type) and type(value).__name__ == "RemoteClass" and \
                type(value).__module__ == "pagedkv.grading.remote":
            return {"$r": type.__getattribute__(value, "_pagedkv_handle")._pagedkv_handle_id}
        if is_library_module(getattr(value, "__module__", None)) and isinstance(value, type) or (
                callable(value) and type(value).__name__ in ("function", "builtin_function_or_method")
                and is_library_module(getattr(value, "__module__", None))):
            name = qualified_name(value)
            if name is not None:
                return {"$ref": name}
        if self.side == "t" and library_jit_name(value) is not None:
            # a check's own @triton.jit function put into the learner's namespace (set 06 judges exercise 2
            # with exercise 1's answer in place of the learner's): the sandbox's copy of it, by name. Only this
            # way: what the sandbox sends stays a handle, as before.
            return {"$ref": library_jit_name(value)}
        if not isinstance(value, type) and _library_base(type(value), exact=False) is not None:
            # a library object, a test's subclass of one (trusted side), or a learner's (sandbox side): mirrored.
            # Every test above looks at the type alone, so the next instance of this class comes straight here.
            self._mirrored.add(kind)
            return {"$m": self._mirror_id(value)}
        if self._export is not None:
            return self._export(value)
        raise TypeError(f"cannot send a {type(value).__name__} to the learner's code")

    def decode(self, value: Any) -> Any:  # noqa: C901 - one branch per tag
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, list):
            return [self.decode(v) for v in value]
        if type(value) is dict and len(value) == 1 and "$m" in value:  # the most frequent tag first
            obj = self.mirrors.get(str(value["$m"]))
            if obj is None:
                raise ProtocolError(f"mirrored object {value['$m']} was not described")
            return obj
        if not isinstance(value, dict) or len(value) == 0:
            raise ProtocolError(f"unexpected value {str(value)[:80]}")
        if "$tuple" in value:
            return tuple(self.decode(v) for v in value["$tuple"])
        if "$dict" in value:
            return {self.decode(k): self.decode(v) for k, v in value["$dict"]}
        if "$set" in value:
            return {self.decode(v) for v in value["$set"]}
        if "$frozenset" in value:
            return frozenset(self.decode(v) for v in value["$frozenset"])
        if "$bytes" in value:
            return base64.b64decode(value["$bytes"])
        if "$odict" in value:
            return collections.OrderedDict((self.decode(k), self.decode(v)) for k, v in value["$odict"])
        if "$deque" in value:
            return collections.deque((self.decode(v) for v in value["$deque"]), value.get("maxlen"))
        if "$ddict" in value:
            factory = {"list": list, "int": int, "set": set, "dict": dict, "float": float}[value["factory"]]
            return collections.defaultdict(factory, {self.decode(k): self.decode(v) for k, v in value["$ddict"]})
        if "$iter" in value:
            return iter([self.decode(v) for v in value["$iter"]])
        if "$count" in value:
            return itertools.count(int(value["$count"]), int(value.get("step", 1)))
        if "$range" in value:
            return range(*(int(v) for v in value["$range"]))
        if "$slice" in value:
            return slice(*(self.decode(v) for v in value["$slice"]))
        if "$tensor" in value:
            return self._decode_tensor(value)
        if "$dtype" in value:
            import torch

            dtype = getattr(torch, str(value["$dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ProtocolError("unknown dtype")
            return dtype
        if "$np" in value:
            import numpy as np

            dtype = np.dtype(str(value["$np"]))
            if dtype.kind not in "biuf":
                raise ProtocolError("unsupported numpy dtype")
            return np.frombuffer(base64.b64decode(value["data"]), dtype=dtype).reshape(value["shape"]).copy()
        if "$npv" in value:
            import numpy as np

            dtype = np.dtype(str(value["$npv"]))
            if dtype.kind not in "biuf":
                raise ProtocolError("unsupported numpy dtype")
            return dtype.type(value["v"])
        if "$enum" in value:
            cls = self._resolve(str(value["$enum"]))
            return cls[str(value["name"])]
        if "$ref" in value:
            return self._resolve(str(value["$ref"]))
        if "$m" in value:
            obj = self.mirrors.get(str(value["$m"]))
            if obj is None:
                raise ProtocolError(f"mirrored object {value['$m']} was not described")
            return obj
        if "$h" in value:
            if self._import_handle is None:
                raise ProtocolError("handles are not accepted here")
            return self._import_handle(value)
        if "$r" in value:
            if self._exported is None:
                raise ProtocolError("this side exports nothing")
            return self._exported(int(value["$r"]))
        if "$exc" in value:
            return value["$exc"]
        raise ProtocolError(f"unknown tag in {sorted(value)[:3]}")
