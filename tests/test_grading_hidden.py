"""Each set's ``reference:`` list is the only declaration of what the grader hides, and it is complete.

While an exercise is graded, the learner's code runs against a copy of the library in which every symbol of the
exercise's list (``grading/source/NN_*.ipynb``, expanded by ``worker.load_tests``: a class's methods, the lesson
module's checks) raises "not available while grading" (``sandbox.stub_symbols``). Nothing else hides anything:
no private twins beside a public answer, no per-lesson scans of the learner's names. So the list must name every
piece of library code that would hand the learner the answer. These tests walk the library for such code:

- a listed function that only forwards to another library function (``num_gpu_blocks`` returning
  ``_num_gpu_blocks(...)``): the other one computes the same thing, and must be listed too;
- a private twin ``_x`` beside a listed ``x``;
- a subclass that overrides a listed method with its own code (one that inherits it, or extends it through
  ``super()``, reaches the stub);
- another function that returns (or keeps) the same expression as a listed function's answer, up to names
  (``2 * block_size * shape.num_kv_heads * shape.head_dim * dtype.itemsize`` in the profile and in the per-rank
  sizing, beside ``kv_page_bytes``): the library computes each answer in one place and calls it elsewhere;
- every name the stubbed copy reaches a listed function by (a re-export such as ``pagedkv.sizing.X``, an alias,
  an inherited method) is the stub.

A resemblance that is not the answer (the ceiling-division idiom used on other quantities) is listed in
``NOT_AN_ANSWER`` with the reason.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import pkgutil
import re
import subprocess
import sys
import textwrap
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from grade_variant import grade_variant

import pagedkv
from pagedkv.grading import sandbox, worker
from pagedkv.grading.build import find_sources

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(pagedkv.__file__).resolve().parent

#: (listed symbol, the other function, or the normalised expression's source) -> why it is not another copy of
#: the answer. Keep it short: each line is a judgement that a walk cannot make.
NOT_AN_ANSWER: dict[tuple[str, str], str] = {
    ("pagedkv.fragmentation.blocks_needed", "-(-n // b)"):
        "the ceiling-division idiom, on other quantities (vocabulary shards, pixels, tensor rows); the idea itself "
        "is pagedkv.utils.math_utils.cdiv, which set 01 lists",
    ("pagedkv.single_type_kv_cache_manager.SlidingWindowManager.find_longest_cache_hit",
     "(computed, len(computed[0]) * block_size)"):
        "the shape of every manager's result (blocks, tokens); full attention's rule (no window) is another answer",
    ("pagedkv.distributed.layers.kv_head_shard", "range(rank * n, (rank + 1) * n)"):
        "shard_model's MLP rows of the rank; it takes the KV heads from kv_head_shard itself",
    ("pagedkv.kv_cache_manager.KVCacheManager.allocate_slots",
     "pagedkv.sim.baseline.ContiguousKVCacheManager.allocate_slots"):
        "the contiguous baseline's allocation (one max-length run per request), not the paged answer",
}


@cache
def questions() -> dict[str, list[worker.Question]]:
    """Every set's questions, each with its resolved reference list (what the sandbox stubs)."""
    return {p.stem: worker.load_tests(ROOT / "grading" / "autograder" / f"{p.stem}.zip") for p in find_sources(ROOT)}


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for p in parts[cut:]:
            obj = getattr(obj, p, None)
        return obj
    return None


def _python(obj: Any) -> Any:
    """The Python function behind a function, a ``@triton.jit`` kernel (``.fn``) or a wrapper."""
    while hasattr(obj, "fn") and not inspect.isfunction(obj):
        obj = obj.fn
    return inspect.unwrap(obj) if callable(obj) else obj


def _library(module: str) -> bool:
    """The library and the lessons' code, not the grading harness (``pagedkv.grading.checks.run``)."""
    return module.startswith("pagedkv") and (not module.startswith("pagedkv.grading")
                                             or module.startswith("pagedkv.grading.lessons"))


