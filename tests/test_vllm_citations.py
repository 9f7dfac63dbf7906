"""Every citation of a vLLM source file in the lab names a file, and symbols, that vLLM 0.26 has.

The course cites vLLM by file and symbol (``vllm/v1/core/kv_cache_manager.py``: ``KVCacheManager.allocate_slots``).
This test collects those citations from the library's sources (docstrings, comments), the lessons and the exercise
sources (every cell), ``README.md``, ``docs/*.md`` and ``grading/README.md``, and checks each against vLLM 0.26.0's
Python sources where :mod:`pagedkv.parity.fetch` keeps them: the file exists, and each symbol cited with it (a
class, a function, a method or attribute as ``Class.name``, a module-level name) is defined in that file. It never
downloads: without the sources (CI, a fresh machine) it skips; ``python -m pagedkv.parity`` fetches them.

What counts as a symbol cited with a file (code spans are ```x``` or ````x````):

- after the path, inside its span: ``vllm/x.py::name``, ``vllm/x.py: name``;
- after the path's span, joined by ``:``, ``,``, ``(`` or ``'s``: a list of spans separated by ``,``, ``and`` or
  ``/`` (``vllm/x.py``: ``A``, ``B.c``), up to the first span that is not a symbol or is followed by anything else;
- only when nothing follows the path, the span just before it: ``A`` (``vllm/x.py``), ``A`` in ``vllm/x.py``,
  (``A``, ``vllm/x.py``) or vLLM's ``A``, ``vllm/x.py``; a span already listed after an earlier path is not reused;
- unquoted, only as a whole parenthetical: (vllm/x.py, Name), (vllm/x.py: Name), (vllm/x.py::Name), (Name, vllm/x.py).

A span counts as a symbol when it is a dotted name, optionally called (``f()``, ``f(x)``), not a keyword, not a
``.py`` file. A bare name passes when the file defines it anywhere (module level, a class, a class's member or
``self.`` attribute, a variable a function assigns); ``A.b`` needs class ``A`` in the file with member ``b`` (its
own or a base's defined in the same file). Files of vLLM V0 (gone from 0.26) may be cited only as V0's
(:data:`V0_FILES`).
"""

from __future__ import annotations

import ast
import difflib
import json
import keyword
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from pagedkv.parity import fetch

ROOT = Path(__file__).resolve().parents[1]

#: vLLM V0 files the lab cites for what V0 did (swapping): not in 0.26, so not checked; the text must say "V0".
V0_FILES = {
    "vllm/core/scheduler.py",
    "vllm/core/block_manager.py",
    "vllm/core/block/cpu_gpu_block_allocator.py",
    "vllm/worker/cache_engine.py",
}

_ID = r"[A-Za-z_]\w*"
_SYM = rf"{_ID}(?:\.\s*{_ID})*"  # a docstring may wrap a dotted name after a dot
_WS = r"(?:\s|#:?)*"  # whitespace, and a comment's ``#``/``#:`` where a citation wraps in a comment
_SPAN = r"(?P<ticks>`{1,2})(?P<body>[^`]{1,160}?)(?P=ticks)(?!`)"
_PATH = re.compile(r"(?<![\w/.-])vllm/(?:\w+/)*\w+\.py\b")
_IN_SPAN_SYM = re.compile(rf"(?:::|:)\s*({_SYM})\s*(?:\(\))?\s*(?=`)")
_BARE_SYM = re.compile(rf"::({_SYM})|[:,][ \t]+({_SYM})(?=\))")
_AFTER_FIRST = re.compile(rf"(?:'s|\s*[:,(]){_WS}{_SPAN}")
_AFTER_NEXT = re.compile(rf"{_WS}(?:,{_WS}(?:and\b)?|and\b|/){_WS}{_SPAN}")
_BEFORE = re.compile(
    rf"(?P<open>\(|'s{_WS})?{_SPAN}(?P<sep>{_WS}\({_WS}|{_WS},{_WS}|{_WS}\bin\b{_WS}(?:vLLM(?:\s+0\.26)?'s{_WS})?)`*$"
)
_BEFORE_BARE = re.compile(rf"\(({_SYM}),[ \t]+$")


@dataclass(frozen=True)
class Citation:
    where: str  # "pagedkv/x.py:12" or "notebooks/y.ipynb:cell 3, line 4"
    path: str  # "vllm/v1/request.py"
    symbols: tuple[str, ...]
    context: str  # the text just before the path, for V0_FILES


