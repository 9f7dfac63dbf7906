"""Start and end the sandbox that runs a learner's code (:mod:`pagedkv.grading.sandbox_main`).

Each sandbox is a bubblewrap (``bwrap``) container, made fresh for one exercise of one notebook:

- **Namespaces of its own**: user, pid, network, ipc, uts, mount (and cgroup where the kernel has it). Its
  ``/proc`` shows only its own processes (no grader's command line, no other learner's process); it has no
  network (``socket.create_connection`` fails); the learner's Python is its pid 1, so when that ends, every
  process it started ends too.
- **A filesystem of four things**: the Python environment (``/usr``, the interpreter's installation, the
  virtual environment; read-only), the throwaway copy of the library with the exercise's reference symbols
  rewritten to raise "not available while grading" (:func:`copy_library`; read-only, at ``/sandbox/site``),
  the one notebook being graded (read-only, in the home folder), and private tmpfs ``/tmp``, ``/var/tmp``,
  ``/dev/shm`` and home of bounded size (:attr:`Limits.tmpfs`), gone when the sandbox ends. Nothing else of the
  host: no checkout, no class folder, no other clone of the repository.
- **Limits for the whole sandbox**: a cgroup of its own (v2, else v1's ``memory`` and ``pids``) bounds the
  memory and the processes of everything in it together, where one can be made (as root in a container);
  rlimits (data, CPU seconds, file size, processes, no core files) apply in every case, and the address space
  is an rlimit where there is no cgroup (a CUDA context reserves far more than it uses). Where the
  ``cpu`` controller can be had too (v2's ``cpu``, v1's ``cpu`` and ``cpuacct``), the cgroup caps the sandbox at
  :attr:`Limits.cpus` CPUs and the scheduler shares the machine between sandboxes, not between their processes
  (a learner's 150 busy children get one sandbox's share, not 150 times another learner's), and a test case's
  CPU budget counts the CPU time of every process in the sandbox (:meth:`Sandbox.cpu_seconds`).
- **Nothing left behind**: the sandbox's folder and cgroups are named after the worker that made them (its pid
  and start time); a worker killed before it could remove them (the kernel's OOM killer, SIGKILL) has them
  removed by the next sandbox started on the machine (:func:`sweep_stale`), and ``pagedkv grade`` keeps the
  folders in the notebook's own temporary folder, which it removes.
- **No address randomisation** (in the worker too; :func:`same_hashes`).

Where bubblewrap cannot run (:func:`bwrap_problem` says why), ``pagedkv grade --class`` refuses; grading your
own notebook falls back to a plain process with the stubbed copy and the rlimits, and says so once.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pagedkv.grading.limits import Limits

__all__ = ["INSTALL_HINT", "Cgroup", "Sandbox", "bwrap_problem", "close_all", "copy_library", "expand_classes",
           "hidden_message", "isolation_summary", "lesson_checks", "stub_symbols", "sweep_stale"]

def expand_classes(symbols: Iterable[str]) -> list[str]:
    """``symbols`` with each class among them replaced by the functions its own body defines
    (``pagedkv.kv_cache_utils.FreeKVCacheBlockQueue`` -> ``...FreeKVCacheBlockQueue.popleft``, ...; not its
    properties, static or class methods): a set's ``reference:`` may name a whole class when the exercise is the
    whole class. Read from the library's source, not imported (a set's worker imports no more than its checks)."""
    package, kernels = _library_sources()
    out: list[str] = []
    for symbol in symbols:
        found = _source_of(package, symbol.split("."), kernels)
        node = None
        if found is not None and len(found[1]) == 1:
            tree = _parsed(found[0].read_text(encoding="utf-8"))
            node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == found[1][0]), None)
        if node is None:
            out.append(symbol)  # a function, a method (module.Class.method), or a misspelt name (stub_symbols says)
            continue
        plain = ("property", "staticmethod", "classmethod", "cached_property")
        out += [f"{symbol}.{f.name}" for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                and not any(ast.unparse(d).split(".")[-1] in (*plain, "setter", "getter", "deleter")
                            for d in f.decorator_list)]
    return list(dict.fromkeys(out))


@functools.lru_cache(maxsize=256)
def _parsed(source: str) -> ast.Module:
    """``ast.parse(source)``, once per text in a worker: its sandboxes' library copies stub the same files again
    (read-only use: the callers change no node)."""
    return ast.parse(source)


def _source_of(package: Path, parts: list[str], kernels: Path | None = None) -> tuple[Path, list[str]] | None:
    """The file of the library that defines the dotted ``parts`` (``pagedkv``, modules..., then names), and the
    names left (``["KVCacheManager", "allocate_slots"]``): the longest module path that is a file of ``package``
    (``pagedkv.kernels.*`` in ``kernels`` when the kernels live beside the package), or None."""
    if parts[0] != "pagedkv":
        return None
    for cut in range(len(parts) - 1, 0, -1):
        root, rel_parts = package, parts[1:cut]
        if kernels is not None and rel_parts[:1] == ["kernels"]:
            root, rel_parts = kernels, rel_parts[1:]
        rel = Path(*rel_parts) if rel_parts else None
        options = [root / "__init__.py"] if rel is None else [root / rel.with_suffix(".py"), root / rel / "__init__.py"]
        for candidate in options:
            if candidate.is_file():
                return candidate, parts[cut:]
    return None


def lesson_checks(test_sources: Iterable[str]) -> list[str]:
    """The checks of the lesson modules (``pagedkv.grading.lessons.lNN_*``): in the modules these test files use,
    every function the tests import from them (``check_*``, set 04's ``grade_*`` and case builders) and every
    ``check_*``; in every other lesson module, each ``check_*``, ``expected_*`` and ``reference_*``; and the
    private functions of the module that only those call (``_allocate_slots_lifecycle``, the whole of
    ``check_allocate_slots_random``, lesson 5's ``_page_mistakes``), found through the names each body uses. They
    run in the trusted process; in the sandbox they are hidden from every exercise, because a check that computes
    its expected values inline would hand them to a learner's function that runs it with recording stand-ins for
    ``expect_equal``, and another lesson's would hand over its answer (set 10's page per rank from lesson 5's
    mistakes helper: a red-team pass). A notebook cell that runs them there fails with "not available while
    grading", which is not reported. A private function that the module's public helpers call too
    (``PluggableScheduler``, which notebook cells use) stays. Read from the modules' source, not imported."""
    import re

    folder = Path(__file__).resolve().parent / "lessons"
    imported: dict[str, set[str]] = {}
    for src in test_sources:
        for module, names in re.findall(r"from pagedkv\.grading\.lessons\.(l\d\d_\w+) import ([\w, ()\n]+)", src):
            imported.setdefault(module, set()).update(re.findall(r"\w+", names))
    out: list[str] = []
    for path in sorted(folder.glob("l[0-9][0-9]_*.py")):
        tree = _parsed(path.read_text(encoding="utf-8"))
        own = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        # the names each body uses (not its decorators: with_earlier_answers(...) runs in the sandbox too)
        uses = {name: {x.id for stmt in node.body for x in ast.walk(stmt) if isinstance(x, ast.Name)} & set(own)
                for name, node in own.items()}
        # another set's module: its answers too (this set's reference_* stand in for the learner's earlier
        # answers in the sandbox, lessons.depends; another set's are nobody's there)
        roots = ("check_",) if path.stem in imported else ("check_", "expected_", "reference_")
        wanted = imported.get(path.stem, set())
        checks = {name for name, node in own.items() if not isinstance(node, ast.ClassDef)
                  and (name in wanted or name.startswith(roots))}

        def reached(roots: set[str], own: dict = own, uses: dict = uses) -> set[str]:
            seen, todo = set(), list(roots)
            while todo:
                for used in uses[todo.pop()]:
                    if used.startswith("_") and used not in seen and not isinstance(own[used], ast.ClassDef):
                        seen.add(used)
                        todo.append(used)
            return seen

        helpers = reached(checks) - reached(set(own) - checks - {n for n in own if n.startswith("_")})
        out += [f"pagedkv.grading.lessons.{path.stem}.{fn}" for fn in own if fn in checks or fn in helpers]
    return out


_ADDR_NO_RANDOMIZE = 0x0040000


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# ------------------------------------------------------------------------------------------ the library copy
def stub_symbols(package: Path, symbols: Iterable[str]) -> list[str]:
    """Rewrite, in the copy of the library at ``package`` (the ``pagedkv`` folder), the body of each named
    function or method to raise ``RuntimeError`` with :func:`hidden_message` ("your code calls the library's X,
    which is not available while grading ... Write it yourself"). A symbol that is a path (``pagedkv/engine/
    cpu_attention.c``: a compiled op's source, which the learner could otherwise build and call) leaves an empty
    file in its place. Returns the names that were not found (a misspelt reference in a source notebook)."""
    by_file: dict[Path, list[tuple[str, list[str]]]] = {}
    missing: list[str] = []
    for symbol in symbols:
        if "/" in symbol:
            target = package.parent / symbol
            if symbol.startswith("pagedkv/") and ".." not in symbol and target.is_file():
                target.write_text(f"/* {symbol}: hidden while grading */\n", encoding="utf-8")
            else:
                missing.append(symbol)
            continue
        found = _source_of(package, symbol.split("."))
        if found is None:
            missing.append(symbol)
        else:
            by_file.setdefault(found[0], []).append((symbol, found[1]))
    for path, wanted in by_file.items():
        source = path.read_text(encoding="utf-8")
        tree = _parsed(source)
        lines = source.splitlines(True)
        edits: list[tuple[int, int, str]] = []
        for symbol, qual in wanted:
            node = _find(tree, qual)
            if node is None:
                missing.append(symbol)
                continue
            first = node.body[0]
            indent = " " * first.col_offset
            text = f"{indent}raise RuntimeError({hidden_message(symbol, '.'.join(qual))!r})\n"
            edits.append((first.lineno - 1, node.end_lineno or first.lineno, text))
        for start, end, text in sorted(edits, reverse=True):
            lines[start:end] = [text]
        path.write_text("".join(lines), encoding="utf-8")
    return missing


def hidden_message(symbol: str, name: str) -> str:
    """What a stubbed symbol raises, the one place the learner is told that an answer is the library's: ``name``
    is how the learner's code reaches it (``BlockPool.get_new_blocks``), ``symbol`` its dotted path."""
    return (f"your code calls the library's {name} ({symbol}), which is not available while grading: it computes "
            "(or checks) this exercise's answer, so the grader hides it from the learner's code. Write it yourself")


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


# ------------------------------------------------------------------------------------------ bubblewrap
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; ./lab setup does it where it can)"
_SANDBOX_UID = 1000  # the learner's uid inside the sandbox's user namespace
_SITE = "/sandbox/site"  # where the stubbed library copy is mounted, read-only
_HOME = "/home/learner"  # the sandbox's working folder: a private tmpfs holding the one notebook
_PROBE: dict[str, str | None] = {}


