"""One check for the integer arguments of every public entry point: bad input gets a clear error, nothing else.

The lab's own: vLLM validates its configs with pydantic (``vllm/config/``) and its hot paths not at all."""

from __future__ import annotations

import numbers


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer a caller would pass: an ``int``, a numpy integer (``numbers.Integral``
    covers both) or a 0-d numpy integer array (what numpy's reductions can hand back); never a ``bool``
    (``True`` is an ``int`` to Python, never a count to a caller) nor a numpy bool. The one integer predicate
    of the lab: :func:`check_int` below, the engine's arguments and the grading checks' answers all use it."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return True
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    return type(value).__module__ == "numpy" and kind in ("i", "u") and getattr(value, "ndim", None) == 0


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number a caller would pass (``int``, ``float``, numpy scalars: ``numbers.Real``),
    never a ``bool``. The predicate; each caller states its own bounds (finite, > 0, ...) and its own message."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def check_int(value: object, name: str, low: int | None = 0, high: int | None = None, *, why: str = "") -> int:
    """``value`` as a Python ``int`` when it is an integer in ``low..high`` (either bound ``None``: open), else
    ``ValueError("{name} must be an int >= {low}[ (why)], got {value!r}")``.

    Accepts every integer type a caller would pass and refuses ``bool`` (:func:`is_int`). Pure: changes
    nothing."""
    if not is_int(value) or (
        (low is not None and value < low) or (high is not None and value > high)
    ):
        if low is not None and high is not None:
            bounds = f" in {low}..{high}"
        elif low is not None:
            bounds = f" >= {low}"
        elif high is not None:
            bounds = f" <= {high}"
        else:
            bounds = ""
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int{bounds}{reason}, got {value!r}")
    return int(value)
