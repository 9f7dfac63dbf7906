"""Exercise set 10 (tensor parallelism): each plausible mistake fails its exercise with a message naming it, and
a hard-coded answer fails the cases it did not foresee. Runs the source's test cells in-process
(``tests/source_notebook.py``); ``tests/test_grading.py`` grades the built notebooks end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "10_tensor_parallelism.ipynb"
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)


def _first_failure(question: str, answer: str, public_only: bool = False) -> str:
    results = NB.grade({question: answer}, only={question}, public_only=public_only)
    failures = [msg for q, _, ok, msg in results if q == question and not ok]
    assert failures, f"{question}: the planted mistake passed every case"
    return failures[0]


def _variant(question: str, old: str, new: str) -> str:
    src = NB.solutions[question]
    assert old in src, (question, old)
    return src.replace(old, new)


def test_the_solutions_pass_every_case():
    results = NB.grade({})
    assert all(ok for _, _, ok, _ in results), [(q, m) for q, _, ok, m in results if not ok]


@pytest.mark.parametrize("old, new, hint", [
    ("return [rank // (tp // num_kv_heads)]", "return [rank % num_kv_heads]", "NEIGHBOURING"),  # interleaved
    ("return [rank // (tp // num_kv_heads)]", "return [rank]", "NEIGHBOURING"),  # rank 1 of 4, 2 heads: [1]
])
def test_kv_heads_mistakes_are_named(old, new, hint):
    first = _first_failure("kv_heads_of_rank", _variant("kv_heads_of_rank", old, new), public_only=True)
    assert hint in first, first


def test_heads_past_the_last_one_are_named():
    from pagedkv.grading.lessons.l10_tensor_parallelism import check_kv_heads_small

    def no_replication(num_kv_heads, tp, rank):
        n = max(1, num_kv_heads // tp)
        return list(range(rank * n, rank * n + n)) if tp <= num_kv_heads or rank >= num_kv_heads else [0]

    with pytest.raises(AssertionError, match="past the last one"):
        check_kv_heads_small(no_replication)


def test_kv_heads_hard_coded_for_the_examples_fails():
    table = "{(8, 1): 8, (8, 2): 4, (8, 4): 2, (8, 8): 1, (2, 4): 1, (2, 2): 1}"
    hard = ("def kv_heads_of_rank(num_kv_heads, tp, rank):\n"
            f"    n = {table}[(num_kv_heads, tp)]\n"
            "    return [rank * n // max(1, tp // num_kv_heads) + i for i in range(n)] if tp <= num_kv_heads "
            "else [rank // (tp // num_kv_heads)]\n")
    results = NB.grade({"kv_heads_of_rank": hard}, only={"kv_heads_of_rank"})
    passed = {case for q, case, ok, _ in results if ok}
    assert "test_kv_heads_small" not in passed and "test_kv_heads_hidden" not in passed, passed


@pytest.mark.parametrize("old, new, hint", [
    ("max(1, config.get(\"num_key_value_heads\", heads) // tp)", "config.get(\"num_key_value_heads\", heads) // tp",
     "at least one KV head"),
    ("max(1, config.get(\"num_key_value_heads\", heads) // tp)", "config.get(\"num_key_value_heads\", heads)",
     "one-GPU page"),
    ("return block_size * (config[\"kv_lora_rank\"] + config.get(\"qk_rope_head_dim\", 0)) * dtype_bytes",
     "return block_size * (config[\"kv_lora_rank\"] + config.get(\"qk_rope_head_dim\", 0)) * dtype_bytes // tp",
     "the latent is not split"),
    ("return block_size * (config[\"kv_lora_rank\"] + config.get(\"qk_rope_head_dim\", 0)) * dtype_bytes",
     "return 2 * block_size * (config[\"kv_lora_rank\"] + config.get(\"qk_rope_head_dim\", 0)) * dtype_bytes",
     "ONE latent"),
    ("config.get(\"head_dim\") or config[\"hidden_size\"] // heads", "config[\"hidden_size\"] // heads",
     "this config has head_dim="),
])
def test_page_mistakes_are_named(old, new, hint):
    first = _first_failure("kv_page_bytes_per_rank", _variant("kv_page_bytes_per_rank", old, new))
    assert hint in first, first


@pytest.mark.parametrize("new, hint", [
    ("return max(a // page_bytes // num_layers for a in available_per_rank)", "LARGEST"),
    ("return sum(a // page_bytes // num_layers for a in available_per_rank)", "sum over the ranks"),
    ("return available_per_rank[0] // page_bytes // num_layers", "the pool is the smallest"),
])
def test_pool_mistakes_are_named(new, hint):
    old = "return min(a // page_bytes // num_layers for a in available_per_rank)"
    first = _first_failure("pool_num_blocks", _variant("pool_num_blocks", old, new))
    assert hint in first, first


@pytest.mark.parametrize("old, new, hints", [
    ("return 2 * block_size * kv_heads * head_dim * dtype_bytes",
     "return 2 * block_size * kv_heads * head_dim * dtype_bytes * config[\"num_hidden_layers\"]",
     ["the page of all 80 layers"]),
    ("return 2 * block_size * kv_heads * head_dim * dtype_bytes", "return 2 * block_size * kv_heads * head_dim * 2",
     ["multiply by dtype_bytes (1)"]),
    # at tp 1 a head_dim of hidden_size // num_key_value_heads gives the query heads' page: both are named
    ("config[\"hidden_size\"] // heads", "config[\"hidden_size\"] // config[\"num_key_value_heads\"]",
     ["not the query heads", "not // num_key_value_heads"]),
])  # fmt: skip
def test_more_page_mistakes_are_named(old, new, hints):
    first = _first_failure("kv_page_bytes_per_rank", _variant("kv_page_bytes_per_rank", old, new), public_only=True)
    assert all(h in first for h in hints), first


def test_strided_heads_are_named():
    wrong = _variant("kv_heads_of_rank", "list(range(rank * n, (rank + 1) * n))", "list(range(rank, num_kv_heads, tp))")
    first = _first_failure("kv_heads_of_rank", wrong, public_only=True)
    assert "NEIGHBOURING heads" in first and "not one head in every 2" in first, first


@pytest.mark.parametrize("new, hint", [
    ("return min(a / page_bytes / num_layers for a in available_per_rank)", "expected an int"),
    ("return min(round(a / page_bytes / num_layers) for a in available_per_rank)", "round down"),
    ("return min(a // page_bytes // num_layers // 2 for a in available_per_rank)", "do not halve again"),
    ("return sum(available_per_rank) // len(available_per_rank) // page_bytes // num_layers", "average"),
    ("return min(a // page_bytes // num_layers for a in available_per_rank) * len(available_per_rank)",
     "times the 2 ranks"),
])  # fmt: skip
def test_more_pool_mistakes_are_named(new, hint):
    old = "return min(a // page_bytes // num_layers for a in available_per_rank)"
    first = _first_failure("pool_num_blocks", _variant("pool_num_blocks", old, new), public_only=True)
    assert hint in first, first


def test_heads_in_decreasing_order_are_named():
    wrong = _variant("kv_heads_of_rank", "list(range(rank * n, (rank + 1) * n))",
                     "list(range((rank + 1) * n - 1, rank * n - 1, -1))")
    assert "return them in increasing order" in _first_failure("kv_heads_of_rank", wrong, public_only=True)
