"""The ``pagedkv`` command: grade exercises, build them from their sources, run benchmarks.

    pagedkv grade [PATH...] [--json FILE] [--timeout S]   grade notebooks (default: exercises/)
    pagedkv grade PATH --only NAME[,NAME...]             grade some of a notebook's exercises
    pagedkv grade --class FOLDER --csv FILE              grade a class's notebooks, one CSV
    pagedkv build-exercises [--check] [--force] [NAME...] grading/source/ -> exercises/, solutions/, zips
    pagedkv bench [NAME...]                               run the lab's benchmarks (see BENCHMARKS)
    pagedkv serve MODEL [--port N ...]                    an OpenAI-compatible server (vllm serve's flags)

``./lab grade``, ``./lab exercises``, ``./lab bench`` and ``./lab serve`` call these.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

#: Benchmarks that ``pagedkv bench`` runs: name -> module run with ``python -m``. Each module prints its own
#: table (and may save a plot); add yours here.
BENCHMARKS: dict[str, str] = {
    "fragmentation": "pagedkv.benchmarks.fragmentation",  # lesson 1: the card's example and the block-size sweep
    "block_pool": "pagedkv.benchmarks.block_pool",  # lesson 2: is the free-block queue O(1)?
    "prefix_cache": "pagedkv.benchmarks.prefix_cache",  # lesson 3: lookup and hashing cost
    "scheduling": "pagedkv.sim.targets",  # lesson 4: waste and concurrency on the simulator
    "kernels": "pagedkv.kernels.bench",  # lesson 6: decode kernels (tiny interpreter run on a CPU)
    "engine": "pagedkv.benchmarks.engine",  # lesson 7: HF generate / static batch / generate_batch vs the engine
    "serve": "pagedkv.benchmarks.serve",  # lesson 9: load generator against the OpenAI-compatible server
}
#: Benchmarks that need options (and a server) to run: ``pagedkv bench`` without names skips them.
NEEDS_OPTIONS = {"serve"}


def _repo_root() -> Path:
    from pagedkv.grading.build import repo_root

    return repo_root()


def _cmd_grade(args: argparse.Namespace) -> int:
    from pagedkv.grading.grade import UnknownExercise, display_path, format_table, grade_paths, report_json
    from pagedkv.grading.limits import Limits
    from pagedkv.grading.output import escape_controls, write_replacing
    from pagedkv.grading.sandbox import bwrap_problem

    root = _repo_root()
    for flag, value in (("--timeout", args.timeout), ("--cell-timeout", args.cell_timeout),
                        ("--case-timeout", args.case_timeout)):
        if not value > 0:
            print(f"pagedkv grade: {flag} must be a positive number of seconds (got {value:g})", file=sys.stderr)
            return 2
    if not args.memory > 0:
        print(f"pagedkv grade: --memory must be a positive number of GB (got {args.memory:g})", file=sys.stderr)
        return 2
    limits = Limits(timeout=args.timeout, cell_timeout=args.cell_timeout, case_timeout=args.case_timeout,
                    memory=int(args.memory * (1 << 30)))
    if args.jobs is not None and args.jobs < 1:
        print(f"pagedkv grade: --jobs must be at least 1 (got {args.jobs})", file=sys.stderr)
        return 2
    if args.json:
        target = Path(args.json)
        if target.is_dir():
            print(f"pagedkv grade: --json {args.json} is a folder; give a file name", file=sys.stderr)
            return 2
        if not target.resolve().parent.is_dir():
            print(f"pagedkv grade: --json {args.json}: the folder {target.parent} does not exist", file=sys.stderr)
            return 2
    if args.csv and not args.class_folder:
        print("pagedkv grade: --csv goes with --class FOLDER (a folder of learners' notebooks)", file=sys.stderr)
        return 2
    if args.class_folder:
        if not Path(args.class_folder).is_dir():
            print(f"pagedkv grade: --class {args.class_folder}: no such folder", file=sys.stderr)
            return 2
        if args.csv and not Path(args.csv).resolve().parent.is_dir():
            print(f"pagedkv grade: --csv {args.csv}: the folder {Path(args.csv).parent} does not exist",
                  file=sys.stderr)
            return 2
    only = None
    if args.only is not None:
        only = [n.strip() for value in args.only for n in value.split(",") if n.strip()]
        if not only:
            print("pagedkv grade: --only needs exercise names (e.g. --only blocks_needed,waste_percent)",
                  file=sys.stderr)
            return 2
    problem = bwrap_problem()
    if problem is not None and args.class_folder:
        print(f"pagedkv grade --class: refusing to grade a class without a sandbox: {problem}", file=sys.stderr)
        return 2
    if problem is not None and not args.quiet:
        print(f"pagedkv grade: note: grading without a sandbox ({problem}): your code runs as a plain process "
              "with the library's answers removed and rlimits, which is enough to grade your own work",
              file=sys.stderr)
    paths = ([args.class_folder] if args.class_folder else []) + list(args.paths or [])
    paths = paths or [str(root / "exercises")]
    autograder_dir = Path(args.autograder_dir) if args.autograder_dir else root / "grading" / "autograder"
    if not autograder_dir.is_dir():
        print(f"pagedkv grade: no autograder folder at {autograder_dir}", file=sys.stderr)
        return 2

    def progress(result) -> None:
        if not args.quiet:
            shown = escape_controls(display_path(result.notebook))  # as the table shows it
            print(f"graded {shown}: {result.score:g}/{result.possible:g} ({result.status}, {result.seconds:.0f} s)",
                  file=sys.stderr, flush=True)

    try:
        results, problems = grade_paths(paths, autograder_dir=autograder_dir, limits=limits,
                                        require_sandbox=bool(args.class_folder), jobs=args.jobs,
                                        on_result=progress, only=only)
    except UnknownExercise as exc:  # before any notebook was graded
        print(f"pagedkv grade: --only: {exc}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"skipped: {p}", file=sys.stderr)
    if results:
        print(format_table(results))
    if args.json:
        write_replacing(args.json, json.dumps(report_json(results), indent=2) + "\n")
    if args.class_folder:
        from pagedkv.grading.classroom import class_rows, learner_totals, write_csv

        rows = class_rows(results, args.class_folder)
        print("\n" + learner_totals(rows))
        loose = sorted({str(r["learner"]) for r in rows if str(r["learner"]).startswith("./")})
        if loose:
            print(f"pagedkv grade: {', '.join(loose)} fit neither layout of a class folder (FOLDER/<learner>/"
                  "NN_name.ipynb or FOLDER/NN_name-<learner>.ipynb), so each is listed as a learner of its own: "
                  "rename and grade again", file=sys.stderr)
        if args.csv:
            write_csv(rows, args.csv)
    elif results:
        if len({r.autograder for r in results}) < len(results):  # two notebooks of one set: a class?
            print("pagedkv grade: several notebooks of the same set were graded, and the total above adds them up "
                  "as one learner's; to grade a class, one row per learner: ./lab grade --class FOLDER --csv FILE",
                  file=sys.stderr)
        if not args.no_progress and only is None:  # a grade of some exercises is not the set's score
            from pagedkv.grading.progress import is_learners_own, record_progress

            try:
                record_progress(results)  # the notebooks in exercises/ only
            except OSError as exc:  # a read-only checkout: the grades above still stand
                print(f"pagedkv grade: could not record progress: {exc}", file=sys.stderr)
            elsewhere = [r for r in results if not is_learners_own(r.notebook)]
            if elsewhere:
                what, it = ("this notebook is", "it") if len(elsewhere) == 1 else \
                    (f"{len(elsewhere)} of these notebooks are", "them")
                print(f"pagedkv grade: {what} not in exercises/, so the course index's progress table leaves "
                      f"{it} out (it counts your own notebooks there only)", file=sys.stderr)
    if not results:
        print("pagedkv grade: nothing was graded", file=sys.stderr)
        return 2
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    from pagedkv.grading.build import build_all

    root = Path(args.root).resolve() if args.root else None
    try:
        return build_all(root, args.names or None, check=args.check, force=args.force)
    except (ValueError, RuntimeError) as exc:
        print(f"pagedkv build-exercises: {exc}", file=sys.stderr)
        return 2


def _cmd_bench(args: argparse.Namespace) -> int:
    extra = getattr(args, "extra", [])
    if not args.names and {"-h", "--help"} & set(extra):
        print(args.bench_help(), end="")
        return 0
    names = args.names or [n for n in BENCHMARKS if n not in NEEDS_OPTIONS]
    if extra and len(names) != 1:
        print(f"pagedkv bench: options {extra} go to one benchmark; name exactly one (e.g. pagedkv bench engine "
              "--json out.json)", file=sys.stderr)
        return 2
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"pagedkv bench: unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    status = 0
    for name in names:
        print(f"== {name} ({BENCHMARKS[name]})", flush=True)
        rc = subprocess.call([sys.executable, "-m", BENCHMARKS[name], *extra])
        if rc != 0:
            if len(names) == 1:
                return rc  # its own status: 2 for a bad option (argparse's usage error), as for pagedkv's own
            print(f"pagedkv bench: {name} exited with status {rc}", file=sys.stderr)
            status = 1
    return status


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagedkv.entrypoints.api_server import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    from pagedkv.grading.limits import DEFAULT_LIMITS

    parser = argparse.ArgumentParser(prog="pagedkv", description="PagedKV Lab: grade, build exercises, bench.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("grade", help="grade exercise notebooks (default: exercises/)")
    g.add_argument("paths", nargs="*", metavar="PATH", help="notebooks or folders (default: exercises/)")
    g.add_argument("--json", metavar="FILE", help='also write {"score", "possible", "notebooks"} to FILE')
    g.add_argument("--timeout", type=float, default=DEFAULT_LIMITS.timeout, metavar="S",
                   help=f"seconds per notebook before it is stopped and failed (default {DEFAULT_LIMITS.timeout:g})")
    g.add_argument("--cell-timeout", type=float, default=DEFAULT_LIMITS.cell_timeout, metavar="S",
                   help=f"seconds per cell before the cell is interrupted (default {DEFAULT_LIMITS.cell_timeout:g})")
    g.add_argument("--class", dest="class_folder", metavar="FOLDER",
                   help="grade a class: FOLDER/<learner>/NN_name.ipynb (or FOLDER/NN_name-<learner>.ipynb)")
    g.add_argument("--csv", metavar="FILE", help="with --class: one row per learner and exercise")
    g.add_argument("--no-progress", action="store_true",
                   help="do not record the scores in .pagedkv/progress.json (the course index's progress table; "
                   "only notebooks in exercises/ are recorded)")
    g.add_argument("--case-timeout", type=float, default=DEFAULT_LIMITS.case_timeout, metavar="S",
                   help="seconds one test case may spend in your code, all its calls together "
                   f"(default {DEFAULT_LIMITS.case_timeout:g})")
    g.add_argument("--memory", type=float, default=DEFAULT_LIMITS.memory / (1 << 30), metavar="GB",
                   help="memory of the sandbox that runs a notebook's code "
                   f"(default {DEFAULT_LIMITS.memory / (1 << 30):g} GB)")
    g.add_argument("--jobs", "-j", type=int, default=None, help="notebooks graded at once (default: CPUs, max 4)")
    g.add_argument("--only", action="append", metavar="NAME[,NAME...]",
                   help="grade only these exercises (the names the table and the JSON report show), each still "
                   "alone in a sandbox of its own that runs the whole notebook, and skip the others' checks; the "
                   "others are left out of the table, the JSON and the totals (which count the named exercises' "
                   "points only), and nothing is recorded in .pagedkv/progress.json. A name that a graded set "
                   "does not have is refused before anything is graded")
    g.add_argument("--autograder-dir", metavar="DIR", help="where the NN_name.zip files are "
                   "(default: grading/autograder/ of this repository)")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    g.set_defaults(func=_cmd_grade)

    b = sub.add_parser("build-exercises", help="generate exercises/, solutions/ and the autograder zips")
    b.add_argument("names", nargs="*", metavar="NAME", help="sets to build, e.g. 01 or 01_fragmentation (default: all)")
    b.add_argument("--check", action="store_true", help="write nothing; exit 1 when a committed file is stale")
    b.add_argument("--force", action="store_true",
                   help="replace notebooks that have changes of their own (a learner's answers); a copy of each "
                   "is kept under .pagedkv/replaced/")
    b.add_argument("--root", help=argparse.SUPPRESS)
    b.set_defaults(func=_cmd_build)

    from pagedkv.entrypoints.cli_args import make_arg_parser

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (lesson 9)")
    make_arg_parser(s)
    s.set_defaults(func=_cmd_serve)

    # no -h of its own: `pagedkv bench serve --help` is the serve benchmark's help, `pagedkv bench --help` this one's
    r = sub.add_parser("bench", help="run benchmarks and print their tables", add_help=False)
    r.add_argument(
        "names", nargs="*", metavar="NAME",
        help=f"benchmarks to run (default: all of {sorted(BENCHMARKS)}); options after one name go to that "
        "benchmark (pagedkv bench engine --json out.json; pagedkv bench serve --help lists the serve benchmark's)",
    )
    r.set_defaults(func=_cmd_bench, bench_help=r.format_help)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
