"""Grading a Triton kernel from its source (set 06): the learner's ``@triton.jit`` functions, and nothing else.

A kernel exercise is graded in a sandbox that runs none of the notebook's cells: the trusted side takes the
``@triton.jit`` function definitions out of the notebook (their source, parsed here, never run here), with the
module-level constants they may read (``LOG2E = 1.44...``), and the sandbox runs only that program after the
imports a kernel needs. The checks' own harness kernels (library code) then launch the learner's functions there.
So code elsewhere in the notebook (a cell that patches ``JITFunction.__getitem__`` to run PyTorch instead) never
runs while a kernel is graded.

Under the Triton interpreter (no GPU) a kernel's body runs as Python, so the body is also checked to be Triton
code: it may read its arguments, its own locals, ``tl``/``triton``, module constants, other ``@triton.jit``
functions and a few builtins (``range``, ``min``, ``max``...), and contain no import, class, lambda, nested
function, ``global``, ``try`` or ``with``. A body that reaches anything else (``torch``, ``__import__``) fails
its exercise with what it used, as it would fail to compile on a GPU.
"""

from __future__ import annotations

import ast
import builtins

__all__ = ["PRELUDE", "KernelProgram", "kernel_program"]

#: What the sandbox runs before the learner's kernels (the first import sets TRITON_INTERPRET=1 without a GPU).
PRELUDE = "import pagedkv.kernels\nimport math\nimport torch\nimport triton\nimport triton.language as tl\n"

_ALLOWED_BUILTINS = {"range", "min", "max", "int", "float", "bool", "abs", "len", "print", "True", "False", "None"}
_FORBIDDEN = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef,
              ast.Global, ast.Nonlocal, ast.Try, ast.With, ast.AsyncWith, ast.Await, ast.Yield, ast.YieldFrom)


def _is_jit(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef):
        return False
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if (isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name)
                and target.value.id == "triton") or (isinstance(target, ast.Name) and target.id == "jit"):
            return True
    return False


def _is_constant(node: ast.AST) -> bool:
    """A number, or arithmetic of numbers (``1 / math.log(2)`` is not: only literals)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _is_constant(node.left) and _is_constant(node.right)
    return False


def _is_plain(node: ast.AST | None) -> bool:
    """A literal (number, string, bool, None, or a tuple/list of them) or a dotted name (``tl.constexpr``): what a
    kernel's decorator arguments, defaults and annotations may be. Anything else runs code when the ``def`` runs."""
    if node is None or isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_is_plain(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _is_plain(node.operand)
    while isinstance(node, ast.Attribute):
        if node.attr.startswith("__"):
            return False
        node = node.value
    return isinstance(node, ast.Name)


def _signature_problem(fn: ast.FunctionDef) -> str | None:
    """Why the kernel's ``def`` line would run code of its own when the sandbox defines it (another decorator
    than ``@triton.jit``, a default or an annotation that calls something), or None. (A decorator runs when the
    ``def`` runs, and could patch the launcher the grader then calls.)"""
    if len(fn.decorator_list) != 1:
        return "it has another decorator than @triton.jit"
    dec = fn.decorator_list[0]
    if isinstance(dec, ast.Call) and not all(_is_plain(a) for a in (*dec.args, *(k.value for k in dec.keywords))):
        return "its @triton.jit(...) arguments are not plain values"
    args = fn.args
    every = (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg)
    values = (*args.defaults, *args.kw_defaults, fn.returns, *(a.annotation for a in every if a is not None))
    if not all(_is_plain(v) for v in values):
        return "a default value or an annotation of its parameters is not a plain value (tl.constexpr, a number)"
    return None


def _body_problem(fn: ast.FunctionDef, allowed_globals: set[str]) -> str | None:
    """Why the kernel is not Triton code, or None."""
    why = _signature_problem(fn)
    if why is not None:
        return why
    params = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    local = set(params)
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
    for stmt in fn.body:
        for node in ast.walk(stmt):
            if isinstance(node, _FORBIDDEN):
                return f"it contains {type(node).__name__.lower()} code, which a Triton kernel cannot"
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                name = node.id
                if name not in local and name not in allowed_globals and name not in _ALLOWED_BUILTINS:
                    known = hasattr(builtins, name)
                    return (f"it uses `{name}`" + (" (a Python builtin)" if known else "")
                            + ", which is not Triton: a kernel may use tl.*, its arguments, constants and other "
                            "@triton.jit functions")
            if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
                return f"it reads `{node.attr}`, which is not Triton"
    return None


class KernelProgram:
    """The sandbox's program for a kernel exercise, and the kernels whose bodies are not Triton code."""

    def __init__(self, source: str, problems: dict[str, str]) -> None:
        self.source = source
        self.problems = problems


def kernel_program(cells: list[str], wanted: list[str], *, kernel: bool = False) -> KernelProgram | None:
    """The program that defines the notebook's ``@triton.jit`` functions (the last definition of each name, in
    notebook order) and its numeric constants, when every name in ``wanted`` is such a function, or always for a
    ``kernel`` exercise (its stub is a ``@triton.jit`` function: a name the notebook defines some other way is
    then simply not defined, and nothing else of the notebook runs); else None (graded the ordinary way)."""
    defs: dict[str, ast.FunctionDef] = {}
    constants: dict[str, ast.Assign] = {}
    sources: dict[int, str] = {}
    for cell in cells:
        try:
            tree = ast.parse(cell)
        except SyntaxError:
            continue
        for node in tree.body:
            if _is_jit(node):
                defs.pop(node.name, None)
                defs[node.name] = node
                start = node.decorator_list[0]
                sources[id(node)] = "\n".join(cell.splitlines()[start.lineno - 1:node.end_lineno])
            elif (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                  and _is_constant(node.value)):
                constants[node.targets[0].id] = node
                sources[id(node)] = ast.unparse(node)
    if not wanted or not kernel and not all(name in defs for name in wanted):
        return None
    allowed = set(defs) | set(constants) | {"tl", "triton"}
    reached, todo = set(), [w for w in wanted if w in defs]  # the wanted kernels and the jit functions they call
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name) and n.id in defs]
    problems = {}
    for name in sorted(defs):  # every definition runs in the sandbox: each def line is checked, the bodies reached
        why = _body_problem(defs[name], allowed) if name in reached else _signature_problem(defs[name])
        if why is not None:
            problems[name] = why
    parts = [PRELUDE] + [sources[id(n)] for n in constants.values()] + [sources[id(n)] for n in defs.values()]
    return KernelProgram("\n\n".join(parts) + "\n", problems)
