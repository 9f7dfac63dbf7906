"""The trust boundary between the worker and the sandbox, against a hostile sandbox (red-team holes H3, H8-H11).

The learner's code owns the sandbox's process, so it can say anything on the pipe: forge an ``AssertionError``
that would read as the check's verdict (H3), send a reply that costs the worker gigabytes to parse (H8), send
half a message and stall (H9), fork busy processes that take the CPU from other learners (H10), raise with a
20 MB message (H11). The unit tests talk to :mod:`pagedkv.grading.plain` over a pipe; the end-to-end ones run the
worker (``python -m pagedkv.grading.worker``, what ``pagedkv grade`` starts) on set 01's solution with a cell
planted in front that patches the sandbox's server, each grading only the exercise it attacks (a few seconds).
Nothing here depends on the machine's load: deadlines are minutes, or events (a pipe, a CPU-time counter).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pagedkv.grading import checks, plain
from pagedkv.grading.client import Client
from pagedkv.grading.limits import Limits
from pagedkv.grading.sandbox import Cgroup, Sandbox, bwrap_problem, sweep_stale

ROOT = Path(__file__).resolve().parents[1]
FRAG = "01_fragmentation"
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no sandbox here: {bwrap_problem()}")


def _planted(tmp_path: Path, cell: str, name: str = FRAG, replace: dict[int, str] | None = None) -> Path:
    """The solution of set ``name`` with its cells ``replace``d (by index) and ``cell`` run first (after the
    notebook's own first cell)."""
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
    for index, source in (replace or {}).items():
        nb["cells"][index]["source"] = source
    nb["cells"].insert(1, {"cell_type": "code", "id": "planted", "metadata": {}, "source": cell, "outputs": [],
                           "execution_count": None})
    path = tmp_path / "submission" / f"{name}.ipynb"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(nb))
    return path


def _work(tmp_path: Path, notebook: Path, only: list[str], limits: Limits, timeout: float = 600) -> dict:
    """The worker's payload for ``notebook`` (what ``pagedkv grade`` runs, with these limits)."""
    out = tmp_path / "work" / "result.json"
    out.parent.mkdir()
    cmd = [sys.executable, "-m", "pagedkv.grading.worker", "--autograder", str(ROOT / "grading" / "autograder" /
           f"{notebook.stem}.zip"), "--notebook", str(notebook), "--out", str(out), "--limits", limits.to_json(),
           "--only", json.dumps(only)]
    proc = subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONHASHSEED="0"))
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["ok"], payload
    assert not list(out.parent.glob("pagedkv-sandbox-*")), "a sandbox folder was left behind"
    return payload


def _cases(payload: dict) -> list[dict]:
    return [c for q in payload["questions"] for c in q["cases"]]


def _server_answering(when: str, *body: str) -> str:
    """The cell of a learner who owns the sandbox's server: requests ``msg`` for which ``when`` holds get
    ``body`` (lines, run in the handler's place); the others go to the real handler."""
    return "\n".join(["import pagedkv.grading.sandbox_main as sm", "_h = sm.Server.handle",
                      "def _handle(self, msg):", f"    if {when}:", *(f"        {line}" for line in body),
                      "    return _h(self, msg)", "sm.Server.handle = _handle", ""])


def _pipe_reader(chunks: list[bytes], pause_after: bool = False) -> tuple[int, threading.Thread]:
    """A pipe's read end, and a thread writing ``chunks`` into it (and, with ``pause_after``, keeping it open)."""
    r, w = os.pipe()
    stop = threading.Event()

    def feed() -> None:
        for chunk in chunks:
            os.write(w, chunk)
        if pause_after:
            stop.wait(60)
        os.close(w)

    thread = threading.Thread(target=feed, daemon=True)
    thread.start()
    thread.stop = stop  # type: ignore[attr-defined]
    return r, thread


# ------------------------------------------------------------------------------------------ H3
def test_a_learners_assertion_error_is_never_the_checks_own_failure():
    forged = plain.rebuild_exception({"type": "AssertionError", "bases": ["AssertionError", "Exception",
                                      "BaseException"], "message": '=HYPERLINK("http://evil.example","12/12")'})
    assert not isinstance(forged, AssertionError) and isinstance(forged, plain.LearnerError)
    assert type(forged).__name__ == "AssertionError" and plain.from_learner(forged)
    sub = plain.rebuild_exception({"type": "Verdict", "bases": ["AssertionError", "Exception"], "message": "x"})
    assert not isinstance(sub, AssertionError) and plain.from_learner(sub)
    value = plain.rebuild_exception({"type": "ValueError", "bases": ["ValueError", "Exception"], "message": "v"})
    assert type(value) is ValueError and plain.from_learner(value)  # still caught as a ValueError by checks
    assert not plain.from_learner(AssertionError("the check's own"))
    with pytest.raises(AssertionError, match=r"^f\(1\) raised AssertionError: =HYPERLINK"):
        checks.run(lambda x: (_ for _ in ()).throw(forged), (1,), name="f")


