"""Exercise set 01 (fragmentation): the checks pass the solution, fail the stub, and give partial credit that
follows the parts of each contract, with the first failure a learner sees being the one that names the mistake.

The source's test cells run in-process (``tests/source_notebook.py``); ``tests/test_grading.py`` grades the
built notebooks end to end.
"""

from __future__ import annotations

from pathlib import Path

from source_notebook import SourceNotebook, stub

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "01_fragmentation.ipynb"
NB = SourceNotebook(SOURCE)
QUESTIONS = ["blocks_needed", "contiguous_capacity", "paged_admission", "waste_percent"]


def _points(results, question):
    """(passed, total) test cases of one question, and the first failure's message."""
    cases = [(ok, msg) for q, _, ok, msg in results if q == question]
    first = next((msg for ok, msg in cases if not ok), "")
    return sum(ok for ok, _ in cases), len(cases), first


def test_solution_passes_and_stub_fails_every_case() -> None:
    results = NB.grade({})
    assert [r for r in results if not r[2]] == []
    stubbed = NB.grade({q: stub(src) for q, src in NB.solutions.items()})
    assert not [r for r in stubbed if r[2]], "the untouched stub passes a case"
    assert all(msg for *_, msg in stubbed)
    for q in QUESTIONS:
        hidden = {h for qq, h, _, _ in results if qq == q}
        assert hidden == {False, True}, f"{q} needs public and hidden cases"


def test_paged_admission_with_strict_less_than_scores_part_and_names_the_boundary() -> None:
    wrong = NB.solutions["paged_admission"].replace("if need <= free:", "if need < free:")
    assert wrong != NB.solutions["paged_admission"]
    passed, total, first = _points(NB.grade({"paged_admission": wrong}, only={"paged_admission"}), "paged_admission")
    assert (passed, total) == (3, 5)  # fcfs, skip and the refusals hold; the boundary and the hidden sweep fail
    assert "`<=`, not `<`" in first and "paged_admission([16, 16], 2, 16, 'fcfs') returned [0]" in first


def test_paged_admission_without_validation_keeps_the_walks() -> None:
    src = NB.solutions["paged_admission"]
    wrong = src.replace('    if policy not in ("fcfs", "skip"):\n', "    if False:\n").replace(
        "    if pool_blocks < 0:\n", "    if False:\n").replace(
        "needs = [blocks_needed(n, block_size) for n in lens]", "needs = [-(-n // max(block_size, 1)) for n in lens]")
    assert wrong.count("if False:") == 2
    passed, total, first = _points(NB.grade({"paged_admission": wrong}, only={"paged_admission"}), "paged_admission")
    assert 3 <= passed < total
    assert "expected it to raise ValueError" in first


def test_paged_admission_fcfs_for_skip_and_hard_coded_answers_fail_with_hints() -> None:
    fcfs_only = NB.solutions["paged_admission"].replace('elif policy == "fcfs":', "else:")
    passed, total, first = _points(NB.grade({"paged_admission": fcfs_only}, only={"paged_admission"}),
                                   "paged_admission")
    assert 0 < passed < total and "that is what policy='fcfs' admits" in first
    hard = "def paged_admission(lens, pool_blocks, block_size, policy='fcfs'):\n    return list(range(13))\n"
    passed, total, first = _points(NB.grade({"paged_admission": hard}, only={"paged_admission"}), "paged_admission")
    assert passed == 0 and "paged_admission([], 128, 16, 'fcfs') returned [0, 1, 2" in first


def test_run_all_goes_on_past_an_answer_that_raises() -> None:
    raising = "def paged_admission(lens, pool_blocks, block_size, policy='fcfs'):\n    raise NotImplementedError\n"
    results = NB.grade({"paged_admission": raising}, only={"paged_admission"})  # a demo cell that raised would raise
    assert results and not any(ok for _, _, ok, _ in results)
    assert all("raised NotImplementedError" in msg for *_, msg in results)


def test_a_rounding_mistake_in_exercise_1_costs_points_in_exercise_1_only() -> None:
    """The learner's report: blocks_needed rounding down scored 0/12 on the whole set. Exercises 2-4 are judged
    with exercise 1's answer in place of the learner's blocks_needed, and the learner's names are put back."""
    floor = NB.solutions["blocks_needed"].replace("return (num_tokens + block_size - 1) // block_size",
                                                  "return num_tokens // block_size")
    assert floor != NB.solutions["blocks_needed"]
    results = NB.grade({"blocks_needed": floor})
    for q in QUESTIONS[1:]:
        passed, total, first = _points(results, q)
        assert (passed, total, first) == (total, total, ""), (q, first)
    passed, total, first = _points(results, "blocks_needed")
    assert passed == 0 and "rounded down" in first


def test_a_later_exercise_that_keeps_its_own_copy_of_exercise_1_gets_its_own_hint() -> None:
    """issue 19: exercise 2's message is its own (with its hint), and notes that exercise 1 fails too."""
    floor = NB.solutions["blocks_needed"].replace("return (num_tokens + block_size - 1) // block_size",
                                                  "return num_tokens // block_size")
    captured = NB.solutions["contiguous_capacity"].replace(
        "def contiguous_capacity(pool_blocks: int, max_len: int, block_size: int) -> int:",
        "def contiguous_capacity(pool_blocks: int, max_len: int, block_size: int, _bn=blocks_needed) -> int:"
    ).replace("blocks_needed(max_len, block_size)", "_bn(max_len, block_size)")
    assert "_bn(" in captured
    results = NB.grade({"blocks_needed": floor, "contiguous_capacity": captured}, only={"contiguous_capacity"})
    passed, total, first = _points(results, "contiguous_capacity")
    assert passed < total
    assert first.startswith("contiguous_capacity(") and "Hint: each sequence reserves" in first, first
    assert "fix it first" not in first and "own copy" not in first
    assert first.endswith("and exercise 1 (`blocks_needed`) fails its own check too.)"), first


def test_the_learners_blocks_needed_is_put_back_after_each_check() -> None:
    from pagedkv.grading.lessons import l01_fragmentation as l01

    namespace: dict = {}
    exec(NB.solutions["blocks_needed"] + "\n" + NB.solutions["contiguous_capacity"], namespace)
    mine = namespace["blocks_needed"]
    l01.check_contiguous_capacity_examples(namespace["contiguous_capacity"])
    assert namespace["blocks_needed"] is mine
    del namespace["blocks_needed"]
    l01.check_contiguous_capacity_hidden(namespace["contiguous_capacity"])
    assert "blocks_needed" not in namespace
