"""Where a measurement comes from: the commit it was taken at and the CPU (written into the benchmarks' JSON)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def git_commit(paths: tuple[str, ...] = ("kernels", "pagedkv")) -> str:
    """The short commit of this checkout, with ``+local changes`` when ``paths`` have uncommitted changes;
    ``"unknown"`` outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", *paths],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+local changes" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one), else the machine type."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