@needs_bwrap
def test_a_forged_assertion_error_reads_as_the_learners_exception(tmp_path):
    """Red team H3: the sandbox answers the ``names`` request with AssertionError(<a CSV formula>); it used to be
    the case's whole message, as if the check had said it."""
    cell = _server_answering("msg.get('op') == 'names'",
                             "raise AssertionError('=HYPERLINK(\"http://evil.example\",\"award full marks\")')")
    payload = _work(tmp_path, _planted(tmp_path, cell), ["blocks_needed"], Limits(timeout=300))
    messages = [c["message"] for c in _cases(payload)]
    assert messages and all(m.startswith("your code raised AssertionError: =HYPERLINK(") for m in messages), messages


# ------------------------------------------------------------------------------------------ H8
def test_messages_are_bounded_before_they_are_parsed():
    assert plain.MAX_MESSAGE <= 32 << 20
    r, _ = _pipe_reader([struct.pack(">Q", plain.MAX_MESSAGE + 1)])
    with pytest.raises(plain.ProtocolError, match="over the"):
        plain.read_message(r, timeout=60)
    os.close(r)
    # 4.5 million empty lists in 13.5 MB: under the byte limit, about 0.6 GB to parse; refused unparsed
    body = b'{"value":[' + b"[]," * 4_500_000 + b"[]]}"
    r, thread = _pipe_reader([struct.pack(">Q", len(body)), body])
    with pytest.raises(plain.ProtocolError, match="values or more"):
        plain.read_message(r, timeout=60)
    thread.join(60)
    os.close(r)


@pytest.mark.slow
@needs_bwrap
def test_the_worker_has_a_memory_limit_of_its_own(tmp_path):
    """Red team H8: a ``names`` reply of 1.9 million empty lists (6 MB, under both message limits) costs about
    0.3 GB to read; under a worker limit of 250 MiB (set 01's worker needs 0.1) the allocation fails in the
    worker, which reports the case as failed and goes on (it had no limit: 30 MB of them took 1.44 GiB)."""
    cell = _server_answering("msg.get('op') == 'names'", "return {'value': [[]] * 1_900_000}")
    payload = _work(tmp_path, _planted(tmp_path, cell), ["blocks_needed"], Limits(timeout=300,
                                                                                  worker_memory=250 << 20))
    messages = [c["message"] for c in _cases(payload)]
    assert messages and all("has not the memory to read" in m or "the grader ran out of memory" in m
                            for m in messages), messages


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_what_a_killed_worker_left_behind_is_swept(tmp_path, monkeypatch):
    """Red team H8: a worker killed by the OOM killer leaves its sandbox's folder and cgroups; the next sandbox
    started removes those of processes that have ended, never those of a live one."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = tmp_path / f"pagedkv-sandbox-{_dead_pid()}-12345-abcd"
    alive = tmp_path / f"pagedkv-sandbox-{os.getpid()}-{_start_time()}-abcd"
    reused = tmp_path / f"pagedkv-sandbox-{os.getpid()}-1-abcd"  # this pid, but another process's start time
    other = tmp_path / "pagedkv-sandbox-notapid"
    for folder in (dead, alive, reused, other):
        (folder / "site").mkdir(parents=True)
    groups = []
    group = Cgroup(Limits())
    if group.paths:  # a cgroup named after a process that has ended, in each hierarchy this one uses
        groups = [p.parent / f"pagedkv-sandbox-{_dead_pid()}-12345-ab" for p in group.paths]
        for g in groups:
            g.mkdir()
    group.close()
    swept = sweep_stale()
    assert not dead.exists() and not reused.exists() and alive.exists() and other.exists()
    assert not [g for g in groups if g.exists()] and set(groups) <= set(swept)


def _start_time() -> str:
    return open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()[19].decode()


@needs_bwrap
def test_a_worker_killed_mid_grade_leaves_no_cgroup_after_the_sweep(tmp_path):
    """SIGKILL the worker (as the OOM killer does) while its sandbox runs a cell: its sandbox dies with it, the
    folders are in the worker's own (``pagedkv grade`` removes it), and the next sweep removes its cgroups."""
    if not Cgroup(Limits()).paths:
        pytest.skip("no cgroup can be made here")
    notebook = _planted(tmp_path, "import time\nwhile True:\n    time.sleep(1)\n")
    out = tmp_path / "work" / "result.json"
    out.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv.grading.worker", "--autograder",
                             str(ROOT / "grading" / "autograder" / f"{FRAG}.zip"), "--notebook", str(notebook),
                             "--out", str(out), "--limits", Limits(timeout=600).to_json()], cwd=out.parent)
    parents = Cgroup.parents()
    mine = f"pagedkv-sandbox-{proc.pid}-"
    try:
        end = time.monotonic() + 300
        while not any(p.name.startswith(mine) for parent in parents for p in parent.iterdir()):
            assert time.monotonic() < end and proc.poll() is None, "the worker made no cgroup"
            time.sleep(0.2)
        assert [p for p in out.parent.iterdir() if p.name.startswith("pagedkv-sandbox-")]  # beside --out
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    sweep_stale()
    assert not [p for parent in parents for p in parent.iterdir() if p.name.startswith(mine)]


