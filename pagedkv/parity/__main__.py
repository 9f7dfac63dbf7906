"""``python -m pagedkv.parity [--lesson 2|3|4|7|8] [--seeds N]``: check the library against vLLM 0.26 (every
lesson's driver when no ``--lesson`` is given). Exit status 0 when every workload agreed, 1 on a divergence,
2 when vLLM's sources could not be fetched."""

from __future__ import annotations

import argparse
import sys

from pagedkv.parity.runner import LESSON_DRIVERS, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lab parity",
        description="Drive vLLM 0.26's own KVCacheManager and Scheduler beside the library's on random workloads "
        "and compare them after every operation and step. The first run downloads the vllm==0.26.0 wheel "
        "(~300 MB, once; $PAGEDKV_VLLM_WHEEL names a local one), keeps its Python sources and installs the few "
        "packages vLLM's core imports into ~/.cache/pagedkv/vllm-0.26.0 ($PAGEDKV_VLLM_CACHE).",
    )
    parser.add_argument("--lesson", type=int, choices=sorted(LESSON_DRIVERS), help="only this lesson's driver")
    parser.add_argument("--seeds", type=int, default=20, help="random workloads per driver (default 20)")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    lessons = [args.lesson] if args.lesson else sorted(LESSON_DRIVERS)
    report = run(lessons, args.seeds, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(report)
    if report.vllm_import_seconds is not None:
        print(f"(importing vLLM 0.26's core in the worker took {report.vllm_import_seconds:.1f} s)", file=sys.stderr)
    elif report.cached:
        print("(vLLM 0.26's traces for these seeds came from the cache)", file=sys.stderr)
    if report.skipped is not None:
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
