"""Set 08 (hybrid models), a learner's pass: exercise 1's mistake cost exercise 2's points, a float count was
hinted as a wrong value, and two wrong scans of the sliding hit got no hint.

The source's test cells run in-process (``tests/source_notebook.py``), as the check cell runs them; one case is
graded end to end (``pagedkv grade``), where exercise 2's checks bind exercise 1's reference in the sandbox.
"""

from __future__ import annotations

from pathlib import Path

from grade_variant import grade_variant
from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "08_hybrid_models.ipynb"
NB = SourceNotebook(SOURCE)

#: exercise 1, one too many (the next token counted as behind itself)
SKIPPED_PLUS_ONE = """def get_num_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    return max(0, num_computed_tokens - sliding_window + 2)
"""
#: exercise 1, the right count as a float
SKIPPED_FLOAT = """def get_num_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    return max(0.0, num_computed_tokens - sliding_window + 1)
"""
#: exercise 2, right, calling exercise 1 as its text says ("exercise 1's count, in whole blocks")
REMOVE_CALLING_EXERCISE_1 = """def remove_skipped_blocks(manager, request_id: str, num_computed_tokens: int) -> None:
    n = get_num_skipped_tokens(num_computed_tokens, manager.sliding_window) // manager.block_size
    blocks = manager.req_to_blocks[request_id]
    null = manager.block_pool.null_block
    removed = []
    for i in range(min(n, len(blocks)) - 1, -1, -1):
        if blocks[i] is null:
            break
        removed.append(blocks[i])
        blocks[i] = null
    manager.block_pool.free_blocks(removed)
"""


def _results(answers: dict[str, str], question: str, public_only: bool = False):
    return [
        (hidden, ok, msg)
        for q, hidden, ok, msg in NB.grade(answers, only={question}, public_only=public_only)
        if q == question
    ]


def test_remove_skipped_is_judged_with_a_correct_skipped_count() -> None:
    """A right remove_skipped_blocks that calls a wrong get_num_skipped_tokens lost the hidden case (one too many)
    or raised TypeError (a float count): exercise 1's mistake cost exercise 2's points."""
    for wrong in (SKIPPED_PLUS_ONE, SKIPPED_FLOAT):
        results = _results({"skipped_tokens": wrong, "remove_skipped": REMOVE_CALLING_EXERCISE_1}, "remove_skipped")
        assert results and all(ok for _, ok, _ in results), results


def test_a_wrong_remove_with_a_wrong_count_says_both() -> None:
    wrong_remove = REMOVE_CALLING_EXERCISE_1.replace("        blocks[i] = null\n", "")
    results = _results({"skipped_tokens": SKIPPED_PLUS_ONE, "remove_skipped": wrong_remove}, "remove_skipped")
    first = next(msg for _, ok, msg in results if not ok)
    assert "put manager.block_pool.null_block in each released block's place" in first, first
    assert "ran with a correct get_num_skipped_tokens in place of yours" in first, first


def test_remove_skipped_graded_with_a_wrong_count_scores_full(tmp_path: Path) -> None:
    scores = grade_variant(tmp_path, "08_hybrid_models",
                           {"get_num_skipped_tokens": SKIPPED_PLUS_ONE,
                            "remove_skipped_blocks": REMOVE_CALLING_EXERCISE_1},
                           only=["remove_skipped"])  # fmt: skip
    assert scores == {"remove_skipped": 4.0}, scores


def test_a_float_count_is_told_the_type_not_a_wrong_value() -> None:
    """0.0 for 0 was hinted "never negative" (public) and "one too many" (hidden): the value was right."""
    results = _results({"skipped_tokens": SKIPPED_FLOAT}, "skipped_tokens")
    failures = [msg for _, ok, msg in results if not ok]
    assert len(failures) == len(results) == 2, results
    for msg in failures:
        assert "expected an int, got float" in msg and "Hint: the right value, but a float" in msg, msg
        assert "never negative" not in msg and "one too many" not in msg, msg


def _first_hit_failure(old: str, new: str) -> str:
    src = NB.solutions["sliding_hit"]
    assert old in src, old
    results = _results({"sliding_hit": src.replace(old, new)}, "sliding_hit", public_only=True)
    return next(msg for _, ok, msg in results if not ok)


def test_a_scan_from_the_left_is_told_to_scan_from_the_right() -> None:
    first = _first_hit_failure("for i in range(n - 1, -1, -1):", "for i in range(n):").replace("\n", " ")
    assert "first run found from the left; scan from the right" in first, first


def test_a_run_that_is_not_reset_on_a_miss_is_told_consecutive() -> None:
    first = _first_hit_failure("            run = 0\n", "")
    assert "*consecutive* cached blocks" in first, first
    assert "a block that is not cached starts the count of the run again" in first, first


def test_the_released_blocks_message_reads_right_for_one_and_none() -> None:
    """It said "1 tokens are skipped, so the first 0 blocks (only whole blocks) are released"."""
    from pagedkv.grading.lessons.l08_hybrid_models import _released

    assert _released(1, 4) == "1 token is skipped, so no block is released (only whole blocks of 4 tokens are)"
    assert _released(5, 4) == "5 tokens are skipped, so the first block (only whole blocks) is released"
    assert _released(13, 4) == "13 tokens are skipped, so the first 3 blocks (only whole blocks) are released"
