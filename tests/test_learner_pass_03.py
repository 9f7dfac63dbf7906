"""Set 03 (prefix caching and copy-on-write), a learner's pass: correct answers written in other styles score
full marks, and plausible mistakes that the set's own tests do not plant fail with a message that names them.

The source's test cells run in-process (``tests/source_notebook.py``) and, where the answer is a style that must
cross to the grader, through the grading protocol too (``_grade_through_tokens``: the learner's names as tokens,
plain data only, the references stubbed as the sandbox has them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook
from test_exercises_03_prefix_caching import _grade_through_tokens

ROOT = Path(__file__).resolve().parents[1]
NB = SourceNotebook(ROOT / "grading" / "source" / "03_prefix_caching.ipynb", tolerate_cell_errors=True)
SOLUTIONS = NB.solutions


def _variant(question: str, old: str, new: str) -> dict[str, str]:
    assert old in SOLUTIONS[question], f"the solution of {question} no longer contains {old!r}"
    return {question: SOLUTIONS[question].replace(old, new)}


# Correct answers in another style: every case passes, in a check cell and under grading.
# fmt: off
STYLES = {
    "hash_chain_returns_a_tuple": ("hash_chain", "    return hashes\n", "    return tuple(hashes)\n"),
    "lookup_returns_a_tuple_of_blocks": ("prefix_lookup", "        return hits, num_hit_tokens\n",
                                         "        return tuple(hits), num_hit_tokens\n"),
    "lookup_counts_with_numpy": ("prefix_lookup", "        num_hit_tokens = len(hits) * self.block_size\n",
                                 "        num_hit_tokens = __import__('numpy').int64(len(hits)) * self.block_size\n"),
}
# fmt: on


@pytest.mark.parametrize("style", list(STYLES))
def test_a_correct_answer_in_another_style_scores_full_marks(style: str) -> None:
    question, old, new = STYLES[style]
    answers = _variant(question, old, new)
    for route in (NB.grade, _grade_through_tokens):
        results = route(answers, only={question})
        failed = [(hidden, msg) for _, hidden, ok, msg in results if not ok]
        assert results and not failed, (style, route.__name__, failed)


# (id, question, text in the solution, replaced by, a phrase the first public failure must say)
# fmt: off
MISTAKES = [
    ("slice_end_minus_one", "hash_chain", "token_ids[i * block_size : (i + 1) * block_size]",
     "token_ids[i * block_size : (i + 1) * block_size - 1]", "a slice's end is excluded"),
    ("appends_the_parent", "hash_chain",
     "        parent = hash_fn((parent, block, extra_keys))\n        hashes.append(parent)",
     "        hashes.append(parent)\n        parent = hash_fn((parent, block, extra_keys))",
     "The first hash is NONE_HASH"),
    ("extra_keys_in_block_0_only", "hash_chain", "hash_fn((parent, block, extra_keys))",
     "hash_fn((parent, block, extra_keys if i == 0 else None))", "extra_keys went into block 0's key only"),
    ("ignores_hash_fn", "hash_chain", "parent = hash_fn((", "parent = builtin_hash((", "Those are builtin_hash's"),
    ("float_token_count", "prefix_lookup", "        num_hit_tokens = len(hits) * self.block_size\n",
     "        num_hit_tokens = len(hits) * self.block_size / 1\n",
     "returned 16.0 as num_computed_tokens: expected an int"),
    ("queries_count_the_prompt_only", "prefix_lookup", "self.prefix_cache_stats.queries += request.num_tokens",
     "self.prefix_cache_stats.queries += request.num_prompt_tokens", "queries is 10 (expected 19)"),
    ("caches_from_num_computed_tokens", "prefix_lookup", "num_full = num_tokens // self.block_size",
     "num_full = request.num_computed_tokens // self.block_size", "other than its num_tokens argument"),
    ("pops_before_checking", "eviction_on_reuse",
     "        if num_blocks < 0 or num_blocks > self.free_block_queue.num_free_blocks:\n"
     "            raise ValueError(f\"cannot get {num_blocks} blocks: "
     "{self.free_block_queue.num_free_blocks} are free\")\n",
     "", "raised ValueError (No free blocks available"),
    ("misses_the_block_of_the_last_position", "copy_on_write",
     "-(-(request.num_computed_tokens + num_new_tokens) // bs)", "(request.num_computed_tokens + num_new_tokens) // bs",
     "s0's table still holds block 3"),
    ("copies_only_with_three_holders", "copy_on_write", "        if src.ref_cnt > 1:", "        if src.ref_cnt > 2:",
     "s2's table still holds block 3"),
]
# fmt: on


@pytest.mark.parametrize("wid, question, old, new, phrase", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_fails_a_public_case_with_a_message_that_names_it(
    wid: str, question: str, old: str, new: str, phrase: str
) -> None:
    results = NB.grade(_variant(question, old, new), only={question}, public_only=True)
    failures = [msg for _, _, ok, msg in results if not ok]
    assert failures, f"{wid}: no public case of {question} catches it"
    assert phrase in failures[0], f"{wid}: the first failure does not say {phrase!r}: {failures[0]}"


def test_the_pops_before_checking_hint_says_what_to_do() -> None:
    _, question, old, new, _ = next(m for m in MISTAKES if m[0] == "pops_before_checking")
    results = NB.grade(_variant(question, old, new), only={question}, public_only=True)
    first = next(msg for _, _, ok, msg in results if not ok)
    assert "Check that enough blocks are free before popping any" in first, first


def test_the_exercise_says_what_to_return() -> None:
    """A generator of hashes is refused ("expected a list of hashes"): the text says a list; and the hit's token
    count must be an int, as the text says."""
    import json

    text = "".join(
        "".join(c["source"])
        for c in json.loads((ROOT / "exercises" / "03_prefix_caching.ipynb").read_text())["cells"]
        if c["cell_type"] == "markdown"
    )
    assert "Return a list of the hashes of the **full** blocks" in text
    assert "`len(blocks) * block_size` (an int)" in text