def _dotted(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _body(fn: Any) -> list[ast.stmt]:
    """The function's statements, its docstring left out."""
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


@cache
def declared() -> dict[tuple[str, str], list[str]]:
    """(set, question) -> the symbols its ``reference:`` names, a class's methods expanded: what a source notebook
    declares (``Question.reference`` adds the lesson module's checks, hidden in every exercise)."""
    out = {}
    for name in questions():
        with zipfile.ZipFile(ROOT / "grading" / "autograder" / f"{name}.zip") as zf:
            info = json.loads(zf.read("questions.json"))
        for q, ex in info["exercises"].items():
            out[(name, q)] = sandbox.expand_classes(ex.get("reference") or [])
    return out


def _listed():
    """(set, question, symbol, the function) for every function a ``reference:`` list declares."""
    for name, qs in questions().items():
        for q in qs:
            for symbol in declared()[(name, q.name)]:
                fn = _python(_resolve(symbol))
                if inspect.isfunction(fn):
                    yield name, q, symbol, fn


def test_every_listed_symbol_is_in_the_library(tmp_path):
    """A misspelt or moved name would hide nothing: every symbol of every list is found and stubbed in the copy."""
    symbols = sorted({s for qs in questions().values() for q in qs for s in q.reference})
    assert sandbox.copy_library(tmp_path, symbols) == []


def test_a_listed_function_forwards_only_to_listed_functions():
    """``num_gpu_blocks`` was ``return _num_gpu_blocks(...)``: the grader had to guess the twin
    (``sandbox.with_private_twins``). A listed function whose whole body is a call of another library function
    hands the answer on; that function must be listed too (or, better, not exist)."""
    unlisted = []
    for name, q, symbol, fn in _listed():
        try:
            body = _body(fn)
        except (OSError, TypeError, SyntaxError):
            continue
        if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)) \
                or not isinstance(body[0].value, ast.Call):
            continue
        func = body[0].value.func
        callee = None
        if isinstance(func, ast.Name):
            callee = fn.__globals__.get(func.id)
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
            owner = _resolve(symbol.rsplit(".", 1)[0])
            callee = inspect.getattr_static(owner, func.attr, None) if inspect.isclass(owner) else None
        callee = _python(callee) if callee is not None else None
        if inspect.isfunction(callee) and _dotted(callee) not in q.reference and _library(callee.__module__):
            unlisted.append(f"{name} {q.name}: {symbol} forwards to {_dotted(callee)}")
    assert not unlisted, unlisted


def test_no_private_twin_beside_a_listed_function():
    """The library keeps no private copy ``_x`` of a listed ``x`` for its own callers: they call ``x``."""
    twins = []
    for name, q, symbol, _fn in _listed():
        owner_name, _, short = symbol.rpartition(".")
        owner = _resolve(owner_name)
        twin = _python(getattr(owner, f"_{short}", None)) if owner is not None else None
        if inspect.isfunction(twin) and f"{owner_name}._{short}" not in q.reference:
            twins.append(f"{name} {q.name}: {owner_name}._{short} beside {symbol}")
    assert not twins, twins


def _library_classes() -> list[type]:
    out = []
    for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001, S112 - needs what this machine lacks (vLLM itself): not graded code
            continue
        out += [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]
    return out


def test_a_subclass_that_overrides_a_listed_method_is_listed():
    """A subclass that inherits a listed method reaches the stub; one that replaces it with code of its own holds
    another copy of the answer unless it extends the listed one (``super().x``) or is a reviewed other answer."""
    classes = _library_classes()
    found = []
    for name, q, symbol, _fn in _listed():
        owner_name, _, short = symbol.rpartition(".")
        owner = _resolve(owner_name)
        if not inspect.isclass(owner):
            continue
        for cls in classes:
            own = vars(cls).get(short)
            if cls is owner or not issubclass(cls, owner) or not inspect.isfunction(own):
                continue
            other = _dotted(own)
            if other in q.reference or (symbol, other) in NOT_AN_ANSWER:
                continue
            if f"super().{short}(" not in inspect.getsource(own):
                found.append(f"{name} {q.name}: {other} overrides {symbol}")
    assert not found, found


