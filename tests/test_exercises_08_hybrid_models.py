"""Exercise set 08 (hybrid models): the checks pass the solution, fail the stub, and fail plausible wrong
answers with a message that names the mistake. The source's test cells run in-process
(``tests/source_notebook.py``); ``tests/test_grading.py`` grades the built notebooks end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook, stub

from pagedkv.grading.checks import STUB_NOTE

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "08_hybrid_models.ipynb"
NB = SourceNotebook(SOURCE)
QUESTIONS = ["skipped_tokens", "remove_skipped", "sliding_hit", "max_blocks", "group_layers"]


def _points(results, question):
    cases = [(ok, msg) for q, _, ok, msg in results if q == question]
    first = next((msg for ok, msg in cases if not ok), "")
    return sum(ok for ok, _ in cases), len(cases), first


def _wrong(question, old, new):
    src = NB.solutions[question]
    assert old in src, old
    return NB.grade({question: src.replace(old, new)}, only={question})


def test_solution_passes_and_stub_fails_every_case() -> None:
    results = NB.grade({})
    assert [r for r in results if not r[2]] == []
    stubbed = NB.grade({q: stub(src) for q, src in NB.solutions.items()})
    assert not [r for r in stubbed if r[2]], "the untouched stub passes a case"
    assert all(msg for *_, msg in stubbed)
    assert any("still the stub" in msg for q, _, _, msg in stubbed if q == "remove_skipped")
    for q in ("skipped_tokens", "sliding_hit", "max_blocks", "group_layers"):  # the returning exercises: one note
        assert all(STUB_NOTE in msg for qq, _, _, msg in stubbed if qq == q), q
    for q in QUESTIONS:
        assert {h for qq, h, _, _ in results if qq == q} == {False, True}, f"{q} needs public and hidden cases"


def test_skipped_off_by_one_is_named() -> None:
    r = _wrong("skipped_tokens", "num_computed_tokens - sliding_window + 1", "num_computed_tokens - sliding_window")
    passed, total, first = _points(r, "skipped_tokens")
    assert passed == 0 and "is one of the sliding_window tokens it reads" in first


def test_releasing_oldest_first_costs_the_order() -> None:
    r = _wrong(
        "remove_skipped",
        "range(min(skipped // manager.block_size, len(blocks)) - 1, -1, -1)",
        "range(min(skipped // manager.block_size, len(blocks)))",
    )
    passed, total, first = _points(r, "remove_skipped")
    assert passed < total and "newest first" in first


def test_dropping_entries_instead_of_nulls_is_named() -> None:
    src = NB.solutions["remove_skipped"]
    wrong = src.replace("        blocks[i] = null\n", "").replace(
        "    if freed:\n", "    del blocks[: len(freed)]\n    if freed:\n")
    assert wrong != src
    passed, total, first = _points(NB.grade({"remove_skipped": wrong}, only={"remove_skipped"}), "remove_skipped")
    assert passed == 0 and "keep the table's length" in first


def test_not_stopping_at_the_first_null_double_frees() -> None:
    r = _wrong("remove_skipped", "        if blocks[i].is_null:\n            break\n",
               "        if False:\n            break\n")
    passed, total, first = _points(r, "remove_skipped")
    assert passed < total and ("cannot free the null block" in first or "ref_cnt" in first)


def test_the_full_attention_rule_for_the_hit_is_named() -> None:
    src = NB.solutions["sliding_hit"]
    body = src.split("    # BEGIN SOLUTION\n")[1].split("    # END SOLUTION")[0]
    left_to_right = (
        "    blocks = []\n"
        "    for h in block_hashes[: max(0, max_length) // block_size]:\n"
        "        block = block_pool.get_cached_block(h)\n"
        "        if block is None:\n"
        "            break\n"
        "        blocks.append(block)\n"
        "    return blocks, len(blocks) * block_size\n"
    )
    wrong = src.replace(body, left_to_right)
    passed, total, first = _points(NB.grade({"sliding_hit": wrong}, only={"sliding_hit"}), "sliding_hit")
    assert passed < total and "full attention's rule" in first and "scan from the right" in first


@pytest.mark.parametrize(
    "old, new, failing",
    [
        ("need = cdiv(sliding_window - 1, block_size)", "need = cdiv(sliding_window, block_size)", "cdiv(8, 4) = 2"),
        ("    del blocks[run:]\n    return", "    blocks = []\n    return", "short run"),
        ("            del blocks[i + run :]\n", "            blocks = blocks[i:i + run]\n", "gaps"),
    ],
)
def test_hit_mistakes_fail(old, new, failing) -> None:
    passed, total, first = _points(_wrong("sliding_hit", old, new), "sliding_hit")
    assert passed < total and first


def test_max_blocks_mistakes_get_hints() -> None:
    src_expr = "cdiv(min(sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1"
    for new, hint in [
        ("cdiv(min(sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size)", "one block more"),
        ("cdiv(sliding_window - 1 + max_in_flight_tokens, block_size) + 1", "never more than max_model_len"),
        ("cdiv(min(sliding_window + max_in_flight_tokens, max_model_len), block_size) + 1", "not sliding_window"),
    ]:
        passed, total, first = _points(_wrong("max_blocks", src_expr, new), "max_blocks")
        assert passed < total and hint in first, (new, first)
    hard = "def max_admission_blocks_per_request(sliding_window, block_size, max_in_flight_tokens, max_model_len):\n" \
           "    return 1033\n"
    passed, _, _ = _points(NB.grade({"max_blocks": hard}, only={"max_blocks"}), "max_blocks")
    assert passed == 0


def test_grouping_in_chunks_is_named() -> None:
    r = _wrong("group_layers", "groups += [layers[i::n] for i in range(n)]",
               "groups += [layers[i * group_size:(i + 1) * group_size] for i in range(n)]")
    passed, total, first = _points(r, "group_layers")
    assert passed < total and "round-robin" in first
    r = _wrong("group_layers", "    if max(sizes) < group_size * 1.5:\n        group_size = max(sizes)\n", "")
    passed, total, first = _points(r, "group_layers")
    assert passed < total and "pad" in first


@pytest.mark.parametrize(("new", "named"), [("1.25", "close"), ("1.5 or True", "strict")])
def test_a_wrong_padding_threshold_fails_a_public_case(new: str, named: str) -> None:
    """1.25 instead of vLLM's 1.5, or <= instead of <: the public round-robin cases hold a 4 + 5 and a 6 + 4 model."""
    old = "if max(sizes) < group_size * 1.5:"
    answer = NB.solutions["group_layers"].replace(old, "if max(sizes) <= group_size * 1.5:" if "True" in new
                                                   else f"if max(sizes) < group_size * {new}:")
    assert answer != NB.solutions["group_layers"]
    results = [r for r in NB.grade({"group_layers": answer}, only={"group_layers"}, public_only=True)
               if r[0] == "group_layers"]
    assert not all(ok for _, _, ok, _ in results)
    assert any(named in msg for _, _, ok, msg in results if not ok), results


