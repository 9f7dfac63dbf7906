"""The trusted grader's side of the sandbox: proxies that stand in for the learner's functions and objects.

A hidden test runs here, in the trusted process, with the learner's ``blocks_needed`` replaced by a
:class:`RemoteObject`: calling it sends the arguments (plain data, :mod:`pagedkv.grading.wire`) to the sandbox,
which calls the learner's function and sends back the result as plain data, a mirrored library object or a
handle to one of the learner's objects. The test compares what came back with what it expects *here*, with
the checks of this process, which no learner code can patch.

Rules that keep the comparison honest:

- a handle is equal only to itself (``==`` never asks the learner's object), hashes by identity, and is
  callable only when the learner's object is;
- exceptions come back as exception objects made here (``ValueError`` stays a ``ValueError`` for
  ``expect_raises``; ``SystemExit`` and ``KeyboardInterrupt`` raised by the learner's code become ordinary
  ``Exception`` subclasses of those names, so they fail one test case and nothing else);
- a library object the sandbox sends that this side has never seen is rebuilt from its state with
  ``object.__new__``; if its class has methods that are the exercise's reference, it gets a subclass whose
  reference methods raise: the learner cannot hand back a library object and have this process run the
  library's answer on it;
- every wait for the sandbox is bounded: a test case's budget (:class:`TooSlow` when spent, which says how
  many calls took how long), the checks' own per-call ``timeout`` (SIGALRM here), and after an interrupt a
  grace period, after which the sandbox is declared dead (:class:`SandboxDied`).
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import select
import time
import types
import weakref
from typing import Any

from pagedkv.grading.limits import WALL_FACTOR
from pagedkv.grading.sandbox import Sandbox, hidden_message
from pagedkv.grading.wire import Codec, ProtocolError, read_message, resolve_name, write_message

__all__ = ["Client", "RemoteObject", "SandboxDied", "TooSlow", "is_remote"]

_GRACE = 10.0  # seconds the sandbox has to answer after an interrupt


class TooSlow(BaseException):  # noqa: N818 - a BaseException, like CallTimeout: `except Exception` cannot eat it
    """A test case ran past its budget while the learner's code was running."""


class SandboxDied(BaseException):  # noqa: N818
    """The sandbox process ended or stopped answering."""