class _Names(ast.NodeTransformer):
    """Every name the same (``shape`` and ``s``, ``dtype`` and ``kv_dtype``); attributes and numbers kept."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.copy_location(ast.Name(id="_", ctx=ast.Load()), node)


def _shape(expr: ast.expr) -> str:
    return ast.dump(_Names().visit(copy.deepcopy(expr)), annotate_fields=False)


def _answers(node: ast.AST, kinds: tuple[type, ...]) -> list[ast.expr]:
    """The values ``node`` returns (and, with ``ast.Assign`` in ``kinds``, keeps), large enough to be an answer
    (eight nodes and more) and not a plain call of names (a forwarder: the test above)."""
    out = []
    for n in ast.walk(node):
        value = getattr(n, "value", None) if isinstance(n, kinds) else None
        if not isinstance(value, ast.expr) or sum(1 for _ in ast.walk(value)) < 8:
            continue
        if isinstance(value, ast.Call) and all(isinstance(a, (ast.Name, ast.Constant)) for a in value.args) \
                and all(isinstance(k.value, (ast.Name, ast.Constant)) for k in value.keywords):
            continue
        out.append(value)
    return out


def _library_defs() -> dict[str, ast.AST]:
    """Every function the library's source defines, by dotted name (the grading code outside its lessons left
    out: it computes no answer)."""
    out: dict[str, ast.AST] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if "grading" in rel.parts and "lessons" not in rel.parts:
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")

        def walk(body: list[ast.stmt], qual: list[str]) -> None:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[".".join([*qual, node.name])] = node
                    walk(node.body, [*qual, node.name])
                elif isinstance(node, ast.ClassDef):
                    walk(node.body, [*qual, node.name])

        walk(ast.parse(path.read_text(encoding="utf-8")).body, [module])
    return out


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
def test_no_other_function_computes_a_listed_answer():
    """The page size was written three times (``kv_page_bytes``, the profile's ``page = ...``, the per-rank
    ``kv_page_bytes_per_rank``), so a learner could read set 05's answer from ``analytic_profile(...).page_size_bytes``
    or ``kv_page_bytes_per_rank(config, 1)``. A listed function's returned expression, up to names, appears in no
    other library function's return or assignment: the others call the listed one."""
    defs = _library_defs()
    index: dict[str, set[str]] = {}
    for dotted, node in defs.items():
        for value in _answers(node, (ast.Return, ast.Assign)):
            index.setdefault(_shape(value), set()).add(dotted)
    copies = []
    for name, qs in questions().items():
        for q in qs:
            for symbol in declared()[(name, q.name)]:
                if symbol not in defs:
                    continue
                for value in _answers(defs[symbol], (ast.Return,)):
                    if (symbol, ast.unparse(value)) in NOT_AN_ANSWER:
                        continue
                    others = {o for o in index.get(_shape(value), ()) - set(q.reference)
                              if o != symbol and not o.startswith(f"{symbol}.")}
                    if others:
                        copies.append(f"{name} {q.name}: {ast.unparse(value)} of {symbol} also in {sorted(others)}")
    assert not copies, copies


# The stubbed copy, walked in a process of its own: every name a listed function is reachable by.
_WALK = """
import importlib, inspect, json, pkgutil, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                    and "editable" not in getattr(f, "__name__", "")]
sys.path.insert(0, sys.argv[1])
import pagedkv
assert pagedkv.__file__.startswith(sys.argv[1]), pagedkv.__file__
wanted = set(json.loads(sys.argv[2]))
seen = {}

def python(obj):
    while hasattr(obj, "fn") and not inspect.isfunction(obj):
        obj = obj.fn
    try:
        return inspect.unwrap(obj)
    except Exception:
        return obj

def note(where, obj):
    fn = python(obj)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    origin = f"{fn.__module__}.{fn.__qualname__}"
    if origin in wanted:
        stub = any(isinstance(c, str) and "is not available while grading" in c for c in code.co_consts)
        seen.setdefault(origin, {})[where] = stub

for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
    try:
        module = importlib.import_module(info.name)
    except Exception:
        continue
    for name, obj in list(vars(module).items()):
        note(f"{info.name}.{name}", obj)
        if inspect.isclass(obj):
            for attr in dir(obj):
                try:
                    note(f"{info.name}.{name}.{attr}", inspect.getattr_static(obj, attr))
                except Exception:
                    pass
print(json.dumps(seen))
"""