def test_one_group_per_layer_of_a_one_type_model_gets_the_one_type_hint() -> None:
    """All-full layers: the hint says one type is one group, not that two types' counts are close."""
    wrong = "def group_layers(layer_types):\n    return [[i] for i in range(len(layer_types))]\n"
    passed, total, first = _points(NB.grade({"group_layers": wrong}, only={"group_layers"}), "group_layers")
    assert passed == 0 and "['full_attention', 'full_attention', 'full_attention', 'full_attention']" in first
    assert "one attention type is one group" in first and "_get_kv_cache_groups_uniform_spec" in first
    assert "close" not in first and "padding" not in first


@pytest.mark.parametrize(
    ("old", "new", "named", "not_named"),
    [
        ("for layers in same.values():", "for _, layers in sorted(same.items()):", "order of first appearance",
         "close"),  # fmt: skip
        ("n = cdiv(len(layers), group_size)", "n = max(1, len(layers) // group_size)",
         "round the number of groups up", "close"),  # fmt: skip
    ],
)
def test_group_layers_order_and_rounding_are_named(old: str, new: str, named: str, not_named: str) -> None:
    """Types sorted by name instead of by first appearance, and len // group_size groups: each hint says which."""
    passed, total, first = _points(_wrong("group_layers", old, new), "group_layers")
    assert passed < total and named in first and not_named not in first, first


def test_freed_but_left_in_the_table_is_named() -> None:
    passed, total, first = _points(_wrong("remove_skipped", "        blocks[i] = null\n", ""), "remove_skipped")
    assert passed == 0 and "still [1, 2, 3, 4, 5]" in first and "null_block in each released block's place" in first


_RETURN_AT_RUN = "            del blocks[i + run :]\n            return blocks, len(blocks) * block_size"


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("need = cdiv(sliding_window - 1, block_size)", "need = (sliding_window - 1) // block_size",
         "(sliding_window - 1) // block_size = 1 block(s)"),
        ("need = cdiv(sliding_window - 1, block_size)", "need = cdiv(sliding_window, block_size)",
         "cdiv(sliding_window, block_size) = 3 block(s)"),
        ("n = max(0, max_length) // block_size", "n = len(block_hashes)", "a hit is at most max_length tokens"),
        (_RETURN_AT_RUN, _RETURN_AT_RUN.replace("del blocks[i + run :]", "blocks = blocks[i : i + run]"),
         "pool.null_block for every block before the run"),
        (_RETURN_AT_RUN, "            del blocks[i + run :]\n            return blocks, run * block_size",
         "the null blocks count too"),
        ("    del blocks[run:]\n    return blocks, len(blocks) * block_size\n", "    return [], 0\n",
         "still counts when it reaches block 0"),
        ("blocks = [block_pool.null_block] * n", "blocks = [None] * n", "block_pool.null_block, not None"),
    ],
)  # fmt: skip
def test_hit_mistakes_are_named(old: str, new: str, named: str) -> None:
    """Each wrong hit fails a public case whose message names it (a run of cdiv(W, bs) blocks is not called full
    attention's rule, though on the window-9 case both give the same blocks)."""
    results = [r for r in _wrong("sliding_hit", old, new) if r[0] == "sliding_hit" and not r[1]]
    first = next(msg for _, _, ok, msg in results if not ok)
    assert named in first and "full attention's rule" not in first, first


