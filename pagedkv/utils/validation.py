"""One check for the integer arguments of every public entry point: bad input gets a clear error, nothing else.

The lab's own: vLLM validates its configs with pydantic (``vllm/config/``) and its hot paths not at all."""

from __future__ import annotations

import numbers


def check_int(value: object, name: str, low: int | None = 0, high: int | None = None, *, why: str = "") -> int:
    """``value`` as a Python ``int`` when it is an integer in ``low..high`` (either bound ``None``: open), else
    ``ValueError("{name} must be an int >= {low}[ (why)], got {value!r}")``.

    Accepts every integer type a caller would pass (``int``, numpy's integers: ``numbers.Integral``) and
    refuses ``bool`` (``True`` is an ``int`` to Python, never a count to a caller). Pure: changes nothing."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
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