# ------------------------------------------------------------------------------------------ H9
def test_a_message_cut_short_fails_at_its_deadline():
    r, thread = _pipe_reader([struct.pack(">Q", 1000) + b"{"], pause_after=True)
    with pytest.raises(plain.MessageStalled, match="sent 1 of the 1000 bytes"):
        plain.read_message(r, timeout=1.0)
    thread.stop.set()
    thread.join(60)
    os.close(r)


def test_a_reader_that_stops_reading_fails_the_writer_at_its_deadline():
    r, w = os.pipe()
    os.set_blocking(w, False)
    with pytest.raises(plain.MessageStalled, match="stopped reading"):
        plain.write_message(w, {"value": "x" * (1 << 20)}, timeout=1.0)  # the pipe holds 64 KiB
    os.close(r)
    os.close(w)


@pytest.mark.slow
@needs_bwrap
def test_a_sandbox_that_stalls_mid_answer_fails_its_case_and_grading_goes_on(tmp_path):
    """Red team H9: the sandbox answers a call of blocks_needed with a header and one byte, then idles. It used
    to hold the worker until the notebook's limit (every exercise 'timed out'); now each such case fails at the
    message deadline, the sandbox is replaced, and paged_admission (not attacked) passes."""
    cell = _server_answering("msg.get('op') == 'call' and msg.get('name') == 'blocks_needed'",
                             "import os, struct, time", "os.write(self.fd_out, struct.pack('>Q', 1000) + b'{')",
                             "time.sleep(3600)")
    payload = _work(tmp_path, _planted(tmp_path, cell), ["blocks_needed", "paged_admission"],
                    Limits(timeout=600, message_timeout=5.0), timeout=500)
    by_name = {q["name"]: q for q in payload["questions"]}
    stalled = [c["message"] for c in by_name["blocks_needed"]["cases"]]
    assert all("began an answer and stopped in the middle of it" in m for m in stalled), stalled
    assert by_name["paged_admission"]["score"] == by_name["paged_admission"]["possible"], by_name["paged_admission"]


# ------------------------------------------------------------------------------------------ H10
@pytest.mark.slow
@needs_bwrap
def test_a_case_counts_the_cpu_time_of_every_process_in_the_sandbox():
    """Red team H10: busy children that the learner's Python never waits for did not count in a case's CPU
    budget (only pid 1's own time, from /proc). Here two children burn 1 s of CPU each and say so on a pipe;
    the sandbox's CPU time must include them. Where a cgroup caps the CPU, it is at most ``Limits.cpus``."""
    group = Cgroup(Limits())
    if group.usage is None:
        group.close()
        pytest.skip("no cgroup that counts CPU time can be made here")
    if group.cpu_capped:
        quota = [p / "cpu.cfs_quota_us" for p in group.paths if (p / "cpu.cfs_quota_us").is_file()]
        v2 = [p / "cpu.max" for p in group.paths if (p / "cpu.max").is_file()]
        assert [f.read_text().split() for f in quota] == [["100000"]] or \
            [f.read_text().split() for f in v2] == [["100000", "100000"]]
    group.close()
    cell = ("import os, time\nr, w = os.pipe()\n"
            "for _ in range(2):\n"
            "    if os.fork() == 0:\n"
            "        while time.process_time() < 1.0:\n"
            "            pass\n"
            "        os.write(w, b'x')\n"
            "        time.sleep(3600)\n"
            "got = b''\n"
            "while len(got) < 2:\n"
            "    got += os.read(r, 2)\n")
    sandbox = Sandbox(limits=Limits(), require=True)
    sandbox.start()
    try:
        client = Client(sandbox, [])
        before = sandbox.cpu_seconds()
        result = client.exec_cell(1, cell, 300)
        assert not result.get("error") and not result.get("timed_out"), result
        assert sandbox.cpu_seconds() - before >= 1.9, (before, sandbox.cpu_seconds())
    finally:
        sandbox.close()


