"""Set 09 (serving online), a learner's pass: numpy scalars in request_metrics failed the check cell (and passed
``pagedkv grade``), and four plausible mistakes got no hint.

The source's test cells run in-process (``tests/source_notebook.py``), as the check cell runs them.
"""

from __future__ import annotations

from pathlib import Path

from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "09_serving_online.ipynb"
NB = SourceNotebook(SOURCE)

NUMPY_METRICS = """import numpy as np


def request_metrics(start: float, chunk_times: list[float], chunk_tokens: list[int]) -> dict:
    t = np.asarray(chunk_times, dtype=np.float64)
    n = np.sum(np.asarray(chunk_tokens))
    ttft, latency = t[0] - start, t[-1] - start
    return {"ttft": ttft, "itl": list(np.diff(t)), "latency": latency, "output_len": n,
            "tpot": None if n == 1 else (latency - ttft) / (n - 1)}
"""


def _results(question: str, answer: str, public_only: bool = True):
    return [
        (ok, msg)
        for q, _, ok, msg in NB.grade({question: answer}, only={question}, public_only=public_only)
        if q == question
    ]


def _first_failure(question: str, old: str, new: str) -> str:
    src = NB.solutions[question]
    assert old in src, old
    return next(msg for ok, msg in _results(question, src.replace(old, new), public_only=False) if not ok)


def test_numpy_scalars_in_the_metrics_pass() -> None:
    """An np.int64 output_len read "['output_len'] is np.int64(3), expected 3." in the check cell."""
    results = _results("request_metrics", NUMPY_METRICS, public_only=False)
    assert results and all(ok for ok, _ in results), results


def test_metrics_in_milliseconds_are_named() -> None:
    first = _first_failure("request_metrics", "    ttft = chunk_times[0] - start\n",
                           "    ttft = (chunk_times[0] - start) * 1000\n")  # fmt: skip
    assert "['ttft'] is 500.0, expected 0.5" in first and "in milliseconds" in first, first


def test_the_last_stop_match_is_named() -> None:
    first = _first_failure("check_stop_strings", "output_text.find(stop_str, start)",
                           "output_text.rfind(stop_str, start)")  # fmt: skip
    assert "last occurrence" in first and "not rfind" in first, first


def test_an_end_one_short_is_named() -> None:
    first = _first_failure("check_stop_strings", "index += len(stop_str)", "index += len(stop_str) - 1")
    assert first.startswith("check_stop_strings('hello world', 5, ['wor'], True) returned ('wor', 8)"), first
    assert "one short" in first, first


def test_pythons_hash_is_named() -> None:
    first = _first_failure("salted_block_hashes", "hash_block_tokens(sha256_hash,", "hash_block_tokens(hash,")
    assert "pass sha256_hash as hash_block_tokens' hash_fn" in first, first


def test_output_len_as_a_float_fails_saying_it_is_a_count() -> None:
    """``float(sum(chunk_tokens))`` passed: 6.0 is close to 6."""
    first = _first_failure("request_metrics", "output_len = sum(chunk_tokens)", "output_len = float(sum(chunk_tokens))")
    assert "['output_len'] is 3.0, expected 3: a number of tokens is an int" in first, first
