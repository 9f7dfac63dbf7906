"""Set 02 (the block pool), a learner's pass: a hint that named another mistake than the one made.

The source's test cells run in-process (``tests/source_notebook.py``), public cases only, as the check cell runs
them.
"""

from __future__ import annotations

from pathlib import Path

from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "02_block_pool.ipynb"
NB = SourceNotebook(SOURCE)
COMPUTED = "    num_tokens = request.num_computed_tokens + num_new_tokens\n"


def _first_failure(answer: str) -> str:
    results = NB.grade({"allocate_slots": answer}, only={"allocate_slots"}, public_only=True)
    return next(msg for _, _, ok, msg in results if not ok)


def test_allocate_slots_ignoring_the_computed_tokens_is_named() -> None:
    """The table sized for the new tokens alone was hinted "round up, the last block may be partly filled"."""
    src = NB.solutions["allocate_slots"]
    assert COMPUTED in src
    first = _first_failure(src.replace(COMPUTED, "    num_tokens = num_new_tokens\n"))
    assert "the 33rd token crosses into a third block" in first, first
    assert "num_computed_tokens + num_new_tokens = 32 + 1 = 33 tokens, not only the 1 new" in first, first
    assert "round up" not in first, first


def test_a_table_that_is_not_extended_gets_no_computed_tokens_hint() -> None:
    src = NB.solutions["allocate_slots"]
    old = "    manager.req_to_blocks[request.request_id] = table + new_blocks\n"
    assert old in src
    first = _first_failure(src.replace(old, "    manager.req_to_blocks.setdefault(request.request_id, new_blocks)\n"))
    assert "the 33rd token crosses into a third block" in first, first
    assert "not only the" not in first, first


def test_allocate_slots_with_greater_or_equal_is_told_the_boundary() -> None:
    """Refusing when exactly enough blocks are free was told "Is the function still the stub?"."""
    src = NB.solutions["allocate_slots"]
    old = "    if num_missing > manager.block_pool.get_num_free_blocks():\n"
    assert old in src
    first = _first_failure(src.replace(old, old.replace(" > ", " >= ")))
    assert "a 32-token chunk of it: exactly 2 blocks" in first, first
    assert "compare with >, not >=" in first and "still the stub" not in first, first


def test_slot_mapping_that_sorts_positions_is_shown_the_call_it_got() -> None:
    """In a check cell the learner's code got the check's own list: sorted in place, the message showed the
    sorted positions as the call, with the expected slots of the unsorted ones."""
    src = NB.solutions["slot_mapping"]
    head, body = src.split("    # BEGIN SOLUTION\n")
    wrong = head + "    # BEGIN SOLUTION\n    positions.sort()\n" + body
    results = NB.grade({"slot_mapping": wrong}, only={"slot_mapping"}, public_only=True)
    first = next(msg for _, _, ok, msg in results if not ok)
    assert first.startswith("slot_mapping([7, 2], [5, 0, 3], 4) returned [28, 31, 9], expected [9, 28, 31]"), first
