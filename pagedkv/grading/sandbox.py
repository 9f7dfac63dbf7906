"""Start and end the sandbox process that runs a learner's code (:mod:`pagedkv.grading.sandbox_main`).

What the sandbox gets, and why:

- **A throwaway copy of the library**, in a fresh folder under the system's temporary folder, with the
  exercise's reference symbols (``questions.json``'s ``reference`` for the exercise, e.g.
  ``pagedkv.fragmentation.blocks_needed``, plus :data:`FALLBACK_REFERENCE`) rewritten in the copy's source to
  raise "not available while grading": the learner's function cannot wrap the library's answer, and the
  original code is nowhere in the sandbox's reach (no ``__pycache__`` is copied). Python starts on that
  copy (``-s``, an environment of the grader's making, ``PYTHONHASHSEED=0`` as in the worker so that
  ``builtin_hash`` agrees on both sides); the editable install's finder for the repository is removed before
  anything imports.
- **Another user** when the grader runs as root: a uid of its own per sandbox (61000 and up, held with a lock
  file so concurrent graders never share one), owner of nothing but its folder, so it cannot write the
  repository (root's files) or read another sandbox's folder; and "every process of that uid" is exactly what
  to kill at the end. Without root the sandbox runs as the grader's own user.
- **The repository hidden**: in a mount namespace of its own (as root; or a user namespace where the kernel
  allows unprivileged ones) every top-level entry of the repository except the virtual environment is covered
  by an empty read-only tmpfs. Where neither is possible, the copy and the stubs still hold, but the
  repository stays readable (and, without root, writable) to the learner's code: the README says so.
- **Limits** (``resource.setrlimit``): address space (default 4 GiB: a 6 GB allocation fails inside), CPU
  seconds, file size, processes (per uid, as root), no core files; ``OMP_NUM_THREADS=1``.
- **Its own session** (``setsid``) and death with its parent (``PR_SET_PDEATHSIG``). At the end the session
  is killed, then (as root) every process of the sandbox's uid until none is left, which catches a child that
  started a session of its own (``setsid``) or double-forked; without root, orphans are reparented to the
  grader (``PR_SET_CHILD_SUBREAPER``) and killed there.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import fcntl
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_MEMORY", "FALLBACK_REFERENCE", "Sandbox", "close_all", "isolation_summary", "stub_symbols",
           "lesson_checks", "with_private_twins"]

#: Address-space limit of the sandbox process (bytes).
DEFAULT_MEMORY = 4 << 30

#: Reference symbols per exercise, used in addition to what the set's ``questions.json`` lists (``reference:``
#: in the source's ``# BEGIN QUESTION`` cell). Dotted names: module, then class and method where it applies.
FALLBACK_REFERENCE: dict[str, list[str]] = {
    "blocks_needed": ["pagedkv.fragmentation.blocks_needed"],
    "contiguous_capacity": ["pagedkv.fragmentation.contiguous_capacity"],
    "paged_admission": ["pagedkv.fragmentation.paged_admission"],
    "waste_percent": ["pagedkv.fragmentation.waste_percent"],
    "free_queue": [f"pagedkv.kv_cache_utils.FreeKVCacheBlockQueue.{m}" for m in (
        "__init__", "popleft", "popleft_n", "remove", "append", "append_n", "appendleft", "appendleft_n",
        "_insert_after", "__iter__", "get_all_free_blocks", "__len__")],
    "pool_alloc_free": ["pagedkv.block_pool.BlockPool.get_new_blocks", "pagedkv.block_pool.BlockPool.free_blocks"],
    "allocate_slots": ["pagedkv.kv_cache_manager.KVCacheManager.allocate_slots"],
    "hash_chain": ["pagedkv.kv_cache_utils.hash_request_tokens", "pagedkv.kv_cache_utils.update_block_hashes"],
    "prefix_lookup": ["pagedkv.kv_cache_manager.KVCacheManager.get_computed_blocks"],
    "eviction_on_reuse": ["pagedkv.block_pool.BlockPool.get_new_blocks", "pagedkv.block_pool.BlockPool.free_blocks"],
}

#: Library helpers never stubbed, even when a set lists them: other library methods that are not the answer
#: call them (``BlockPool.evict_blocks`` calls ``_maybe_evict_cached_block``), so a stub would break the
#: checks on a correct answer. The part they implement is graded through the methods that are stubbed.
NEVER_STUBBED = {"pagedkv.block_pool.BlockPool._maybe_evict_cached_block"}


def with_private_twins(symbols: Iterable[str]) -> list[str]:
    """``symbols`` plus, for each module-level function among them, its private twin where the module has one
    (``pagedkv.sizing.kv_cache_utils.num_gpu_blocks`` -> ``..._num_gpu_blocks``): the library's own callers use the
    twin so that hiding the public answer leaves them working, and a learner's function must not reach the
    answer through it either. Hidden like the answer, the twin breaks only library calls no check needs (a
    notebook cell that fails with "not available while grading" is not reported)."""
    import importlib
    import inspect

    out = list(symbols)
    for symbol in list(out):
        module_name, _, name = symbol.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a class method, or a misspelt name: reported by stub_symbols
            continue
        twin = getattr(module, f"_{name}", None)
        if inspect.isfunction(twin) and twin.__module__ == module_name and f"{module_name}._{name}" not in out:
            out.append(f"{module_name}._{name}")
    return out


def lesson_checks(test_sources: Iterable[str]) -> list[str]:
    """The checks of the lesson modules (``pagedkv.grading.lessons.lNN_*``) these test files use: every function the
    tests import from them (``check_*``, set 04's ``grade_*`` and case builders) and every ``check_*`` function.
    They run in the trusted process; in the sandbox they are hidden from every exercise of the set, because a
    check that computes its expected values inline would hand them to a learner's function that runs it with
    recording stand-ins for ``expect_equal`` (a notebook cell that runs them there fails with "not available
    while grading", which is not reported)."""
    import importlib
    import inspect
    import re

    wanted: dict[str, set[str]] = {}
    for src in test_sources:
        for module, names in re.findall(r"from pagedkv\.grading\.lessons\.(l\d\d_\w+) import ([\w, ()\n]+)", src):
            wanted.setdefault(module, set()).update(re.findall(r"\w+", names))
    out: list[str] = []
    for name, imported in sorted(wanted.items()):
        module = importlib.import_module(f"pagedkv.grading.lessons.{name}")
        out += [f"{module.__name__}.{fn}" for fn, obj in vars(module).items()
                if (fn in imported or fn.startswith("check_")) and inspect.isfunction(obj)
                and obj.__module__ == module.__name__]
    return out


_UID_BASE = 61000
_UID_COUNT = 1000
_LOCK_DIR = Path(tempfile.gettempdir()) / "pagedkv-sandbox-uids"
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 0x4000, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_ADDR_NO_RANDOMIZE = 0x0040000


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ the library copy
def stub_symbols(package: Path, symbols: Iterable[str]) -> list[str]:
    """Rewrite, in the copy of the library at ``package`` (the ``pagedkv`` folder), the body of each named
    function or method to raise ``RuntimeError("... is not available while grading ...")``. Returns the names
    that were not found (a misspelt reference in a source notebook)."""
    by_file: dict[Path, list[tuple[str, list[str]]]] = {}
    missing: list[str] = []
    for symbol in symbols:
        parts = symbol.split(".")
        if parts[0] != "pagedkv":
            missing.append(symbol)
            continue
        found = False
        for cut in range(len(parts) - 1, 0, -1):
            rel = Path(*parts[1:cut]) if cut > 1 else None
            options = (package / "__init__.py",) if rel is None else (package / rel.with_suffix(".py"),
                                                                       package / rel / "__init__.py")
            for candidate in options:
                if candidate.is_file():
                    by_file.setdefault(candidate, []).append((symbol, parts[cut:]))
                    found = True
                    break
            if found:
                break
        if not found:
            missing.append(symbol)
    for path, wanted in by_file.items():
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        lines = source.splitlines(True)
        edits: list[tuple[int, int, str]] = []
        for symbol, qual in wanted:
            node = _find(tree, qual)
            if node is None:
                missing.append(symbol)
                continue
            first = node.body[0]
            indent = " " * first.col_offset
            text = (f"{indent}raise RuntimeError({symbol!r} + ' is not available while grading: the grader "
                    "removed it from the library the learner code runs against')\n")
            edits.append((first.lineno - 1, node.end_lineno or first.lineno, text))
        for start, end, text in sorted(edits, reverse=True):
            lines[start:end] = [text]
        path.write_text("".join(lines), encoding="utf-8")
    return missing


def _find(tree: ast.AST, qual: list[str]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    scope: list[ast.stmt] = list(getattr(tree, "body", []))
    for i, name in enumerate(qual):
        match = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                match = node
        if match is None:
            return None
        if i == len(qual) - 1:
            return match if isinstance(match, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        scope = list(match.body)
    return None


def _library_sources() -> tuple[Path, Path | None]:
    """The ``pagedkv`` package folder and the ``kernels`` folder (``pagedkv.kernels``) of this installation."""
    import pagedkv

    package = Path(pagedkv.__file__).resolve().parent
    kernels = package.parent / "kernels"
    return package, kernels if (kernels / "__init__.py").is_file() else None


def copy_library(dest: Path, symbols: Iterable[str]) -> list[str]:
    """``dest/pagedkv``: the library with ``symbols`` stubbed; returns the symbols not found."""
    package, kernels = _library_sources()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    shutil.copytree(package, dest / "pagedkv", ignore=ignore)
    if kernels is not None and not (dest / "pagedkv" / "kernels").exists():
        shutil.copytree(kernels, dest / "pagedkv" / "kernels", ignore=ignore)
    return stub_symbols(dest / "pagedkv", symbols)


_BOOT = """\
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                    and "editable" not in getattr(f, "__name__", "")]
sys.path[:] = [{site!r}] + [p for p in sys.path if p.startswith(sys.prefix) or not p.startswith({repo!r})]
from pagedkv.grading.sandbox_main import main
main()
"""


# ------------------------------------------------------------------------------------------ uids
def _uid_in_use(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(entry))
                        break
        except OSError:
            continue
    return pids


def _take_uid() -> tuple[int, int] | None:
    """A free sandbox uid and the file descriptor of its lock (held until the sandbox is gone)."""
    _LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    start = (os.getpid() * 7) % _UID_COUNT
    for k in range(_UID_COUNT):
        uid = _UID_BASE + (start + k) % _UID_COUNT
        fd = os.open(_LOCK_DIR / f"{uid}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _kill_uid(uid)  # leftovers of a grader that was killed outright
        return uid, fd
    return None


def _kill_uid(uid: int, rounds: int = 50) -> None:
    for _ in range(rounds):
        pids = _uid_in_use(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------ the process
def _hidden_paths(repo: Path) -> list[str]:
    """Top-level entries of the repository to cover, all but the one holding the running Python."""
    keep = Path(sys.prefix).resolve()
    out = []
    try:
        entries = sorted(repo.iterdir())
    except OSError:
        return out
    for p in entries:
        rp = p.resolve()
        if p.is_dir() and not p.is_symlink() and not (keep == rp or rp in keep.parents):
            out.append(str(p))
    return out


def _closed_ancestor(path: Path) -> Path | None:
    """The topmost folder above ``path`` that other users cannot enter (``/root`` for a pyenv Python)."""
    for parent in reversed(path.parents):
        with contextlib.suppress(OSError):
            if parent != Path("/") and not (os.stat(parent).st_mode & 0o001):
                return parent
    return None


def reopen_plan(keeps: Iterable[Path]) -> dict[Path, list[Path]]:
    """For each folder that other users cannot enter (the topmost one above a path in ``keeps``), the paths to
    put back inside it: ``/root`` for a pyenv Python, and the clone's own folder when it was made private (a
    ``mktemp -d`` folder is 0700), for the virtual environment."""
    plan: dict[Path, list[Path]] = {}
    for keep in dict.fromkeys(keeps):
        closed = _closed_ancestor(keep)
        if closed is not None:
            plan.setdefault(closed, []).append(keep)
    return plan


def _reopen(libc: ctypes.CDLL, stage: Path, closed: Path, keeps: list[Path]) -> None:
    """Cover ``closed`` (e.g. /root) with an empty tmpfs that others can enter, and put each of ``keeps`` (the
    Python installation, the virtual environment) back at its path: the sandbox user can run Python, and sees
    nothing else there."""
    staged = []
    for keep in keeps:
        at = stage / str(len(staged))
        at.mkdir(parents=True, exist_ok=True)
        if libc.mount(str(keep).encode(), str(at).encode(), None, _MS_BIND | _MS_REC, None) == 0:
            staged.append((keep, at))
    if not staged:
        return
    libc.mount(b"tmpfs", str(closed).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"size=64k,mode=755")
    for keep, at in staged:
        keep.mkdir(parents=True, exist_ok=True)
        libc.mount(str(at).encode(), str(keep).encode(), None, _MS_BIND | _MS_REC, None)
    libc.mount(b"none", str(closed).encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None)


def same_hashes() -> None:
    """Turn address-space randomisation off for this process and what it executes (``setarch -R``).

    Before Python 3.12, ``hash(None)`` is ``None``'s address, so the library's ``builtin_hash`` of a block
    without extra keys differs between two processes, and a check could not compare the learner's prefix-cache
    keys (made in the sandbox) with the reference's (made in the worker). Without randomisation, the same
    interpreter puts ``None`` at the same address in both. The worker and the sandbox use it; neither needs
    randomisation (the worker parses JSON, the sandbox runs arbitrary code anyway)."""
    libc = _libc()
    if libc is not None and sys.version_info < (3, 12):
        current = libc.personality(0xFFFFFFFF)
        if current != -1:
            libc.personality(current | _ADDR_NO_RANDOMIZE)


def _preexec(uid: int | None, memory: int, cpu_seconds: int, hide: list[str], stage: Path | None = None) -> None:
    """In the child, before exec: session, death with the parent, namespaces, limits, user."""
    os.setsid()
    same_hashes()
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        flags = _CLONE_NEWNS if os.geteuid() == 0 else _CLONE_NEWNS | _CLONE_NEWUSER
        outer_uid, outer_gid = os.geteuid(), os.getegid()
        if hide and libc.unshare(flags) == 0:
            if flags & _CLONE_NEWUSER:
                with contextlib.suppress(OSError):
                    Path("/proc/self/setgroups").write_text("deny")
                    Path("/proc/self/uid_map").write_text(f"{outer_uid} {outer_uid} 1")
                    Path("/proc/self/gid_map").write_text(f"{outer_gid} {outer_gid} 1")
            libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)
            for path in hide:
                libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, b"size=4k")
            if uid is not None and stage is not None:
                keeps = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
                for i, (closed, inside) in enumerate(reopen_plan(keeps).items()):
                    _reopen(libc, stage / str(i), closed, inside)
    limits = [(resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_FSIZE, 1 << 30)]
    if uid is not None:
        limits.append((resource.RLIMIT_NPROC, 256))
    for which, value in limits:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (value, value))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


_SUBREAPER_SET = False
_LIVE: list[Sandbox] = []  # started and not yet closed (the worker closes them all when it is stopped)


def close_all() -> None:
    """Close every sandbox this process started and has not closed."""
    for sandbox in list(_LIVE):
        sandbox.close()


def isolation_summary() -> str:
    """One line on what isolation this machine gives the sandbox (for the README and the test logs)."""
    if os.geteuid() == 0:
        return "root: a uid of its own per sandbox, the repository hidden in a mount namespace, rlimits, a session"
    return "not root: the grader's own user, the repository hidden where user namespaces allow, rlimits, a session"


@dataclass
class Sandbox:
    """One sandbox process; :meth:`start`, talk over ``fd_to``/``fd_from``, :meth:`close`."""

    references: list[str] = field(default_factory=list)
    memory: int = DEFAULT_MEMORY
    cpu_seconds: int = 600
    proc: subprocess.Popen | None = None
    root: Path | None = None
    uid: int | None = None
    missing: list[str] = field(default_factory=list)
    _lock_fd: int | None = None
    fd_to: int = -1
    fd_from: int = -1

    def start(self) -> None:
        global _SUBREAPER_SET
        self.root = Path(tempfile.mkdtemp(prefix="pagedkv-sandbox-"))
        site = self.root / "site"
        self.missing = copy_library(site, self.references)
        for sub in ("work", "home", "tmp"):
            (self.root / sub).mkdir()
        package, _ = _library_sources()
        repo = package.parent
        (site / "_pagedkv_sandbox_boot.py").write_text(_BOOT.format(site=str(site), repo=str(repo)))
        if os.geteuid() == 0:
            taken = _take_uid()
            if taken is not None:
                self.uid, self._lock_fd = taken
                for dirpath, _dirnames, filenames in os.walk(self.root):
                    os.chown(dirpath, self.uid, self.uid)
                    for name in filenames:
                        os.chown(os.path.join(dirpath, name), self.uid, self.uid)
        elif not _SUBREAPER_SET:
            libc = _libc()
            if libc is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
                _SUBREAPER_SET = True
        os.chmod(self.root, 0o700)
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"), "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
            "TRITON_CACHE_DIR": str(self.root / "tmp" / "triton"), "MPLCONFIGDIR": str(self.root / "tmp" / "mpl"),
            "LANG": "C.UTF-8",
        }
        for key in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PAGEDKV_DEVICE", "PAGEDKV_SANDBOX_PROFILE"):
            if key in os.environ:
                env[key] = os.environ[key]
        hide = _hidden_paths(repo)
        stage = self.root / "python"
        log = open(self.root / "tmp" / "learner-output.log", "wb")  # noqa: SIM115 - closed below
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-s", "-X", "faulthandler", str(site / "_pagedkv_sandbox_boot.py"),
                 str(to_r), str(from_w)],
                cwd=self.root / "work", env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(to_r, from_w), close_fds=True,
                preexec_fn=lambda: _preexec(self.uid, self.memory, self.cpu_seconds, hide, stage),  # noqa: PLW1509
            )
        finally:
            log.close()
            os.close(to_r)
            os.close(from_w)
        self.fd_to, self.fd_from = to_w, from_r
        _LIVE.append(self)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def interrupt(self) -> None:
        """KeyboardInterrupt in the learner's code (the sandbox's main thread)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self.proc.pid, signal.SIGINT)

    def exit_description(self) -> str:
        if self.proc is None:
            return "never started"
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            why = {"SIGKILL": " (killed: out of memory or CPU time?)", "SIGXCPU": " (its CPU-time limit)",
                   "SIGSEGV": " (a segmentation fault)"}.get(name, "")
            return f"ended by {name}{why}"
        return f"exited with status {code}"

    def close(self) -> None:
        """Kill the sandbox, its session, and every process it left behind; remove its folder."""
        if self in _LIVE:
            _LIVE.remove(self)
        for fd in (self.fd_to, self.fd_from):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd_to = self.fd_from = -1
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.uid is not None:
            _kill_uid(self.uid)
        elif _SUBREAPER_SET:
            _kill_orphans()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kill_orphans() -> None:
    """Without root: processes reparented to this one (it is a subreaper) are a sandbox's leftovers."""
    me = os.getpid()
    for _ in range(20):
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry}/status").read_text(errors="replace")
            except OSError:
                continue
            m = re.search(r"^PPid:\s+(\d+)", text, re.M)
            if m and int(m.group(1)) == me:
                found.append(int(entry))
        if not found:
            return
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.02)
