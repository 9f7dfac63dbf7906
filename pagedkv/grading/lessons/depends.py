"""Judge a later exercise with the earlier exercises' answers in place of the learner's.

Set 01's ``contiguous_capacity`` calls the learner's own ``blocks_needed``; set 05's ``predict_num_gpu_blocks``
calls their ``kv_page_bytes`` and ``num_gpu_blocks``. Checked as written, one mistake in exercise 1 fails every
later exercise too, with hints about the later exercise that do not point at the cause. So a later exercise's
checks run with each earlier function replaced, for the duration of the check, by its reference
(:func:`with_earlier_answers`), in the namespace the learner's function reads its globals from: the notebook's
(the in-notebook check), or the sandbox's (under ``pagedkv grade``: the reference, a function of a
``pagedkv.grading.lessons`` module, crosses by name and is bound there for the test case). The learner's names
are put back afterwards, whatever happens.

Where the later function still fails, the message is the later exercise's own, hint included (its mistake is
judged as if the earlier answer were right); when the learner's earlier function fails its own check too, a
note says so and that the check used a correct one. Set 06 does the same for
``kv_block_offsets`` inside its scenario (:func:`pagedkv.grading.lessons.l06_paged_attention_kernel.
drive_decode_v1` launches a re-jitted copy of the learner's kernel over the reference, in a notebook and under
grading alike).
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


def _namespace(fn: Any) -> dict | None:
    """The globals the learner's ``fn`` reads when it runs in this process (the notebook's namespace); None for
    a callable object or a builtin (checked as it is)."""
    try:
        namespace = getattr(fn, "__globals__", None)
    except Exception:  # noqa: BLE001 - a learner's object whose attribute access raises
        return None
    return namespace if isinstance(namespace, dict) else None


def _learners(value: Any) -> bool:
    """Whether ``value`` is the learner's own (not missing, not a library function imported in its place)."""
    from pagedkv.grading.plain import Learner

    if value is _MISSING:
        return False
    module = value.module if isinstance(value, Learner) else getattr(value, "__module__", None)
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
    replaced by its reference in the namespace ``fn`` reads: its globals here, or under ``pagedkv grade`` the
    sandbox's (``bind``, :meth:`pagedkv.grading.client.Client.bind`); put the learner's names back afterwards.
    A failure while an earlier exercise of the learner's fails its own check says so, without the later
    exercise's hint. ``env`` (the test's ``env`` parameter) is accepted for the test cells' sake."""
    from pagedkv.grading.plain import Learner

    failure: AssertionError | None = None
    if isinstance(fn, Learner):
        client = fn._client
        mine = client.names([e.name for e in earlier])  # the learner's own, as they are before the swap
        client.bind({e.name: e.reference for e in earlier})
        try:
            body()
        except AssertionError as exc:
            failure = exc
        finally:
            client.restore()
        saved = {e.name: mine.get(e.name, _MISSING) for e in earlier}
        swapped = True
    else:
        namespace = _namespace(fn)
        saved = {}
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
        swapped = namespace is not None
    if failure is None:
        return
    if not swapped:
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