@pytest.mark.slow
def test_the_copy_stubs_a_listed_function_under_every_name(tmp_path):
    """A re-export (``pagedkv.sizing.num_gpu_blocks`` of ``pagedkv.sizing.kv_cache_utils.num_gpu_blocks``, the
    package's ``pagedkv.cdiv``), an alias, a subclass that overrides nothing: in the stubbed copy each name of a
    listed function is the stub. One copy with every set's list stubbed, imported whole in a process of its own."""
    listed = sorted({_dotted(fn) for _, _, _, fn in _listed()})
    symbols = sorted({s for qs in questions().values() for q in qs for s in q.reference})
    assert sandbox.copy_library(tmp_path, symbols) == []
    proc = subprocess.run([sys.executable, "-c", _WALK, str(tmp_path), json.dumps(listed)], capture_output=True,
                          text=True, timeout=600, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    open_names = sorted(where for names in seen.values() for where, stub in names.items() if not stub)
    assert not open_names, open_names
    assert len(seen) > 0.9 * len(listed), sorted(set(listed) - set(seen))  # the walk reaches them
    assert "pagedkv.sizing.num_gpu_blocks" in seen["pagedkv.sizing.kv_cache_utils.num_gpu_blocks"]


def test_a_reference_the_sandbox_sends_back_arrives_as_a_name_only():
    """A learner's code that returns the library's answer (the function, or its class) hands the worker a name,
    never an object it could call: the check that calls it fails, and nothing of the library's runs for it."""
    from pagedkv.grading import plain

    for sent in ({"$lib": "pagedkv.fragmentation:blocks_needed"}, {"$lib": "pagedkv.block_pool:BlockPool"}):
        got = plain.decode(json.loads(json.dumps(sent)))
        assert isinstance(got, plain.LibraryName) and got == sent["$lib"]
        with pytest.raises(TypeError):
            got(40, 16)


# ------------------------------------------------------------------------------------ the routes, graded
# Each answer below implements nothing: it calls the library's answer (the listed symbol itself, through
# ``super()``, an inherited method or a second name), or another library function that computed the same thing
# before it was made to call the listed one. Each scores what the stub scores, and is told why in the stub's own
# words (``sandbox.hidden_message``), with no per-lesson scan of its names (``co_names``) or patched class.
HIDDEN = "calls the library's"


def _graded(tmp_path: Path, name: str, answers: dict[str, str]) -> dict[str, dict]:
    grade_variant(tmp_path, name, answers)
    report = json.loads((tmp_path / "r.json").read_text())
    return {e["name"]: e for e in report["notebooks"][0]["exercises"]}


def _first_failure(exercise: dict) -> str:
    return next((c["message"] for c in exercise["cases"] if not c["passed"]), "")


def _scores_0_told_why(tmp_path: Path, name: str, routes: dict[str, str], told: set[str] | None = None) -> None:
    """Every exercise graded (those of the planted answers) scores 0, and those in ``told`` (default: all) fail
    first with the stub's message."""
    graded = _graded(tmp_path, name, routes)
    assert {q: e["score"] for q, e in graded.items()} == dict.fromkeys(graded, 0.0), graded
    for q in graded if told is None else told:
        assert HIDDEN in _first_failure(graded[q]), (q, _first_failure(graded[q]))


SET02_ROUTES = {
    "FreeQueue": "from pagedkv.kv_cache_utils import FreeKVCacheBlockQueue\n\n\n"
                 "class FreeQueue(FreeKVCacheBlockQueue):\n    pass\n",
    "get_new_blocks": "def get_new_blocks(pool, num_blocks):\n    return pool.get_new_blocks(num_blocks)\n\n\n"
                      "def free_blocks(pool, ordered_blocks):\n    pool.free_blocks(ordered_blocks)\n",
    "allocate_slots": "def allocate_slots(manager, request, num_new_tokens):\n"
                      "    return manager.allocate_slots(request, num_new_tokens)\n",
    "slot_mapping": "def slot_mapping(block_table, positions, block_size):\n"
                    "    from pagedkv.block_table import compute_slot_mapping as slots\n"
                    "    return slots(block_table, positions, block_size)\n",
}


@pytest.mark.slow
def test_set02_the_librarys_answers_score_0_without_a_names_scan(tmp_path):
    """The checks refused these by scanning the learner's ``co_names`` (``_require_own_queue``,
    ``_forbid_library_call``, ``_require_own_slot_mapping``): now the stubs refuse them, under any name."""
    _scores_0_told_why(tmp_path, "02_block_pool", SET02_ROUTES)


SET03_ROUTES = {
    "hash_chain": "def hash_chain(token_ids, block_size, hash_fn=builtin_hash, extra_keys=None):\n"
                  "    from pagedkv.kv_cache_utils import hash_block_tokens as one\n"
                  "    if block_size < 1:\n        raise ValueError('block_size')\n"
                  "    out, parent = [], None\n"
                  "    for i in range(len(token_ids) // block_size):\n"
                  "        parent = one(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)\n"
                  "        out.append(parent)\n    return out\n",
    "PrefixCachingKVCacheManager": "class PrefixCachingKVCacheManager(KVCacheManager):\n"
                                   "    def get_computed_blocks(self, request):\n"
                                   "        return super().get_computed_blocks(request)\n\n"
                                   "    def _cache_blocks(self, request, num_tokens):\n"
                                   "        return super()._cache_blocks(request, num_tokens)\n",
    "EvictingBlockPool": "class EvictingBlockPool(BlockPool):\n"
                         "    def free_blocks(self, ordered_blocks):\n"
                         "        return super().free_blocks(ordered_blocks)\n\n"
                         "    def get_new_blocks(self, num_blocks):\n"
                         "        return super().get_new_blocks(num_blocks)\n",
    # the single-type manager's own copy-on-write, over the manager's table and pool
    "copy_on_write": "def copy_on_write(manager, request, num_new_tokens):\n"
                     "    from pagedkv.single_type_kv_cache_manager import FullAttentionManager\n"
                     "    group = FullAttentionManager.__new__(FullAttentionManager)\n"
                     "    group.req_to_blocks = manager.req_to_blocks\n"
                     "    group.num_cached_block = manager.num_cached_block\n"
                     "    group.block_pool, group.block_size = manager.block_pool, manager.block_size\n"
                     "    group.pending_copies = manager.pending_copies\n"
                     "    group.copy_on_write(request.request_id, request.num_computed_tokens, num_new_tokens)\n",
}


@pytest.mark.slow
def test_set03_the_librarys_answers_score_0_without_patched_classes(tmp_path):
    """The checks refused these with ``co_names`` scans and by patching the library's classes while the
    learner's ran (``forbid``, ``forbid_library``). Before: copy-on-write through ``SingleTypeKVCacheManager.
    copy_on_write`` (not listed then) scored 5/5, and the lookup and caching through ``super()`` 2/5 (the hidden
    case composed the learner's class with the library's caching and with its lookup, so its sandbox held both:
    now they are two cases)."""
    _scores_0_told_why(tmp_path, "03_prefix_caching", SET03_ROUTES, {"hash_chain", "prefix_lookup",
                                                                     "eviction_on_reuse"})


SET04_ROUTES = {
    "schedule_waiting": "def schedule_waiting(scheduler, step):\n"
                        "    from pagedkv.scheduler import Scheduler\n"
                        "    Scheduler._schedule_waiting(scheduler, step)\n",
    "select_victim": "def select_victim(running, policy):\n"
                     "    from pagedkv.scheduler import Scheduler\n"
                     "    fake = Scheduler.__new__(Scheduler)\n"
                     "    fake.running, fake.policy = list(running), policy\n"
                     "    return Scheduler._select_victim(fake)\n",
    "preempt": "def preempt(scheduler, step, victim):\n"
               "    from pagedkv.scheduler import Scheduler\n"
               "    Scheduler._preempt_request(scheduler, victim, step)\n",
}


@pytest.mark.slow
def test_set04_the_librarys_hooks_score_0_without_a_names_scan(tmp_path):
    """``l04_scheduling._require`` refused ``_schedule_waiting`` and the others by name; the stubs do it now."""
    _scores_0_told_why(tmp_path, "04_scheduling", SET04_ROUTES)


def _first_that_runs(signature: str, imports: str, setup: str, routes: list[str], only: int | None = None) -> str:
    """An answer that tries each of ``routes`` (expressions) in turn and returns the first that does not raise the
    grader's stub error, else raises the last: one planted answer closes every route only if each is hidden.
    ``only=i``: an answer that takes route ``i`` alone."""
    if only is not None:
        return f"def {signature}:\n{imports}{setup}    return {routes[only]}\n"
    return f"def {signature}:\n{imports}{setup}" + _try_each([f"lambda: {r}" for r in routes], "")


def _try_each(callables: list[str], args: str) -> str:
    """A function body that calls each of ``callables`` with ``args`` in turn, returns the first result that is not
    the grader's stub error (a ``RuntimeError``), else raises the last."""
    listed = "".join(f"        {c},\n" for c in callables)
    return (f"    last = None\n    for route in [\n{listed}    ]:\n"
            f"        try:\n            return route({args})\n        except RuntimeError as exc:\n"
            "            last = exc\n    raise last\n")


_PAGE_IMPORTS = ("    import types\n    import torch\n    from pagedkv.engine.llm import LLM\n"
                 "    from pagedkv.kv_cache_interface import FullAttentionSpec\n"
                 "    from pagedkv.sim.cost import ModelSpec\n"
                 "    from pagedkv.sizing import KV_CACHE_DTYPES, analytic_profile, model_shape\n"
                 "    from pagedkv.sizing.parallel import kv_page_bytes_per_rank\n")
# one layer's page from the spec, from the engine's block bytes (called unbound on a stand-in), from the cost model
_PAGE_ROUTES = [
    "FullAttentionSpec(block_size=block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_dim, "
    "dtype=d).page_size_bytes",
    "LLM._block_bytes(types.SimpleNamespace(kv_cache_groups=None, block_size=block_size, model=types.SimpleNamespace("
    "config=types.SimpleNamespace(**{**cfg, 'num_hidden_layers': 1}), parameters=lambda: iter([torch.empty(0, "
    "dtype=d)]))))",
    "ModelSpec('m', 1, 1, 1, 1, s.num_kv_heads, s.head_dim, kv_dtype_bytes=d.itemsize).kv_bytes_per_token "
    "* block_size",
]
SET05_ROUTES = {
    # the profile's copy of the page size, the per-rank sizing's at one rank, then the three above
    "kv_page_bytes": (
        "kv_page_bytes(config, block_size, kv_cache_dtype='auto')", _PAGE_IMPORTS,
        "    cfg, s = dict(config), model_shape(config)\n"
        "    d = s.dtype if kv_cache_dtype == 'auto' else KV_CACHE_DTYPES[kv_cache_dtype]\n",
        ["analytic_profile(config, 1, block_size=block_size, kv_cache_dtype=kv_cache_dtype, total_memory=1 << 50, "
         "max_model_len=1).page_size_bytes",
         "kv_page_bytes_per_rank(config, 1, block_size, kv_cache_dtype)", *_PAGE_ROUTES]),
    # what was the private twin, by its old name; then lesson 4's cost model, one "block" in every layer
    "num_gpu_blocks": (
        "num_gpu_blocks(total, utilization, weights, peak_activation, non_torch, cudagraph, page_bytes, num_layers)",
        "    import pagedkv.sizing.kv_cache_utils as k\n"
        "    from pagedkv.sim.cost import CostModel, GPUSpec, ModelSpec\n",
        "    gpu = GPUSpec('g', hbm_bytes=total, hbm_bandwidth=1, peak_flops=1, pcie_bandwidth=1)\n"
        "    model = ModelSpec('m', weights, num_layers, 1, 1, 1, page_bytes // 2, dtype_bytes=1, kv_dtype_bytes=1)\n",
        ["getattr(k, '_num_gpu_blocks', k.num_gpu_blocks)(total, utilization, weights, peak_activation, non_torch, "
         "cudagraph, page_bytes, num_layers)",
         "CostModel(gpu, model, block_size=1).num_gpu_blocks(utilization, activation_bytes=peak_activation, "
         "cudagraph_bytes=cudagraph, non_torch_bytes=non_torch)"]),
    # the profile (by the old twin's name), then the per-rank sizing at one rank
    "predict_num_gpu_blocks": (
        "predict_num_gpu_blocks(config, weights_bytes, max_num_batched_tokens, total_memory, "
        "gpu_memory_utilization=0.92, block_size=16, kv_cache_dtype='auto')",
        "    import pagedkv.sizing.gpu_worker as g\n    from pagedkv.sizing.parallel import rank_sizing\n", "",
        ["getattr(g, '_analytic_profile', g.analytic_profile)(config, max_num_batched_tokens, block_size=block_size, "
         "kv_cache_dtype=kv_cache_dtype, gpu_memory_utilization=gpu_memory_utilization, weights_memory=weights_bytes, "
         "total_memory=total_memory).num_gpu_blocks",
         "rank_sizing(config, 1, total_memory=total_memory, gpu_memory_utilization=gpu_memory_utilization, "
         "block_size=block_size, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=max_num_batched_tokens, "
         "weights_memory=weights_bytes).num_blocks"]),
}
SET09_ROUTES = {  # the unsalted chain in one call (a red-team pass: the public unsalted case, 1 point of 3)
    "salted_block_hashes": (
        "salted_block_hashes(token_ids, block_size, cache_salt)",
        "    from pagedkv.kv_cache_utils import hash_request_tokens, sha256_hash\n", "",
        ["hash_request_tokens(sha256_hash, block_size, token_ids, None if cache_salt is None else (cache_salt,))"]),
}
SET10_ROUTES = {  # a red-team pass: lesson 5's page with exercise 1's head count (3/3), and the routes above
    "kv_page_bytes_per_rank": (
        "kv_page_bytes_per_rank(config, tp, block_size=16, dtype_bytes=2)",
        _PAGE_IMPORTS + "    from pagedkv.distributed.layers import num_kv_heads_per_rank\n"
        "    from pagedkv.sizing import kv_page_bytes\n    from pagedkv.sizing.parallel import is_mla, mla_head_size\n",
        "    if is_mla(config):\n        return block_size * mla_head_size(config) * dtype_bytes\n"
        "    heads = num_kv_heads_per_rank(model_shape(config).num_kv_heads, tp)\n"
        "    cfg = {**config, 'num_key_value_heads': heads}\n    s = model_shape(cfg)\n"
        "    d = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[dtype_bytes]\n",
        ["kv_page_bytes(cfg, block_size, d)", *_PAGE_ROUTES]),
}


def _planted(routes: dict[str, tuple]) -> dict[str, str]:
    return {name: _first_that_runs(*spec) for name, spec in routes.items()}


def test_every_planted_route_computes_the_answer_when_nothing_is_hidden():
    """Each route above, run against the library itself, returns what the listed function returns: the grading
    tests below prove the stubs close real routes, not broken ones."""
    from pagedkv.kv_cache_utils import hash_request_tokens as chain
    from pagedkv.kv_cache_utils import sha256_hash
    from pagedkv.sizing import analytic_profile, kv_page_bytes, num_gpu_blocks
    from pagedkv.sizing.parallel import kv_page_bytes_per_rank

    llama = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "dtype": "bfloat16"}
    mla = {"num_hidden_layers": 4, "num_attention_heads": 16, "hidden_size": 2048, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64}
    blocks = (80 << 30, 0.92, 16_060_522_496, 2 << 30, 1 << 29, 1 << 28, 65536, 32)
    tiny = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
            "dtype": "float32"}
    for routes in (SET05_ROUTES, SET09_ROUTES, SET10_ROUTES):
        for name, spec in routes.items():
            for i in range(len(spec[3])):
                one: dict = {}
                exec(_first_that_runs(*spec, only=i), one)  # noqa: S102 - the test's own planted answers
                got = {
                    "kv_page_bytes": lambda f: f(llama, 16, "auto"),
                    "num_gpu_blocks": lambda f: f(*blocks),
                    "predict_num_gpu_blocks": lambda f: f(tiny, 558_400, 2048, 512 << 20),
                    "salted_block_hashes": lambda f: f(list(range(40)), 16, None),
                    "kv_page_bytes_per_rank": lambda f: (f(llama, 4), f(mla, 4, 16, 2)),
                }[name](one[name])
                want = {
                    "kv_page_bytes": kv_page_bytes(llama, 16),
                    "num_gpu_blocks": num_gpu_blocks(*blocks),
                    "predict_num_gpu_blocks": analytic_profile(tiny, 2048, weights_memory=558_400,
                                                               total_memory=512 << 20).num_gpu_blocks,
                    "salted_block_hashes": chain(sha256_hash, 16, list(range(40))),
                    "kv_page_bytes_per_rank": (kv_page_bytes_per_rank(llama, 4),
                                               kv_page_bytes_per_rank(mla, 4, 16, "bf16")),
                }[name]
                assert got == want, (name, spec[3][i], got, want)


