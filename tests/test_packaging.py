"""The project installs as one package tree: every subpackage is listed in pyproject.toml, and kernels/ is
importable only as pagedkv.kernels."""

from __future__ import annotations

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pagedkv").rglob("__init__.py")
    } | {"pagedkv.kernels"}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert cfg["package-dir"]["pagedkv.kernels"] == "kernels"


def test_kernels_is_pagedkv_kernels():
    import pagedkv.kernels

    assert pathlib.Path(pagedkv.kernels.__file__).resolve().parent == ROOT / "kernels"


def test_no_top_level_kernels_import_in_the_repo():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts:
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            stripped = line.strip()
            if stripped.startswith(("import kernels", "from kernels ", "from kernels.")):
                offenders.append(f"{path.relative_to(ROOT)}: {stripped}")
    assert not offenders, offenders