def _system_mounts() -> list[str]:
    """Read-only binds of the system's programs and libraries (``/usr`` and what ``/bin``, ``/lib`` ... are on
    this host: symlinks into ``/usr`` on a merged-``/usr`` system), and of the Python environment: the
    interpreter's installation and the virtual environment, wherever they are (``/root/.pyenv/...``,
    ``.venv`` inside the checkout). The base installation's own ``site-packages`` is covered by an empty
    tmpfs when a virtual environment is in use: it is not on the sandbox's path, and it is one more place a
    copy of the library could sit."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    base, prefix = Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()
    for root in dict.fromkeys((base, prefix)):
        if not str(root).startswith("/usr/"):
            args += ["--ro-bind", str(root), str(root)]
    if prefix != base:
        for site in sorted(base.glob("lib/python3*/site-packages")):
            args += ["--tmpfs", str(site), "--remount-ro", str(site)]
    return args


def bwrap_command(site: Path, notebook: Path | None, limits: Limits, info_fd: int) -> list[str]:
    """The ``bwrap`` command line for one sandbox: fresh user, pid, network, ipc, uts and cgroup namespaces;
    a filesystem of the Python environment (read-only), the stubbed library copy (read-only), the one notebook
    (read-only) and private tmpfs ``/tmp``, ``/var/tmp``, ``/dev/shm`` and home of ``limits.tmpfs`` bytes each;
    its own ``/proc`` (only the sandbox's processes) and a minimal ``/dev``. The learner's Python is the
    namespace's pid 1 (``--as-pid-1``): when it ends, the kernel ends every process left in the sandbox."""
    size = str(int(limits.tmpfs))
    args = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--as-pid-1", "--cap-drop", "ALL",
            "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID), "--hostname", "sandbox",
            "--info-fd", str(info_fd), "--proc", "/proc", "--dev", "/dev"]
    for tmp in ("/tmp", "/var/tmp", "/dev/shm", _HOME):
        args += ["--size", size, "--tmpfs", tmp]
    # The Python environment after the private tmpfs: a checkout or virtual environment under /tmp (a clone in
    # a temporary folder) is bound on top of the sandbox's own /tmp instead of hidden by it.
    args += _system_mounts()
    args += ["--ro-bind", str(site), _SITE]
    if notebook is not None:
        args += ["--ro-bind", str(notebook), f"{_HOME}/{notebook.name}"]
    return args + ["--chdir", _HOME, "--"]


def bwrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox on this machine (not installed, or the kernel refuses it the namespaces),
    or None when it can; found once per process by starting a sandbox that runs ``true``."""
    if "answer" not in _PROBE:
        if shutil.which("bwrap") is None:
            _PROBE["answer"] = f"bubblewrap (bwrap) is not installed: {INSTALL_HINT}"
        else:
            r, w = os.pipe()
            try:
                cmd = bwrap_command(Path(sys.prefix), None, Limits(), w)
                proc = subprocess.run([*cmd, sys.executable, "-c", "pass"], capture_output=True, text=True,
                                      timeout=60, pass_fds=(w,), check=False)
                why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
                _PROBE["answer"] = None if proc.returncode == 0 else (
                    f"bubblewrap cannot make its namespaces on this machine ({why}); in a container, allow user "
                    "namespaces (Docker: --security-opt seccomp=unconfined, or run it with --privileged)")
            except (OSError, subprocess.TimeoutExpired) as exc:
                _PROBE["answer"] = f"bubblewrap did not start ({exc})"
            finally:
                os.close(r)
                os.close(w)
    return _PROBE["answer"]


# ------------------------------------------------------------------------------------------ cgroups
_PREFIX = "pagedkv-sandbox-"
_CPU_PERIOD = 100_000  # microseconds: the period of a cgroup's CPU quota


def _start_time(pid: int | str) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot: ``/proc/PID/stat``'s 22nd field), which with
    the pid names one process for good; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError, ValueError):
        return None


def _owner_tag() -> str:
    """``PID-STARTTIME`` of this process: what the names of its sandboxes' folders and cgroups begin with."""
    return f"{os.getpid()}-{_start_time('self') or 0}"


