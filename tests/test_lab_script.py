"""``./lab``: its argument handling, the torch build it chooses, the fallback when PyTorch's CPU index cannot
be reached, and what ``./lab open`` prints on a machine without a display.

Nothing is installed and no server starts: each test points ``PAGEDKV_VENV`` at a throwaway folder whose
``bin/python``, ``bin/jupyter`` and ``bin/ruff`` are tiny fakes that log their arguments. The CPU index is
either a local HTTP server (reachable) or a closed local port (unreachable, as on machines without internet
access); the NVIDIA driver probe is pointed at paths that do or do not exist. Every test takes well under a
second of the script's own time.
"""

from __future__ import annotations

import functools
import http.server
import os
import shlex
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab"


def _write_exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: connections are refused at once


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    """A venv whose python fakes ``import torch`` (absent) and ``-m`` (logs; pip fails for FAIL_INDEX), and runs
    any other ``-c`` code with the real interpreter (the port and token helpers of ``./lab open``)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    _write_exe(
        venv / "bin" / "python",
        f"""#!/usr/bin/env bash
echo "python $*" >> {shlex.quote(str(log))}
if [ "$1" = -c ] && [[ "$2" == *"import torch"* ]]; then exit 1; fi
if [ "$1" = -m ]; then  # pip, or a module the command runs: logged only
  if [ -n "${{FAIL_INDEX:-}}" ] && [[ "$*" == *"$FAIL_INDEX"* ]]; then echo "pip: no $FAIL_INDEX" >&2; exit 1; fi
  exit 0
fi
exec {shlex.quote(sys.executable)} "$@"
""",
    )
    for tool in ("ruff", "pagedkv"):
        _write_exe(venv / "bin" / tool, f'#!/usr/bin/env bash\necho "{tool} $*" >> {shlex.quote(str(log))}\n')
    # jupyter: logs its arguments, then answers one /api/status on its port (as a started server would) and exits
    _write_exe(
        venv / "bin" / "jupyter",
        f"""#!/usr/bin/env bash
echo "jupyter $*" >> {shlex.quote(str(log))}
exec {shlex.quote(sys.executable)} -c {shlex.quote(FAKE_SERVER)} "$@"
""",
    )
    return venv


FAKE_SERVER = """
import http.server, os, sys
if os.environ.get("FAKE_JUPYTER_EXIT"):
    sys.exit(int(os.environ["FAKE_JUPYTER_EXIT"]))
args = sys.argv[1:]
port = next((a.split("=", 1)[1] for a in args if a.startswith(("--port=", "--ServerApp.port="))), None)
if port is None and "--port" in args:
    port = args[args.index("--port") + 1]
