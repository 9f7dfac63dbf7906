"""Exercise set 05 (sizing the pool): a mistake in exercise 1 or 2 costs points there only. Exercise 3's checks
put the reference ``kv_page_bytes`` and ``num_gpu_blocks`` in place of the learner's while they run
(``pagedkv.grading.lessons.depends``); ``tests/test_sizing.py`` tests each check's messages."""

from __future__ import annotations

from pathlib import Path

from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "05_sizing_the_pool.ipynb"
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)


def _cases(results, question):
    return [(ok, msg) for q, _, ok, msg in results if q == question]


def test_a_page_without_the_factor_2_costs_points_in_exercise_1_only() -> None:
    half = NB.solutions["kv_page_bytes"].replace("return 2 * block_size *", "return block_size *")
    assert half != NB.solutions["kv_page_bytes"]
    results = NB.grade({"kv_page_bytes": half})
    assert not any(ok for ok, _ in _cases(results, "kv_page_bytes"))
    assert all(ok for ok, _ in _cases(results, "num_gpu_blocks"))
    assert all(ok for ok, _ in _cases(results, "predict_num_gpu_blocks")), _cases(results, "predict_num_gpu_blocks")


def test_a_prediction_that_keeps_its_own_page_size_gets_its_own_message() -> None:
    half = NB.solutions["kv_page_bytes"].replace("return 2 * block_size *", "return block_size *")
    own = NB.solutions["predict_num_gpu_blocks"].replace(
        "kv_cache_dtype=\"auto\") -> int:", "kv_cache_dtype=\"auto\", _page=kv_page_bytes) -> int:"
    ).replace("page = kv_page_bytes(config, block_size, kv_cache_dtype)",
              "page = _page(config, block_size, kv_cache_dtype)")
    assert "_page(config" in own and "_page=kv_page_bytes" in own
    results = NB.grade({"kv_page_bytes": half, "predict_num_gpu_blocks": own}, only={"predict_num_gpu_blocks"})
    (ok, first), *_ = _cases(results, "predict_num_gpu_blocks")
    assert not ok and first.startswith("predict_num_gpu_blocks(") and "fix it first" not in first, first
    assert first.endswith("and exercise 1 (`kv_page_bytes`) fails its own check too.)"), first


def _first_public_failure(question: str, answer: str) -> str:
    results = NB.grade({question: answer}, only={question}, public_only=True)
    return next(msg for _, _, ok, msg in results if not ok)


def test_a_derived_head_dim_is_named_alone_once_the_factor_2_is_known_to_be_right() -> None:
    derived = NB.solutions["kv_page_bytes"].replace('config.get("head_dim") or ', "")
    assert derived != NB.solutions["kv_page_bytes"]
    first = _first_public_failure("kv_page_bytes", derived)
    assert "an explicit head_dim (128) wins" in first and "half the answer" not in first, first


def test_a_head_dim_set_to_none_is_explained() -> None:
    no_none = NB.solutions["kv_page_bytes"].replace(
        'config.get("head_dim") or config["hidden_size"] // heads',
        'config.get("head_dim", config["hidden_size"] // heads)')
    assert no_none != NB.solutions["kv_page_bytes"]
    first = _first_public_failure("kv_page_bytes", no_none)
    assert "head_dim: None" in first and "returns that None" in first, first


def test_an_argument_not_passed_on_is_named_before_a_look_alike() -> None:
    fixed = NB.solutions["predict_num_gpu_blocks"].replace(
        "kv_page_bytes(config, block_size, kv_cache_dtype)", "kv_page_bytes(config, block_size)")
    assert fixed != NB.solutions["predict_num_gpu_blocks"]
    first = _first_public_failure("predict_num_gpu_blocks", fixed)
    assert "Hint: that is the count with kv_cache_dtype='auto'" in first, first


def test_two_mistakes_at_once_are_both_named() -> None:
    """issue 21: a page without the factor 2 that also counts the query heads gets a hint naming both."""
    both = NB.solutions["kv_page_bytes"].replace("return 2 * block_size *", "return block_size *").replace(
        'config.get("num_key_value_heads") or heads', "heads")
    assert both.count("heads") < NB.solutions["kv_page_bytes"].count("heads"), both
    first = _first_public_failure("kv_page_bytes", both)
    assert "Hint: two things at once. First, that is half the answer" in first, first
    assert "Second, you used num_attention_heads" in first, first


def test_auto_on_a_config_without_a_dtype_is_float32() -> None:
    """A learner's pass found ``config.get("dtype", "float16")`` graded 10/10: no case used 'auto' on a config
    without a dtype. Now one does, in a case of its own (the other cases still pass)."""
    fp16 = NB.solutions["kv_page_bytes"].replace('config.get("dtype") or "float32"', 'config.get("dtype", "float16")')
    assert fp16 != NB.solutions["kv_page_bytes"]
    cases = _cases(NB.grade({"kv_page_bytes": fp16}, only={"kv_page_bytes"}), "kv_page_bytes")
    failed = [msg for ok, msg in cases if not ok]
    assert len(failed) == 1 and "no dtype in the config means float32" in failed[0], cases
