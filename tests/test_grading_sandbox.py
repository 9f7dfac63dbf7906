"""The grading sandbox against what a hostile learner's cell tries (issue 19's table), one sandbox per test.

Each test starts a :class:`~pagedkv.grading.sandbox.Sandbox` (bubblewrap: fresh namespaces, the Python
environment, the stubbed library copy, the one notebook, private tmpfs), runs a cell in it as the grader runs a
notebook's cells, and reads what the cell found out through the names it left behind. None imports torch, so a
sandbox costs well under a second. The tests need bubblewrap; where it cannot run they are skipped, and
``pagedkv grade --class`` refuses (tested here too, by hiding ``bwrap`` from the command's ``PATH``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.grading import classroom, grade
from pagedkv.grading.client import Client
from pagedkv.grading.limits import Limits
from pagedkv.grading.output import escape_controls, write_replacing
from pagedkv.grading.sandbox import Cgroup, Sandbox, bwrap_problem

ROOT = Path(__file__).resolve().parents[1]
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no sandbox here: {bwrap_problem()}")


def _run(cell: str, names: list[str], *, limits: Limits | None = None, notebook: Path | None = None,
         references: list[str] | None = None) -> dict:
    """Run ``cell`` in a fresh sandbox; the values of ``names`` it defined (plain data)."""
    sandbox = Sandbox(references=references or [], limits=limits or Limits(), notebook=notebook, require=True)
    sandbox.start()
    try:
        client = Client(sandbox, references or [])
        result = client.exec_cell(1, cell, 120)
        assert not result.get("error") and not result.get("timed_out"), result
        return client.names(names)
    finally:
        sandbox.close()


@needs_bwrap
def test_proc_shows_no_grader_and_the_filesystem_no_other_notebook(tmp_path):
    """Route: read the grader's command line from /proc, glob the --class folder, take another learner's code."""
    klass = tmp_path / "class"
    (klass / "alice").mkdir(parents=True)
    (klass / "alice" / "01_fragmentation.ipynb").write_text("{}")
    mine = tmp_path / "mine" / "01_fragmentation.ipynb"
    mine.parent.mkdir()
    mine.write_text("{}")
    cell = (
        "import os\n"
        "cmdlines = []\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try:\n"
        "            cmdlines.append(open(f'/proc/{p}/cmdline', 'rb').read().decode(errors='replace'))\n"
        "        except OSError:\n"
        "            pass\n"
        "top = sorted(os.listdir('/'))\n"
        "notebooks = []\n"
        "for d, subs, files in os.walk('/'):\n"
        "    subs[:] = [s for s in subs if s not in ('usr', 'proc', '.venv', '.pyenv', 'site-packages')]\n"
        "    notebooks += sorted(os.path.join(d, f) for f in files if f.endswith('.ipynb'))\n"
        f"class_visible = os.path.exists({str(klass)!r})\n"
    )
    got = _run(cell, ["cmdlines", "notebooks", "class_visible", "top"], notebook=mine)
    assert got["class_visible"] is False
    # The Python environment is bound where it lives (``/root/.pyenv``, a checkout's ``.venv`` under ``/work``
    # or ``/check``): its top folder is the one the grader's machine adds to the sandbox's own.
    env_tops = {Path(p).resolve().parts[1] for p in (sys.prefix, sys.base_prefix)}
    assert set(got["top"]) <= {"bin", "dev", "home", "lib", "lib32", "lib64", "libx32", "proc", "sandbox",
                               "sbin", "tmp", "usr", "var"} | env_tops, got["top"]
    assert got["notebooks"] == ["/home/learner/01_fragmentation.ipynb"], got["notebooks"]
    assert all("pagedkv" not in c or "_pagedkv_sandbox_boot" in c for c in got["cmdlines"]), got["cmdlines"]
    assert len(got["cmdlines"]) <= 2  # the learner's Python (and the cell's own reads)


@needs_bwrap
def test_no_other_copy_of_the_library_is_reachable(tmp_path):
    """Route: load fragmentation.py from another world-readable copy (another clone, the checkout itself)."""
    clone = tmp_path / "clone" / "pagedkv"
    clone.mkdir(parents=True)
    (clone / "fragmentation.py").write_text((ROOT / "pagedkv" / "fragmentation.py").read_text())
    for p in (tmp_path, tmp_path / "clone", clone):
        p.chmod(0o755)
    cell = (
        "import os, pagedkv\n"
        f"paths = [{str(clone / 'fragmentation.py')!r}, {str(ROOT / 'pagedkv' / 'fragmentation.py')!r}]\n"
        "seen = [os.path.exists(p) for p in paths]\n"
        "where = pagedkv.__file__\n"
        "from pagedkv.fragmentation import blocks_needed\n"
        "try:\n"
        "    blocks_needed(40, 16)\n"
        "    answer = 'callable'\n"
        "except RuntimeError:\n"
        "    answer = 'stub'\n"
    )
    got = _run(cell, ["seen", "where", "answer"], references=["pagedkv.fragmentation.blocks_needed"])
    assert got["seen"] == [False, False]
    assert got["where"].startswith("/sandbox/site/"), got["where"]
    assert got["answer"] == "stub"


@needs_bwrap
def test_no_network():
    """Route: socket.create_connection from learner code."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        cell = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5).close()\n"
            "    outcome = 'connected'\n"
            "except OSError as e:\n"
            "    outcome = type(e).__name__\n"
        )
        got = _run(cell, ["outcome"])
        assert got["outcome"] != "connected"
        with pytest.raises(BlockingIOError):
            server.accept()


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
@needs_bwrap
def test_memory_is_bounded_for_the_whole_sandbox():
    """Route: forked children of 2 GiB each (here 3 x 400 MiB under a 768 MiB sandbox): where a cgroup can be
    made, the sandbox as a whole stays under its limit and a child is killed; rlimits alone would let all three
    fill their memory (each is under the per-process limit)."""
    group = Cgroup(Limits())
    if not group.paths:
        pytest.skip("no cgroup can be made here: each process is bounded by RLIMIT_AS (see grading/README.md)")
    group.close()
    cell = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'\\x01' * (400 << 20)\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "statuses = [os.waitpid(pid, 0)[1] for pid in kids]\n"
    )
    got = _run(cell, ["statuses"], limits=Limits(memory=768 << 20))
    assert any(s != 0 for s in got["statuses"]), got["statuses"]


