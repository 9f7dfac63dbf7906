"""Set 07 (the engine): every library function that computes attention over a paged cache, or writes a step's
K/V into one, is hidden from the learner's ``paged_attention`` while grading; and the checks judge the learner's
call on inputs of their own.

``paged_attention`` is the glue transformers calls in every layer: write the new K/V into the paged cache, then
attend through the block tables. The library does exactly that in many places (the engine's backends, lesson 6's
reference and kernels, their launchers, the benchmark's baseline, the compiled CPU decode): each is a way to
score the exercise without writing it, so each must be in the exercise's ``reference:`` list (a stub that raises
in the sandbox). The walk below finds them from the library's source, so a new one added later fails here until
it is listed. ``tests/test_engine_exercises.py`` checks the set's messages on known mistakes; ``tests/
test_grading_bypasses.py`` grades some of these routes end to end.
"""

from __future__ import annotations

import ast
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from source_notebook import parse_source
from test_engine import one_thread  # noqa: F401 (an autouse fixture: one torch thread)

import pagedkv
from pagedkv.grading.sandbox import copy_library, expand_classes, lesson_checks

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "grading" / "source" / "07_serving_engine.ipynb"

#: Parameter names that say a function reads a paged cache (or the engine's metadata, which holds the caches).
CACHE_PARAMS = {"key_cache", "value_cache", "kv_caches", "kv_cache", "k_cache", "v_cache", "k_cache_ptr",
                "v_cache_ptr", "meta", "metadata", "pagedkv_metadata", "block_tables", "block_table",
                "block_tables_ptr"}
#: Calls that are attention: softmax, or the exponentials of an online softmax in a Triton kernel; and any
#: function whose name says attention (transformers' sdpa_attention_forward, the compiled paged_attention_f32,
#: lesson 6's attention; not a class such as AttentionMetadata).
SOFTMAX = {"softmax", "scaled_dot_product_attention", "exp2", "exp"}
#: Found by the walk but not a way to the answer, with the reason.
NOT_ROUTES = {
    "pagedkv.grading.lessons.l07_serving_engine.plugged": "the set's harness: it runs the attention function it "
                                                          "is given (the learner's) inside the engine",
    "pagedkv.grading.lessons.l07_serving_engine.drive_attention_call": "the set's harness: one call of the attention "
                                                                       "function it is given (the learner's), as the "
                                                                       "engine makes it, on inputs sent as plain data",
}


