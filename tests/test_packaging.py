"""The project installs as one package tree: every subpackage is listed in pyproject.toml, and kernels/ is
importable only as pagedkv.kernels."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest
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


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
def test_the_repo_root_on_sys_path_does_not_shadow_hugging_faces_kernels():
    """transformers imports Hugging Face's ``kernels`` (a dependency of transformers 5.25); from the repository
    root (``python -m``, an xdist worker) the lab's kernels/ folder was found first and every model failed to
    load with "cannot import name 'CUDAProperties' from 'kernels'". The folder now loads that package instead."""
    code = (
        "import sys\n"
        "import kernels\n"
        "assert 'site-packages' in kernels.__file__, kernels.__file__\n"
        "import transformers.integrations.hub_kernels, transformers\n"
        "transformers.LlamaForCausalLM\n"
        "import pagedkv.kernels as pk\n"
        "assert pk.__file__.endswith('/kernels/__init__.py') and 'site-packages' not in pk.__file__\n"
        "assert pk.paged_attention_decode and sys.modules['kernels'] is kernels\n"
    )
    if not importlib.metadata.packages_distributions().get("kernels"):
        pytest.skip("Hugging Face's kernels package is not installed")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_without_hugging_faces_kernels_the_folder_is_not_a_top_level_module():
    """No site-packages (``-S``): ``import kernels`` from the root raises ModuleNotFoundError, as it would
    anywhere else, so a ``try: import kernels`` probe answers "not installed"."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "try:\n    import kernels\nexcept ModuleNotFoundError as e:\n"
        "    assert e.name == 'kernels' and 'pagedkv.kernels' in str(e), e\n"
        "    assert 'kernels' not in sys.modules\n"
        "else:\n    raise SystemExit(f'imported {kernels.__file__}')\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]


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


def test_entry_points_are_executable_in_git():
    """A fresh clone must be able to run ./lab (and CI its .ci/run) without chmod."""
    out = subprocess.run(["git", "ls-files", "-s", "lab", ".ci/run"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip("not a git checkout")
    modes = {line.split()[-1]: line.split()[0] for line in out.stdout.splitlines()}
    assert modes == {"lab": "100755", ".ci/run": "100755"}, modes


def test_setup_env_uses_the_standard_library_only():
    """The lessons' set-up cell runs pagedkv/setup_env.py as a script before the lab (or numpy) is installed."""
    tree = ast.parse((ROOT / "pagedkv" / "setup_env.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    lazy = {"torch"}  # imported inside prepare(), after the install
    outside = {m for m in modules if m.split(".")[0] not in sys.stdlib_module_names} - lazy - {"__future__"}
    assert not outside, f"setup_env.py imports {sorted(outside)}, which a fresh Colab kernel may not have"


def test_readme_links_and_pictures_resolve():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"(https?:|mailto:|#)", link)]
    assert local, "the README links its docs and pictures"
    missing = [link for link in local if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README links to missing files: {missing}"
    assert "![" in text and "docs/img/filmstrip.svg" in text


def test_the_repository_names_no_design_note_it_does_not_contain():
    """Code and docs cite the design notes in docs/ (design.md, browser-testing.md, ...), never a file that
    lives outside the repository (the workshop's LAB_DESIGN.md or its notes folder)."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = ("LAB_DESIGN", "/work/shared", "shared/notes/")
    offenders = [path for path in out if path.endswith((".py", ".md", ".ipynb", ".toml", ".yml"))
                 and path != "tests/test_packaging.py" and (ROOT / path).is_file()
                 and any(s in (ROOT / path).read_text(errors="replace") for s in outside)]
    assert not offenders, offenders
    for note in ("design.md", "browser-testing.md", "vllm-core-on-cpu.md"):
        assert (ROOT / "docs" / note).is_file(), note


def test_moved_names_keep_their_old_import_paths():
    """Split modules re-export what lessons and exercises import from the old path: the same objects."""
    import pagedkv.contiguous as contiguous
    import pagedkv.kv_cache_utils as kv_cache_utils
    from pagedkv.contiguous import allocator, replay
    from pagedkv.metrics import stats

    assert kv_cache_utils.PrefixCacheStats is stats.PrefixCacheStats
    assert contiguous.FirstFitAllocator is allocator.FirstFitAllocator and contiguous.Hole is allocator.Hole
    for name in ("AllocationEvent", "TraceRequest", "make_trace", "simulate_first_fit", "simulate_paged"):
        assert getattr(contiguous, name) is getattr(replay, name), name