def _owner_gone(name: str) -> bool:
    """Whether the process that made the folder or cgroup ``name`` (``pagedkv-sandbox-PID-START-...``; before
    these names, ``pagedkv-sandbox-PID-ID`` for a cgroup) has ended."""
    parts = name[len(_PREFIX):].split("-")
    if not name.startswith(_PREFIX) or len(parts) < 2 or not parts[0].isdigit():
        return False
    start = _start_time(parts[0])
    return start is None or len(parts) >= 3 and parts[1].isdigit() and start != parts[1]


class Cgroup:
    """A cgroup of its own for one sandbox, bounding the memory and the number of processes of everything in
    it together: cgroup v2 (``memory.max``, ``pids.max``) where this process's cgroup lets it make a child with
    both controllers, else cgroup v1's ``memory`` and ``pids`` hierarchies (as root in a container). ``paths``
    is empty where neither can be made; the sandbox then relies on rlimits.

    Where it can, it also caps the CPU (v2: ``cpu.max``; v1: the ``cpu`` hierarchy's ``cpu.cfs_quota_us``) at
    ``limits.cpus`` CPUs, so that the scheduler shares the machine between sandboxes (each a group of the same
    weight) rather than between processes, and reads the CPU time of the whole sandbox (v2: ``cpu.stat``'s
    ``usage_usec``, there even without the ``cpu`` controller; v1: ``cpuacct.usage``): :meth:`cpu_seconds`."""

    def __init__(self, limits: Limits) -> None:
        self.paths: list[Path] = []
        self.usage: Path | None = None  # the file holding the whole cgroup's CPU time, where there is one
        self.cpu_group = False  # a group of its own for the CPU scheduler (the cpu controller)
        self.cpu_capped = False  # ... with a quota of limits.cpus CPUs
        name = f"{_PREFIX}{_owner_tag()}-{id(self):x}"
        with contextlib.suppress(OSError):
            self._make_v2(name, limits) or self._make_v1(name, limits)

    @staticmethod
    def _own(controller: str) -> str | None:
        """This process's cgroup in the hierarchy of ``controller`` (v1: ``cpu`` is found in ``cpu,cpuacct``),
        or in the v2 hierarchy for ``""``."""
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, names, path = line.split(":", 2)
                if (controller in names.split(",")) if controller else names == "":
                    return path
        return None

    @classmethod
    def parents(cls) -> list[Path]:
        """The folders in which this process makes its sandboxes' cgroups (v2's and each v1 hierarchy's)."""
        out = []
        own = cls._own("")
        for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            if own is not None and (mount / "cgroup.controllers").is_file():
                out.append(mount / own.lstrip("/"))
        for controller in ("memory", "pids", "cpu", "cpuacct"):
            path = cls._own(controller)
            if path is not None:
                out.append(Path("/sys/fs/cgroup") / controller / path.lstrip("/"))
        return list(dict.fromkeys(out))

    def cpu_seconds(self) -> float | None:
        """CPU seconds used by every process of the cgroup so far (None where it cannot be read)."""
        if self.usage is None:
            return None
        try:
            text = self.usage.read_text()
            if self.usage.name == "cpu.stat":
                return next(int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("usage_usec ")) / 1e6
            return int(text) / 1e9
        except (OSError, ValueError, StopIteration, IndexError):
            return None

    def _try(self, path: Path, settings: dict[str, str]) -> bool:
        try:
            path.mkdir()
        except OSError:
            return False
        try:
            for key, value in settings.items():
                (path / key).write_text(value)
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return False
        self.paths.append(path)
        return True

    def _make_v2(self, name: str, limits: Limits) -> bool:
        own = self._own("")
        for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            if own is None or not (mount / "cgroup.controllers").is_file():
                continue
            parent = mount / own.lstrip("/")
            with contextlib.suppress(OSError):
                enabled = (parent / "cgroup.subtree_control").read_text().split()
                if {"memory", "pids"} <= set(enabled):
                    if not self._try(parent / name, {"memory.max": str(limits.memory), "memory.swap.max": "0",
                                                     "pids.max": str(limits.processes)}):
                        return False
                    if "cpu" in enabled:  # a group of its own already: the cap is on top of that
                        self.cpu_group = True
                        self.cpu_capped = self._cap_cpu(parent / name, limits)
                    self.usage = parent / name / "cpu.stat"
                    return True
        return False

    @staticmethod
    def _cap_cpu(path: Path, limits: Limits) -> bool:
        """Cap the cgroup at ``path`` at ``limits.cpus`` CPUs; False where it cannot be (v1 refuses a quota over
        its parent's: the sandbox is then a group of its own without a cap of its own, which is what shares
        the CPU fairly; the parent's cap holds)."""
        quota = int(limits.cpus * _CPU_PERIOD)
        try:
            if (path / "cpu.max").is_file():
                (path / "cpu.max").write_text(f"{quota} {_CPU_PERIOD}")
            else:
                (path / "cpu.cfs_period_us").write_text(str(_CPU_PERIOD))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError:
            return False
        return True

    def _make_v1(self, name: str, limits: Limits) -> bool:
        memory, pids = self._own("memory"), self._own("pids")
        if memory is None or pids is None:
            return False
        mem_dir = Path("/sys/fs/cgroup/memory") / memory.lstrip("/") / name
        pid_dir = Path("/sys/fs/cgroup/pids") / pids.lstrip("/") / name
        settings = {"memory.limit_in_bytes": str(limits.memory)}
        if (mem_dir.parent / "memory.memsw.limit_in_bytes").exists():
            settings["memory.memsw.limit_in_bytes"] = str(limits.memory)
        if not (self._try(mem_dir, settings) and self._try(pid_dir, {"pids.max": str(limits.processes)})):
            self.close()
            return False
        cpu, acct = self._own("cpu"), self._own("cpuacct")  # optional: memory and processes are bounded anyway
        if cpu is not None:
            cpu_dir = Path("/sys/fs/cgroup/cpu") / cpu.lstrip("/") / name
            self.cpu_group = self._try(cpu_dir, {})
            self.cpu_capped = self.cpu_group and self._cap_cpu(cpu_dir, limits)
        if acct is not None:
            acct_dir = Path("/sys/fs/cgroup/cpuacct") / acct.lstrip("/") / name
            if (acct_dir / "cpuacct.usage").is_file() or self._try(acct_dir, {}):  # cpu,cpuacct: the same one
                self.usage = acct_dir / "cpuacct.usage"
        return True

    def join(self) -> None:
        """Put the calling process in the cgroup (in the child, before it executes ``bwrap``)."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        """Kill every process left in the cgroup and remove it."""
        _remove_cgroups(self.paths)
        self.paths = []
        self.usage = None


def _remove_cgroups(paths: Iterable[Path], seconds: float = 10.0) -> None:
    """Kill every process in each cgroup of ``paths`` and remove it, waiting up to ``seconds`` for the processes
    to be gone (many busy ones in a throttled group take a while to exit; a cgroup with one left cannot be
    removed)."""
    paths = list(paths)
    end = time.monotonic() + seconds
    left = list(paths)
    while left:
        for path in list(left):
            try:
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                pids = []
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if not pids:
                with contextlib.suppress(OSError):
                    path.rmdir()
                if not path.exists():
                    left.remove(path)
        if not left or time.monotonic() > end:
            break
        time.sleep(0.02)


def sweep_stale() -> list[Path]:
    """Remove the sandbox folders (in the temporary folder) and cgroups that a process which has ended left
    behind: a worker killed by SIGKILL or the kernel's OOM killer cannot remove its own. Only those whose
    maker (the pid and start time in their names) is gone are touched; returns them."""
    found: list[Path] = []
    with contextlib.suppress(OSError):
        for parent in Cgroup.parents():
            found += [p for p in parent.glob(f"{_PREFIX}*") if p.is_dir() and _owner_gone(p.name)]
    _remove_cgroups(found)
    with contextlib.suppress(OSError):
        for folder in Path(tempfile.gettempdir()).glob(f"{_PREFIX}*"):
            if _owner_gone(folder.name) and folder.is_dir() and not folder.is_symlink():
                shutil.rmtree(folder, ignore_errors=True)
                found.append(folder)
    return found


def isolation_summary() -> str:
    """One line on what isolation this machine gives the sandbox (for ``pagedkv grade`` and the tests' logs)."""
    problem = bwrap_problem()
    if problem is not None:
        return f"no sandbox: {problem}; the learner's code runs as a plain process with rlimits"
    group = Cgroup(Limits())
    bound = ("a cgroup bounds memory and processes of the whole sandbox" if group.paths
             else "rlimits bound each process's address space and the uid's processes (no cgroup can be made)")
    if group.paths:
        bound += (f", and its CPU at {Limits().cpus:g} CPU (a group of its own: sandboxes share the CPU fairly)"
                  if group.cpu_capped else ", and makes it a group of its own for the CPU scheduler"
                  if group.cpu_group else "")
    group.close()
    return f"bubblewrap: fresh user, pid, network, ipc and mount namespaces; {bound}"


def _preexec(limits: Limits, cgroup: Cgroup | None) -> None:
    """In the child, before it executes ``bwrap`` (or, with no sandbox, Python): a session of its own, no
    address randomisation, death with the grader, the cgroup, and rlimits (data, CPU time, file size, processes,
    no core files; the address space where there is no cgroup)."""
    os.setsid()
    # Python installs its KeyboardInterrupt handler only where SIGINT is not ignored at start, and a grader
    # started in the background (`cmd &`, nohup) passes an ignored SIGINT on: a looping cell could not be
    # interrupted. The cell limit depends on that interrupt, so the sandbox always starts with the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    same_hashes()
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if cgroup is not None:
        cgroup.join()
    # RLIMIT_DATA (what allocations take): the worker's own (Limits.worker_memory) is inherited; the sandbox has
    # the sandbox's. RLIMIT_AS only where no cgroup bounds the memory: a CUDA context reserves tens of GiB of
    # address space that it never fills, so an address-space limit would stop the sandbox from using a GPU.
    rlimits = [(resource.RLIMIT_DATA, limits.memory), (resource.RLIMIT_CPU, limits.cpu_seconds),
               (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, limits.tmpfs),
               (resource.RLIMIT_NPROC, limits.processes)]
    if cgroup is None:
        rlimits.append((resource.RLIMIT_AS, limits.memory))
    for which, value in rlimits:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (value, value))


