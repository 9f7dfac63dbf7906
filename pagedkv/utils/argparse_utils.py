"""Command-line integers as ``vllm serve`` reads them: ``--max-model-len 32k``, ``--kv-cache-memory-bytes 64M``,
``--max-model-len auto``. Mirrors ``human_readable_int`` and ``human_readable_int_or_auto`` in vLLM 0.26's
``vllm/utils/argparse_utils.py``; ``EngineArgs.add_cli_args`` (``vllm/engine/arg_utils.py``) gives them to
``--max-model-len``, ``--max-num-batched-tokens`` and ``--kv-cache-memory-bytes``."""

from __future__ import annotations

import argparse
import re

__all__ = ["human_readable_int", "human_readable_int_or_auto"]

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """An integer, or a number with a suffix: lower case decimal (``1k`` = 1,000, ``25.6k`` = 25,600), upper
    case binary (``1K`` = 1,024; no decimals: ``1.5K`` is refused). ``ValueError`` (argparse: "invalid
    human_readable_int value") for anything else."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) * _BINARY[suffix]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. Did you mean to use "
                f"{number}{suffix.lower()} instead?") from exc
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    """:func:`human_readable_int`, or ``-1`` for ``-1`` and ``auto``: fit the length to the KV pool at start-up
    (``LLM(max_model_len=-1)``)."""
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)
