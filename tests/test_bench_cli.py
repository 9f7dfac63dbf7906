"""``pagedkv bench NAME ...``: bad input is refused up front, in one line, before any work; help is help.

No benchmark runs here: each benchmark's ``run`` is replaced by one that fails the test if it is called."""

from __future__ import annotations

import importlib
import math
import socket

import pytest

import pagedkv.cli as cli
from pagedkv.utils.paths import output_path_problem


def _no_run(*args, **kwargs):
    raise AssertionError("the benchmark ran: the bad path should have been refused before any work")


class _Ran(Exception):
    """What a stubbed ``run`` raises where the check should let the run go ahead."""


def _ran(*args, **kwargs):
    raise _Ran


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- the shared check --------------------------------------------------------------------------------------------


def test_output_path_problem_names_the_option_and_the_path(tmp_path):
    (tmp_path / "a_file").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    check = output_path_problem
    assert check(files={"--json": str(tmp_path / "r.json"), "--plot": None}) is None
    assert check(folders={"--out": str(tmp_path / "new" / "deeper")}) is None  # created later, by the benchmark
    assert check(folders={"--out": str(tmp_path)}) is None
    problem = check(files={"--json": "/nonexistent/x.json"})
    assert problem.startswith("--json /nonexistent/x.json") and "/nonexistent" in problem and "exist" in problem
    assert "is a folder" in check(files={"--plot": str(tmp_path)})
    assert check(folders={"--out": str(tmp_path / "a_file" / "dir")}).startswith(f"--out {tmp_path / 'a_file'}/dir")
    assert "/proc" in check(folders={"--out": "/proc/x"})  # exists, but nothing can be created there (even by root)
    assert check(files={"--json": "/proc/x.json"}).startswith("--json /proc/x.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # checked, nothing made


# -- each benchmark refuses a bad output path before it runs -----------------------------------------------------

BAD_PATHS = [
    ("pagedkv.benchmarks.engine", ["--tiny", "--json", "/nonexistent/x.json"], "--json /nonexistent/x.json"),
    ("pagedkv.benchmarks.engine", ["--tiny", "--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png"),
    ("pagedkv.benchmarks.engine", ["--tiny", "--out", "/proc/x"], "--out /proc/x"),
    ("pagedkv.benchmarks.serve", ["--base-url", "http://127.0.0.1:9", "--json", "/nonexistent/s.json"],
     "--json /nonexistent/s.json"),
    ("pagedkv.benchmarks.serve", ["--launch", "tiny", "--plot", "/nonexistent/s.png"], "--plot /nonexistent/s.png"),
    ("pagedkv.kernels.bench", ["--tiny", "--out", "/proc/x"], "--out /proc/x"),
]


@pytest.mark.parametrize(("module", "argv", "named"), BAD_PATHS, ids=[f"{m.split('.')[-1]} {a[-2]}" for m, a, _ in
                                                                        BAD_PATHS])
def test_a_bad_output_path_is_refused_before_the_run(module, argv, named, monkeypatch, capsys):
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "run", _no_run)
    try:
        rc = mod.main(argv)
    except SystemExit as exc:  # the kernel benchmark's main returns its result, so it exits to refuse
        rc = exc.code
    assert rc == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("pagedkv bench ") and named in line


def test_the_engine_default_run_checks_its_default_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").write_text("a file where the default folder goes")
    from pagedkv.benchmarks import engine

    monkeypatch.setattr(engine, "run", _no_run)
    assert engine.main([]) == 2
    assert "artifacts" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize(("module", "argv"), [
    ("pagedkv.benchmarks.engine", ["--tiny", "--out", "{tmp}/new/dir"]),
    ("pagedkv.benchmarks.engine", ["--tiny", "--json", "{tmp}/e.json", "--plot", "{tmp}/e.png"]),
    ("pagedkv.benchmarks.serve", ["--base-url", "http://127.0.0.1:9", "--json", "{tmp}/s.json"]),
    ("pagedkv.kernels.bench", ["--tiny", "--out", "{tmp}/new/dir", "--no-plot"]),
])
def test_good_output_paths_go_ahead(module, argv, tmp_path, monkeypatch):
    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "run", _ran)
    with pytest.raises(_Ran):
        mod.main([a.format(tmp=tmp_path) for a in argv])


