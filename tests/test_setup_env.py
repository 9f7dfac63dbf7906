"""Opening a lesson anywhere: ``pagedkv/setup_env.py`` (what the lessons' set-up cell runs) and
``tools/colab_cells.py`` (which writes that cell and the Colab badge into the lessons).

Nothing is cloned or installed: commands are recorded, the network is replaced by the file on disk, and
Colab and the GPU are stand-ins.
"""

from __future__ import annotations

import importlib.util
import site
import subprocess
import sys
import types
import urllib.request
from pathlib import Path
from typing import Any

import nbformat
import pytest

from pagedkv import setup_env
from pagedkv.setup_env import REPO_URL, find_repo_root, install_commands, kernel_dtype, prepare, raw_url

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "pagedkv" / "setup_env.py"


def _load_tool() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("colab_cells", ROOT / "tools" / "colab_cells.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


colab_cells = _load_tool()


def fake_checkout(path: Path) -> Path:
    (path / "pagedkv").mkdir(parents=True)
    (path / "notebooks").mkdir()
    (path / "pyproject.toml").write_text('[project]\nname = "pagedkv-lab"\n')
    return path


# --- finding or cloning the repository, and installing it -------------------------------------------------
def test_this_repository_is_found_from_inside_it() -> None:
    assert find_repo_root(ROOT / "notebooks") == ROOT
    assert install_commands(ROOT / "notebooks", "/py") == [["/py", "-m", "pip", "install", "--quiet", "-e", str(ROOT)]]


def test_outside_a_checkout_the_lab_is_cloned_then_installed(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "something-else"\n')  # not the lab
    cmds = install_commands(tmp_path, "/py", "https://github.com/o/r", "main")
    dest = str(tmp_path / "pagedkv-lab")
    assert cmds == [
        ["git", "clone", "--quiet", "--depth=1", "--branch=main", "https://github.com/o/r", dest],
        ["/py", "-m", "pip", "install", "--quiet", "-e", dest],
    ]


def test_a_previous_clone_is_reused(tmp_path: Path) -> None:
    root = fake_checkout(tmp_path / "pagedkv-lab")
    assert find_repo_root(tmp_path) == root
    assert install_commands(tmp_path, "/py") == [["/py", "-m", "pip", "install", "--quiet", "-e", str(root)]]


def test_main_runs_the_commands_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    ran: list[tuple[list[str], dict[str, Any]]] = []
    assert setup_env.main(["install", "--repo", "https://github.com/o/r"], run=lambda c, **k: ran.append((c, k))) == 0
    assert [c[0] for c, _ in ran] == ["git", sys.executable]
    assert all(k == {"check": True} for _, k in ran), "a failed clone or install stops the set-up"
    assert "can import pagedkv now" in capsys.readouterr().out


def test_the_script_runs_on_its_own_from_stdin(tmp_path: Path) -> None:
    """The set-up cell pipes this file into ``python - install``, before pagedkv exists: standard library only.
    ``-S -I``: no site-packages, no user site, no PYTHONPATH."""
    proc = subprocess.run(
        [sys.executable, "-S", "-I", "-", "install", "--dry-run", "--repo", "https://github.com/o/r"],
        input=SCRIPT.read_bytes(), cwd=tmp_path, capture_output=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert f"+ git clone --quiet --depth=1 --branch=main https://github.com/o/r {tmp_path / 'pagedkv-lab'}" in out
    assert f"-m pip install --quiet -e {tmp_path / 'pagedkv-lab'}" in out


def test_raw_url() -> None:
    assert raw_url("pagedkv/setup_env.py", "https://github.com/o/r/", "main") == (
        "https://raw.githubusercontent.com/o/r/main/pagedkv/setup_env.py"
    )
    with pytest.raises(ValueError, match="github.com"):
        raw_url("x", "git@github.com:o/r.git")


# --- inside the notebook --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("capability", "dtype"), [(None, "float32"), ((7, 0), "float16"), ((7, 5), "float16"), ((8, 0), "bfloat16"),
                              ((9, 0), "bfloat16")],
)  # fmt: skip
def test_kernel_dtype(capability: tuple[int, int] | None, dtype: str) -> None:
    assert kernel_dtype(capability) == dtype


def test_prepare_in_colab_on_a_t4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_checkout(tmp_path / "pagedkv-lab")  # where install put it; Colab starts in /content
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    moved: list[Path] = []
    report = prepare(
        False, cwd=tmp_path, chdir=moved.append, device=lambda: ("Tesla T4 (compute capability 7.5)", (7, 5))
    )
    assert moved == [root / "notebooks"], "into the clone's notebooks/, so relative paths work"
    assert report.front_end == "colab" and report.dtype == "float16" and report.root == root
    text = str(report)
    assert text.startswith("PagedKV Lab · colab · Tesla T4") and "kernels in float16" in text
    assert "no bfloat16" in text and "custom widget manager" in text


def test_prepare_inside_the_checkout_stays_put(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    monkeypatch.setenv("VSCODE_PID", "1")
    moved: list[Path] = []
    report = prepare(cwd=ROOT / "notebooks", chdir=moved.append, device=lambda: ("NVIDIA H200", (9, 0)))
    assert moved == [] and report.front_end == "vscode" and report.dtype == "bfloat16" and report.notes == []
    assert capsys.readouterr().out.strip() == "PagedKV Lab · vscode · NVIDIA H200 · kernels in bfloat16"


def test_prepare_reports_this_machine(capsys) -> None:
    report = prepare(cwd=ROOT / "notebooks", chdir=lambda p: None)
    assert report.device  # CPU here, a GPU elsewhere: either is described
    assert capsys.readouterr().out.startswith("PagedKV Lab · ")


# --- the set-up cell and the badge -----------------------------------------------------------------------
def test_the_set_up_cell_installs_through_the_script_when_pagedkv_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    source = colab_cells.setup_cell_source()
    assert len(source.splitlines()) <= 24, "the cell stays short: the logic lives in pagedkv/setup_env.py"
    fetched: list[str] = []
    ran: list[tuple[list[str], dict[str, Any]]] = []

    class Response:
        def __init__(self, url: str, timeout: float | None = None) -> None:
            fetched.append(url)

        def read(self) -> bytes:
            return SCRIPT.read_bytes()

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pagedkv" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(urllib.request, "urlopen", Response)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: ran.append((cmd, kw)))
    monkeypatch.setattr(setup_env, "_device", lambda: ("CPU", None))
    loaded: list[str] = []
    monkeypatch.setattr(site, "getsitepackages", lambda: ["/site-a", "/site-b"])
    monkeypatch.setattr(site, "addsitedir", loaded.append)
    namespace: dict[str, Any] = {}
    exec(compile(source, "<set-up cell>", "exec"), namespace)
    assert fetched == [raw_url("pagedkv/setup_env.py", REPO_URL)]
    install = [sys.executable, "-", "install", "--repo", REPO_URL]
    assert ran == [(install, {"input": SCRIPT.read_bytes(), "check": True})]
    assert loaded == ["/site-a", "/site-b"], "the new install's .pth hooks are run in the kernel"
    assert namespace["report"].dtype == "float32"


def test_the_set_up_cell_does_nothing_where_the_lab_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("nothing to fetch"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("nothing to install"))
    monkeypatch.setattr(setup_env, "_device", lambda: ("CPU", None))
    exec(compile(colab_cells.setup_cell_source(), "<set-up cell>", "exec"), {})


def test_colab_cells_is_idempotent_and_keeps_the_rest() -> None:
    nb_dir = ROOT / "notebooks"
    src = sorted(nb_dir.glob("0[1-9]_*.ipynb"))[0]
    nb = nbformat.read(src, as_version=4)
    before = [c.source for c in nb.cells if not c.get("metadata", {}).get("tags")]
    target = nb_dir / src.name  # the badge names the notebook's path in the repository
    assert colab_cells.apply(nb, target) in (True, False)
    assert colab_cells.apply(nb, target) is False, "a second run changes nothing"
    badge, setup = nb.cells[0], nb.cells[1]
    assert badge.cell_type == "markdown" and f"/blob/main/notebooks/{src.name})" in badge.source
    assert badge.source.startswith("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]")
    assert setup.cell_type == "code" and setup.source == colab_cells.setup_cell_source()
    assert [c.source for c in nb.cells[2:] if not c.get("metadata", {}).get("tags")] == before
    nbformat.validate(nb)


def test_colab_cells_check_flags_and_then_fixes_a_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys) -> None:  # fmt: skip
    monkeypatch.setattr(colab_cells, "ROOT", tmp_path)  # a stand-in repository
    (tmp_path / "pyproject.toml").write_text('[project.urls]\nRepository = "https://github.com/o/r"\n')
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "09_x.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A lesson")]), path)
    assert colab_cells.main(["--check", str(path)]) == 1 and "09_x.ipynb" in capsys.readouterr().out
    assert len(nbformat.read(path, as_version=4).cells) == 1, "--check changes nothing"
    assert colab_cells.main([str(path)]) == 0
    cells = nbformat.read(path, as_version=4).cells
    assert [c.cell_type for c in cells] == ["markdown", "code", "markdown"] and cells[2].source == "# A lesson"
    mtime = path.stat().st_mtime_ns
    assert colab_cells.main([str(path)]) == 0 and path.stat().st_mtime_ns == mtime, "up to date: not rewritten"
    assert colab_cells.main(["--check", str(path)]) == 0
    outside = tmp_path.parent / "elsewhere.ipynb"
    with pytest.raises(SystemExit):
        colab_cells.main([str(outside)])


