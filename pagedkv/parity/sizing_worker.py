"""vLLM 0.26's own sizing functions on the lab's hybrid cases, in a worker process.

``python -m pagedkv.parity.sizing_worker CASES.json RESULT.json``: ``CASES.json`` holds ``{"paths": [...],
"cases": [...]}`` (vLLM's unpacked sources and extra packages, as :mod:`pagedkv.parity.fetch` prepares them;
each case a list of layers ``[head_size, sliding_window or null]`` with ``kv_heads``, ``block_size``,
``max_model_len``, ``in_flight`` (``VllmConfig.max_in_flight_tokens``), ``disable`` (the hybrid manager off)
and ``available`` bytes). For each case it runs ``vllm/v1/core/kv_cache_utils.py``'s ``get_kv_cache_groups``,
``get_kv_cache_config_from_groups``, ``get_max_concurrency_for_kv_cache_config`` and
``_max_memory_usage_bytes_from_groups`` on a stand-in ``VllmConfig`` holding only what they read, and writes
the number of blocks, the groups (layer count, spec type, block size), the concurrency and the bytes one
request needs. :func:`compare_with_vllm` runs it and the lab's :mod:`pagedkv.sizing.hybrid` side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _vllm_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    vc = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=case["max_model_len"], original_max_model_len=case["max_model_len"]),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=case["disable"]),
        cache_config=SimpleNamespace(num_gpu_blocks_override=None),
        kv_transfer_config=None,
        speculative_config=None,
        max_in_flight_tokens=case["in_flight"],
    )
    specs = {}
    for i, (head_size, window) in enumerate(case["layers"]):
        common = {"block_size": case["block_size"], "num_kv_heads": case["kv_heads"], "head_size": head_size}
        spec = (
            SlidingWindowSpec(sliding_window=window, dtype=torch.bfloat16, **common)
            if window
            else FullAttentionSpec(dtype=torch.bfloat16, **common)
        )
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    groups = ku.get_kv_cache_groups(vc, specs)
    config = ku.get_kv_cache_config_from_groups(vc, groups, case["available"])
    return {
        "num_blocks": config.num_blocks,
        "groups": [[len(g.layer_names), type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size] for g in groups],
        "concurrency": ku.get_max_concurrency_for_kv_cache_config(vc, config),
        "needed": ku._max_memory_usage_bytes_from_groups(vc, groups),
    }


def _lab_case(case: dict[str, Any]) -> dict[str, Any]:
    from pagedkv.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from pagedkv.sizing import hybrid

    specs: dict[str, Any] = {}
    for i, (head_size, window) in enumerate(case["layers"]):
        common = {"block_size": case["block_size"], "num_kv_heads": case["kv_heads"], "head_size": head_size}
        specs[f"model.layers.{i}.self_attn.attn"] = (
            SlidingWindowSpec(sliding_window=window, dtype="bfloat16", **common)
            if window
            else FullAttentionSpec(dtype="bfloat16", **common)
        )
    groups = hybrid.get_kv_cache_groups(specs, case["disable"]).groups
    config = hybrid.get_kv_cache_config_from_groups(groups, case["available"])
    m, f = case["max_model_len"], case["in_flight"]
    return {
        "num_blocks": config.num_blocks,
        "groups": [[len(g.layer_names), type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size] for g in groups],
        "concurrency": hybrid.get_max_concurrency_for_kv_cache_config(config, m, f),
        "needed": hybrid.max_memory_usage_bytes_from_groups(groups, m, f),
    }


def compare_with_vllm(cases: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """``(vLLM's, the lab's)`` answers for each case; ``fetch.VllmUnavailable`` when vLLM cannot run."""
    from pagedkv.parity import fetch

    sources = fetch.ensure_vllm(log=lambda _msg: None)
    repo_root = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_CONFIGURE_LOGGING="0")
    env["PYTHONPATH"] = os.pathsep.join([repo_root, *filter(None, [env.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="pagedkv-sizing-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"paths": sources.paths, "cases": cases}))
        cmd = [sys.executable, "-m", "pagedkv.parity.sizing_worker", str(job), str(result)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if not result.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise fetch.VllmUnavailable(f"vLLM's sizing worker failed: {tail[-1] if tail else proc.returncode}")
        theirs = json.loads(result.read_text())
    return [(v, _lab_case(c)) for v, c in zip(theirs, cases, strict=True)]


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    sys.path.extend(p for p in job["paths"] if p not in sys.path)
    Path(result_path).write_text(json.dumps([_vllm_case(c) for c in job["cases"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