@needs_bwrap
def test_the_address_space_is_unbounded_where_a_cgroup_bounds_the_memory():
    """A CUDA context reserves tens of GiB of address space: under a cgroup the sandbox has no RLIMIT_AS (the
    cgroup bounds the whole sandbox's memory, RLIMIT_DATA each process's allocations); without one it has."""
    import resource

    cell = "import resource\nlimits = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_DATA)]\n"
    got = _run(cell, ["limits"], limits=Limits(memory=768 << 20))["limits"]
    group = Cgroup(Limits())
    has_cgroup = bool(group.paths)
    group.close()
    inherited = resource.getrlimit(resource.RLIMIT_AS)[0]  # the grader's own, passed on
    assert got == [inherited if has_cgroup else 768 << 20, 768 << 20], got


@needs_bwrap
def test_nothing_survives_the_sandbox(tmp_path):
    """Route: files in /tmp, /var/tmp, /dev/shm stay after grading; a process that double-forks into a session of
    its own outlives it."""
    mark = f"pagedkv-left-{os.getpid()}-{tmp_path.name}"
    cell = (
        "import os, subprocess, sys\n"
        f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
        f"    open(os.path.join(d, {mark!r}), 'w').write('x')\n"
        "subprocess.Popen([sys.executable, '-c', 'import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n"
        "    time.sleep(4244.5)'], start_new_session=True)\n"
        "ok = True\n"
    )
    assert _run(cell, ["ok"]) == {"ok": True}
    assert not [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.exists(os.path.join(d, mark))]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=60).stdout
    assert "4244.5" not in ps


