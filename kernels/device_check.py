"""The GPU device check, one command: ``python -m pagedkv.kernels.device_check``.

On a CUDA machine it runs, within a time budget (6 minutes by default), and in this order:

1. ``tests/test_kernels.py`` natively (compiled kernels, not the interpreter), in parallel workers;
2. the quick benchmark, ``python -m pagedkv.kernels.bench --quick``;
3. lesson 6's cells (``notebooks/06_paged_attention_kernel.ipynb``, executed into a copy; the lesson
   file itself is not touched),

and, with ``--with-engine``, then

4. the engine's GPU tests (``tests/test_engine.py -m gpu``: the Triton backend eager and with CUDA graphs,
   token for token against transformers);
5. the engine's GPU benchmark, ``python -m pagedkv.benchmarks.engine --gpu`` (~1B Llama shape, bf16),

and, with ``--with-serve``, then

6. lesson 9's measurement on the GPU: ``pagedkv bench serve --launch tiny`` with a ~1B Llama shape (random
   weights, bf16) behind the OpenAI-compatible server, paged against contiguous ``max_model_len`` reservation
   on the same KV bytes (``--kv-cache-memory-bytes``), Poisson rates and a burst, ShareGPT-shaped lengths
   (``serve_gpu.json``, ``serve_gpu.png``),

and writes ``device_check.json`` (each step's command, exit status, seconds and output tail) plus the
benchmarks' JSON and plots into ``benchmarks/results/gpu/<date>-<gpu>-device-check/``. Each step gets
what is left of the budget; a step that runs out is stopped and recorded as timed out, and the check
exits non-zero if any step failed.

    python -m pagedkv.kernels.device_check               # on a GPU
    python -m pagedkv.kernels.device_check --dry-run     # anywhere: print the plan, run nothing
    python -m pagedkv.kernels.device_check --skip lesson --budget 300 --out DIR
    python -m pagedkv.kernels.device_check --with-engine --budget 570   # all five, one 10-minute command
    python -m pagedkv.kernels.device_check --with-serve --skip tests --skip bench --skip lesson --budget 540
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

STEPS = ("tests", "bench", "lesson", "engine-tests", "engine-bench", "serve-bench")
ENGINE_STEPS = ("engine-tests", "engine-bench")
SERVE_STEPS = ("serve-bench",)
#: Lesson 9 on a GPU: a Llama-3.2-1B-like shape (random weights) and a 4 GiB KV pool, the same for both modes.
SERVE_MODEL = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 32000, "initializer_range": 0.02,
               "max_position_embeddings": 4096}
SERVE_KV_BYTES = 4 * 2**30
ROOT = Path(__file__).resolve().parents[1]  # the source checkout (kernels/ sits at its top level)
LESSON = ROOT / "notebooks" / "06_paged_attention_kernel.ipynb"
DEFAULT_BUDGET_S = 360


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedkv.kernels.device_check", description=__doc__.split("\n")[0])
    p.add_argument("--budget", type=int, default=DEFAULT_BUDGET_S,
                   help=f"seconds for all steps together (default {DEFAULT_BUDGET_S})")
    p.add_argument("--skip", action="append", default=[], choices=STEPS, help="leave a step out (repeatable)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default: benchmarks/results/gpu/<date>-<gpu>-device-check)")
    p.add_argument("--workers", type=int, default=8, help="pytest-xdist workers for the kernel tests")
    p.add_argument("--with-engine", action="store_true",
                   help="also run the engine's GPU tests and its GPU benchmark (lesson 7), after the kernel steps")
    p.add_argument("--with-serve", action="store_true",
                   help="also run lesson 9's serving benchmark (paged vs contiguous reservation), after the others")
    p.add_argument("--dry-run", action="store_true", help="print the steps and the folder; run nothing")
    args = p.parse_args(argv)
    if args.budget < 30:
        p.error(f"--budget must be at least 30 seconds; got {args.budget}")
    if args.workers < 1:
        p.error(f"--workers must be at least 1; got {args.workers}")
    return args


def plan(args: argparse.Namespace, out_dir: Path) -> list[tuple[str, list[str]]]:
    """The steps to run: (name, command)."""
    py = sys.executable
    # Parallel workers compile kernels side by side (pytest-xdist, a dev dependency); without it, one process.
    workers = ["-n", str(args.workers)] if importlib.util.find_spec("xdist") and args.workers > 1 else []
    steps = {
        # The compile-for-sm_90 check is for machines without a GPU; here the kernels compile for real.
        "tests": [py, "-m", "pytest", str(ROOT / "tests" / "test_kernels.py"), "-q", "-p", "no:cacheprovider",
                  "-k", "not compile_for_a_gpu", *workers],
        "bench": [py, "-m", "pagedkv.kernels.bench", "--quick", "--out", str(out_dir)],
        "lesson": [py, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(LESSON),
                   "--output-dir", str(out_dir), "--output", "06_paged_attention_kernel.executed.ipynb",
                   "--ExecutePreprocessor.timeout=300"],
        "engine-tests": [py, "-m", "pytest", str(ROOT / "tests" / "test_engine.py"), "-q", "-p", "no:cacheprovider",
                         "-m", "gpu"],
        "engine-bench": [py, "-m", "pagedkv.benchmarks.engine", "--gpu", "--json", str(out_dir / "engine_gpu.json"),
                         "--plot", str(out_dir / "engine_gpu.png")],
        "serve-bench": [py, "-m", "pagedkv.benchmarks.serve", "--launch", "tiny", "--modes", "paged", "contiguous",
                        "--rates", "8", "32", "inf", "--num-prompts", "256", "--vocab-size", "32000",
                        "--server-args", f"--hf-overrides {shlex.quote(json.dumps(SERVE_MODEL))} "
                        f"--dtype bfloat16 --max-model-len 2048 --kv-cache-memory-bytes {SERVE_KV_BYTES}",
                        "--note", "GPU device check: a ~1B Llama shape with random weights, bf16, 4 GiB of KV",
                        "--json", str(out_dir / "serve_gpu.json"), "--plot", str(out_dir / "serve_gpu.png")],
    }
    skip = set(args.skip) | (set() if args.with_engine else set(ENGINE_STEPS))
    skip |= set() if args.with_serve else set(SERVE_STEPS)
    return [(name, cmd) for name, cmd in steps.items() if name not in skip]


def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower().replace("nvidia ", "")).strip("-")


def run_step(name: str, cmd: list[str], seconds_left: float, env: dict) -> dict:
    t0 = time.perf_counter()
    record = {"step": name, "command": " ".join(cmd)}
    if seconds_left < 1:
        return {**record, "status": "not run: no time left in the budget", "rc": None, "seconds": 0.0}
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds_left,
                             start_new_session=True)
        rc, output = res.returncode, res.stdout + res.stderr
        status = "ok" if rc == 0 else "failed"
    except subprocess.TimeoutExpired as exc:
        rc, status = None, f"timed out after {seconds_left:.0f} s"
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(errors="replace")
    return {**record, "status": status, "rc": rc, "seconds": round(time.perf_counter() - t0, 1),
            "output_tail": output[-4000:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = _gpu_name()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    out_dir = args.out or ROOT / "benchmarks" / "results" / "gpu" / f"{date}-{_slug(gpu or 'no-gpu')}-device-check"
    steps = plan(args, out_dir)
    print(f"device check: GPU {gpu or 'none'}; budget {args.budget} s; results in {out_dir}")
    for name, cmd in steps:
        print(f"  {name:7s} {' '.join(cmd)}")
    if args.dry_run:
        return 0
    if gpu is None:
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing run. Use --dry-run to see the plan.")
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TRITON_INTERPRET="0")  # compiled kernels, never the interpreter
    deadline = time.perf_counter() + args.budget
    records = []
    for name, cmd in steps:
        rec = run_step(name, cmd, deadline - time.perf_counter(), env)
        records.append(rec)
        print(f"{name}: {rec['status']} ({rec['seconds']} s)")
    import torch
    import triton

    summary = {"gpu": gpu, "when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "torch": torch.__version__, "triton": triton.__version__, "budget_s": args.budget,
               "steps": records, "ok": all(r["status"] == "ok" for r in records)}
    (out_dir / "device_check.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out_dir / 'device_check.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
