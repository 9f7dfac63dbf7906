"""Put an "Open in Colab" badge and the set-up cell at the top of lesson notebooks (idempotent).

    .venv/bin/python tools/colab_cells.py notebooks/01_fragmentation.ipynb [...]   # or: notebooks/*.ipynb
    .venv/bin/python tools/colab_cells.py --check notebooks/*.ipynb                # exit 1 if any lacks them

The badge (a markdown cell tagged ``pagedkv-colab-badge``) opens the notebook from GitHub in Colab. The set-up
cell (a code cell tagged ``pagedkv-setup``) installs the lab where ``pagedkv`` cannot be imported (it runs
``pagedkv/setup_env.py`` as a script, downloaded from the repository) and then calls
``pagedkv.setup_env.prepare()``. Both take the repository's address from one place, ``Repository`` under
``[project.urls]`` in pyproject.toml: a fork sets its own there and runs this tool again. Where that address
does not answer, the set-up cell stops with what to set, instead of a 404 traceback. Running the tool again
replaces both cells with their current text and leaves everything else, outputs included, as it was; a
notebook already up to date is not rewritten. The set-up cell's outputs are kept when its text is unchanged;
re-execute the notebook after a change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv.setup_env import BRANCH, published_repo_url  # noqa: E402

BADGE_TAG = "pagedkv-colab-badge"
SETUP_TAG = "pagedkv-setup"


def repo_url() -> str:
    """pyproject.toml's ``[project.urls] Repository``: where the course is published."""
    url = published_repo_url(ROOT)
    if not url or not url.startswith("https://github.com/"):
        raise SystemExit(f"{ROOT / 'pyproject.toml'}: set Repository = \"https://github.com/OWNER/NAME\" under "
                         f"[project.urls] (the badges and set-up cells open the lessons from there); found {url!r}")
    return url.rstrip("/")


def colab_url(notebook: Path, repo: str | None = None, branch: str = BRANCH) -> str:
    """Colab's address for ``notebook`` (a path inside the repository) on GitHub."""
    rel = notebook.resolve().relative_to(ROOT).as_posix()
    owner_name = (repo or repo_url()).removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{owner_name}/blob/{branch}/{rel}"


def badge_source(notebook: Path) -> str:
    return (
        f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(notebook)})"
        " · on your own machine: `./lab open` (see the README)"
    )


def setup_cell_source(repo: str | None = None) -> str:
    """The set-up cell: short; its logic lives in ``pagedkv/setup_env.py`` (tested in tests/test_setup_env.py)."""
    return f"""# Set-up. Where the lab is not installed (Colab, or a kernel other than the lab's .venv), this fetches
# its set-up script from REPO, which clones the repository and pip-installs it (about a minute).
# Elsewhere it only checks the machine.
import importlib.util
import site
import subprocess
import sys
import urllib.request

REPO = "{repo or repo_url()}"  # where the course is published (README: "Publishing a fork")
if importlib.util.find_spec("pagedkv") is None:
    url = REPO.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/{BRANCH}/pagedkv/setup_env.py"
    try:
        script = urllib.request.urlopen(url, timeout=60).read()
    except OSError as exc:  # a 404 (no such repository), or no network
        raise SystemExit(f"{{url}}: {{exc}}. Set REPO above to the GitHub address this notebook comes from "
                         "and run this cell again (a fork: README, 'Publishing a fork').") from None
    subprocess.run([sys.executable, "-", "install", "--repo", REPO], input=script, check=True)
    for path in site.getsitepackages():  # load the new install without restarting the kernel
        site.addsitedir(path)
from pagedkv.setup_env import prepare

report = prepare()"""


def _tags(cell: nbformat.NotebookNode) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def _tagged(cell: nbformat.NotebookNode, tag: str) -> bool:
    """``cell`` is this tool's badge or set-up cell: it carries ``tag``, or it is an untagged copy written by hand
    or by an older version of the tool (its opening line is the badge's or the set-up cell's), to be replaced."""
    if tag in _tags(cell):
        return True
    opening = {BADGE_TAG: ("markdown", "[![Open In Colab]("), SETUP_TAG: ("code", "# Set-up. Where the lab is not")}
    kind, start = opening[tag]
    return cell.cell_type == kind and cell.source.startswith(start)


def apply(nb: nbformat.NotebookNode, notebook: Path) -> bool:
    """Put the badge and set-up cells first in ``nb`` (replacing older ones); True if anything changed."""
    badge = nbformat.v4.new_markdown_cell(badge_source(notebook), metadata={"tags": [BADGE_TAG]})
    setup = nbformat.v4.new_code_cell(setup_cell_source(), metadata={"tags": [SETUP_TAG]})
    old_badge = next((c for c in nb.cells if _tagged(c, BADGE_TAG)), None)
    old_setup = next((c for c in nb.cells if _tagged(c, SETUP_TAG)), None)
    if old_setup is not None and old_setup.source == setup.source and SETUP_TAG in _tags(old_setup):
        setup = old_setup  # keep its outputs and execution count
    if old_badge is not None and old_badge.source == badge.source and BADGE_TAG in _tags(old_badge):
        badge = old_badge
    rest = [c for c in nb.cells if not (_tagged(c, BADGE_TAG) or _tagged(c, SETUP_TAG))]
    cells = [badge, setup, *rest]
    changed = [id(c) for c in cells] != [id(c) for c in nb.cells]
    if changed:
        nb.cells = cells
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook is not up to date")
    args = parser.parse_args(argv)
    stale = []
    for path in args.notebooks:
        if not path.resolve().is_relative_to(ROOT):
            parser.error(f"{path} is not inside the repository {ROOT}: Colab could not open it from GitHub")
        nb = nbformat.read(path, as_version=4)
        if apply(nb, path):
            stale.append(path)
            if not args.check:
                nbformat.write(nb, path)
                print(f"updated {path}")
    if args.check and stale:
        print("not up to date (run tools/colab_cells.py on them):", *map(str, stale), sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