server = http.server.HTTPServer(("localhost", int(port)), http.server.BaseHTTPRequestHandler)
server.timeout = 20
server.RequestHandlerClass.do_GET = lambda self: (self.send_response(200), self.end_headers())
server.RequestHandlerClass.log_message = lambda *a: None
server.handle_request()
"""


def run_lab(*args: str, venv: Path, **env: str) -> subprocess.CompletedProcess[str]:
    unset = ("TORCH_SPEC", "SSH_CONNECTION", "DISPLAY", "WAYLAND_DISPLAY", "JUPYTER_TOKEN", "LAB_PORT")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    base.update(
        PAGEDKV_VENV=str(venv),
        PAGEDKV_NVIDIA_PROC=str(venv / "no-such-proc-entry"),
        PAGEDKV_NVIDIA_SMI=str(venv / "no-such-nvidia-smi"),
        TORCH_CPU_INDEX=f"http://127.0.0.1:{_closed_port()}/whl/cpu",
        PAGEDKV_CHROMIUM=str(venv / "no-such-chromium"),
        PAGEDKV_APT_GET=str(venv / "no-such-apt-get"),  # set-up never runs the real apt-get here
    )
    base.update(env)
    return subprocess.run(["bash", str(LAB), *args], capture_output=True, text=True, env=base, timeout=120)


def calls(venv: Path) -> list[str]:
    log = venv.parent / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def pip_installs(venv: Path) -> list[str]:
    return [c for c in calls(venv) if c.startswith("python -m pip install") and "--upgrade pip" not in c]


@pytest.fixture
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A reachable stand-in for PyTorch's CPU index (it only has to answer GET /torch/)."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# --- arguments ---------------------------------------------------------------------------------------------
def test_unknown_command_says_so_and_prints_the_usage(fake_venv: Path) -> None:
    r = run_lab("frobnicate", venv=fake_venv)
    assert r.returncode == 2
    assert "unknown command 'frobnicate'" in r.stderr
    assert "usage: ./lab" in r.stderr and "parity" in r.stderr
    assert "set -euo" not in r.stderr and "cd " not in r.stderr  # not the script's own lines
    assert calls(fake_venv) == []  # nothing was set up


@pytest.mark.parametrize("arg", ["help", "-h", "--help"])
def test_help_prints_the_usage(fake_venv: Path, arg: str) -> None:
    r = run_lab(arg, venv=fake_venv)
    assert r.returncode == 0 and r.stdout.startswith("usage: ./lab")
    for cmd in ("open", "setup", "test", "grade", "exercises", "bench", "parity", "lint", "torch"):
        assert f"\n  {cmd} " in r.stdout, cmd


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["parity", "--lesson", "3"], "python -m pagedkv.parity --lesson 3"),
        (["grade", "exercises/x.ipynb"], "pagedkv grade exercises/x.ipynb"),
        (["exercises", "02"], "pagedkv build-exercises 02"),
        (["bench", "engine"], "pagedkv bench engine"),
        (["lint"], "ruff check ."),
        (["setup"], "python -m pip install -q -e .[dev]"),
    ],
)
def test_commands_run_their_tool_after_set_up(fake_venv: Path, args: list[str], expected: str) -> None:
    r = run_lab(*args, venv=fake_venv)
    assert r.returncode == 0, r.stderr
    log = calls(fake_venv)
    assert log[-1] == expected
    assert any(c.startswith("python -m pip install -q -e .[dev]") for c in log)  # set-up ran first
    assert (fake_venv / ".pagedkv-installed").exists()


def test_set_up_runs_once(fake_venv: Path) -> None:
    assert run_lab("lint", venv=fake_venv).returncode == 0
    n = len(pip_installs(fake_venv))
    assert run_lab("lint", venv=fake_venv).returncode == 0
    assert len(pip_installs(fake_venv)) == n  # the stamp is newer than pyproject.toml: nothing reinstalled


def test_set_up_installs_chromium_with_apt_as_root_else_says_how(fake_venv: Path, tmp_path: Path) -> None:
    """The browser test's Chromium comes from set-up (apt-get, as root), never from a pytest fixture."""
    apt = tmp_path / "apt-get"
    apt.write_text(f'#!/bin/sh\necho "apt-get $*" >> {tmp_path / "apt.log"}\n')
    apt.chmod(0o755)
    r = run_lab("setup", venv=fake_venv, PAGEDKV_APT_GET=str(apt))
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "apt.log").read_text().splitlines() if (tmp_path / "apt.log").exists() else []
    if os.geteuid() == 0:
        assert log == ["apt-get update -qq", "apt-get install -y -qq chromium"], log
    else:
        assert log == [] and "as root: apt-get install -y chromium" in r.stdout


# --- which torch -----------------------------------------------------------------------------------------
def test_no_driver_and_cpu_index_unreachable_falls_back_to_the_ordinary_index(fake_venv: Path) -> None:
    r = run_lab("torch", venv=fake_venv)
    assert r.returncode == 0, r.stderr
    assert "torch: pip install torch==2.13.0\n" in r.stdout
    assert "cannot be reached" in r.stdout
    assert run_lab("lint", venv=fake_venv).returncode == 0
    assert pip_installs(fake_venv)[0] == "python -m pip install -q torch==2.13.0"


def test_no_driver_and_cpu_index_reachable_installs_cpu_wheels(fake_venv: Path, cpu_index: str) -> None:
    r = run_lab("torch", venv=fake_venv, TORCH_CPU_INDEX=cpu_index)
    assert r.returncode == 0, r.stderr
    assert f"torch: pip install torch==2.13.0 --index-url {cpu_index}" in r.stdout
    assert "CPU-only build" in r.stdout
    assert run_lab("lint", venv=fake_venv, TORCH_CPU_INDEX=cpu_index).returncode == 0
    assert pip_installs(fake_venv)[0] == f"python -m pip install -q torch==2.13.0 --index-url {cpu_index}"


def test_cpu_index_reachable_but_pip_fails_there_falls_back(fake_venv: Path, cpu_index: str) -> None:
    r = run_lab("lint", venv=fake_venv, TORCH_CPU_INDEX=cpu_index, FAIL_INDEX=cpu_index)
    assert r.returncode == 0, r.stderr
    assert pip_installs(fake_venv)[:2] == [
        f"python -m pip install -q torch==2.13.0 --index-url {cpu_index}",
        "python -m pip install -q torch==2.13.0",
    ]
    assert "trying the ordinary index" in r.stdout


@pytest.mark.parametrize("probe", ["proc", "smi"])
def test_a_driver_gets_the_cuda_build(fake_venv: Path, cpu_index: str, tmp_path: Path, probe: str) -> None:
    env = {"TORCH_CPU_INDEX": cpu_index}  # reachable, yet not used: a GPU wants PyPI's CUDA build
    if probe == "proc":
        (tmp_path / "nvidia").mkdir()
        env["PAGEDKV_NVIDIA_PROC"] = str(tmp_path / "nvidia")
    else:
        _write_exe(tmp_path / "nvidia-smi", "#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H200'\n")
        env["PAGEDKV_NVIDIA_SMI"] = str(tmp_path / "nvidia-smi")
    r = run_lab("torch", venv=fake_venv, **env)
    assert "torch: pip install torch==2.13.0\n" in r.stdout and "NVIDIA driver is present" in r.stdout
    assert run_lab("lint", venv=fake_venv, **env).returncode == 0
    assert pip_installs(fake_venv)[0] == "python -m pip install -q torch==2.13.0"


