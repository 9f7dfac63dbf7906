"""Triton's interpreter, made cheaper where it repeats work: device-function calls inside a launch.

Under ``TRITON_INTERPRET=1`` a launch (``GridExecutor.__call__`` in ``triton/runtime/interpreter.py``)
swaps ``triton.language``'s builtins for NumPy ones (``_patch_lang``), runs every program of the grid,
and swaps them back. A ``@triton.jit`` helper called from inside the kernel (``InterpretedFunction.__call__``,
e.g. ``decode_v3._attend_tiles``) patches the same modules again on every call, with
``inspect.getmembers`` over ``triton.language``: about a millisecond each time, once per call per program,
which made a third of the lab's interpreter time on CPU. Inside a launch that already patched the modules the
helper's globals refer to, the second patch changes nothing, so :func:`install` skips it there; a helper
that sees a module not patched yet in this launch (``tl.cdiv`` sees ``triton.language.core``) is patched as
before, once per launch.
Results are the same bit for bit; only the interpreter's Python overhead goes.

Nothing changes when the kernels are compiled (a GPU), or when the installed Triton does not have the
interpreter's internals this relies on (then it is left as it is).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

_INSTALLED = False
_launch_langs: list[frozenset[int]] = []  # per running launch: id() of the language modules patched in it
_LANGS: dict[Any, frozenset[int]] = {}  # per kernel or helper function: what _patch_lang would patch for it


def _langs_of(fn: Any, tl: Any) -> frozenset[int]:
    """The language modules ``_patch_lang(fn)`` would patch: those of ``fn``'s globals that are
    ``triton.language`` or ``triton.language.core``."""
    langs = _LANGS.get(fn)
    if langs is None:
        langs = _LANGS[fn] = frozenset(
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        )
    return langs


def install() -> bool:
    """Skip the repeated patch in device-function calls of the interpreter; True when installed (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_cls = getattr(interpreter, "GridExecutor", None)
    fn_cls = getattr(interpreter, "InterpretedFunction", None)
    error_cls = getattr(interpreter, "InterpreterError", None)
    if grid_cls is None or fn_cls is None or error_cls is None or not hasattr(interpreter, "_patch_lang"):
        return False  # another Triton: leave its interpreter alone
    if getattr(fn_cls.__call__, "_pagedkv_shortcut", False):
        _INSTALLED = True  # installed by an earlier import of this module (pagedkv.kernels imported afresh)
        return True
    launch, device_call = grid_cls.__call__, fn_cls.__call__

    @functools.wraps(launch)
    def patched_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        _launch_langs.append(_langs_of(self.fn, tl))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launch_langs.pop()

    @functools.wraps(device_call)
    def patched_device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        langs = _langs_of(self.fn, tl)
        if not _launch_langs:
            return device_call(self, *args, **kwargs)
        if not langs <= _launch_langs[-1]:
            # e.g. tl.cdiv, whose globals hold triton.language.core: the original patches that module (and never
            # puts it back), so for the rest of this launch it is patched too
            _launch_langs[-1] = _launch_langs[-1] | langs
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()  # what the original does, without the _patch_lang already in effect
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error_cls(repr(e)) from e

    patched_device_call._pagedkv_shortcut = True  # type: ignore[attr-defined]
    grid_cls.__call__ = patched_launch
    fn_cls.__call__ = patched_device_call
    _INSTALLED = True
    return True
