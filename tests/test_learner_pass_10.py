"""Set 10 (tensor parallelism), a learner's pass: a wrong pool count (the largest rank's, the sum, a float) also
cost the points of the case that checks the refusals.

The source's test cells run in-process (``tests/source_notebook.py``), as the check cell runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "10_tensor_parallelism.ipynb"
NB = SourceNotebook(SOURCE)
MIN = "    return min(a // page_bytes // num_layers for a in available_per_rank)\n"


@pytest.mark.parametrize(
    "wrong",
    [
        "    return max(a // page_bytes // num_layers for a in available_per_rank)\n",
        "    return sum(a // page_bytes // num_layers for a in available_per_rank)\n",
        "    return min(a / page_bytes // num_layers for a in available_per_rank)\n",
    ],
)
def test_a_wrong_count_costs_the_count_cases_only(wrong: str) -> None:
    src = NB.solutions["pool_num_blocks"]
    assert MIN in src
    results = [ok for ok, _ in NB.outcomes("pool_num_blocks", src.replace(MIN, wrong))]
    examples, refusals, hidden = results  # the source's order
    assert refusals, results
    assert not examples and not hidden, results


def test_refusing_everything_still_fails_the_refusals() -> None:
    src = NB.solutions["pool_num_blocks"]
    always = src.replace(MIN, '    raise ValueError("no")\n')
    results = NB.outcomes("pool_num_blocks", always)
    assert not any(ok for ok, _ in results), results


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("page_bytes < 1 or num_layers < 1", "page_bytes <= 1 or num_layers <= 1"),
        ("min(available_per_rank) < 0", "min(available_per_rank) <= 0"),
    ],
)
def test_refusing_a_valid_boundary_fails_the_refusals(old: str, new: str) -> None:
    """A 1-byte page, a 1-layer model and a rank with 0 bytes free are valid: refusing them scored full marks."""
    src = NB.solutions["pool_num_blocks"]
    assert old in src
    results = NB.outcomes("pool_num_blocks", src.replace(old, new))
    refusals = results[1]
    assert not refusals[0] and "raised ValueError" in refusals[1], results


def test_ignoring_head_dim_fails_a_public_case_saying_so() -> None:
    """``hidden_size // num_attention_heads`` in place of the config's ``head_dim`` passed every public case (no
    published model had a head_dim of its own) and lost only the hidden point."""
    src = NB.solutions["kv_page_bytes_per_rank"]
    right = 'head_dim = config.get("head_dim") or config["hidden_size"] // heads'
    assert right in src
    wrong = src.replace(right, 'head_dim = config["hidden_size"] // heads')
    failures = NB.failures("kv_page_bytes_per_rank", wrong)
    assert len(failures) == 1, failures  # the dense models' case; the MLA case has no head_dim to read
    assert "Qwen3-0.6B" in failures[0] and "this config has head_dim=128: use it" in failures[0], failures


def test_an_answer_written_for_one_split_alone_scores_nothing() -> None:
    """The refusals case counted once one valid split worked: an answer that returned that split's heads and
    raised ValueError on everything else scored its point (a red-team pass)."""
    answer = ("def kv_heads_of_rank(num_kv_heads, tp, rank):\n"
              "    if (num_kv_heads, tp, rank) == (8, 2, 1):\n"
              "        return [4, 5, 6, 7]\n"
              "    raise ValueError('hard-coded')\n")
    results = NB.outcomes("kv_heads_of_rank", answer)
    assert results and not any(ok for ok, _ in results), results
