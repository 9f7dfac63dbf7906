"""Getting a lesson running wherever it was opened: Colab, VS Code, JupyterLab, a rented GPU box.

Every lesson starts with a short set-up cell (``tools/colab_cells.py`` writes it). Where ``pagedkv`` cannot be
imported yet — Colab, or a kernel that is not the lab's ``.venv`` — the cell downloads this file and runs it as
a script, ``python - install``, which finds the repository (the clone the notebook sits in, or a previous
download) or clones it, and ``pip install -e``\\ s it into the running kernel's interpreter. So this file uses
the standard library only and must run on its own, outside the package. The cell then loads the new install
into the running kernel (``site.addsitedir`` runs the install's ``.pth`` hook, which Python otherwise reads
only at start-up) and calls ``prepare()``, which moves into the repository's ``notebooks/`` folder when the
notebook was opened from elsewhere (Colab opens it straight from GitHub), so the lessons' relative paths
work, and prints one line about the machine: the device, and the dtype the GPU kernels use there (bf16 from
Ampere on; a T4 has no bf16, so fp16).

There is no vLLM counterpart; vLLM is installed with pip and has no notebooks.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Where a fresh clone goes when the notebook is not inside one (Colab: /content/pagedkv-lab).
CLONE_DIR = "pagedkv-lab"
PROJECT_NAME = "pagedkv-lab"


def published_repo_url(root: Path | None = None) -> str | None:
    """Where the course is published: ``Repository`` under ``[project.urls]`` in the checkout's pyproject.toml
    (the one place that says it; ``tools/colab_cells.py`` writes it into every lesson's badge and set-up cell).
    None outside a checkout: this file run as a script from the set-up cell is then given ``--repo``."""
    if root is None:
        try:
            root = Path(__file__).resolve().parents[1]
        except (NameError, IndexError):  # run from stdin: no checkout around it
            return None
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    urls = text.split("[project.urls]", 1)[1].split("\n[", 1)[0] if "[project.urls]" in text else ""
    for line in urls.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "Repository":
            return value.strip().strip('"')
    return None


#: The repository the lab is cloned from (PAGEDKV_REPO_URL overrides pyproject.toml's), and the branch whose
#: ``setup_env.py`` the cell downloads.
REPO_URL = os.environ.get("PAGEDKV_REPO_URL") or published_repo_url()
BRANCH = "main"


def raw_url(path: str, repo_url: str | None = REPO_URL, branch: str = BRANCH) -> str:
    """The address of one file of the repository on GitHub's raw host (what the set-up cell downloads)."""
    prefix = "https://github.com/"
    if not repo_url or not repo_url.startswith(prefix):
        raise ValueError(f"expected a https://github.com/OWNER/NAME address, got {repo_url!r}")
    return f"https://raw.githubusercontent.com/{repo_url[len(prefix) :].rstrip('/')}/{branch}/{path}"


def is_repo_root(path: Path) -> bool:
    """Whether ``path`` is a checkout of the lab (its ``pyproject.toml`` names the project)."""
    pyproject = path / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return False
    return f'name = "{PROJECT_NAME}"' in text and (path / "pagedkv").is_dir()


def find_repo_root(start: Path) -> Path | None:
    """The checkout of the lab that ``start`` lies in, or that sits in ``start/pagedkv-lab``; None if neither."""
    start = start.resolve()
    for path in (start, *start.parents):
        if is_repo_root(path):
            return path
    if is_repo_root(start / CLONE_DIR):
        return start / CLONE_DIR
    return None


def install_commands(cwd: Path, python: str, repo_url: str | None = REPO_URL,
                     branch: str = BRANCH) -> list[list[str]]:
    """The commands that put the lab into ``python``'s environment, run from ``cwd``: clone it into
    ``cwd/pagedkv-lab`` unless ``cwd`` lies in a checkout (or one is there already), then ``pip install`` it.

    The install is editable, so the package runs from the checkout: the exercise checks find their tests
    beside it (``grading/autograder/``), as ``pagedkv.grading.build.repo_root`` expects. torch is left as it
    is when the environment has one (Colab's matches its GPU)."""
    root = find_repo_root(cwd)
    commands: list[list[str]] = []
    if root is None:
        if not repo_url:
            raise ValueError("no checkout of the lab here, and no repository to clone it from: pass --repo URL")
        root = cwd.resolve() / CLONE_DIR
        commands.append(["git", "clone", "--quiet", "--depth=1", f"--branch={branch}", repo_url, str(root)])
    commands.append([python, "-m", "pip", "install", "--quiet", "-e", str(root)])
    return commands


def main(argv: Sequence[str] | None = None, run: Callable[..., object] = subprocess.run) -> int:
    """``python setup_env.py install [--dry-run]``: run (or print) ``install_commands`` for this interpreter."""
    parser = argparse.ArgumentParser(prog="setup_env.py", description="Install PagedKV Lab into this Python.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="clone the lab if needed and pip install it into this interpreter")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    p.add_argument("--repo", default=REPO_URL, help=f"the repository to clone (default {REPO_URL})")
    p.add_argument("--branch", default=BRANCH)
    args = parser.parse_args(argv)
    try:
        commands = install_commands(Path.cwd(), sys.executable, args.repo, args.branch)
    except ValueError as exc:
        parser.error(str(exc))
    for cmd in commands:
        print("+", " ".join(cmd), flush=True)
        if not args.dry_run:
            run(cmd, check=True)
    if not args.dry_run:
        print("PagedKV Lab is installed; the notebook can import pagedkv now.", flush=True)
    return 0


# --- after the install: inside the notebook ------------------------------------------------------------
def where() -> str:
    """``"colab"``, ``"vscode"`` or ``"jupyter"``: the front end this kernel serves, as far as it can tell."""
    if "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ:
        return "colab"
    if "VSCODE_PID" in os.environ or "VSCODE_CWD" in os.environ:
        return "vscode"
    return "jupyter"


def kernel_dtype(capability: tuple[int, int] | None) -> str:
    """The dtype the lab's GPU kernels and engine use on a GPU of this compute capability (None: no GPU).

    bf16 needs compute capability 8.0 (Ampere) or newer; a T4 (7.5) or a V100 (7.0) gets fp16; without a GPU,
    Triton's interpreter runs fp32 (it has no bf16)."""
    if capability is None:
        return "float32"
    return "bfloat16" if tuple(capability) >= (8, 0) else "float16"


@dataclass
class SetupReport:
    """What ``prepare`` found: the front end, the repository folder, the device and the kernels' dtype."""

    front_end: str
    root: Path | None
    device: str
    dtype: str
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"PagedKV Lab · {self.front_end} · {self.device} · kernels in {self.dtype}"]
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def _device() -> tuple[str, tuple[int, int] | None]:
    if importlib.util.find_spec("torch") is None:
        return "no torch installed", None
    import torch

    if not torch.cuda.is_available():
        return f"CPU (torch {torch.__version__}; Triton kernels run in its interpreter, at small sizes)", None
    props = torch.cuda.get_device_properties(0)
    capability = (int(props.major), int(props.minor))
    return f"{props.name} (compute capability {capability[0]}.{capability[1]}, torch {torch.__version__})", capability


def prepare(
    verbose: bool = True,
    *,
    cwd: Path | None = None,
    chdir: Callable[[Path], None] = os.chdir,
    device: Callable[[], tuple[str, tuple[int, int] | None]] = _device,
) -> SetupReport:
    """Get the running notebook ready and say what it runs on.

    When the working folder is not inside a checkout (Colab opens a lesson from GitHub and starts in
    /content), move into ``<checkout>/notebooks`` so the lessons' relative paths (``../exercises/``, results
    files) work; a checkout is looked for where ``install`` puts one. Prints the report when ``verbose``."""
    cwd = Path.cwd() if cwd is None else cwd
    front_end = where()
    notes: list[str] = []
    root = find_repo_root(cwd)
    if root is not None and not cwd.resolve().is_relative_to(root):
        chdir(root / "notebooks")
        notes.append(f"working folder: {root / 'notebooks'} (the lessons' relative paths start there)")
    name, capability = device()
    dtype = kernel_dtype(capability)
    if capability is not None and dtype == "float16":
        notes.append("this GPU has no bfloat16 (it needs compute capability 8.0): use float16 here")
    if front_end == "colab":
        notes.append("Colab: the widgets render through Colab's custom widget manager, which anywidget turns on")
    report = SetupReport(front_end, root, name, dtype, notes)
    if verbose:
        print(report)
    return report


if __name__ == "__main__":
    raise SystemExit(main())
