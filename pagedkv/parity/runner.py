"""Run a parity check: vLLM's traces from the worker process (or the trace cache), the lab side's here, and
the comparison, entry by entry."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pagedkv
from pagedkv.parity import fetch, workloads
from pagedkv.parity.report import Divergence, DriverResult, ParityReport

#: Which drivers each lesson's check runs: ``(driver, enable_caching)``.
LESSON_DRIVERS: dict[int, list[tuple[str, bool | None]]] = {
    2: [("manager", False)],
    3: [("manager", True)],
    4: [("scheduler", None)],
    7: [("async_scheduler", None)],
    8: [("hybrid_manager", None), ("hybrid_scheduler", None), ("hybrid_async_scheduler", None)],
}
WORKER_TIMEOUT_S = 1200.0


def _trace_key(name: str, enable_caching: bool | None) -> str:
    """Cached vLLM traces are valid only for the same workloads and the same vLLM side: key them by both."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for module in ("workloads.py", "vllm_side.py"):
        digest.update((here / module).read_bytes())
    caching = "" if enable_caching is None else ("-cached" if enable_caching else "-uncached")
    return f"{name}{caching}-{digest.hexdigest()[:12]}"


def _load_cached(cache: Path, key: str, seeds: list[int]) -> dict[str, Any] | None:
    path = cache / "traces" / f"{key}.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if all(str(s) in stored["traces"] for s in seeds):
        return stored
    return None


def _store_cached(cache: Path, key: str, traces: dict[str, Any], seconds: float, num_seeds: int) -> None:
    path = cache / "traces" / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        old = _load_cached(cache, key, []) or {"traces": {}}
        old["traces"].update(traces)
        old["seconds_per_seed"] = seconds / max(1, num_seeds)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(old))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written only costs time