@pytest.mark.slow
def test_set05_no_other_copy_of_an_answer_scores(tmp_path):
    """The page size was computed in three places (``kv_page_bytes``, the profile, the per-rank sizing): the
    profile's and the per-rank copies were closed only because ``resolve_kv_cache_dtype``, which both call, is
    listed too; the private twins ``_num_gpu_blocks`` and ``_analytic_profile`` were hidden by a guess from their
    names (``sandbox.with_private_twins``). Now each answer has one copy, which the others call, and no twin."""
    _scores_0_told_why(tmp_path, "05_sizing_the_pool", _planted(SET05_ROUTES))


@pytest.mark.slow
def test_set09_and_set10_no_other_copy_of_an_answer_scores(tmp_path):
    """A red-team pass scored set 10's page per rank 3/3 with lesson 5's ``kv_page_bytes`` and exercise 1's
    ``num_kv_heads_per_rank`` (neither listed for exercise 2), and set 05's page 4/4 through the spec's page size,
    the engine's block bytes and the cost model (written again there, not listed; the engine's now call
    ``kv_page_bytes``); set 09's public unsalted case fell to ``hash_request_tokens``."""
    for folder, name, routes in (("09", "09_serving_online", SET09_ROUTES),
                                 ("10", "10_tensor_parallelism", SET10_ROUTES)):
        (tmp_path / folder).mkdir()
        _scores_0_told_why(tmp_path / folder, name, _planted(routes))


