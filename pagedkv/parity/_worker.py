"""The worker process that runs vLLM's side of a parity check.

``python -m pagedkv.parity._worker JOB.json RESULT.json``: the job names the folders that hold vLLM's
unpacked sources and the extra packages its core imports, and the drivers and seeds to run. They are
appended to ``sys.path`` (after the lab's own packages, so torch and everything the lab pins stay the
lab's), vLLM is imported, each seed's workload runs, and the traces are written to RESULT.json as plain
JSON. vLLM runs in this separate process so that importing it (its logging set-up, environment variables,
registrations) never touches the learner's notebook kernel, and a failure there cannot take it down.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main(job_path: str, result_path: str) -> int:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    for path in job["paths"]:
        if path not in sys.path:
            sys.path.append(path)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    result: dict = {"traces": {}, "seconds": {}}
    try:
        t0 = time.perf_counter()
        from pagedkv.parity import vllm_side, workloads

        result["seconds"]["import"] = time.perf_counter() - t0
        for spec in job["drivers"]:
            name = spec["name"]
            t0 = time.perf_counter()
            traces = {}
            sides = {"manager": vllm_side.VllmManagerSide, "hybrid_manager": vllm_side.VllmHybridManagerSide,
                     "async_scheduler": vllm_side.VllmAsyncSchedulerSide,
                     "hybrid_async_scheduler": vllm_side.VllmAsyncSchedulerSide}
            side_cls = sides.get(name, vllm_side.VllmSchedulerSide)
            for seed in spec["seeds"]:
                cfg, drive = workloads.driver(name, seed, spec["enable_caching"])
                traces[str(seed)] = drive(side_cls(cfg), seed, cfg)
            key = spec.get("key", name)
            result["traces"][key] = traces
            result["seconds"][key] = time.perf_counter() - t0
    except BaseException as exc:  # report, never hang: the parent turns this into a one-line reason
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
