"""Judge a later exercise with the earlier exercises' answers in place of the learner's.

Set 01's ``contiguous_capacity`` calls the learner's own ``blocks_needed``; set 05's ``predict_num_gpu_blocks``
calls their ``kv_page_bytes`` and ``num_gpu_blocks``. Checked as written, one mistake in exercise 1 fails every
later exercise too, with hints about the later exercise that do not point at the cause. So a later exercise's
checks run with each earlier function replaced, for the duration of the check, by its reference
(:func:`with_earlier_answers`), in the namespace the learner's function reads its globals from: the notebook's
(the in-notebook check), or the sandbox's (under ``pagedkv grade``, where the learner's function is a handle and
its ``__globals__`` a handle to the sandbox's namespace; the reference, a function of a
``pagedkv.grading.lessons`` module, crosses by name). The learner's names are put back afterwards, whatever
happens.

Where the later function still fails, the message is the later exercise's own, hint included (its mistake is
judged as if the earlier answer were right); when the learner's earlier function fails its own check too, a
note says so and that the check used a correct one. Set 06 does the same for
``kv_block_offsets`` with a re-jitted kernel in the notebook (:func:`pagedkv.grading.lessons.
l06_paged_attention_kernel.with_reference_offsets`) and the same namespace swap under ``pagedkv grade``
(:func:`pagedkv.grading.lessons.l06_paged_attention_kernel.reference_offsets_in`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Earlier", "with_earlier_answers"]

_MISSING = object()


@dataclass(frozen=True)
class Earlier:
    """An earlier exercise that a later one calls."""

    name: str  # the learner's name for it: "blocks_needed"
    number: int  # its exercise number, as the heading shows it
    reference: Callable[..., Any]  # the answer: a function of a pagedkv.grading.lessons module
    check: Callable[[Any], None]  # one of its public checks: raises AssertionError on a wrong answer


def _is_handle(value: Any) -> bool:
    """A proxy for an object in the grader's sandbox (:class:`pagedkv.grading.remote.RemoteObject`)."""
    return any(k.__name__ == "RemoteObject" and k.__module__ == "pagedkv.grading.remote" for k in type(value).__mro__)


def _namespace(fn: Any, env: Any) -> Any:
    """The globals the learner's ``fn`` reads: its ``__globals__`` when it runs in this process (the notebook's
    namespace, whatever copy of it ``env`` is), the test's ``env`` when ``fn`` is a sandbox handle (``env`` is
    then a handle to the sandbox's namespace; ``fn.__globals__`` would arrive as a copy); else None (a callable
    object, a builtin: checked as it is)."""
    if _is_handle(fn):
        return env if env is not None and _is_handle(env) else None
    try:
        namespace = getattr(fn, "__globals__", None)
    except Exception:  # noqa: BLE001 - a learner's object whose attribute access raises
        return None
    return namespace if isinstance(namespace, dict) else None


def _learners(value: Any) -> bool:
    """Whether ``value`` is the learner's own (not missing, not a library function imported in its place)."""
    if value is _MISSING:
        return False
    module = getattr(value, "__module__", None)
    return not (isinstance(module, str) and (module == "pagedkv" or module.startswith("pagedkv.")))


def _passes(check: Callable[[Any], None], fn: Any) -> bool:
    try:
        check(fn)
    except AssertionError:
        return False
    return True


def with_earlier_answers(fn: Any, earlier: Sequence[Earlier], body: Callable[[], None], *, what: str,
                         env: Any = None) -> None:
    """Run ``body()`` (the checks of the learner's function ``fn``, named ``what``) with each of ``earlier``
    replaced by its reference in ``fn``'s globals (``env``: the test's ``env`` parameter, the notebook's
    namespace); put the learner's names back afterwards. A failure while an earlier exercise of the learner's
    fails its own check says so, without the later exercise's hint."""
    namespace = _namespace(fn, env)
    saved: dict[str, Any] = {}
    failure: AssertionError | None = None
    try:
        if namespace is not None:
            for e in earlier:
                saved[e.name] = namespace[e.name] if e.name in namespace else _MISSING
                namespace[e.name] = e.reference
        try:
            body()
        except AssertionError as exc:
            failure = exc
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                namespace.pop(name, None)
            else:
                namespace[name] = value
    if failure is None:
        return
    if namespace is None:
        raise failure
    # The learner's function may still reach their earlier one (a default argument, an alias, a shared helper).
    failing = [e for e in earlier if _learners(saved[e.name]) and not _passes(e.check, saved[e.name])]
    if not failing or "still the stub" in str(failure):  # an untouched later exercise: say that, nothing else
        raise failure
    which = " and ".join(f"exercise {e.number} (`{e.name}`)" for e in failing)
    message = str(failure).rstrip()
    end = "" if message.endswith((".", "?", "!")) else "."
    raise AssertionError(
        f"{message}{end} (This check ran with a correct {' and '.join(e.name for e in failing)} in place of yours, "
        f"and {which} {'fails' if len(failing) == 1 else 'fail'} {'its' if len(failing) == 1 else 'their'} own "
        "check too.)"
    ) from None