@pytest.mark.parametrize(
    ("new", "named"),
    [
        ("cdiv(min(sliding_window - 1, max_model_len), block_size) + 1", ["the tokens in flight count too"]),
        ("min(cdiv(sliding_window - 1, block_size) + cdiv(max_in_flight_tokens, block_size), "
         "cdiv(max_model_len, block_size)) + 1", ["round up once"]),
        # these two are wrong exactly when "no + 1" is, and give its count: the hint names both
        ("min(sliding_window - 1 + max_in_flight_tokens, max_model_len) // block_size + 1",
         ["one block more", "round the tokens up"]),
        ("min(cdiv(sliding_window - 1 + max_in_flight_tokens, block_size) + 1, cdiv(max_model_len, block_size))",
         ["one block more", "cap the tokens at max_model_len first"]),
    ],
)  # fmt: skip
def test_more_max_blocks_mistakes_are_named(new: str, named: list[str]) -> None:
    expr = "cdiv(min(sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1"
    passed, total, first = _points(_wrong("max_blocks", expr, new), "max_blocks")
    assert passed == 0 and all(n in first for n in named), first


@pytest.mark.parametrize(
    ("new", "named", "not_named"),
    [
        ("max(0, num_computed_tokens - sliding_window + 2)", "one too many", "swapped"),
        ("max(0, sliding_window - num_computed_tokens + 1)", "arguments swapped", "one too many"),
        # a constant 0 (an answer for the examples only) is not called num_computed_tokens - sliding_window
        ("0 if (num_computed_tokens, sliding_window) != (7, 4) else 4", "returned 0, expected 1", "that is"),
    ],
)
def test_skipped_mistakes_are_named(new: str, named: str, not_named: str) -> None:
    r = _wrong("skipped_tokens", "max(0, num_computed_tokens - sliding_window + 1)", new)
    passed, total, first = _points(r, "skipped_tokens")
    assert passed == 0 and named in first and not_named not in first, first


def test_lowering_ref_cnt_by_hand_is_named() -> None:
    r = _wrong("remove_skipped", "        manager.block_pool.free_blocks(freed)",
               "        for b in freed:\n            b.ref_cnt -= 1")
    passed, total, first = _points(r, "remove_skipped")
    assert passed == 0 and "blocks [3, 2, 1] were released but are not in it" in first, first


def test_scenarios_run_without_the_hidden_references_and_return_plain_data(monkeypatch) -> None:
    """Under grading the scenarios run in a sandbox where the exercise's reference raises: building the manager
    and the pool must not call it (``allocate_slots`` calls ``remove_skipped_blocks``), and what comes back must
    be plain data, the same after the trip between processes."""
    from pagedkv.grading.lessons import l08_hybrid_models as lesson
    from pagedkv.grading.plain import decode, encode
    from pagedkv.kv_cache_coordinator import KVCacheCoordinator
    from pagedkv.single_type_kv_cache_manager import SingleTypeKVCacheManager, SlidingWindowManager

    ns: dict = {"cdiv": lesson.cdiv}
    exec(NB.solutions["remove_skipped"] + "\n" + NB.solutions["sliding_hit"], ns)

    def hidden(*args, **kwargs):
        raise NotImplementedError("not available while grading")

    with monkeypatch.context() as m:
        m.setattr(SingleTypeKVCacheManager, "remove_skipped_blocks", hidden)
        m.setattr(KVCacheCoordinator, "remove_skipped_blocks", hidden)
        removed = lesson.drive_remove_skipped(ns["remove_skipped_blocks"], [(4, 8, 20, [8, 20]), (2, 3, 20, [10])])
    with monkeypatch.context() as m:
        m.setattr(SlidingWindowManager, "find_longest_cache_hit", hidden)
        hits = lesson.drive_sliding_hit(ns["find_longest_sliding_hit"], [(4, 8, 24, [3, 5], 24), (4, 16, 24, [3], 24)])
    assert removed[0]["before"]["table"] == [1, 2, 3, 4, 5] and removed[0]["steps"][1]["table"] == [0, 0, 0, 4, 5]
    assert hits == [{"blocks": [0, 2, 3], "length": 12}, {"blocks": [1, 2, 3], "length": 12}]
    for record in (removed, hits):
        assert decode(encode(record)) == record