_PR_SET_PDEATHSIG = 1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_LIVE: list[Sandbox] = []  # started and not yet closed (the worker closes them all when it is stopped)
_FALLBACK_SAID: list[bool] = []


def close_all() -> None:
    """Close every sandbox this process started and has not closed."""
    for sandbox in list(_LIVE):
        sandbox.close()


@dataclass
class Sandbox:
    """One sandbox process; :meth:`start`, talk over ``fd_to``/``fd_from``, :meth:`close`.

    ``require`` (``pagedkv grade --class``): refuse to start without bubblewrap, rather than fall back to a
    plain process (self-study's fallback, which keeps the stubbed copy and the rlimits but not the namespaces).
    """

    references: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    notebook: Path | None = None
    require: bool = False
    proc: subprocess.Popen | None = None
    root: Path | None = None
    missing: list[str] = field(default_factory=list)
    sandboxed: bool = False
    fd_to: int = -1
    fd_from: int = -1
    _cgroup: Cgroup | None = None
    _pid: int | None = None  # the learner's Python (pid 1 of the sandbox), as this side numbers it

    def start(self) -> None:
        problem = bwrap_problem()
        if problem is not None and self.require:
            raise RuntimeError(f"cannot grade in a sandbox: {problem}")
        self.sandboxed = problem is None
        sweep_stale()
        self.root = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{_owner_tag()}-"))
        site = self.root / "site"
        self.missing = copy_library(site, self.references)
        package, _ = _library_sources()
        inside = _SITE if self.sandboxed else str(site)
        (site / "_pagedkv_sandbox_boot.py").write_text(_BOOT.format(site=inside, repo=str(package.parent)))
        tmp = self.root / "tmp"
        tmp.mkdir()
        home = _HOME if self.sandboxed else str(tmp)
        scratch = "/tmp" if self.sandboxed else str(tmp)
        env = {
            "PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": scratch, "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "LOGNAME": "learner",
            "USER": "learner", "TRITON_CACHE_DIR": f"{scratch}/triton", "MPLCONFIGDIR": f"{scratch}/mpl",
            "LANG": "C.UTF-8",
        }
        for key in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PAGEDKV_DEVICE", "PAGEDKV_SANDBOX_PROFILE"):
            if key in os.environ:
                env[key] = os.environ[key]
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        info_r, info_w = os.pipe()
        python = [sys.executable, "-s", "-X", "faulthandler", f"{inside}/_pagedkv_sandbox_boot.py", str(to_r),
                  str(from_w)]
        if self.sandboxed:
            self._cgroup = Cgroup(self.limits)
            cmd = bwrap_command(site, self.notebook, self.limits, info_w) + python
        else:
            cmd = python
        log = open(tmp / "learner-output.log", "wb")  # noqa: SIM115 - closed below
        try:
            self.proc = subprocess.Popen(
                cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(to_r, from_w, info_w), close_fds=True,
                preexec_fn=lambda: _preexec(self.limits, self._cgroup),  # noqa: PLW1509
            )
        finally:
            log.close()
            for fd in (to_r, from_w, info_w):
                os.close(fd)
        self.fd_to, self.fd_from = to_w, from_r
        os.set_blocking(to_w, False)  # a request must be taken within a deadline (plain.write_message)
        _LIVE.append(self)
        self._pid = self._read_child_pid(info_r) if self.sandboxed else self.proc.pid
        os.close(info_r)

    def _read_child_pid(self, fd: int) -> int | None:
        """bwrap's ``--info-fd`` JSON: the host's pid of the sandbox's pid 1 (the learner's Python)."""
        data = b""
        while b"}" not in data:
            ready, _, _ = select.select([fd], [], [], 60)
            chunk = os.read(fd, 4096) if ready else b""
            if not chunk:
                break
            data += chunk
        with contextlib.suppress(ValueError, TypeError):
            return int(json.loads(data.decode())["child-pid"])
        return None

    def cpu_seconds(self) -> float:
        """CPU seconds the sandbox has used: every process in it (its cgroup's CPU time, where it has one that
        counts it: children it never waits for count too), else the learner's Python (user + system, its threads
        and the children it waited for, from ``/proc``); 0 once it has ended."""
        used = self._cgroup.cpu_seconds() if self._cgroup is not None else None
        if used is not None:
            return used
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return sum(int(x) for x in fields[11:15]) / _CLOCK_TICKS
        except (OSError, ValueError, IndexError):
            return 0.0

    @property
    def pid(self) -> int:
        return self._pid if self._pid is not None else -1

    def interrupt(self) -> None:
        """KeyboardInterrupt in the learner's code (the sandbox's main thread)."""
        if self.proc is not None and self.proc.poll() is None and self._pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._pid, signal.SIGINT)

    def exit_description(self) -> str:
        if self.proc is None:
            return "never started"
        code = self.proc.poll()
        if code is None:
            return "still running"
        if code < 0 or code > 128:  # bwrap passes its child's "killed by signal N" on as status 128 + N
            number = -code if code < 0 else code - 128
            try:
                name = signal.Signals(number).name
            except ValueError:
                name = f"signal {number}"
            why = {"SIGKILL": " (killed: out of memory or CPU time?)", "SIGXCPU": " (its CPU-time limit)",
                   "SIGSEGV": " (a segmentation fault)"}.get(name, "")
            return f"ended by {name}{why}"
        return f"exited with status {code}"

    def close(self) -> None:
        """Kill the sandbox and every process in it (its pid namespace ends with its pid 1; the cgroup, where
        there is one, is emptied too); remove its folder. Its tmpfs go with its mount namespace."""
        if self in _LIVE:
            _LIVE.remove(self)
        for fd in (self.fd_to, self.fd_from):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd_to = self.fd_from = -1
        if self._pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self._cgroup is not None:
            self._cgroup.close()
            self._cgroup = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