def test_a_case_that_composes_both_halves_of_an_answer_is_refused(monkeypatch):
    """Set 03's hidden lookup case built the learner's manager with the library's caching and, a few lines on,
    with the library's lookup; the worker ran it again in a sandbox holding both, where the learner's methods
    reached them through ``super()`` (2/5 for an answer that implemented nothing). A case that needs a second
    library part now fails, naming both, so that the course splits it."""
    from pagedkv.grading.limits import Limits

    def test_case(PrefixCachingKVCacheManager):
        pass

    needs = iter([{"pagedkv.kv_cache_manager.KVCacheManager._cache_blocks"},
                  {"pagedkv.kv_cache_manager.KVCacheManager.get_computed_blocks"}])
    grader = worker.Grader([], Limits())
    monkeypatch.setattr(grader, "run_case", lambda case, refs, clients: next(needs))
    q = worker.Question("prefix_lookup", [worker.Case("test_case", 2.0, True, test_case)],
                        ["pagedkv.kv_cache_manager.KVCacheManager._cache_blocks",
                         "pagedkv.kv_cache_manager.KVCacheManager.get_computed_blocks"])
    (case,) = grader.grade_question(q)["cases"]
    assert not case["passed"] and "KVCacheManager._cache_blocks and also with" in case["message"], case


