"""The block-table widget in a real browser: JupyterLab on localhost, driven by headless Chromium.

What it checks, per notebook in ``TARGET_NOTEBOOKS``: the notebook opens in JupyterLab, Run All executes
it, the widget renders (and hides its static fallback picture), pressing play advances the frames in the
browser and the drawn block tables change between frames, step and scrub move the view. It saves
screenshots under ``artifacts/browser/`` (or ``$PAGEDKV_ARTIFACTS/browser/``) and prints where.

Chromium is Debian's package at ``/usr/bin/chromium``; ``./lab setup`` installs it with apt-get where it can
(as root, as in CI), and the ``chromium`` fixture skips, saying so, where it is missing. Playwright drives it
through ``executable_path`` (``playwright install`` is never run: its downloads are blocked). Facts this
relies on are in ``docs/browser-testing.md``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
#: Lesson 2, once it exists; the browser test opens it as well as the small demo below.
LESSON_NOTEBOOK = REPO / "notebooks" / "02_block_pool.ipynb"
#: A small notebook kept with the tests: builds a manager, records a trace, shows the widget.
DEMO_NOTEBOOK = REPO / "tests" / "browser" / "block_table_demo.ipynb"
#: The notebooks the test opens (the one constant to change to point the test elsewhere).
TARGET_NOTEBOOKS: list[Path] = [p for p in (DEMO_NOTEBOOK, LESSON_NOTEBOOK) if p.exists()]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ARTIFACTS = Path(os.environ.get("PAGEDKV_ARTIFACTS", REPO / "artifacts")) / "browser"
TIMEOUT_MS = 60_000  # Playwright's default 5 s is too short on a 2-core machine
RUN_TIMEOUT_MS = 240_000  # Run All on a lesson notebook (the widget cell may follow slower ones)


# --------------------------------------------------------------------------------------------------
# Chromium (apt), JupyterLab (a subprocess), Playwright
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def chromium() -> str:
    """Path to Debian's Chromium, or skip saying how to get it: ``./lab setup`` installs it with apt-get where it
    can (as root), so no test runs apt (under pytest-xdist two workers would run it at once)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"Chromium is not at {CHROMIUM}: `./lab setup` installs it as root with apt-get "
                    "(or run `apt-get install -y chromium`)")
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_lab_settings(settings_dir: Path) -> None:
    """User settings for a quiet, deterministic Lab: no news or update checks, every cell rendered."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    }
    for rel, content in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


class LabServer:
    def __init__(
        self, root: Path, port: int, token: str, proc: subprocess.Popen, log: Path, env: dict[str, str]
    ) -> None:
        self.root, self.port, self.token, self.proc, self.log, self.env = root, port, token, proc, log, env

    def trust(self, name: str) -> None:
        """Sign a notebook in this server's own notary database (as running it in Lab would)."""
        subprocess.run(
            [sys.executable, "-m", "jupyter", "trust", str(self.root / name)],
            env=self.env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, notebook: str) -> str:
        return f"{self.base}/lab/tree/{notebook}?token={self.token}&reset"

    def shutdown_kernels(self) -> None:
        """Stop every kernel, so that a lesson's remaining cells stop using the CPU after a test."""
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{self.base}/api/kernels?token={self.token}", timeout=10) as r:
                kernels = json.load(r)
            for k in kernels:
                req = urllib.request.Request(f"{self.base}/api/kernels/{k['id']}?token={self.token}", method="DELETE")
                urllib.request.urlopen(req, timeout=30).close()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabServer]:
    """JupyterLab on 127.0.0.1 serving a temporary folder; stopped by its PID at the end."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "root"
    root.mkdir()
    settings = base / "settings"
    _write_lab_settings(settings)
    token = uuid.uuid4().hex
    port = _free_port()
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTER_DATA_DIR": str(base / "data"),  # the notary database (trusted notebooks) lives here
        "IPYTHONDIR": str(base / "ipython"),
        # the lessons' kernels run their smaller workloads, as in tests/test_notebooks.py: what is checked here is
        # the widget, and lesson 2's benchmark would otherwise keep a core busy beside the browser
        "PAGEDKV_SMALL_WORKLOADS": "1",
    }
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = base / "jupyterlab.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
    server = LabServer(root, port, token, proc, log, env)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with code {proc.returncode} before answering:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer /api/status within 90 s:\n{server.log_tail()}")
            time.sleep(0.25)
        print(f"\nJupyterLab ready in {time.monotonic() - t0:.1f} s on port {port}", file=sys.stderr)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[object]:
    """Chromium under Playwright's sync API, for this module's tests only: while the API is alive it marks an
    asyncio loop as running in this thread (between its calls), so a later test's ``asyncio.run`` in the same
    pytest-xdist worker would raise "cannot be called from a running event loop"."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Python Playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _serve_copy(notebook: Path, root: Path) -> str:
    """Copy ``notebook`` into the server's folder without outputs or saved widget state (so the widget seen
    is the one this run makes, and the committed file is never touched); return its name there."""
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    name = f"{notebook.stem}-{uuid.uuid4().hex[:6]}.ipynb"
    nbformat.write(nb, root / name)
    return name


