"""Shared test set-up: Triton runs in its interpreter on the CPU unless a CUDA GPU is present."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from hypothesis import settings

# `python -m pytest` from the repository root puts the root on sys.path, and transformers probes for Hugging
# Face's `kernels` package by importing it: it would find the lab's kernels/ folder (which is pagedkv.kernels,
# never a top-level module). The lab is installed, so the root is not needed on the path.
_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _ROOT]

# nbformat imports jsonschema, which builds a grammar for IRI strings with lark when `rfc3987_syntax` is
# installed (JupyterLab's jupyter-events brings it): about 2.5 CPU-seconds in every test process, each xdist
# worker included, for a format ("iri") that no notebook schema uses. A None entry makes that optional import
# fail, so jsonschema leaves the "iri" format unchecked; notebook validation is the same.
sys.modules.setdefault("rfc3987_syntax", None)

# No per-example deadline anywhere: CI machines are shared, and a slow example is not a wrong one.
settings.register_profile("lab", deadline=None)
settings.load_profile("lab")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - torch missing or broken: no GPU
        return False


HAS_CUDA = _has_cuda()
if not HAS_CUDA:
    # Must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none found: torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
