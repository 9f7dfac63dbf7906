"""``pagedkv bench``: options after one benchmark's name reach that benchmark; elsewhere they are refused."""

from __future__ import annotations

import pytest

import pagedkv.cli as cli


@pytest.fixture
def calls(monkeypatch):
    seen: list[list[str]] = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: seen.append(cmd[2:]) or 0)
    return seen


def test_bench_forwards_options_to_the_one_benchmark_named(calls):
    assert cli.main(["bench", "engine", "--json", "/tmp/x.json", "--tiny"]) == 0
    assert calls == [["pagedkv.benchmarks.engine", "--json", "/tmp/x.json", "--tiny"]]


def test_help_after_a_benchmark_name_is_that_benchmarks_help(calls, capsys):
    """``./lab help`` sends learners to ``pagedkv bench serve --help``: it must reach the serve benchmark."""
    assert cli.main(["bench", "serve", "--help"]) == 0
    assert calls == [["pagedkv.benchmarks.serve", "--help"]]
    assert cli.main(["bench", "--help"]) == 0
    assert calls == [["pagedkv.benchmarks.serve", "--help"]]
    assert "benchmarks to run" in capsys.readouterr().out


def test_bench_options_need_exactly_one_name(calls, capsys):
    assert cli.main(["bench", "engine", "kernels", "--tiny"]) == 2
    assert calls == []
    assert "name exactly one" in capsys.readouterr().err


def test_unknown_options_elsewhere_are_refused(calls):
    with pytest.raises(SystemExit) as e:
        cli.main(["grade", "--bogus"])
    assert e.value.code == 2
    assert calls == []


def test_the_benchmarks_default_folders_are_ignored_by_git():
    """``./lab bench`` with no names runs the engine's default run and the kernel benchmark (a full sweep on a
    GPU): neither writes a tracked file unless given a place."""
    import shutil
    import subprocess
    from pathlib import Path

    from pagedkv.kernels import bench as kernels_bench

    from pagedkv.benchmarks import engine

    files = [engine.default_results_folder({"config": {"date": "2026-12-02T03:00:00+00:00", "cpu_count": 2}})
             / "engine.json"]
    files += [kernels_bench.default_out_dir(mode, "NVIDIA H200", "2026-12-02") / "bench.json"
              for mode in ("full", "quick", "tiny-gpu", "tiny-interpreter")]
    assert all(not f.is_absolute() and f.parts[0] == "artifacts" for f in files), files
    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    for f in files:
        ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(f)])
        assert ignored.returncode == 0, f"{f} is not ignored by git"
