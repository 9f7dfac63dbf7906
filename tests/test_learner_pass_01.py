"""Set 01 (fragmentation), a learner's pass: mistakes whose check-cell message and grade disagreed, or whose hint
named another mistake.

In-process (``tests/source_notebook.py``) for the messages; one end-to-end grade (``grade_variant``) for the
argument that the learner's code changes, which under ``pagedkv grade`` is a copy in the sandbox.
"""

from __future__ import annotations

from pathlib import Path

from grade_variant import grade_variant
from source_notebook import SourceNotebook

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "01_fragmentation.ipynb"
NB = SourceNotebook(SOURCE)

# Turns each length into the blocks it needs, in the list it was given (a tuple is copied first): right answers,
# and the caller's list changed.
WRITES_INTO_LENS = """def paged_admission(lens, pool_blocks, block_size, policy="fcfs"):
    if policy not in ("fcfs", "skip"):
        raise ValueError(policy)
    if pool_blocks < 0 or block_size < 1 or any(n < 0 for n in lens):
        raise ValueError("bad input")
    lens = lens if isinstance(lens, list) else list(lens)
    for i, n in enumerate(lens):
        lens[i] = blocks_needed(n, block_size)
    free, out = pool_blocks, []
    for i, need in enumerate(lens):
        if need <= free:
            free -= need
            out.append(i)
        elif policy == "fcfs":
            break
    return out
"""


def _first_failure(answers: dict[str, str], question: str, public_only: bool = True) -> tuple[int, int, str]:
    results = NB.grade(answers, only={question}, public_only=public_only)
    cases = [(ok, msg) for q, _, ok, msg in results if q == question]
    return sum(ok for ok, _ in cases), len(cases), next((msg for ok, msg in cases if not ok), "")


def test_writing_into_lens_is_seen_in_the_check_cell() -> None:
    passed, total, first = _first_failure({"paged_admission": WRITES_INTO_LENS}, "paged_admission")
    assert passed == total - 1
    assert first.startswith("paged_admission changed its argument lens: [40, 128, 300"), first
    assert "do not write into it" in first


def test_writing_into_lens_costs_its_point_under_grading(tmp_path: Path) -> None:
    """The check called the learner's function and then looked at its own list: under grading the call runs in
    the sandbox on a copy, so the change was never seen (5/5 graded, 4/5 in the check cell)."""
    assert grade_variant(tmp_path, "01_fragmentation", {"paged_admission": WRITES_INTO_LENS}) == {
        "paged_admission": 4.0
    }


def test_a_replaced_scenario_does_not_hide_the_change(tmp_path: Path) -> None:
    """A red team's route: the answer that writes into lens, plus a cell replacing the scenario that reports
    lens with one echoing it unchanged. The sandbox runs each scenario from a fresh copy of its lesson module,
    so the replacement is never called (it scored 12/12)."""
    forged = WRITES_INTO_LENS + (
        "\n\nimport pagedkv.grading.lessons.l01_fragmentation as _L\n"
        "_L.drive_paged_admission_keeps_lens = lambda fn, lens, *a: {'label': 'x', 'lens': list(lens)}\n"
    )
    assert grade_variant(tmp_path, "01_fragmentation", {"paged_admission": forged}) == {"paged_admission": 4.0}


def test_a_negative_length_after_the_fcfs_stop_must_be_refused() -> None:
    """Relying on blocks_needed to refuse a negative length misses one that FCFS never reaches."""
    lazy = (
        'def paged_admission(lens, pool_blocks, block_size, policy="fcfs"):\n'
        '    if policy not in ("fcfs", "skip") or pool_blocks < 0 or block_size < 1:\n'
        '        raise ValueError("bad input")\n'
        "    free, out = pool_blocks, []\n"
        "    for i, n in enumerate(lens):\n"
        "        need = blocks_needed(n, block_size)\n"
        "        if need <= free:\n"
        "            free -= need\n"
        "            out.append(i)\n"
        '        elif policy == "fcfs":\n'
        "            break\n"
        "    return out\n"
    )
    passed, total, first = _first_failure({"paged_admission": lazy}, "paged_admission")
    assert passed == total - 1, first
    assert first.startswith("paged_admission([300, -1], 1, 16, 'fcfs') returned [], expected it to raise"), first


def test_the_tuple_hint_only_follows_a_right_answer_for_a_list() -> None:
    """A wrong answer (fcfs where skip was asked) failed the refusals case on the tuple call, hinted "lens may be
    any sequence, a tuple too"."""
    fcfs_only = NB.solutions["paged_admission"].replace('elif policy == "fcfs":', "else:")
    results = NB.grade({"paged_admission": fcfs_only}, only={"paged_admission"}, public_only=True)
    messages = [msg for _, _, ok, msg in results if not ok]
    assert messages and not any("a tuple too" in msg for msg in messages), messages
    tuple_only = NB.solutions["paged_admission"].replace(
        "    # BEGIN SOLUTION\n", "    # BEGIN SOLUTION\n    if isinstance(lens, tuple):\n        return []\n"
    )
    assert tuple_only != NB.solutions["paged_admission"]
    passed, total, first = _first_failure({"paged_admission": tuple_only}, "paged_admission")
    assert passed == total - 1 and "a tuple too" in first, first


def test_contiguous_capacity_hints_name_the_mistake_made() -> None:
    src = NB.solutions["contiguous_capacity"]
    line = next(x for x in src.splitlines() if x.strip().startswith("return ") and "//" in x)
    indent = line[: len(line) - len(line.lstrip())]
    cases = {
        # true division: the count is right but a float; the hint blamed tokens
        f"{indent}return pool_blocks / blocks_needed(max_len, block_size)": "divide with //, not /",
        # tokens instead of blocks: the hint said "not 31" where the answer had no 31
        f"{indent}return pool_blocks * block_size // max_len": "nor 500 / 16 = 31.25 in tokens",
        # blocks rounded down: this count is also what the tokens mistake gives
        f"{indent}return pool_blocks // (max_len // block_size)": "not 31",
    }
    for new, phrase in cases.items():
        passed, total, first = _first_failure({"contiguous_capacity": src.replace(line, new)}, "contiguous_capacity")
        assert passed == 0 and phrase in first, (new, first)


def test_waste_percent_hints_name_rounding_floor_division_and_a_mean_of_percentages() -> None:
    src = NB.solutions["waste_percent"]
    line = next(x for x in src.splitlines() if x.strip().startswith("return 100"))
    indent = line[: len(line) - len(line.lstrip())]
    expr = line.strip()[len("return ") :]
    cases = {
        f"{indent}return round({expr}, 2)": "16.666666666666668 rounded: return the exact percentage",
        f"{indent}return {expr.replace(' / ', ' // ')}": "rounded down: divide with /, not //",
        (
            f"{indent}lens = [n for n in lens if n]\n"
            f"{indent}return sum(waste_percent([n], block_size) for n in lens) / len(lens) if len(lens) > 1 "
            f"else {expr}"
        ): "the mean of each sequence's percentage",
    }
    for new, phrase in cases.items():
        assert expr.count(" / ") == 1, expr
        passed, total, first = _first_failure({"waste_percent": src.replace(line, new)}, "waste_percent")
        assert passed == 0 and phrase in first, (new, first)
