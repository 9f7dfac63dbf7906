"""Exercise set 09 (serving online): the plausible mistakes fail with a message naming them, and cost points in
their own exercise only. The source's test cells run in-process (``tests/source_notebook.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "09_serving_online.ipynb"
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)


def _first_failure(question: str, answer: str) -> str:
    results = NB.grade({question: answer}, only={question})
    return next(msg for _, _, ok, msg in results if not ok)


def test_the_solutions_pass_every_case() -> None:
    assert all(ok for _, _, ok, _ in NB.grade({})), [m for *_, ok, m in NB.grade({}) if not ok]


@pytest.mark.parametrize(("question", "old", "new", "named"), [
    ("check_stop_strings", "start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)", "start = 0",
     "searched already"),
    ("check_stop_strings", "if index >= len(output_text):", "if False:", "the offset is -1"),
    ("salted_block_hashes", "if i == 0 and cache_salt is not None", "if cache_salt is not None",
     "first block's only"),
    ("salted_block_hashes", "parent = hashes[-1] if hashes else None", "parent = None", "without its parent"),
    ("request_metrics", "latency = chunk_times[-1] - start", "latency = chunk_times[-1] - chunk_times[0]",
     "when the request was sent"),
    ("request_metrics", "/ (output_len - 1) if output_len > 1 else None", "/ output_len if output_len > 1 else None",
     "output_len - 1"),
])
def test_a_plausible_mistake_is_named(question: str, old: str, new: str, named: str) -> None:
    answer = NB.solutions[question].replace(old, new)
    assert answer != NB.solutions[question], old
    results = NB.grade({question: answer})
    assert not all(ok for q, _, ok, _ in results if q == question)
    assert all(ok for q, _, ok, _ in results if q != question), "a mistake costs points in its own exercise only"
    assert named in _first_failure(question, answer)
