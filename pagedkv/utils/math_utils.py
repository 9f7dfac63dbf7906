"""Integer arithmetic: ``vllm/utils/math_utils.py`` in vLLM 0.26."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division, ``ceil(a / b)`` without floats: the blocks ``a`` tokens take at ``b`` tokens a block.

    Mirrors ``vllm/utils/math_utils.py::cdiv`` (``-(a // -b)``). Pure; no checks (callers validate)."""
    return -(a // -b)