def test_lessons_carry_the_current_set_up_cell() -> None:
    """Every lesson opens with today's badge and set-up cell, tagged (run tools/colab_cells.py after changing
    them): the tool would change nothing in any of them."""
    stale = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        if colab_cells.apply(nb, path):
            stale.append(path.name)
    assert not stale, f"run: .venv/bin/python tools/colab_cells.py {' '.join('notebooks/' + s for s in stale)}"
    assert "00_primer.ipynb" in {p.name for p in (ROOT / "notebooks").glob("*.ipynb")}


def test_colab_cells_replaces_untagged_copies_instead_of_adding_more(tmp_path: Path, monkeypatch) -> None:
    """A badge and a set-up cell pasted by hand (no tags, older text) are replaced, not kept below new ones."""
    monkeypatch.setattr(colab_cells, "ROOT", tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project.urls]\nRepository = "https://github.com/o/r"\n')
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "10_x.ipynb"
    old_setup = "# Set-up. Where the lab is not installed, this fetches its set-up script.\nimport sys"
    cells = [nbformat.v4.new_markdown_cell("[![Open In Colab](https://old/badge)](x)"),
             nbformat.v4.new_code_cell(old_setup), nbformat.v4.new_markdown_cell("# A lesson")]
    nb = nbformat.v4.new_notebook(cells=cells)
    assert colab_cells.apply(nb, path) is True
    want = [colab_cells.badge_source(path), colab_cells.setup_cell_source(), "# A lesson"]
    assert [c.source for c in nb.cells] == want
    assert [c.metadata["tags"] for c in nb.cells[:2]] == [[colab_cells.BADGE_TAG], [colab_cells.SETUP_TAG]]
    assert colab_cells.apply(nb, path) is False