# -- serve: nothing listening ------------------------------------------------------------------------------------


def test_serve_bench_says_in_one_line_that_nothing_listens(capsys):
    from pagedkv.benchmarks import serve

    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        rc = serve.main(["--base-url", url, "--num-prompts", "4", "--rates", "inf"])
    assert rc != 0
    line = _one_line(capsys.readouterr().err)
    assert line == f"pagedkv bench serve: cannot reach {url} (connection refused): is a server running there?"


# -- help --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(cli.BENCHMARKS))
def test_every_bench_prints_its_help_as_pagedkv_bench_name(name, monkeypatch, capsys):
    mod = importlib.import_module(cli.BENCHMARKS[name])
    for attr in ("run", "run_benchmark", "measure"):  # whatever does the work, fail if it is reached
        if hasattr(mod, attr):
            monkeypatch.setattr(mod, attr, _no_run)
    if name == "fragmentation":
        import pagedkv.fragmentation

        monkeypatch.setattr(pagedkv.fragmentation, "main", _no_run)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: pagedkv bench {name} ")


# -- what the tables print ---------------------------------------------------------------------------------------


def test_serve_table_shows_no_running_figure_without_a_sample_that_saw_the_load():
    from pagedkv.benchmarks import serve

    for series in ([], [{"t": 0.05, "running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0, "preemptions": 0.0}]):
        stats = serve.running_stats(series)
        assert math.isnan(stats["max_running"]) and math.isnan(stats["mean_running"])
    seen = serve.running_stats([{"t": 0.05, "running": 0.0, "waiting": 3.0}, {"t": 0.3, "running": 4.0, "waiting": 0}])
    assert seen == {"max_running": 4.0, "mean_running": 2.0}
    row = {"mode": "paged", "request_rate": "inf", "request_throughput": 6.0, "output_throughput": 900.0,
           "median_ttft_ms": 70.0, "p99_ttft_ms": 75.0, "median_tpot_ms": 3.5, "median_itl_ms": 3.3,
           "p99_itl_ms": 7.8, "num_preemptions": 0, "failed": 0, **serve.running_stats([])}
    header, line, *notes = serve.format_table([row]).splitlines()
    assert "TTFT med (ms)" in header and "ITL p99 (ms)" in header and "TPOT med (ms)" in header
    assert line.split()[-3:-1] == ["-", "-"], line  # run max, run mean; not 0
    assert notes and "--poll" in notes[0]
    # repetitions: the median of those that sampled the load; "-" only where none did
    runs = [dict(row, repeat=i, errors=[], timeseries=[], **stats) for i, stats in
            enumerate([serve.running_stats([]), {"max_running": 3.0, "mean_running": 1.5}])]
    (agg,) = serve.aggregate(runs)
    assert (agg["max_running"], agg["max_running_min"], agg["max_running_max"]) == (3.0, 3.0, 3.0)
    (agg,) = serve.aggregate([runs[0], dict(runs[0], repeat=1)])
    assert math.isnan(agg["max_running"]) and serve.format_table([agg]).splitlines()[1].split()[-3] == "-"


def test_kernel_bench_prints_the_host_cost_as_a_table():
    from pagedkv.kernels.bench_report import host_cost_table

    text = host_cost_table({"dispatch_B1_L512_v4": 23.677720000000825, "dispatch_B64_L512_v3": 31.2049999999,
                            "sdpa_smallest_cpu": 9.87654321, "method": "CPU: thread CPU time per call"})
    assert "{" not in text and "23.677" not in text and "23.7" in text and "us" in text
    assert "CPU: thread CPU time per call" in text
    assert len(text.splitlines()) >= 4