def as_symbol(body: str) -> str | None:
    """The dotted name a code span names (``A.b``, ``f()``, ``f(x)``), or None."""
    m = re.fullmatch(rf"\s*({_SYM})\s*(?:\(.*\))?\s*", body, re.S)
    if m is None:
        return None
    sym = re.sub(r"\s+", "", m[1])
    parts = sym.split(".")
    if any(keyword.iskeyword(p) for p in parts) or parts[-1] == "py" or parts[0] in {"self", "vllm", "pagedkv"}:
        return None
    return sym


def extract(text: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(offset, path, symbols)`` for each citation of a vLLM file in ``text``."""
    out = []
    taken: set[int] = set()  # where the spans listed after a path end: not a later path's "before" symbol
    for m in _PATH.finditer(text):
        start, end = m.span()
        syms: list[str] = []
        open_ticks = len(text[:start]) - len(text[:start].rstrip("`"))
        # Inside the path's own span, or as an unquoted parenthetical.
        if open_ticks:
            if (inside := _IN_SPAN_SYM.match(text, end)) is not None:
                syms.append(re.sub(r"\s+", "", inside[1]))
            close = text.find("`", end)
            pos = close + open_ticks if close != -1 and "\n\n" not in text[end:close] else end
        else:
            if (bare := _BARE_SYM.match(text, end)) is not None:
                syms.append(re.sub(r"\s+", "", bare[1] or bare[2]))
            pos = end
        # A list of spans after the path.
        nxt = _AFTER_FIRST.match(text, pos) if open_ticks else None
        while nxt is not None and (sym := as_symbol(nxt["body"])) is not None:
            syms.append(sym)
            taken.add(nxt.end())
            nxt = _AFTER_NEXT.match(text, nxt.end())
        # Just before the path, when nothing follows it.
        if not syms:
            lo = max(0, start - open_ticks - 240)
            window = text[lo : start - open_ticks]
            b = _BEFORE.search(window)
            if (
                b is not None
                and (b["open"] or "," not in b["sep"])
                and lo + b.end("body") + len(b["ticks"]) not in taken
            ):
                if (sym := as_symbol(b["body"])) is not None:
                    syms.append(sym)
            elif open_ticks == 0 and (bb := _BEFORE_BARE.search(window)) is not None:
                syms.append(re.sub(r"\s+", "", bb[1]))
        out.append((start, m[0], tuple(dict.fromkeys(syms))))
    return out


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _sources() -> list[tuple[str, str, str]]:
    """``(label, text, line label prefix)`` for every place the course cites vLLM."""
    files = sorted((ROOT / "pagedkv").rglob("*.py"))
    files += [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "grading" / "README.md"]
    out = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"), "") for p in files]
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "grading" / "source").glob("*.ipynb")):
        cells = json.loads(p.read_text(encoding="utf-8"))["cells"]
        for i, cell in enumerate(cells):
            src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            out.append((str(p.relative_to(ROOT)), src, f"cell {i}, "))
    return out


def collect() -> list[Citation]:
    cites = []
    for label, text, cell in _sources():
        for offset, path, syms in extract(text):
            where = f"{label}:{cell}line {_line(text, offset)}" if cell else f"{label}:{_line(text, offset)}"
            cites.append(Citation(where, path, syms, text[max(0, offset - 300) : offset]))
    return cites


class Defs:
    """What one module defines: module-level names, classes (also nested) and their members."""

    def __init__(self, source: str):
        tree = ast.parse(source)
        self.top = self._names(tree.body)
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.imported: set[str] = set()
        self.assigned: set[str] = set()  # every name assigned anywhere, a function's locals included
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    self.assigned.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.imported.update((a.asname or a.name).split(".")[0] for a in node.names)

    @staticmethod
    def _names(body: list[ast.stmt]) -> set[str]:
        """Names bound by statements of ``body`` (into ``if``/``try``/``with`` blocks, not into functions)."""
        names: set[str] = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for sub in getattr(node, block, []):
                        names |= Defs._names(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])
        return names

    def members(self, cls: str, seen: frozenset[str] = frozenset()) -> set[str]:
        """Members of class ``cls``: its body's names, ``self.x`` it assigns, and its bases' (same file)."""
        out: set[str] = set()
        for node in self.classes.get(cls, []):
            out |= self._names(node.body)
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for n in ast.walk(fn):
                        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                            if isinstance(n.value, ast.Name) and n.value.id == "self":
                                out.add(n.attr)
            for base in node.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name in self.classes and name not in seen and name != cls:
                    out |= self.members(name, seen | {cls})
        return out

    def qualified(self) -> set[str]:
        return self.top | set(self.classes) | {f"{c}.{m}" for c in self.classes for m in self.members(c)}

    def defines(self, symbol: str) -> bool:
        parts = symbol.split(".")
        if len(parts) == 1:
            if symbol in self.top or symbol in self.classes or symbol in self.assigned:
                return True
            return any(symbol in self.members(c) for c in self.classes)
        if parts[0] not in self.classes:
            return False
        for i, part in enumerate(parts[1:], 1):
            if part not in self.members(parts[i - 1]):
                return False
            if i < len(parts) - 1 and part not in self.classes:
                return False
        return True

    def closest(self, symbol: str) -> str | None:
        names = self.qualified()
        pool = names if "." in symbol else {n.rsplit(".", 1)[-1] for n in names}
        near = difflib.get_close_matches(symbol, sorted(pool), n=1, cutoff=0.6)
        return near[0] if near else None


def vllm_src() -> Path | None:
    """vLLM 0.26's sources where :mod:`pagedkv.parity.fetch` keeps them (``src/vllm``), if a fetch finished."""
    cache_dir = fetch.cache_dir()
    src = cache_dir / "src"
    return src if (cache_dir / "READY").is_file() and (src / "vllm").is_dir() else None


@cache
def _defs(src: Path, path: str) -> Defs:
    return Defs((src / path).read_text(encoding="utf-8"))


def _defined_elsewhere(src: Path, symbol: str) -> list[str]:
    """vLLM files that define the last part of ``symbol`` (a class or function, or a module-level assignment)."""
    name = symbol.rsplit(".", 1)[-1]
    pat = re.compile(rf"^(?:\s*(?:async\s+)?(?:class|def)\s+{re.escape(name)}\b|{re.escape(name)}\s*[:=])", re.M)
    hits = []
    for p in sorted((src / "vllm").rglob("*.py")):
        text = p.read_text(encoding="utf-8", errors="replace")
        if name in text and pat.search(text):
            hits.append(str(p.relative_to(src)))
    return hits


def check(cites: list[Citation], src: Path) -> list[str]:
    """One line per wrong citation."""
    failures = []
    all_paths: list[str] | None = None
    for c in cites:
        if c.path in V0_FILES:
            if "V0" not in c.context:
                failures.append(f"{c.where}: {c.path} is vLLM V0's, gone from 0.26; the text must say V0")
            continue
        if not (src / c.path).is_file():
            if all_paths is None:
                all_paths = sorted(str(p.relative_to(src)) for p in (src / "vllm").rglob("*.py"))
            same = [p for p in all_paths if p.rsplit("/", 1)[-1] == c.path.rsplit("/", 1)[-1]]
            near = same or difflib.get_close_matches(c.path, all_paths, n=2, cutoff=0.7)
            hint = f" (closest: {', '.join(near)})" if near else ""
            failures.append(f"{c.where}: {c.path} does not exist in vLLM 0.26{hint}")
            continue
        defs = _defs(src, c.path)
        for sym in c.symbols:
            if defs.defines(sym):
                continue
            hints = []
            if (near := defs.closest(sym)) is not None:
                hints.append(f"closest there: {near}")
            if sym.split(".")[0] in defs.imported:
                hints.append(f"{sym.split('.')[0]} is imported there")
            if elsewhere := [p for p in _defined_elsewhere(src, sym) if p != c.path]:
                more = f" +{len(elsewhere) - 3}" if len(elsewhere) > 3 else ""
                hints.append(f"{sym.rsplit('.', 1)[-1]} is defined in {', '.join(elsewhere[:3])}{more}")
            hint = f" ({'; '.join(hints)})" if hints else ""
            failures.append(f"{c.where}: {c.path}: {sym} is not defined there{hint}")
    return failures


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
def test_citations_of_vllm_name_files_and_symbols_that_vllm_026_has():
    src = vllm_src()
    if src is None:
        pytest.skip(f"vLLM 0.26's sources are not in {fetch.cache_dir()} (python -m pagedkv.parity fetches them)")
    cites = collect()
    assert len(cites) > 100, f"only {len(cites)} citations found: is the extractor broken?"
    failures = check(cites, src)
    n_syms = sum(len(c.symbols) for c in cites)
    assert not failures, f"{len(failures)} of {len(cites)} citations ({n_syms} symbols) are wrong:\n" + "\n".join(
        failures
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "`vllm/v1/core/kv_cache_manager.py`: `KVCacheManager.allocate_slots`",
            [("vllm/v1/core/kv_cache_manager.py", ("KVCacheManager.allocate_slots",))],
        ),
        (
            "as Model Runner V2 (vllm/v1/worker/gpu/model_runner.py, GPUModelRunner) does",
            [("vllm/v1/worker/gpu/model_runner.py", ("GPUModelRunner",))],
        ),
        (
            "``vllm/v1/worker/gpu_worker.py::\n    determine_available_memory``",
            [("vllm/v1/worker/gpu_worker.py", ("determine_available_memory",))],
        ),
        (
            "``vllm/utils/async_utils.py: merge_async_iterators``",
            [("vllm/utils/async_utils.py", ("merge_async_iterators",))],
        ),
        (
            "(``vllm/v1/kv_cache_interface.py``: ``FullAttentionSpec``, ``SlidingWindowSpec``,\n"
            "   ``KVCacheGroupSpec``; x)",
            [("vllm/v1/kv_cache_interface.py", ("FullAttentionSpec", "SlidingWindowSpec", "KVCacheGroupSpec"))],
        ),
        (
            "Mirrors ``KVCacheBlocks`` in ``vllm/v1/core/kv_cache_manager.py``.",
            [("vllm/v1/core/kv_cache_manager.py", ("KVCacheBlocks",))],
        ),
        (
            "whose `profile_cudagraph_memory()` (`vllm/v1/worker/gpu/model_runner.py`) returns 0",
            [("vllm/v1/worker/gpu/model_runner.py", ("profile_cudagraph_memory",))],
        ),
        ("(`Sym.a`, `vllm/x.py`) but not `Other`, `vllm/y.py`", [("vllm/x.py", ("Sym.a",)), ("vllm/y.py", ())]),
        ("# Mirrors ``A.b`` (``vllm/x.py``: ``c``,\n# ``d``).", [("vllm/x.py", ("c", "d"))]),
        ("# ``A.b`` in\n# ``vllm/x.py``.", [("vllm/x.py", ("A.b",))]),
        (
            "(``vllm/v1/engine/core.py``: ``EngineCore.step``: ``schedule()``)",
            [("vllm/v1/engine/core.py", ("EngineCore.step",))],
        ),
        ("(`vllm/a.py`, `X`, `vllm/b.py`)", [("vllm/a.py", ("X",)), ("vllm/b.py", ())]),
        ("vLLM 0.26's\n  `A.b`, `vllm/x.py`; and `C` in `vllm/y.py`", [("vllm/x.py", ("A.b",)), ("vllm/y.py", ("C",))]),
        (
            "vllm/v1/request.py: the rest, and vllm/v1/outputs.py, which",
            [("vllm/v1/request.py", ()), ("vllm/v1/outputs.py", ())],
        ),
        ("(``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``, ``True``)", [("vllm/v1/core/block_pool.py", ())]),
        ("`vllm/`, `pagedkv/vllm/x.py`, https://github.com/vllm-project/vllm/blob/main/vllm/v1/request.py", []),
    ],
)
def test_extract(text, expected):
    assert [(path, syms) for _, path, syms in extract(text)] == expected


def test_defs_resolves_methods_attributes_bases_and_module_names():
    defs = Defs(
        "from x import imported\n"
        "GiB = 1 << 30\n"
        "if TYPE_CHECKING:\n    FLAG: int = 0\n"
        "class Base:\n    DEFAULT = 16\n    def run(self):\n        self.count = 0\n"
        "class Child(Base):\n    field: int\n    class Inner:\n        deep = 1\n"
        "    @property\n    def size(self): ...\n"
        "def helper():\n    local = 1\n"
    )
    for ok in ["GiB", "FLAG", "Base", "helper", "run", "count", "local", "Child.size", "Child.run", "Child.count",
               "Base.DEFAULT", "Child.field", "Child.Inner.deep", "deep"]:  # fmt: skip
        assert defs.defines(ok), ok
    for bad in ["Base.size", "Child.nope", "imported", "helper.run", "nope", "Child.size.x", "helper.local"]:
        assert not defs.defines(bad), bad
    assert defs.closest("Child.sizes") == "Child.size"