def test_a_failing_nvidia_smi_is_no_driver(fake_venv: Path, tmp_path: Path) -> None:
    _write_exe(tmp_path / "nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")
    r = run_lab("torch", venv=fake_venv, PAGEDKV_NVIDIA_SMI=str(tmp_path / "nvidia-smi"))
    assert "no NVIDIA driver" in r.stdout


def test_torch_spec_overrides_the_choice(fake_venv: Path, cpu_index: str) -> None:
    spec = "torch==2.12.0 --index-url https://example.invalid/whl/cu128"
    r = run_lab("torch", venv=fake_venv, TORCH_SPEC=spec, TORCH_CPU_INDEX=cpu_index)
    assert f"torch: pip install {spec}\n" in r.stdout and "TORCH_SPEC" in r.stdout
    assert run_lab("lint", venv=fake_venv, TORCH_SPEC=spec).returncode == 0
    assert pip_installs(fake_venv)[0] == f"python -m pip install -q {spec}"


def test_pinned_torch_matches_the_wheel_ci_installs() -> None:
    text = LAB.read_text()
    assert "TORCH_VERSION=2.13.0" in text


# --- ./lab open ------------------------------------------------------------------------------------------
def _jupyter_args(venv: Path) -> list[str]:
    line = [c for c in calls(venv) if c.startswith("jupyter ")][-1]
    return line.split()[1:]


def test_open_without_a_display_prints_the_url_and_does_not_open_a_browser(fake_venv: Path) -> None:
    r = run_lab("open", venv=fake_venv, JUPYTER_TOKEN="abc123", LAB_PORT="8899")
    assert r.returncode == 0, r.stderr
    url = "http://localhost:8899/lab/tree/notebooks/00_index.ipynb?token=abc123"
    assert url in r.stdout
    args = _jupyter_args(fake_venv)
    assert args[0] == "lab" and "--no-browser" in args
    assert "--IdentityProvider.token=abc123" in args and "--ServerApp.port_retries=0" in args
    assert "--port=8899" in args, "the server listens where the printed URL points"
    assert "--ServerApp.log_level=WARN" in args, "JupyterLab's own lines would show the address with token=..."
    assert "--LabApp.log_level=WARN" in args, "the LabApp extension logs its [I ...] start-up lines on its own"
    assert "ssh -N" not in r.stdout


def test_open_over_ssh_prints_the_tunnel(fake_venv: Path) -> None:
    r = run_lab("open", venv=fake_venv, JUPYTER_TOKEN="t", LAB_PORT="8890", USER="ada",
                SSH_CONNECTION="203.0.113.9 51234 198.51.100.7 2222")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "ssh -N -L 8890:localhost:8890 -p 2222 ada@198.51.100.7" in r.stdout
    assert "--no-browser" in _jupyter_args(fake_venv) and "--port=8890" in _jupyter_args(fake_venv)


def test_open_with_a_display_lets_jupyter_open_the_browser(fake_venv: Path) -> None:
    r = run_lab("open", venv=fake_venv, DISPLAY=":0", JUPYTER_TOKEN="t")
    assert r.returncode == 0, r.stderr
    args = _jupyter_args(fake_venv)
    assert "--no-browser" not in args
    port = next(a.split("=", 1)[1] for a in args if a.startswith("--port="))
    assert f"http://localhost:{port}/lab/tree/notebooks/00_index.ipynb?token=t" in r.stdout


def test_open_passes_a_port_given_on_the_command_line_through(fake_venv: Path) -> None:
    r = run_lab("open", "--port", "9123", venv=fake_venv, JUPYTER_TOKEN="t")
    assert r.returncode == 0, r.stderr
    assert "http://localhost:9123/" in r.stdout
    args = _jupyter_args(fake_venv)
    assert args[-2:] == ["--port", "9123"] and not any(a.startswith("--port=") for a in args)


def test_ci_still_calls_lab_test() -> None:
    assert "./lab test" in (ROOT / ".ci" / "run").read_text()


def test_open_prints_the_url_only_once_the_server_answers(fake_venv: Path) -> None:
    r = run_lab("open", venv=fake_venv, JUPYTER_TOKEN="t", LAB_PORT="8897", FAKE_JUPYTER_EXIT="3")
    assert r.returncode == 3, "./lab open exits with the server's status"
    assert "starting JupyterLab on port 8897" in r.stdout
    assert "http://localhost:8897/lab" not in r.stdout, "no URL for a server that never answered"