def _serve_executed(notebook: Path, root: Path) -> str | None:
    """Copy ``notebook`` into the server's folder with its outputs and saved widget state; return its name.

    A lesson is used as committed (lessons are committed executed): ``None`` when it has no saved widget
    state. The small demo notebook is committed clean, so it is executed here with nbclient (which saves the
    widget state, as ``jupyter nbconvert --execute`` does)."""
    nb = nbformat.read(notebook, as_version=4)
    if not nb.metadata.get("widgets"):
        if notebook != DEMO_NOTEBOOK:
            return None
        from nbclient import NotebookClient

        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(root)}}).execute()
    name = f"{notebook.stem}-saved-{uuid.uuid4().hex[:6]}.ipynb"
    nbformat.write(nb, root / name)
    return name


def _open_notebook(page: object, lab: LabServer, name: str, n_cells: int) -> None:
    """Open a notebook and wait until it is ready: all cells shown, the kernel named, and it idle."""
    from playwright.sync_api import expect

    page.goto(lab.url(name))  # type: ignore[attr-defined]
    expect(page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")).to_have_count(  # type: ignore[attr-defined]
        n_cells, timeout=TIMEOUT_MS
    )
    expect(page.locator(".jp-NotebookPanel .jp-Toolbar-kernelName").first).to_contain_text(  # type: ignore[attr-defined]
        re.compile("Python"), timeout=TIMEOUT_MS
    )
    expect(page.locator(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator").first).to_have_attribute(  # type: ignore[attr-defined]
        "data-status", "idle", timeout=TIMEOUT_MS
    )


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------
DRAWING_JS = """root => {
  const q = s => root.querySelector(s);
  const cells = [...root.querySelectorAll('[data-testid=pool-grid] .pkv-cell')]
      .map(c => `${c.dataset.blockId}:${c.dataset.refCnt}:${c.dataset.owners}:${c.className}`).join('|');
  return {
    frame: Number(root.dataset.frameIndex),
    n: Number(root.dataset.numFrames),
    tables: q('[data-testid=block-tables]').innerText,
    tablesHtml: q('[data-testid=block-tables]').innerHTML,
    pool: cells,
    free: q('[data-testid=free-queue]').innerText,
    caption: q('[data-testid=caption]').innerText,
  };
}"""


@pytest.mark.parametrize("notebook", TARGET_NOTEBOOKS, ids=[p.stem for p in TARGET_NOTEBOOKS])
def test_widget_animates_in_jupyterlab(
    notebook: Path, lab: LabServer, browser: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from playwright.sync_api import expect

    t0 = time.monotonic()
    before = notebook.read_bytes()
    name = _serve_copy(notebook, lab.root)
    n_cells = len(nbformat.read(notebook, as_version=4).cells)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    context = browser.new_context(viewport={"width": 1280, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.on("pageerror", lambda e: errors.append(str(e)))
    timings: dict[str, float] = {}
    try:
        _open_notebook(page, lab, name, n_cells)
        timings["open"] = time.monotonic() - t0

        page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
        page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
        root = page.locator(".pkv-root").first
        expect(root).to_be_visible(timeout=RUN_TIMEOUT_MS)
        root.scroll_into_view_if_needed()
        timings["run"] = time.monotonic() - t0 - timings["open"]

        # The live widget hides the static picture published beside it.
        fallback = page.locator(".pkv-static-fallback")
        assert fallback.count() >= 1, "the static fallback picture was not published next to the widget"
        expect(fallback.first).to_be_hidden()

        first = root.evaluate(DRAWING_JS)
        assert first["n"] >= 3, f"the trace has only {first['n']} frames"
        page.wait_for_timeout(400)  # let the cells' colour transitions finish before the screenshot
        root.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-before-play.png"))

        # Play: the frame index advances in the browser and the drawn block tables change.
        page.locator(".pkv-root .pkv-play").first.click()
        expect(root).to_have_attribute("data-playing", "true")
        seen = {first["frame"]: first}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len({d["tablesHtml"] for d in seen.values()}) < 3:
            page.wait_for_timeout(100)
            d = root.evaluate(DRAWING_JS)
            seen.setdefault(d["frame"], d)
            if d["frame"] == d["n"] - 1 and root.get_attribute("data-playing") == "false":
                break
        frames_seen = sorted(seen)
        assert len(frames_seen) >= 3, f"play showed only frames {frames_seen}"
        tables = {seen[k]["tablesHtml"] for k in frames_seen}
        pools = {seen[k]["pool"] for k in frames_seen}
        assert len(tables) >= 2, f"the block tables looked the same in frames {frames_seen}"
        assert len(pools) >= 2, f"the pool grid looked the same in frames {frames_seen}"
        assert len({seen[k]["caption"] for k in frames_seen}) >= 2, "the caption never changed"
        page.locator(".pkv-root .pkv-play").first.click()  # pause (or no-op if it already stopped)
        expect(root).to_have_attribute("data-playing", "false")
        page.wait_for_timeout(400)
        root.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-playing.png"))

        # Step and scrub.
        k = int(root.get_attribute("data-frame-index") or 0)
        if k == 0:
            page.locator(".pkv-root .pkv-step-fwd").first.click()
            expect(root).to_have_attribute("data-frame-index", "1")
            k = 1
        page.locator(".pkv-root .pkv-step-back").first.click()
        expect(root).to_have_attribute("data-frame-index", str(k - 1))
        target = first["n"] // 2
        page.locator(".pkv-root .pkv-scrubber").first.evaluate(
            "(el, v) => { el.value = String(v); el.dispatchEvent(new Event('input', {bubbles: true})); }", target
        )
        expect(root).to_have_attribute("data-frame-index", str(target))
        if target in seen:  # a frame is drawn the same whether reached by playing or by scrubbing
            now = root.evaluate(DRAWING_JS)
            assert (now["tablesHtml"], now["pool"]) == (seen[target]["tablesHtml"], seen[target]["pool"])
        page.wait_for_timeout(400)
        root.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-widget.png"))
        page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-page.png"), full_page=False)
        timings["animate"] = time.monotonic() - t0 - timings["open"] - timings["run"]
    except Exception:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-failure.png"), full_page=True)
        print(f"JupyterLab log:\n{lab.log_tail()}\npage errors: {errors}", file=sys.stderr)
        raise
    finally:
        context.close()
        lab.shutdown_kernels()
    assert notebook.read_bytes() == before, "the test changed the committed notebook"
    widget_errors = [e for e in errors if "pkv" in e or "block_table" in e]
    assert not widget_errors, f"the widget raised in the browser: {widget_errors}"
    with capsys.disabled():
        print(
            f"\n[browser] {notebook.name}: opened {timings['open']:.1f} s, ran {timings['run']:.1f} s, "
            f"animated {timings['animate']:.1f} s; frames seen while playing {frames_seen}; "
            f"screenshots in {ARTIFACTS}"
        )


@pytest.mark.parametrize("notebook", TARGET_NOTEBOOKS, ids=[p.stem for p in TARGET_NOTEBOOKS])
def test_saved_notebook_before_running(
    notebook: Path, lab: LabServer, browser: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """A notebook saved with its outputs and widget state (as lessons are committed), opened before any cell
    runs. Untrusted (a fresh clone): JupyterLab will not run the widget, so the static picture must show.
    Trusted (after ``jupyter trust``): the live widget comes back from the saved state and plays, with no
    kernel work, and the picture is hidden."""
    from playwright.sync_api import expect

    t0 = time.monotonic()
    name = _serve_executed(notebook, lab.root)
    if name is None:
        pytest.skip(f"{notebook.name} has no saved widget state (commit it executed, as nbconvert --execute saves)")
    n_cells = len(nbformat.read(lab.root / name, as_version=4).cells)
    t_exec = time.monotonic() - t0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        # Untrusted: the static picture, decoded and visible; no live widget.
        _open_notebook(page, lab, name, n_cells)
        img = page.locator(".pkv-static-fallback img").first
        expect(img).to_be_visible(timeout=TIMEOUT_MS)
        img.scroll_into_view_if_needed()
        assert img.evaluate("el => el.complete && el.naturalWidth > 0"), "the static picture did not decode"
        if notebook == DEMO_NOTEBOOK:  # executed here with today's widget: its picture is the key-frame strip
            assert (img.get_attribute("alt") or "").startswith("block table, key frames:"), img.get_attribute("alt")
        assert page.locator(".pkv-root").count() == 0
        expect(page.get_by_text(re.compile(r"BlockTableWidget\(\d+ frames")).first).to_be_visible()
        img.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-untrusted-static.png"))

        # Trusted: the widget is restored from the saved state and plays without running anything.
        lab.trust(name)
        _open_notebook(page, lab, name, n_cells)
        root = page.locator(".pkv-root").first
        expect(root).to_be_visible(timeout=TIMEOUT_MS)
        root.scroll_into_view_if_needed()
        expect(page.locator(".pkv-static-fallback").first).to_be_hidden()
        assert page.locator(".jp-InputArea-prompt", has_text="[*]").count() == 0, "a cell is running"
        start = int(root.get_attribute("data-frame-index") or 0)
        page.locator(".pkv-root .pkv-play").first.click()
        page.wait_for_function(
            "([el, k]) => Number(el.dataset.frameIndex) !== k && Number(el.dataset.frameIndex) > 0",
            arg=[root.element_handle(), start],
        )
        page.wait_for_timeout(600)
        root.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-trusted-restored.png"))
    except Exception:
        with contextlib.suppress(Exception):
            page.screenshot(path=str(ARTIFACTS / f"{notebook.stem}-saved-failure.png"), full_page=True)
        print(f"JupyterLab log:\n{lab.log_tail()}", file=sys.stderr)
        raise
    finally:
        context.close()
        lab.shutdown_kernels()
    with capsys.disabled():
        print(
            f"\n[browser] {notebook.name} saved with widget state: prepared {t_exec:.1f} s, then static picture "
            f"(untrusted) and restored widget playing (trusted) in {time.monotonic() - t0 - t_exec:.1f} s; "
            f"screenshots in {ARTIFACTS}"
        )