# --- where the course is published: one place, and a clear stop when it does not answer (issue 21, item 9) ----
def test_the_badge_and_the_set_up_cell_take_the_address_from_pyproject(tmp_path: Path, monkeypatch) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'Repository = "{REPO_URL}"' in text.split("[project.urls]", 1)[1].split("\n[", 1)[0]
    assert setup_env.published_repo_url(ROOT) == REPO_URL
    fork = fake_checkout(tmp_path / "fork")
    (fork / "pyproject.toml").write_text('[project]\nname = "pagedkv-lab"\n\n[project.urls]\nRepository = '
                                         '"https://github.com/me/my-fork"\n\n[tool.x]\nRepository = "no"\n')
    monkeypatch.setattr(colab_cells, "ROOT", fork)
    lesson = fork / "notebooks" / "01_x.ipynb"
    assert colab_cells.colab_url(lesson) == "https://colab.research.google.com/github/me/my-fork/blob/main/notebooks/01_x.ipynb"
    assert 'REPO = "https://github.com/me/my-fork"' in colab_cells.setup_cell_source()
    (fork / "pyproject.toml").write_text('[project]\nname = "pagedkv-lab"\n')
    with pytest.raises(SystemExit, match=r"\[project.urls\]"):
        colab_cells.setup_cell_source()


def test_the_set_up_cell_stops_with_what_to_set_when_the_address_does_not_answer(monkeypatch) -> None:
    """A repository that does not exist (or no network): no HTTPError traceback, but what to change."""
    import urllib.error

    def not_found(url: str, timeout: float | None = None):
        raise urllib.error.HTTPError(url, 404, "Not Found", None, None)  # type: ignore[arg-type]

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pagedkv" else real_find_spec(name, *a)
    )
    monkeypatch.setattr(urllib.request, "urlopen", not_found)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("nothing to install"))
    with pytest.raises(SystemExit) as stop:
        exec(compile(colab_cells.setup_cell_source("https://github.com/nobody/nothing"), "<set-up cell>", "exec"), {})
    message = str(stop.value)
    assert "raw.githubusercontent.com/nobody/nothing/main/pagedkv/setup_env.py" in message and "404" in message
    assert "Set REPO above" in message and "Publishing a fork" in message
    assert stop.value.__suppress_context__, "shown without the HTTPError's traceback"


def test_the_script_outside_a_checkout_needs_a_repository(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        setup_env.main(["install", "--dry-run", "--repo", ""], run=lambda *a, **k: pytest.fail("nothing to run"))
    assert "--repo" in capsys.readouterr().err
