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


def test_bench_options_need_exactly_one_name(calls, capsys):
    assert cli.main(["bench", "engine", "kernels", "--tiny"]) == 2
    assert calls == []
    assert "name exactly one" in capsys.readouterr().err


def test_unknown_options_elsewhere_are_refused(calls):
    with pytest.raises(SystemExit) as e:
        cli.main(["grade", "--bogus"])
    assert e.value.code == 2
    assert calls == []


def test_the_engine_benchmarks_default_folder_is_ignored_by_git():
    """``./lab bench`` with no names runs the engine's default run: it writes no tracked file."""
    import shutil
    import subprocess
    from pathlib import Path

    from pagedkv.benchmarks import engine

    folder = engine.default_results_folder({"config": {"date": "2026-12-02T03:00:00+00:00", "cpu_count": 2}})
    assert not folder.is_absolute() and folder.parts[0] == "artifacts"
    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", str(folder / "engine.json")])
    assert ignored.returncode == 0, f"{folder} is not ignored by git"