# A decode "loop" that shortens every sequence to its first token in the check's own seq_lens, then writes that
# token's value: the attention over one token.
SHORTENED = '''@triton.jit
def paged_decode_v1_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    tl.store(seq_lens_ptr + b, 1)
    block = tl.load(block_tables_ptr + b * stride_bt)
    offs_d = tl.arange(0, HEAD_DIM)
    v = tl.load(v_cache_ptr + block * stride_kb + (h // GROUP) * stride_kh + offs_d)
    tl.store(out_ptr + b * stride_qb + h * stride_qh + offs_d, v.to(out_ptr.dtype.element_ty))
'''


@pytest.mark.slow
def test_set06_a_kernel_that_shortens_the_checks_sequences_scores_0(tmp_path):
    """The decode checks handed the kernel their own ``seq_lens`` and computed the reference afterwards from it:
    a kernel that wrote 1 into every sequence length and returned the first token's value matched. The reference
    is computed first now, and the kernel gets copies."""
    graded = _graded(tmp_path, "06_paged_attention_kernel", {"paged_decode_v1_kernel": SHORTENED})
    assert graded["paged_decode_v1_kernel"]["score"] == 0, graded["paged_decode_v1_kernel"]


ROUTES = ROOT / "tests" / "data" / "unlisted_routes"  # SET__EXERCISE__ROUTE.txt: an answer cell's code