def run_worker(sources: fetch.VllmSources, drivers: list[dict[str, Any]]) -> dict[str, Any]:
    """Run vLLM's side in a worker process; its result (``traces``, ``seconds``). ``VllmUnavailable`` with
    a one-line reason when it fails."""
    repo_root = str(Path(pagedkv.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([repo_root, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="pagedkv-parity-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"paths": sources.paths, "drivers": drivers}))
        cmd = [sys.executable, "-m", "pagedkv.parity._worker", str(job), str(result)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise fetch.VllmUnavailable(f"vLLM's side did not finish in {WORKER_TIMEOUT_S:.0f} s") from None
        if not result.is_file():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()
            raise fetch.VllmUnavailable(f"vLLM's worker process failed: {tail[-1] if tail else proc.returncode}")
        out = json.loads(result.read_text())
    if "error" in out:
        first = out["error"].strip().splitlines()[0] if out["error"].strip() else "unknown error"
        raise fetch.VllmUnavailable(f"importing or running vLLM 0.26's core failed: {first}")
    return out


def _normalise(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return json.loads(json.dumps(trace))


def compare(
    seed: int, config: dict[str, Any], vllm_trace: list[dict[str, Any]], lab_trace: list[dict[str, Any]]
) -> Divergence | None:
    """The first entry where the traces differ (an operation, or what a side observed after it)."""
    lab_trace = _normalise(lab_trace)
    for i in range(max(len(vllm_trace), len(lab_trace))):
        v = vllm_trace[i] if i < len(vllm_trace) else None
        mine = lab_trace[i] if i < len(lab_trace) else None
        if v != mine:
            op = (v or mine or {}).get("op", {})
            v_obs, my_obs = (None if v is None else v["obs"]), (None if mine is None else mine["obs"])
            return Divergence(seed, i, config, op, v_obs, my_obs)
    return None


def _lab_trace(name: str, seed: int, enable_caching: bool | None, impl: Any) -> tuple[dict[str, Any], list]:
    from pagedkv.parity.lab_side import LabAsyncSchedulerSide, LabHybridManagerSide, LabManagerSide, LabSchedulerSide

    cfg, drive = workloads.driver(name, seed, enable_caching)
    side_cls = {"manager": LabManagerSide, "hybrid_manager": LabHybridManagerSide,
                "async_scheduler": LabAsyncSchedulerSide,
                "hybrid_async_scheduler": LabAsyncSchedulerSide}.get(name, LabSchedulerSide)
    try:
        side = side_cls(cfg, impl)
    except Exception as exc:  # noqa: BLE001 - a learner's constructor failing is a divergence at entry 0
        return workloads.config_dict(cfg), [{"op": {"op": "create"}, "obs": workloads.error_obs(exc)}]
    return workloads.config_dict(cfg), drive(side, seed, cfg)


def who(impl: Any, lessons: list[int]) -> str:
    if impl is not None:
        target = getattr(impl, "func", impl)  # a functools.partial names its function
        return f"Your {getattr(target, '__name__', type(target).__name__)}"
    if lessons == [7]:
        return "The library's AsyncScheduler"
    return "The library's Scheduler" if lessons == [4] else "The library"


def run(lessons: list[int], num_seeds: int, impl: Any = None, log: Callable[[str], None] = print) -> ParityReport:
    """Check ``lessons``' drivers on seeds ``0 .. num_seeds - 1``; never raises for vLLM's side (a report
    that says why it was skipped comes back instead)."""
    report = ParityReport(lessons=list(lessons), who=who(impl, lessons))
    specs = [(name, caching) for lesson in lessons for name, caching in LESSON_DRIVERS[lesson]]
    seeds = list(range(num_seeds))
    try:
        sources = fetch.ensure_vllm(log)
        cached: dict[tuple[str, bool | None], dict[str, Any]] = {}
        to_run = []
        for name, caching in specs:
            stored = _load_cached(sources.cache_dir, _trace_key(name, caching), seeds)
            if stored is not None:
                cached[(name, caching)] = stored
            else:
                to_run.append((name, caching))
        vllm_traces: dict[tuple[str, bool | None], dict[str, Any]] = {}
        vllm_seconds: dict[tuple[str, bool | None], float] = {}
        if to_run:
            log(f"running vLLM {fetch.VLLM_VERSION}'s side in a worker process (importing vLLM takes a while) ...")
            drivers = [{"name": n, "enable_caching": c, "seeds": seeds, "key": f"{n}-{c}"} for n, c in to_run]
            out = run_worker(sources, drivers)  # one process: vLLM is imported once
            report.vllm_import_seconds = out["seconds"].get("import")
            for d in drivers:
                key = (d["name"], d["enable_caching"])
                vllm_traces[key] = out["traces"][d["key"]]
                vllm_seconds[key] = out["seconds"][d["key"]]
                _store_cached(sources.cache_dir, _trace_key(*key), vllm_traces[key], vllm_seconds[key], len(seeds))
        for key, stored in cached.items():
            vllm_traces[key] = stored["traces"]
            vllm_seconds[key] = stored.get("seconds_per_seed", 0.0) * len(seeds)
        report.cached = not to_run
    except fetch.VllmUnavailable as exc:
        report.skipped = str(exc)
        return report
    except Exception as exc:  # noqa: BLE001 - e.g. a full disk while unpacking: a reason, not a traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        report.skipped = f"{type(exc).__name__}: {first}"
        return report
    for name, caching in specs:
        result = DriverResult(name, enable_caching=caching, vllm_seconds=vllm_seconds[(name, caching)])
        t0 = time.perf_counter()
        for seed in seeds:
            config, lab_trace = _lab_trace(name, seed, caching, impl)
            divergence = compare(seed, config, vllm_traces[(name, caching)][str(seed)], lab_trace)
            result.seeds_run += 1
            if divergence is None:
                result.seeds_agreeing += 1
            elif result.divergence is None:
                result.divergence = divergence
        result.lab_seconds = time.perf_counter() - t0
        report.drivers.append(result)
    return report
