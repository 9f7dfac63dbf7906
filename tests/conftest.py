"""Shared test set-up: Triton runs in its interpreter on the CPU unless a CUDA GPU is present."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

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