class NeedsLibrary(BaseException):  # noqa: N818
    """A check composes the learner's class with library methods that this sandbox has as stubs (the
    exercise's other part: ``type("LookupOnly", (C,), {"_cache_blocks": KVCacheManager._cache_blocks})``); the
    worker runs that test case again in a sandbox where those methods are the library's."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(", ".join(sorted(names)))
        self.names = set(names)


def is_remote(value: Any) -> bool:
    return isinstance(value, RemoteObject)


class RemoteObject:
    """A handle to one of the learner's objects in the sandbox. See the module's docstring."""

    __slots__ = ("__weakref__", "_pagedkv_client", "_pagedkv_handle_id", "_pagedkv_meta")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_pagedkv_"):
            raise AttributeError(name)
        return self._pagedkv_client.request("getattr", h=self._pagedkv_handle_id, name=name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_pagedkv_"):
            object.__setattr__(self, name, value)
        else:
            self._pagedkv_client.request("setattr", h=self._pagedkv_handle_id, name=name, value=value)

    def __len__(self) -> int:
        n = self._pagedkv_client.request("len", h=self._pagedkv_handle_id)
        if type(n) is not int:
            raise TypeError("len() of the learner's object is not an int")
        return n

    def __iter__(self) -> Any:
        it = self._pagedkv_client.request("iter", h=self._pagedkv_handle_id)
        while True:
            try:
                yield self._pagedkv_client.request("next", h=it._pagedkv_handle_id)
            except StopIteration:
                return

    def __getitem__(self, key: Any) -> Any:
        return self._pagedkv_client.request("getitem", h=self._pagedkv_handle_id, key=key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._pagedkv_client.request("setitem", h=self._pagedkv_handle_id, key=key, value=value)

    def __contains__(self, item: Any) -> bool:
        return bool(self._pagedkv_client.request("contains", h=self._pagedkv_handle_id, item=item) is True)

    def __bool__(self) -> bool:
        return self._pagedkv_client.request("bool", h=self._pagedkv_handle_id) is True

    def __repr__(self) -> str:
        text = self._pagedkv_client.request("repr", h=self._pagedkv_handle_id)
        return text if isinstance(text, str) else "<the learner's object>"

    def __str__(self) -> str:
        text = self._pagedkv_client.request("str", h=self._pagedkv_handle_id)
        return text if isinstance(text, str) else "<the learner's object>"

    def __eq__(self, other: object) -> bool:
        return other is self or (isinstance(other, RemoteObject) and
                                 other._pagedkv_handle_id == self._pagedkv_handle_id and
                                 other._pagedkv_client is self._pagedkv_client)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((id(self._pagedkv_client), self._pagedkv_handle_id))


class _CallableRemote(RemoteObject):
    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._pagedkv_client.request("call", h=self._pagedkv_handle_id, args=list(args), kwargs=kwargs)


_HANDLE_TYPES: dict[tuple[str, bool, str | None, bool], type] = {}
_EXC_TYPES: dict[tuple[str, str], type] = {}
_BUILTIN_EXC = {name: obj for name, obj in vars(__import__("builtins")).items()
                if isinstance(obj, type) and issubclass(obj, Exception)}


def _handle_type(type_name: str, is_callable: bool, module: str | None = None, is_class: bool = False) -> type:
    """A RemoteObject subclass named like the learner's type (``Weird``), so messages name it, and whose
    ``__module__`` is the learner's object's (``__main__``, or the library's for an imported function).

    A handle to a learner's *class* passes ``isinstance(handle, type)`` (its ``__class__`` is ``type``) and
    ``issubclass(handle, KVCacheManager)`` (its ``__bases__`` come from the sandbox: library classes by name,
    the learner's own as handles), as the checks ask of an answer that must subclass a library class."""
    key = (type_name, is_callable, module, is_class)
    if key not in _HANDLE_TYPES:
        name = type_name if type_name.isidentifier() else "RemoteObject"
        base = _CallableRemote if is_callable else RemoteObject
        namespace: dict[str, Any] = {"__slots__": (), "__module__": module or "__main__"}
        if is_class:
            namespace["__class__"] = property(lambda self: type)
        _HANDLE_TYPES[key] = type(name, (base,), namespace)
    return _HANDLE_TYPES[key]


_CLASS_OWN = {"__dict__", "__mro__", "__name__", "__qualname__", "__module__", "__bases__", "__class__", "__base__",
              "__instancecheck__", "__subclasscheck__", "__subclasses__", "mro", "__call__", "__new__", "__init__",
              "__repr__", "__str__", "__hash__", "__eq__", "__ne__", "__weakref__", "__doc__", "__init_subclass__",
              "__prepare__", "__abstractmethods__", "__annotations__", "__slots__", "__getattribute__", "__setattr__",
              "__flags__", "__basicsize__", "__itemsize__", "__dictoffset__", "__weakrefoffset__", "__type_params__",
              "__orig_bases__", "__parameters__", "__class_getitem__", "__mro_entries__", "__dir__", "__sizeof__",
              "__reduce__", "__reduce_ex__", "__getstate__", "__format__", "__subclasshook__", "__delattr__"}


class RemoteClass(type):
    """The metaclass of the classes that stand for a learner's classes.

    Such a class is a real class here, so ``isinstance(C, type)`` holds and ``issubclass(C, KVCacheManager)``
    follows the learner's class (its one base here is the first library class of the learner's class's MRO);
    every attribute read (``C.get_computed_blocks``) and every instantiation goes to the sandbox. A check that
    subclasses it (``type("LookupOnly", (C,), {"_cache_blocks": KVCacheManager._cache_blocks})``: the learner's
    method with the library's for the other part) gets that subclass made in the sandbox, from the library's
    own copy of the methods named."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> Any:  # noqa: N804
        if "_pagedkv_handle" in namespace:
            return super().__new__(mcls, name, bases, namespace)
        remote = [b for b in bases if isinstance(b, RemoteClass)]
        client = type.__getattribute__(remote[0], "_pagedkv_handle")._pagedkv_client
        handles = [type.__getattribute__(b, "_pagedkv_handle") if isinstance(b, RemoteClass) else b for b in bases]
        members = {k: v for k, v in namespace.items() if k not in ("__module__", "__qualname__", "__doc__")}
        wanted = {f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', '')}" for v in members.values()
                  if callable(v)}
        if wanted & client.references:
            raise NeedsLibrary(wanted & client.references)
        return client.request("subclass", name=name, bases=handles, namespace=members)

    def __init__(cls, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> None:
        if "_pagedkv_handle" in namespace:
            super().__init__(name, bases, namespace)

    def __getattribute__(cls, name: str) -> Any:
        if name.startswith("_pagedkv_") or name in _CLASS_OWN:
            return type.__getattribute__(cls, name)
        return type.__getattribute__(cls, "_pagedkv_handle").__getattr__(name)

    def __setattr__(cls, name: str, value: Any) -> None:
        setattr(type.__getattribute__(cls, "_pagedkv_handle"), name, value)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return type.__getattribute__(cls, "_pagedkv_handle")(*args, **kwargs)


def _is_view(name: str) -> bool:
    """A library method that only reads its object's state into plain data: ``snapshot`` and its helpers."""
    return name == "snapshot" or name.startswith("_snapshot")


class RemoteError(Exception):
    """Base of the exceptions rebuilt from the sandbox's."""


def _exception(info: dict) -> BaseException:
    """An exception made here from the sandbox's description: same type name, a built-in base kept (ValueError
    stays catchable as ValueError), always an ``Exception`` (a learner's SystemExit fails one case)."""
    name = str(info.get("type") or "Exception")
    if name == "StopIteration":
        return StopIteration()
    builtin = next((_BUILTIN_EXC[b] for b in info.get("bases") or [] if b in _BUILTIN_EXC), None)
    if builtin is not None and builtin.__name__ == name:
        exc: BaseException = builtin(str(info.get("message") or ""))
    else:
        key = (name, builtin.__name__ if builtin else "")
        if key not in _EXC_TYPES:
            bases = (builtin, RemoteError) if builtin is not None and builtin is not Exception else (RemoteError,)
            _EXC_TYPES[key] = type(name if name.isidentifier() else "LearnerError", bases, {"__module__": "__main__"})
        exc = _EXC_TYPES[key](str(info.get("message") or ""))
    where = info.get("where") or {}
    return _with_learner_frame(exc, where)


def _with_learner_frame(exc: BaseException, where: dict) -> BaseException:
    """Give ``exc`` a traceback whose last frame reads like the learner's (function name, line, text), so the
    checks' "(in f, line 3: return x // 0)" works for an exception that happened in the sandbox."""
    name, line, text = where.get("name"), where.get("line"), where.get("text") or ""
    if not (isinstance(name, str) and name.isidentifier() and isinstance(line, int) and 1 <= line < 100_000):
        return exc
    filename = f"<learner code: {name}>"
    lines = ["\n"] * (line - 1) + [f"{text}\n"]
    linecache.cache[filename] = (len(lines), None, lines, filename)
    pad = "\n" * max(0, line - 2)
    if line < 2:
        return exc
    code = compile(f"{pad}def {name}(e):\n raise e\n", filename, "exec")
    scope: dict[str, Any] = {}
    exec(code, scope)  # noqa: S102 - our own two-line function, named after the learner's
    try:
        scope[name](exc)
    except BaseException as raised:  # noqa: BLE001
        tb = raised.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        return raised.with_traceback(tb)
    return exc


class Client:
    """Talks to one :class:`~pagedkv.grading.sandbox.Sandbox`; see the module's docstring."""

    def __init__(self, sandbox: Sandbox, references: list[str]) -> None:
        self.sandbox = sandbox
        self.references = set(references)
        self.dead: str | None = None
        self.deadline: float | None = None  # the current test case's budget (None between cases)
        self.budget = 0.0
        self._cpu_start = 0.0
        self.calls = 0
        self.call_seconds = 0.0
        self.slowest = 0.0
        self._tainted: dict[type, type] = {}
        self._handles: weakref.WeakValueDictionary[int, RemoteObject] = weakref.WeakValueDictionary()
        self._released: list[int] = []  # handles this side dropped: the sandbox may forget them
        self._methods: dict[tuple[str, str], RemoteObject] = {}  # (mirror id, name) -> its bound method, this case
        self._method_of: dict[int, Any] = {}  # the handle of such a bound method -> the object it is bound to
        self.codec = Codec("t", export=None, import_handle=self._import_handle, exported=None,
                           resolve=self._resolve, make_mirror=self._make_mirror)

    # ------------------------------------------------------------------ what the sandbox may name
    def _resolve(self, name: str) -> Any:
        """A library name the sandbox sent: the exercise's reference functions as stubs that raise, a class
        with reference methods as its subclass that refuses them (see :meth:`_tainted_class`)."""
        obj = resolve_name(name)
        dotted = name.replace(":", ".")
        if dotted in self.references:
            def unavailable(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(hidden_message(dotted, name.rpartition(":")[2]))
            unavailable.__name__ = dotted.rsplit(".", 1)[-1]
            return unavailable
        if isinstance(obj, type) and not issubclass(obj, BaseException):
            return self._tainted_class(obj)
        return obj

    def _tainted_class(self, cls: type) -> type:
        """``cls``, or when some of its methods are the exercise's reference, a subclass of the same name whose
        reference methods raise: what this side makes of a library object or class the learner's code sent."""
        tainted = self._tainted.get(cls)
        if tainted is None:
            prefixes = [f"{k.__module__}.{k.__qualname__}." for k in cls.__mro__]
            names = {r[len(p):] for r in self.references for p in prefixes
                     if r.startswith(p) and "." not in r[len(p):]}
            names.discard("__init__")
            if not names:
                tainted = cls
            else:
                def refused(name: str) -> Any:
                    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                        raise RuntimeError(hidden_message(f"{cls.__module__}.{cls.__qualname__}.{name}",
                                                          f"{cls.__name__}.{name}"))
                    return method
                tainted = type(cls.__name__, (cls,), {n: refused(n) for n in sorted(names)})
                tainted.__module__ = cls.__module__
                tainted.__qualname__ = cls.__qualname__
            self._tainted[cls] = tainted
        return tainted

    def _make_mirror(self, cls: type, mid: str) -> Any:
        """A library object the sandbox made (``cls`` already passed through :meth:`_resolve`)."""
        from pagedkv.grading.wire import _new

        return _new(cls)

    def _import_handle(self, meta: dict) -> Any:
        hid = int(meta["$h"])
        known = self._handles.get(hid)
        if known is not None:
            return known
        if meta.get("is_class"):
            return self._class_proxy(hid, meta)
        module = meta.get("module")
        cls = _handle_type(str(meta.get("type") or "object"), bool(meta.get("callable")),
                           module if isinstance(module, str) else None, bool(meta.get("is_class")))
        obj = object.__new__(cls)
        object.__setattr__(obj, "_pagedkv_client", self)
        object.__setattr__(obj, "_pagedkv_handle_id", int(meta["$h"]))
        object.__setattr__(obj, "_pagedkv_meta", meta)
        self._handles[hid] = obj
        weakref.finalize(obj, self._released.append, hid)
        return obj

    def _class_proxy(self, hid: int, meta: dict) -> type:
        """A :class:`RemoteClass` standing for the learner's class ``hid``."""
        handle = object.__new__(_handle_type("type", True, meta.get("module"), False))
        object.__setattr__(handle, "_pagedkv_client", self)
        object.__setattr__(handle, "_pagedkv_handle_id", hid)
        object.__setattr__(handle, "_pagedkv_meta", meta)
        base: type = object
        if isinstance(meta.get("library_base"), str):
            with contextlib.suppress(Exception):
                base = resolve_name(meta["library_base"])
        name = str(meta.get("name") or "LearnerClass")
        name = name if name.isidentifier() else "LearnerClass"
        client = self
        # The library's properties the learner's classes do not define (KVCacheManager.block_pool): read here,
        # from the mirrored state, with no round trip; none that is the exercise's reference.
        # So are its read-only views (KVCacheManager.snapshot and its _snapshot_groups): the library's code on the
        # mirrored state, which is the sandbox's as of the last answer, here rather than a round trip per call.
        learner_names = meta.get("own_names")
        properties: dict[str, property] = {}
        views: dict[str, Any] = {}
        if isinstance(learner_names, list):
            seen: set[str] = set(map(str, learner_names))
            for klass in base.__mro__:
                for attr_name, member in vars(klass).items():
                    if attr_name in seen:
                        continue
                    seen.add(attr_name)
                    if f"{klass.__module__}.{klass.__qualname__}.{attr_name}" in self.references:
                        continue
                    if isinstance(member, property) and member.fget is not None:
                        properties[attr_name] = member
                    elif _is_view(attr_name) and inspect.isfunction(member):
                        views[attr_name] = member

        def __getattribute__(obj: Any, attr: str) -> Any:  # noqa: N807 - an instance: its data here, methods there
            if attr in ("__dict__", "__class__") or attr.startswith("_pagedkv_"):
                return object.__getattribute__(obj, attr)
            own = object.__getattribute__(obj, "__dict__")
            if attr in own:
                return own[attr]
            mid = client.codec._mirror_ids.get(id(obj))
            if mid is None:
                raise AttributeError(attr)
            prop = properties.get(attr)
            if prop is not None:
                return prop.fget(obj)
            view = views.get(attr)
            if view is not None:
                return types.MethodType(view, obj)
            method = client._methods.get((mid, attr))
            if method is not None:  # the bound method this case already got: no round trip per method call
                return method
            value = client.request("getattr", m=mid, name=attr)
            if isinstance(value, RemoteObject) and object.__getattribute__(value, "_pagedkv_meta").get("type") == \
                    "method":
                client._methods[(mid, attr)] = value
                client._method_of[object.__getattribute__(value, "_pagedkv_handle_id")] = obj
            return value

        namespace = {"_pagedkv_handle": handle, "__module__": meta.get("module") or "__main__", "__qualname__": name,
                     "__getattribute__": __getattribute__}
        try:
            cls = RemoteClass(name, (base,), namespace)
        except TypeError:  # a library base that cannot be subclassed here
            cls = RemoteClass(name, (object,), namespace)
        self._handles[hid] = cls
        weakref.finalize(cls, self._released.append, hid)
        return cls

    # ------------------------------------------------------------------ test cases
    def start_case(self, budget: float) -> None:
        """A new test case: ``budget`` CPU seconds of the learner's process, all the case's calls together, or
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
        self._handles.clear()
        self._methods.clear()
        self._method_of.clear()
        self._released.clear()
        if self.dead is None:
            with contextlib.suppress(BaseException):
                self._exchange({"op": "reset"}, timeout=_GRACE)
        self.codec.clear()

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
                f"call{'s' if self.calls != 1 else ''} of your "
                f"functions, {secs(avg)} per call on average, the slowest {secs(self.slowest)}); a call is correct "
                "only if it is also fast enough: look for repeated work (a loop over all blocks inside a loop, a "
                "sleep)")

    # ------------------------------------------------------------------ requests
    def exec_cell(self, number: int, source: str, timeout: float) -> dict:
        """Run one cell; ``{"error": text}``, ``{"timed_out": True, ...}``, or ``{}``."""
        start = time.monotonic()
        try:
            reply = self._exchange({"op": "exec", "number": number, "source": source}, timeout=timeout,
                                   interruptible=True)
        except TimeoutError:
            return {"timed_out": True, "seconds": time.monotonic() - start,
                    "error": "KeyboardInterrupt" if self.dead is None else "could not be interrupted"}
        return reply

    def names(self, names: list[str]) -> dict[str, Any]:
        return self.request("names", names=names)

    def launch(self, kernel: Any, grid: Any, args: tuple, kwargs: dict) -> None:
        fn = getattr(kernel, "fn", kernel)
        name = f"{fn.__module__}:{fn.__qualname__}"
        return self.request("launch", kernel=name, grid=tuple(grid), args=list(args), kwargs=kwargs)

    def request(self, op: str, **fields: Any) -> Any:
        if self.dead is not None:
            raise SandboxDied(self.dead)
        if self._over_budget():
            raise TooSlow(self.too_slow_message())
        codec = self.codec
        codec.begin()
        msg: dict[str, Any] = {"op": op}
        for key, value in fields.items():
            if key in ("h", "name", "m"):
                msg[key] = value
            elif key == "kwargs":
                msg[key] = codec.encode(dict(value))
            elif key == "names":
                msg[key] = list(value)
            elif key == "kernel":
                msg[key] = value
            else:
                msg[key] = codec.encode(value)
        # what the call can reach: its arguments, and the learner's objects mirrored here (their data may have
        # been changed by the test since the last call: `cache(mine, mine.blocks[i], h)`)
        roots = [v for k, v in fields.items() if k not in ("h", "name", "names", "kernel", "m")]
        bound = self._method_of.get(fields["h"]) if op == "call" and "h" in fields else None
        if bound is not None:  # a method of one of the learner's objects: that object and the arguments
            roots.append(bound)
        else:
            roots += [obj for obj in codec.mirrors.values() if isinstance(type(obj), RemoteClass)]
        msg["mirrors"] = codec.mirror_states(roots)
        msg["storages"] = codec.storages()
        if self._released:
            msg["release"], self._released = self._released, []
        timeout = None if self.deadline is None else max(0.0, WALL_FACTOR * self.budget - self.call_seconds)
        start = time.monotonic()
        try:
            reply = self._exchange(msg, timeout=timeout, interruptible=True, budgeted=self.deadline is not None)
        except TimeoutError:
            self._count(start, op)
            raise TooSlow(self.too_slow_message()) from None
        self._count(start, op)
        codec.load_storages(reply.get("storages") or {})
        codec.apply_mirror_states(reply.get("mirrors") or {})
        codec.write_back(reply.get("writeback") or {})
        if "raised" in reply:
            info = reply["raised"]
            if not isinstance(info, dict):
                raise ProtocolError("a malformed exception")
            raise _exception(info)
        return codec.decode(reply.get("value"))

    def _count(self, start: float, op: str) -> None:
        """Every wait counts toward the case's budget; the calls of the learner's functions are what the "too
        slow" message describes (attribute reads and the like are quick)."""
        spent = time.monotonic() - start
        self.call_seconds += spent
        if op in ("call", "launch"):
            self.calls += 1
            self.function_seconds += spent
            self.slowest = max(self.slowest, spent)

    def _exchange(self, msg: dict, *, timeout: float | None, interruptible: bool = False,
                  budgeted: bool = False) -> dict:
        """Send ``msg`` and wait for the answer; on a timeout (or an exception raised here while waiting, such
        as the checks' SIGALRM), interrupt the learner's code and wait for its answer so the conversation stays
        in step; if none comes within the grace period, the sandbox is dead."""
        try:
            write_message(self.sandbox.fd_to, msg)
        except OSError as exc:
            self._die(f"the learner's process {self.sandbox.exit_description()} ({exc.strerror})")
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
        case's call) once the case has used its CPU budget, looked at every 0.2 s."""
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
            return read_message(self.sandbox.fd_from)
        except (EOFError, OSError):
            with contextlib.suppress(Exception):
                self.sandbox.proc.wait(timeout=2)
            self._die(f"the learner's process {self.sandbox.exit_description()}")
        except ProtocolError as exc:
            self._die(f"the learner's process sent garbage ({exc})")
        raise AssertionError("unreachable")

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


@contextlib.contextmanager
def forward_triton_launches(client_of: Any) -> Any:
    """While grading: a library Triton kernel launched with a learner's ``@triton.jit`` function (a handle)
    among its arguments is launched in the sandbox instead (the harness kernel is library code; the outputs
    come back as data and are compared here). ``client_of()`` gives the current :class:`Client`."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001 - no Triton: nothing to forward
        yield
        return
    saved = {cls: cls.__getitem__ for cls in (JITFunction, InterpretedFunction)}

    def patched(original: Any) -> Any:
        def getitem(self: Any, grid: Any) -> Any:
            launcher = original(self, grid)

            def launch(*args: Any, **kwargs: Any) -> Any:
                if any(isinstance(a, RemoteObject) for a in (*args, *kwargs.values())):
                    if callable(grid):
                        raise TypeError("a grid given as a function cannot be sent to the learner's process")
                    return client_of().launch(self, grid, args, kwargs)
                return launcher(*args, **kwargs)
            return launch
        return getitem

    for cls, original in saved.items():
        cls.__getitem__ = patched(original)
    try:
        yield
    finally:
        for cls, original in saved.items():
            cls.__getitem__ = original