def _warm_imports(sources: list[str]) -> str:
    """Top-level imports of every module the answers import inside their functions: the cell runs them once, so a
    check's first call imports nothing. A cold import of torch and the engine takes 2 s or more on a slow 2-core
    machine, the limit of one check call: the route would then fail on time, not on the hidden answer."""
    modules = sorted({m.group(1) for src in sources
                      for m in re.finditer(r"^\s+(?:from|import) ([\w.]+)", src, re.M)})
    return "".join(f"try:\n    import {m}\nexcept Exception:\n    pass\n" for m in modules)


def _combined(sources: list[str]) -> str:
    """One answer cell that tries each of several answers of a function exercise (``def NAME``) in turn
    (:func:`_try_each`), their modules imported first (:func:`_warm_imports`)."""
    if len(sources) == 1:
        return _warm_imports(sources) + "\n\n" + sources[0]
    name = re.search(r"^def (\w+)", sources[0], re.M).group(1)
    parts = [re.sub(rf"^def {name}\(", f"def _route{i}(", src, count=1, flags=re.M) for i, src in enumerate(sources)]
    return (_warm_imports(sources) + "\n\n" + "\n\n".join(parts) + f"\n\ndef {name}(*args, **kwargs):\n"
            + _try_each([f"_route{i}" for i in range(len(sources))], "*args, **kwargs"))


@pytest.mark.slow
def test_routes_a_search_of_the_library_found_score_0(tmp_path):
    """A helper searched the library for other code computing each answer of sets 01-04, 07 and 08 and found 13
    routes, each scoring full marks (``tests/data/unlisted_routes``: ceil division in the engine bench's KV budget
    and the tensor-parallel vocabulary split, the pool's capacity in lesson 5's ``max_concurrency`` and lesson 4's
    contiguous manager, ``allocate_slots`` and the prefix lookup through the single-type managers, the slot
    mapping through Model Runner V2's block tables and the Triton kernel, ``prepare_inputs`` through the runner's
    method, the skipped tokens through the decode attention's groups, the victim through the waiting queue's
    order). All listed now (the victim's full tie checked instead: the waiting queue's order is what priority
    scheduling runs on). And set 10's page per rank from lesson 5's check helper ``_page_mistakes``: every lesson
    module's checks, expected and reference functions are hidden in every set now (``sandbox.lesson_checks``). A
    third search (sets 05, 09, 10): the page from the benchmarks' byte counts and from a ``ModelRunner``'s cache
    (which now takes its page from ``kv_page_bytes``), the block count from the tensor-parallel ``Worker`` and the
    hybrid pool's config, the request metrics from the Prometheus logger. A fourth (every set): ceil division in
    the per-rank shape, the parity workloads and the decode-attention metadata, the capacity from a KV cache
    config, the waste from the simulator's step record, the slot mapping read back through ``gather_kv`` and the
    shadow cache, the skipped tokens from the window mask and from ``attention`` itself, the per-rank pool from the
    cost model. Every planted exercise scores 0, told why."""
    by_set: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROUTES.glob("*.txt")):
        set_number, exercise, _ = path.stem.split("__")
        by_set.setdefault(set_number, {}).setdefault(exercise, []).append(path.read_text())
    names = {p.stem[:2]: p.stem for p in (ROOT / "grading" / "source").glob("*.ipynb")}
    for set_number, answers in by_set.items():
        name = names[set_number]
        cells = {re.search(r"^(?:def|class) (\w+)", srcs[0], re.M).group(1): _combined(srcs)
                 for srcs in answers.values()}
        (tmp_path / set_number).mkdir()
        graded = _graded(tmp_path / set_number, name, cells)
        assert set(graded) == set(answers) and all(e["score"] == 0 for e in graded.values()), (name, graded)
        for exercise, result in graded.items():
            why = _first_failure(result)
            assert HIDDEN in why or "tie on priority and arrival time" in why, (name, exercise, why)