# ------------------------------------------------------------------------------------------ H11
def test_a_learners_message_is_cut_where_it_is_rebuilt():
    exc = plain.rebuild_exception({"type": "ValueError", "bases": ["ValueError"], "message": "A" * 20_000_000,
                                   "where": {"name": "f" * 10_000, "line": 3, "text": "x"}})
    assert len(str(exc)) < 2100 and str(exc).endswith("(19,998,000 characters cut)")
    named = plain.rebuild_exception({"type": "E" * 1_000_000, "bases": [], "message": "m"})
    assert type(named).__name__ == "LearnerError"


@needs_bwrap
def test_a_20_mb_exception_message_does_not_reach_the_report_whole(tmp_path):
    """Red team H11: the sandbox says a call raised ValueError('A' * 20_000_000) (the sandbox's own description
    cuts at 4,000 characters, but the learner's code writes the answer); each case's message is cut."""
    cell = _server_answering(
        "msg.get('op') == 'call'",
        "return {'raised': {'type': 'ValueError', 'bases': ['ValueError'], 'message': 'A' * 20_000_000}}")
    payload = _work(tmp_path, _planted(tmp_path, cell), ["blocks_needed"], Limits(timeout=300))
    messages = [c["message"] for c in _cases(payload)]
    assert messages and all(len(m) <= 4100 and "characters cut" in m for m in messages), [m[:300] for m in messages]


@pytest.mark.slow
@needs_bwrap
def test_a_20_mb_message_in_a_scenarios_record_is_cut_in_the_report(tmp_path):
    """Red team H11 as found: set 02's get_new_blocks raises ValueError('A' * 20_000_000) inside a scenario,
    whose record carries the message to the check, which quoted it whole (20 MB in the CSV). The record is now
    over the message limit (the case fails saying so), and a message is cut anyway."""
    huge = "def get_new_blocks(pool, num_blocks):\n    raise ValueError('A' * 20_000_000)\n"
    payload = _work(tmp_path, _planted(tmp_path, "pass", "02_block_pool", {8: huge}), ["pool_alloc_free"],
                    Limits(timeout=600))
    messages = [c["message"] for c in _cases(payload)]
    assert messages and all(len(m) <= 4100 for m in messages), [m[:300] for m in messages]


def test_a_set_of_colliding_hashes_or_a_huge_range_is_refused_before_it_is_built():
    """Red team, second pass: ``{"$set": [k * (2**61 - 1) ...]}`` (every item hashes to 0) made the worker's
    ``set()`` quadratic, in C, past every time limit (75 s where the limit was 60); a ``$range`` of 10**18 values
    in a record made a check iterate it. Both are refused in linear time; honest sets and ranges cross."""
    start = time.process_time()
    with pytest.raises(plain.ProtocolError, match="distinct hashes"):
        plain.decode({"$set": [k * (2**61 - 1) for k in range(400_000)]})
    with pytest.raises(plain.ProtocolError, match="distinct hashes"):
        plain.decode({"$dict": [[k * (2**61 - 1), 0] for k in range(400_000)]})
    assert time.process_time() - start < 30  # quadratic: hours; linear: well under a second
    with pytest.raises(plain.ProtocolError, match="a range of"):
        plain.decode({"$range": [1, 10**18, 1]})
    assert plain.decode({"$set": list(range(10_000))}) == set(range(10_000))
    assert plain.decode({"$dict": [[str(i), i] for i in range(1000)]})["7"] == 7
    assert plain.decode({"$range": [0, 10, 2]}) == range(0, 10, 2)


def test_a_heading_that_names_a_cell_is_cut(tmp_path):
    """Red team, second pass: a 15 MB "##" heading above cells that raise was quoted whole in every message that
    names those cells (a 60 MB CSV and a 300 MB JSON from one learner). Headings are cut where they are read."""
    from pagedkv.grading.worker import SECTION, notebook_cells

    nb = {"cells": [{"cell_type": "markdown", "source": "## " + "x" * 1_000_000},
                    {"cell_type": "code", "source": "raise ValueError"}], "metadata": {}, "nbformat": 4,
          "nbformat_minor": 5}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    ((_, _, section),) = notebook_cells(path)
    assert len(section) < SECTION + 50 and section.endswith("characters cut)"), section[:200]
