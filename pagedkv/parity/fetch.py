"""Fetch vLLM 0.26.0's Python sources once, and the few pure-Python packages its core imports.

Where things go: ``$PAGEDKV_VLLM_CACHE`` or ``~/.cache/pagedkv/vllm-0.26.0/``, holding ``wheel/`` (the
downloaded wheel, ~300 MB), ``src/vllm/`` (only its ``.py`` files, ~30 MB of the 700 MB the wheel unpacks
to; nothing compiled), ``deps/`` (the extra packages) and ``READY`` (written last, so an interrupted fetch
is simply redone). ``$PAGEDKV_VLLM_WHEEL`` names a local wheel (or a folder holding it) to use instead of
downloading.

Why a ``pip install --target`` folder, not the lab's environment or a side venv: installing vLLM's
requirements into the lab's environment could upgrade or downgrade packages the lab pins (numpy,
transformers, pydantic), and vLLM's full requirements pull a CUDA torch; a side venv with
``--system-site-packages`` does not see the lab's venv (a venv's "system" is the base interpreter), so
torch would be missing there. A folder of exactly the missing packages, installed with ``--no-deps`` and
appended to ``sys.path`` of the worker process after the lab's own packages, leaves the lab's environment
untouched and keeps torch the lab's. The wheel is fetched with ``--platform manylinux_2_28_x86_64``: only
its Python sources are used, so any OS with a CPython vLLM supports (3.10 to 3.14) can use it, except
Windows, where ``uvloop`` (imported by vLLM's core) has no build.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.26.0"
WHEEL_PLATFORM = "manylinux_2_28_x86_64"

#: What vLLM 0.26's ``vllm.v1.core`` needs beyond the lab's own environment, found by importing
#: ``vllm.v1.core.kv_cache_manager`` and ``vllm.v1.core.sched.scheduler`` until nothing was missing
#: (``docs/vllm-core-on-cpu.md``). Installed without dependencies, each only if the lab's
#: environment lacks it; the bounds are vLLM's own where it sets them.
EXTRA_PACKAGES: list[tuple[str, str]] = [
    ("msgspec", "msgspec"),
    ("cbor2", "cbor2"),
    ("aiohttp", "aiohttp>=3.13.3"),
    ("multidict", "multidict"),
    ("yarl", "yarl"),
    ("propcache", "propcache"),
    ("aiohappyeyeballs", "aiohappyeyeballs"),
    ("aiosignal", "aiosignal"),
    ("frozenlist", "frozenlist"),
    ("openai-harmony", "openai-harmony>=0.0.3"),
    ("openai", "openai>=2.0.0"),
    ("httpx", "httpx"),
    ("httpcore", "httpcore"),
    ("h11", "h11"),
    ("anyio", "anyio"),
    ("sniffio", "sniffio"),
    ("distro", "distro"),
    ("jiter", "jiter"),
    ("pybase64", "pybase64"),
    ("cachetools", "cachetools"),
    ("cloudpickle", "cloudpickle"),
    ("uvloop", "uvloop"),
    ("py-cpuinfo", "py-cpuinfo"),
    ("llguidance", "llguidance>=1.7.0,<1.8.0"),
    ("xgrammar", "xgrammar>=0.2.1,<1.0.0"),
    ("apache-tvm-ffi", "apache-tvm-ffi"),
    ("pydantic", "pydantic>=2.12.0"),
    ("pyzmq", "pyzmq>=25.0.0"),
    ("psutil", "psutil"),
    ("regex", "regex"),
    ("prometheus-client", "prometheus_client>=0.18.0"),
    ("pillow", "pillow"),
    ("requests", "requests>=2.26.0"),
]


class VllmUnavailable(RuntimeError):
    """vLLM's sources could not be made ready; the message is one line saying why."""


@dataclass(frozen=True)
class VllmSources:
    """Where the worker finds vLLM: ``paths`` are appended to its ``sys.path``."""

    cache_dir: Path
    src_dir: Path
    deps_dir: Path

    @property
    def paths(self) -> list[str]:
        return [str(self.src_dir), str(self.deps_dir)]


def cache_dir() -> Path:
    env = os.environ.get("PAGEDKV_VLLM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedkv" / f"vllm-{VLLM_VERSION}"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("WARNING: Location")]
    return lines[-1] if lines else "no output"


def _pip(args: list[str], what: str, timeout: float) -> None:
    cmd = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VllmUnavailable(f"{what} took longer than {timeout:.0f} s (offline or a slow network?)") from None
    if proc.returncode != 0:
        raise VllmUnavailable(f"{what} failed (offline?): {_last_line(proc.stderr or proc.stdout)}")