def _library_files():
    """(dotted module, path) of every module of the library, ``pagedkv.kernels`` (the repo's kernels/) included."""
    package = Path(pagedkv.__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        yield "pagedkv." + ".".join(path.relative_to(package).with_suffix("").parts), path
    kernels = package.parent / "kernels"
    for path in sorted(kernels.rglob("*.py")):
        yield "pagedkv.kernels." + ".".join(path.relative_to(kernels).with_suffix("").parts), path


class LibraryWalk:
    """Every function of the library (methods and nested functions too, by dotted name: ``pagedkv.kernels.
    decode._versioned.run``), the library functions each one calls (resolved through the module's imports, the
    package re-exports, ``self.`` and enclosing scopes) and what each calls outside the library."""

    def __init__(self) -> None:
        self.funcs: dict[str, dict] = {}
        self.aliases: dict[str, dict[str, str]] = {}
        for module, path in _library_files():
            is_package = module.endswith(".__init__")
            module = module.removesuffix(".__init__")
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = self.aliases.setdefault(module, {})
            base = module if is_package else module.rpartition(".")[0]
            for node in ast.walk(tree):  # function-level imports too (the engine imports its kernels lazily)
                if isinstance(node, ast.ImportFrom):
                    source = node.module or ""
                    if node.level:
                        where = base
                        for _ in range(node.level - 1):
                            where = where.rpartition(".")[0]
                        source = f"{where}.{source}" if source else where
                    for alias in node.names:
                        names[alias.asname or alias.name] = f"{source}.{alias.name}"
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        names[alias.asname or alias.name.split(".")[0]] = (
                            alias.name if alias.asname else alias.name.split(".")[0])
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names[node.name] = f"{module}.{node.name}"
            self._visit(module, tree, module, None)
        self.calls = {q: {t for c in f["calls"] if (t := self._resolve(q, c))} for q, f in self.funcs.items()}

    def _visit(self, module: str, node: ast.AST, prefix: str, cls: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                args = child.args
                calls = []
                for sub in ast.walk(child):
                    if isinstance(sub, ast.Call):
                        func = sub.func
                        while isinstance(func, ast.Subscript):  # a Triton launch: kernel[grid](...)
                            func = func.value
                        parts = []
                        while isinstance(func, ast.Attribute):
                            parts.append(func.attr)
                            func = func.value
                        if isinstance(func, ast.Name):
                            calls.append(".".join([func.id, *reversed(parts)]))
                        elif parts:
                            calls.append("?." + ".".join(reversed(parts)))
                self.funcs[name] = {
                    "module": module, "cls": cls, "calls": calls, "text": ast.unparse(child),
                    "params": {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs},
                }
                self._visit(module, child, name, cls)
            elif isinstance(child, ast.ClassDef):
                self._visit(module, child, f"{prefix}.{child.name}", f"{prefix}.{child.name}")

    def _definition(self, dotted: str, depth: int = 0) -> str | None:
        """The function ``dotted`` names, followed through re-exports (``pagedkv.kernels.paged_prefill_attention``
        is ``pagedkv.kernels.prefill.paged_prefill_attention``)."""
        if dotted in self.funcs:
            return dotted
        head, _, last = dotted.rpartition(".")
        target = self.aliases.get(head, {}).get(last)
        if target is None or target == dotted or depth > 10:
            return None
        return self._definition(target, depth + 1)

    def _resolve(self, caller: str, call: str) -> str | None:
        if call.startswith("?."):
            return None
        info = self.funcs[caller]
        first, _, rest = call.partition(".")
        if first == "self" and info["cls"] and rest:
            return self._definition(f"{info['cls']}.{rest}")
        target = self.aliases[info["module"]].get(first)
        scope = caller
        while target is None and "." in scope:  # a function of an enclosing scope
            scope = scope.rpartition(".")[0]
            if f"{scope}.{first}" in self.funcs:
                target = f"{scope}.{first}"
        return None if target is None else self._definition(f"{target}.{rest}" if rest else target)

    def attending(self) -> set[str]:
        """The functions that compute attention: a softmax (or a Triton kernel's exp/exp2), a call of anything
        whose name says attention, or a call of a library function that computes attention."""
        def attention(call: str) -> bool:
            last = call.rpartition(".")[2]  # a function, not a class (AttentionMetadata(...) is no attention)
            return last in SOFTMAX or last[:1].islower() and ("attention" in last.lower() or "attend" in last)

        found = {q for q, f in self.funcs.items() if any(attention(c) for c in f["calls"])}
        grew = True
        while grew:
            grew = False
            for q in self.funcs:
                if q not in found and self.calls[q] & found:
                    found.add(q)
                    grew = True
        return found

    def reads_a_paged_cache(self, name: str) -> bool:
        f = self.funcs[name]
        return bool(f["params"] & CACHE_PARAMS) or "pagedkv_metadata" in f["text"] or "METADATA_KWARG" in f["text"]

    def writes_a_paged_cache(self, name: str) -> bool:
        """Takes a slot mapping and a cache: the step's K/V written at its slots (``reshape_and_cache``)."""
        params = self.funcs[name]["params"]
        return bool(params & {"slot_mapping", "slot_mapping_ptr"}) and bool(params & CACHE_PARAMS)


@pytest.fixture(scope="module")
def walk() -> LibraryWalk:
    return LibraryWalk()


def _reference(question: str) -> list[str]:
    """The ``reference:`` list of ``question`` in the set's source notebook."""
    import nbformat
    import yaml

    for cell in nbformat.read(SOURCE, as_version=4).cells:
        text = cell.source
        if cell.cell_type == "raw" and text.startswith("# BEGIN QUESTION") and f"name: {question}\n" in text:
            return [str(r) for r in yaml.safe_load(text.partition("\n")[2]).get("reference") or []]
    raise AssertionError(f"no question {question!r} in {SOURCE.name}")


def _hidden(question: str) -> set[str]:
    """What the sandbox of ``question`` has as stubs: its reference list and the set's checks."""
    tests = [src for kind, _, src, _ in parse_source(SOURCE) if kind == "test"]
    return set(expand_classes(_reference(question))) | set(lesson_checks(tests))


def test_the_walk_finds_the_known_routes(walk) -> None:
    """The two routes of the issue (the engine's torch backend, lesson 6's reference) and the others known when
    this test was written: if the walk stops seeing them, it is the walk that broke."""
    found = {q for q in walk.attending() if walk.reads_a_paged_cache(q)}
    known = {
        "pagedkv.engine.attention.torch_paged_attention", "pagedkv.attention.ref_paged_prefill_attention",
        "pagedkv.attention.ref_paged_attention_decode", "pagedkv.engine.attention.paged_attention",
        "pagedkv.engine.attention.paged_attention_forward", "pagedkv.engine.attention.triton_paged_attention",
        "pagedkv.engine.attention.pool_decode_attention", "pagedkv.engine.cpu_kernel.decode_attention",
        "pagedkv.kernels.decode.paged_attention_decode", "pagedkv.kernels.prefill.paged_prefill_attention",
        "pagedkv.kernels.prefill._paged_prefill_kernel", "pagedkv.kernels.decode_v1._paged_decode_v1_kernel",
        "pagedkv.kernels.decode_v4._paged_decode_split_kernel", "pagedkv.kernels.bench_cases._gather_sdpa",
    }
    assert known <= found, sorted(known - found)
    # dense attention (no cache) is the learner's building block: not a route
    assert "pagedkv.attention.attention" in walk.attending() and "pagedkv.attention.attention" not in found
    writers = {q for q in walk.funcs if walk.writes_a_paged_cache(q)}
    assert {"pagedkv.engine.attention.write_kv_torch", "pagedkv.kernels.cache.reshape_and_cache"} <= writers


def test_every_paged_attention_route_is_in_the_reference_list(walk) -> None:
    """Each library function that computes attention over a paged cache, or writes K/V into one, is in
    ``paged_attention``'s ``reference:`` list (a lesson module's check helpers may be hidden as checks instead)."""
    routes = {q for q in walk.attending() if walk.reads_a_paged_cache(q)}
    routes |= {q for q in walk.funcs if walk.writes_a_paged_cache(q)}
    routes -= set(NOT_ROUTES)
    listed, hidden = set(_reference("paged_attention")), _hidden("paged_attention")
    library = {q for q in routes if not q.startswith("pagedkv.grading.lessons.l07_")}
    assert not library - listed, f"add to paged_attention's reference: list: {sorted(library - listed)}"
    assert not routes - hidden, f"not hidden in the sandbox: {sorted(routes - hidden)}"


def test_every_route_is_a_stub_in_the_sandbox_copy(walk, tmp_path) -> None:
    """In the sandbox's copy of the library (``copy_library`` with the exercise's hidden symbols) each route's
    body is one ``raise``, and every listed symbol was found (a misspelt one would stay the library's)."""
    hidden = _hidden("paged_attention")
    assert copy_library(tmp_path, sorted(hidden)) == []
    routes = ({q for q in walk.attending() if walk.reads_a_paged_cache(q)}
              | {q for q in walk.funcs if walk.writes_a_paged_cache(q)}) - set(NOT_ROUTES)
    for route in sorted(routes):
        module = walk.funcs[route]["module"]
        rel = Path(*module.split(".")[1:])
        path = next(p for p in (tmp_path / "pagedkv" / rel.with_suffix(".py"), tmp_path / "pagedkv" / rel /
                                "__init__.py") if p.is_file())
        scope: list = ast.parse(path.read_text(encoding="utf-8")).body
        node = None
        for part in route[len(module) + 1:].split("."):
            node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
            scope = node.body
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert len(body) == 1 and isinstance(body[0], ast.Raise), f"{route} is not a stub in the sandbox's copy"


def test_the_compiled_cpu_attention_is_out_of_reach(tmp_path) -> None:
    """``cpu_kernel.load()`` hands out the compiled library with its signatures set: ``lib.paged_attention_f32``
    attends every row of a step over the paged cache, called with ctypes as ``decode_attention`` does. Hiding
    ``decode_attention`` leaves that call, so ``load`` and ``_build`` are hidden too, and the sandbox's copy holds
    the attention's and the cache write's C sources empty (a learner could compile and load them with ``cc``).
    With ``load`` hidden, ``serves`` says no: the engine keeps its PyTorch paths instead of failing."""
    hidden = _hidden("paged_attention")
    assert {"pagedkv.engine.cpu_kernel.load", "pagedkv.engine.cpu_kernel._build",
            "pagedkv/engine/cpu_attention.c", "pagedkv/engine/cpu_cache.c"} <= hidden
    assert copy_library(tmp_path, sorted(hidden)) == []
    for name in ("cpu_attention.c", "cpu_cache.c"):
        text = (tmp_path / "pagedkv" / "engine" / name).read_text()
        assert text.startswith("/*") and text.count("\n") == 1 and "hidden while grading" in text, name
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pagedkv.engine import cpu_kernel\n"
            "assert cpu_kernel.__file__.startswith(sys.argv[1]), cpu_kernel.__file__\n"
            "assert not cpu_kernel.serves('cpu', __import__('torch').float32)\n"
            "try:\n    cpu_kernel.load()\n"
            "except RuntimeError as e:\n    assert 'not available while grading' in str(e)\n"
            "else:\n    raise AssertionError('load() answered')\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)


def test_prepare_inputs_keeps_the_engines_attention() -> None:
    """The prepare_inputs exercise's sandbox keeps the library's attention: the notebook's last cell runs the engine
    there (the end-to-end checks run it in the grader's process, where nothing is hidden)."""
    assert not set(_reference("prepare_inputs")) & set(_reference("paged_attention"))


# ------------------------------------------------------------------------------------------- the check's side
def test_cache_problem_skips_padding_slots() -> None:
    """A slot of -1 is padding (``write_kv_torch`` writes nothing there): the check's picture of the cache skips
    it instead of reading flat slot -1, the pool's last slot."""
    from pagedkv.engine.attention import write_kv_torch
    from pagedkv.grading.lessons import l07_serving_engine as l07

    for seed in range(20):  # a step whose rows do not write the pool's last slot themselves
        module, q, k, v, meta = l07.random_metadata(seed)
        last = meta.kv_caches[0][0].shape[0] * meta.kv_caches[0][0].shape[1] - 1
        if last not in meta.slot_mapping.tolist():
            break
    meta.slot_mapping[0] = -1  # the first row is padding
    before = copy.deepcopy(meta)
    right = copy.deepcopy(meta)
    kc, vc = right.kv_caches[module.layer_idx]
    write_kv_torch(k[0].transpose(0, 1), v[0].transpose(0, 1), kc, vc, right.slot_mapping)
    assert l07._cache_problem(right, before, module.layer_idx, k, v, meta) is None
    wrong = copy.deepcopy(meta)  # row 0 written at index -1, the pool's last slot
    kc, vc = wrong.kv_caches[module.layer_idx]
    hkv, d = kc.shape[2], kc.shape[3]
    kc.view(-1, hkv, d)[wrong.slot_mapping] = k[0].transpose(0, 1)
    vc.view(-1, hkv, d)[wrong.slot_mapping] = v[0].transpose(0, 1)
    problem = l07._cache_problem(wrong, before, module.layer_idx, k, v, meta)
    assert problem is not None and "no row of the step maps to it" in problem, problem


def test_the_learners_call_gets_a_step_of_its_own() -> None:
    """The scenario builds the step the learner's function gets; the check builds its own (and deep copies of it
    for the reference and for the caches before the call): what the call does to its metadata, tensors or
    caches reaches none of them."""
    from pagedkv.engine.attention import paged_attention_forward
    from pagedkv.grading.lessons import l07_serving_engine as l07

    seen = []

    def vandal(module, query, key, value, attention_mask, scaling=None, pagedkv_metadata=None, **kwargs):
        out = paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      pagedkv_metadata=pagedkv_metadata)
        seen.append(pagedkv_metadata)
        meta = pagedkv_metadata  # then wreck everything it was given
        meta.slot_mapping.fill_(-1)
        meta.seq_lens.zero_()
        meta.query_start_loc.zero_()
        meta.block_tables.zero_()
        for kc, vc in meta.kv_caches[1 - module.layer_idx:2 - module.layer_idx]:  # the other layer's only
            kc.zero_()
            vc.zero_()
        return out

    with pytest.raises(AssertionError, match="layer .'s cache was changed"):
        l07.check_attention_writes_the_cache(vandal)
    assert seen
    l07.check_attention_random_steps(vandal)  # the output is the library's; the wrecked inputs change nothing


def test_a_scenario_record_is_plain_data() -> None:
    """What the scenarios return crosses to the grader: plain data only (tensors, numbers, strings, lists)."""
    from pagedkv.grading.lessons import l07_serving_engine as l07
    from pagedkv.grading.plain import decode, encode

    def answer(so, token_ids, block_size):
        from pagedkv.engine.model_runner import prepare_inputs

        got = prepare_inputs(so, token_ids, block_size)
        got.positions = torch.tensor(got.positions)  # a tensor field: its values are what count
        return got

    records = l07.drive_prepare_inputs(answer, ["example", (0, 3)])
    assert decode(encode(records)) == records and len(records) >= 2
    assert all(type(p) is int for p in records[0]["fields"]["positions"])
    records = l07.drive_attention(lambda *a, **k: None, [0])
    assert records[0]["result"] is None and len(records[0]["caches"]) == 2
    assert decode(encode(records))[0]["caches"][0][0].equal(records[0]["caches"][0][0])

    def raises(*args, **kwargs):
        return 1 // 0

    records = l07.drive_attention(raises, [0, 1])  # the first raise ends the scenario
    assert len(records) == 1 and records[0]["raised"] == "ZeroDivisionError", records
    assert "in raises, line" in records[0]["where"] and "1 // 0" in records[0]["where"], records
