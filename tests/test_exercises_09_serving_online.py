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


def test_the_untouched_stub_gets_the_stub_message_only() -> None:
    """The stub returns None; every case's message said so and then gave the search-window hint (the mistake that
    also returns None on that case), pointing a learner who has not started at a bug they do not have."""
    stub = NB.solutions["check_stop_strings"].split('"""', 2)
    stub = stub[0] + '"""' + stub[1] + '"""\n    ...\n'
    for _, _, ok, message in NB.grade({"check_stop_strings": stub}, only={"check_stop_strings"}):
        assert not ok and "still the stub" in message and "Hint" not in message, message