def _find_wheel(folder: Path) -> Path | None:
    wheels = sorted(folder.glob(f"vllm-{VLLM_VERSION}-*.whl")) if folder.is_dir() else []
    return wheels[0] if wheels else None


def _wheel(cache: Path, log: Callable[[str], None]) -> Path:
    local = os.environ.get("PAGEDKV_VLLM_WHEEL")
    if local:
        path = Path(local).expanduser()
        wheel = _find_wheel(path) if path.is_dir() else path
        if wheel is None or not wheel.is_file():
            raise VllmUnavailable(
                f"PAGEDKV_VLLM_WHEEL={local} is not a vllm-{VLLM_VERSION} wheel or a folder holding one"
            )
        return wheel
    wheel = _find_wheel(cache / "wheel")
    if wheel is not None:
        return wheel
    log(f"downloading vllm=={VLLM_VERSION} (about 300 MB, once) into {cache / 'wheel'} ...")
    args = ["download", f"vllm=={VLLM_VERSION}", "--no-deps", "--only-binary=:all:", "--platform", WHEEL_PLATFORM]
    _pip([*args, "-d", str(cache / "wheel"), "-q"], f"pip download vllm=={VLLM_VERSION}", timeout=1800)
    wheel = _find_wheel(cache / "wheel")
    if wheel is None:
        raise VllmUnavailable(f"pip download vllm=={VLLM_VERSION} left no wheel in {cache / 'wheel'}")
    return wheel


def _unpack(wheel: Path, src: Path) -> None:
    """Extract only ``vllm/**.py`` into ``src`` (via a temporary folder, renamed when complete)."""
    tmp = Path(tempfile.mkdtemp(prefix="src-", dir=src.parent))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("vllm/") and name.endswith(".py") and ".." not in name:
                    zf.extract(name, tmp)
        if src.exists():
            shutil.rmtree(src)
        tmp.rename(src)
    except zipfile.BadZipFile:
        shutil.rmtree(tmp, ignore_errors=True)
        raise VllmUnavailable(f"{wheel} is not a valid wheel (an interrupted download? delete it and retry)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def missing_packages() -> list[str]:
    """The requirement strings of :data:`EXTRA_PACKAGES` whose distribution the lab's environment lacks."""
    out = []
    for dist, spec in EXTRA_PACKAGES:
        try:
            importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out.append(spec)
    return out


def _is_ready(ready: Path, src: Path) -> bool:
    """A finished fetch: ``READY`` written (last) and the sources there."""
    return ready.is_file() and (src / "vllm" / "v1" / "core" / "sched" / "scheduler.py").is_file()


def ensure_vllm(log: Callable[[str], None] = print) -> VllmSources:
    """Make vLLM 0.26.0's sources and the extra packages ready (a no-op once done); return where they are.
    Raises :class:`VllmUnavailable` with a one-line reason when that cannot be done."""
    if sys.platform.startswith("win"):
        raise VllmUnavailable("unsupported platform: vLLM's core imports uvloop, which has no Windows build (use WSL)")
    if not (3, 10) <= sys.version_info[:2] < (3, 15):
        raise VllmUnavailable(f"vLLM {VLLM_VERSION} supports Python 3.10 to 3.14, not {sys.version.split()[0]}")
    cache = cache_dir()
    src, deps, ready = cache / "src", cache / "deps", cache / "READY"
    sources = VllmSources(cache, src, deps)
    if _is_ready(ready, src):
        return sources
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VllmUnavailable(f"cannot create the cache folder {cache}: {exc.strerror}") from None
    import fcntl  # POSIX only, like vLLM itself (refused on Windows above)

    with open(cache / ".lock", "w") as lock:  # one fetch at a time (pytest-xdist workers, two notebooks)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_ready(ready, src):
            return sources  # another process finished the fetch while this one waited
        _fetch(cache, src, deps, ready, log)
    return sources


def _fetch(cache: Path, src: Path, deps: Path, ready: Path, log: Callable[[str], None]) -> None:
    """Download (or reuse) the wheel, unpack its sources, install the extra packages, then write ``READY``."""
    wheel = _wheel(cache, log)
    log(f"unpacking vLLM's Python sources from {wheel.name} into {src} ...")
    _unpack(wheel, src)
    missing = missing_packages()
    if missing:
        log(f"installing {len(missing)} packages vLLM's core imports into {deps} (the lab's environment is untouched)")
        _pip(["install", "--no-deps", "--target", str(deps), "--upgrade", "-q", *missing], "pip install", timeout=1800)
    else:
        deps.mkdir(exist_ok=True)
    ready.write_text(json.dumps({"vllm": VLLM_VERSION, "wheel": wheel.name, "installed": missing}) + "\n")