@needs_bwrap
def test_a_looping_cell_is_interrupted_even_when_the_grader_ignores_sigint():
    """A grader started in the background (``cmd &``, nohup) has SIGINT ignored and passes that on: Python then
    installs no KeyboardInterrupt handler, and a looping cell could not be interrupted (its sandbox was killed
    and the cell reported as one that ignores interrupts, whatever it did)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sandbox = Sandbox(limits=Limits(), require=True)
        sandbox.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        client = Client(sandbox, [])
        assert client.exec_cell(1, "before = 1\n", 120) == {}  # started (a generous bound), then the loop
        result = client.exec_cell(2, "while True:\n    pass\n", 1)
        assert result.get("timed_out") and result.get("error") == "KeyboardInterrupt", result
        assert client.dead is None
        assert client.exec_cell(3, "after = 1\n", 120) == {}
        assert client.names(["after"]) == {"after": 1}
    finally:
        sandbox.close()


def test_reports_replace_a_planted_symlink_instead_of_writing_through_it(tmp_path):
    """Route: symlinks planted at the --csv/--json paths; the grader (root) must not write through them."""
    secret = tmp_path / "root-only"
    secret.write_text("keep me")
    secret.chmod(0o600)
    for name in ("grades.csv", "class.json"):
        (tmp_path / name).symlink_to(secret)
    classroom.write_csv([{"learner": "a", "set": "s", "exercise": "e", "points": 1.0, "max": 1.0,
                          "status": "passed", "first failure": ""}], tmp_path / "grades.csv")
    write_replacing(tmp_path / "class.json", json.dumps({"score": 1}))
    assert secret.read_text() == "keep me"
    assert not (tmp_path / "grades.csv").is_symlink() and "learner" in (tmp_path / "grades.csv").read_text()
    assert json.loads((tmp_path / "class.json").read_text()) == {"score": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["class.json", "grades.csv", "root-only"]


def test_control_characters_in_learner_text_are_escaped():
    """Route: a message with ``\\x1b[2K\\x1b[1A`` rewrites the printed table on the terminal."""
    evil = "boom\x1b[2K\x1b[1A\rhidden\u202e"
    assert escape_controls(evil) == "boom\\x1b[2K\\x1b[1A\\x0dhidden\\u202e"
    ex = grade._exercise_from_json({"name": "f", "score": 0, "possible": 1, "cases": [
        {"name": "c", "hidden": False, "points": 1, "passed": False, "message": f"f(1) raised ValueError: {evil}"}]})
    result = grade.NotebookResult(f"nb{evil}.ipynb", None, "graded", 0, 1, 0.0, "", [ex])
    table = grade.format_table([result])
    assert "\x1b" not in table and "\r" not in table and "\\x1b[2K" in table
    assert "\x1b" not in ex.message


def test_class_refuses_without_a_sandbox_and_self_study_says_so_once(tmp_path):
    """Where bubblewrap cannot run (here: not on the PATH), --class refuses with the reason and the install
    command; grading your own notebook falls back and says so, once."""
    env = dict(os.environ, PATH=str(tmp_path))
    klass = tmp_path / "class"
    klass.mkdir()
    refused = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", "--class", str(klass)], env=env,
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert refused.returncode == 2
    assert "refusing to grade a class without a sandbox" in refused.stderr and "apt-get install bubblewrap" in \
        refused.stderr
    alone = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", str(ROOT / "solutions" /
                            "01_fragmentation.ipynb"), "--no-progress"], env=env, capture_output=True, text=True,
                           timeout=600, cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    assert alone.stderr.count("grading without a sandbox") == 1, alone.stderr
    assert "score: 12 / 12" in alone.stdout


PATCH_CELL = (  # set 06's route: the learner's process patches the launch to run PyTorch instead of the kernel
    "import triton.runtime.interpreter as _interp\n"
    "_interp.InterpretedFunction.__getitem__ = lambda self, grid: (lambda *a, **k: print('PyTorch instead'))\n"
)
EMPTY_KERNEL = "@triton.jit\ndef paged_decode_v1_kernel(out_ptr, q_ptr, BLOCK: tl.constexpr):\n    pass\n"


def test_a_kernel_is_graded_from_its_source_alone():
    """Route: an empty @triton.jit kernel whose launch is patched in the learner's process. A kernel exercise's
    sandbox runs only the notebook's @triton.jit definitions and numeric constants, so the patch never runs."""
    from pagedkv.grading.kernel_source import kernel_program

    cells = ["import triton\nimport triton.language as tl\nLOG2E = 1.4426950408889634\nSCALE = 2 * LOG2E",
             PATCH_CELL, "x = 1\n" + EMPTY_KERNEL + "print('not run either')\n"]
    program = kernel_program(cells, ["paged_decode_v1_kernel"])
    assert program is not None and program.problems == {}
    assert "InterpretedFunction" not in program.source and "print" not in program.source
    assert "LOG2E = 1.4426950408889634" in program.source and "def paged_decode_v1_kernel" in program.source
    assert "SCALE" not in program.source and "x = 1" in program.source  # literal constants only
    assert kernel_program(cells, ["blocks_needed"]) is None  # not a kernel exercise: the notebook runs as usual


@pytest.mark.parametrize("body, used", [
    ("    import torch\n", "import"),
    ("    torch.zeros(4)\n", "`torch`"),
    ("    __import__('os')\n", "`__import__`"),
    ("    tl.store.__globals__\n", "`__globals__`"),
])
def test_a_kernel_body_that_is_not_triton_fails_its_exercise(body, used):
    """Under the interpreter a kernel's body runs as Python: reaching beyond Triton is refused, as a GPU would."""
    from pagedkv.grading.kernel_source import kernel_program

    helper = "@triton.jit\ndef helper(x):\n" + body + "    return x\n"
    kernel = "@triton.jit\ndef k(out_ptr, BLOCK: tl.constexpr):\n    y = helper(tl.arange(0, BLOCK))\n"
    program = kernel_program([helper, kernel], ["k"])
    assert program is not None and used in program.problems["helper"], program.problems
    assert kernel_program([kernel.replace("helper(", "tl.sum(")], ["k"]).problems == {}


@needs_bwrap
def test_only_plain_data_crosses_and_a_scenario_runs_beside_the_learners_code():
    """The narrow protocol, end to end: a plain call, a scenario (``checks.drive``) on the learner's function in
    the sandbox, a learner's object that cannot cross (an ``__eq__`` that says yes to everything), and a library
    function the learner hands back, which arrives as its name only."""
    from pagedkv.grading import checks, plain
    from pagedkv.grading.lessons.l02_block_pool import drive_slot_mapping

    sandbox = Sandbox(references=["pagedkv.fragmentation.blocks_needed"], limits=Limits(), require=True)
    sandbox.start()
    try:
        client = Client(sandbox, ["pagedkv.fragmentation.blocks_needed"])
        cell = ("class Yes:\n    def __eq__(self, other):\n        return True\n\n"
                "def liar():\n    return Yes()\n\n"
                "def slot_mapping(table, positions, block_size):\n"
                "    return [table[p // block_size] * block_size + p % block_size for p in positions]\n\n"
                "def answer():\n    from pagedkv.fragmentation import blocks_needed\n    return blocks_needed\n\n"
                "def heads():\n    return range(2, 4)\n\n"
                "def metrics():\n    import collections\n    return collections.OrderedDict(ttft=0.5, n=3)\n\n"
                "def array():\n    import numpy\n    return numpy.arange(2)\n\n"
                "limit = 7\n")
        assert client.exec_cell(1, cell, 120) == {}
        found = client.names(["slot_mapping", "liar", "answer", "limit", "Yes", "missing"])
        assert found["limit"] == 7 and "missing" not in found
        fn, liar, answer = found["slot_mapping"], found["liar"], found["answer"]
        assert isinstance(fn, plain.Learner) and fn.kind == "function" and found["Yes"].kind == "class"
        client.start_case(60)
        assert fn([3, 1], [0, 5], 4) == [12, 5]
        records = checks.drive(drive_slot_mapping, fn, [([3, 1], [0, 5], 4), ([3], {"range": [0, 2]}, 4)])
        assert records == drive_slot_mapping(lambda t, p, b: [t[i // b] * b + i % b for i in p],
                                             [([3, 1], [0, 5], 4), ([3], {"range": [0, 2]}, 4)])
        with pytest.raises(TypeError, match="cannot send the result|cannot be sent"):
            liar()
        came_back = answer()
        assert isinstance(came_back, plain.LibraryName) and not callable(came_back)
        # What a check in the notebook accepts crosses too: a range as a range, an OrderedDict as a dict; what
        # cannot cross is said to be a returned value, not an exception the learner's code raised.
        more = client.names(["heads", "metrics", "array"])
        assert more["heads"]() == range(2, 4) and more["metrics"]() == {"ttft": 0.5, "n": 3}
        with pytest.raises(AssertionError, match=r"^array\(\) returned a value the grader cannot receive: a ndarray "):
            checks.run(more["array"], (), name="array()")
        client.end_case()
    finally:
        sandbox.close()


PATCHING_DECORATOR = (  # the launch patched from the decorator line, which runs when the sandbox defines the kernel
    "@(lambda f: setattr(__import__('triton.runtime.interpreter', fromlist=['x']).InterpretedFunction, "
    "'__getitem__', lambda self, grid: (lambda *a, **k: None)) or f)\n"
)


@pytest.mark.parametrize("kernel, why", [
    ("@triton.jit\n" + PATCHING_DECORATOR + "def k(out_ptr, BLOCK: tl.constexpr):\n    pass\n", "another decorator"),
    (PATCHING_DECORATOR + "@triton.jit\ndef k(out_ptr, BLOCK: tl.constexpr):\n    pass\n", "another decorator"),
    ("@triton.jit\ndef k(out_ptr, BLOCK: tl.constexpr = __import__('os').getpid()):\n    pass\n", "default value"),
    ("@triton.jit\ndef k(out_ptr, BLOCK: print('x') or tl.constexpr):\n    pass\n", "annotation"),
    ("@triton.jit(do_not_specialize=[print('x')])\ndef k(out_ptr):\n    pass\n", "arguments are not plain"),
])
def test_a_kernels_def_line_runs_no_code_of_its_own(kernel, why):
    """A red-team lead: only the kernel's body was checked, yet its decorators, defaults and annotations run when
    the sandbox defines it, where a decorator could patch the launch as the notebook cell above could (a
    helper kernel the graded one never calls is defined too, so its line is checked as well)."""
    from pagedkv.grading.kernel_source import kernel_program

    program = kernel_program([kernel], ["k"])
    assert program is not None and why in program.problems.get("k", ""), program.problems
    unused = kernel.replace("def k(", "def unused(")
    program = kernel_program([unused, EMPTY_KERNEL], ["paged_decode_v1_kernel"])
    assert why in program.problems.get("unused", ""), program.problems
    fine = "@triton.jit(do_not_specialize=['n'])\ndef k(out_ptr, n, BLOCK: tl.constexpr = 64, eps: float = -1e-6):\n"
    assert kernel_program([fine + "    pass\n"], ["k"]).problems == {}
