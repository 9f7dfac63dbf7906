"""Exercise set 06 (a Triton paged-attention kernel): its checks pass the solution and fail the stub; each part is
scored on its own (a wrong exercise 1 costs exercise 2 nothing, the offsets and the mask earn a point each);
"Run All" never stops at a "Try it" cell; the hints name the mistake that was made.

The source's cells run in-process (``tests/source_notebook.py``), the kernels in Triton's interpreter on CPU:
each grading of the whole source takes tens of seconds, so these tests are marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pagedkv.kernels  # noqa: F401 - sets TRITON_INTERPRET=1 without a GPU, before any kernel is defined
import pytest
from source_notebook import SourceNotebook, stub

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the checks run in the interpreter on CPU"),
]

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "06_paged_attention_kernel.ipynb"
NB = SourceNotebook(SOURCE)  # tolerate_cell_errors=False: a "Try it" cell that raises fails the test
SOL = NB.solutions
INT32 = ("physical = tl.load(table_row_ptr + j).to(tl.int64)", "physical = tl.load(table_row_ptr + j)")
LE = ("mask = j * BLOCK_SIZE + slot < seq_len", "mask = j * BLOCK_SIZE + slot <= seq_len")


def _by_question(results):
    out: dict[str, list[tuple[bool, str]]] = {}
    for q, _, ok, msg in results:
        out.setdefault(q, []).append((ok, msg))
    return out


def _broken(question: str, old: str, new: str) -> str:
    assert old in SOL[question], f"the solution of {question} no longer contains {old!r}"
    return SOL[question].replace(old, new)


def test_solution_passes_and_the_stub_fails_every_case_and_run_all_runs_through() -> None:
    assert [r for r in NB.grade({}) if not r[2]] == []
    stubbed = NB.grade({q: stub(src) for q, src in SOL.items()})  # raises if a "Try it" cell raises
    assert not [r for r in stubbed if r[2]], "the untouched stub passes a case"
    assert all(msg for *_, msg in stubbed)


def test_offsets_and_mask_score_apart_with_their_hints() -> None:
    wrong_mask = _by_question(NB.grade({"kv_block_offsets": _broken("kv_block_offsets", *LE)},
                                       only={"kv_block_offsets"}))["kv_block_offsets"]
    assert [ok for ok, _ in wrong_mask] == [True, False, False]
    assert "use `<`, not `<=`" in wrong_mask[1][1]
    wrapped = _by_question(NB.grade({"kv_block_offsets": _broken("kv_block_offsets", *INT32)},
                                    only={"kv_block_offsets"}))["kv_block_offsets"]
    assert [ok for ok, _ in wrapped] == [False, True, False]
    message = wrapped[0][1]
    assert "wrapped around int32" in message and message.endswith("counted in elements, pass 2**31")  # whole hint
    # The slot compared with seq_len, not its logical position: at seq_len 37 the block j=2 holds position 37 at
    # slot 5, so a test of the `<=` mistake run first named that one, which the learner had not made.
    slot_only = _by_question(NB.grade({"kv_block_offsets": _broken("kv_block_offsets", LE[0], "mask = slot < seq_len")},
                                      only={"kv_block_offsets"}))["kv_block_offsets"]
    assert not slot_only[1][0] and "logical position" in slot_only[1][1] and "<=" not in slot_only[1][1]


def test_a_loop_that_misses_the_partial_block_is_named() -> None:
    """``seq_len // BLOCK_SIZE`` iterations: a sequence shorter than a block is 0 / 0, NaN. The hint used to be
    the softmax's NaN (exp2(-inf - (-inf))), which this kernel does right."""
    wrong = _broken("paged_decode_v1_kernel", "range(0, tl.cdiv(seq_len, BLOCK_SIZE))",
                    "range(0, seq_len // BLOCK_SIZE)")
    results = _by_question(NB.grade({"paged_decode_v1_kernel": wrong}, only={"paged_decode_v1_kernel"},
                                    public_only=True))["paged_decode_v1_kernel"]
    assert not any(ok for ok, _ in results)
    assert "tl.cdiv(seq_len, BLOCK_SIZE)" in results[0][1] and "exp2(-inf" not in results[0][1], results[0][1]


def test_a_wrong_exercise_1_costs_exercise_2_nothing() -> None:
    results = _by_question(NB.grade({"kv_block_offsets": _broken("kv_block_offsets", *INT32)},
                                    only={"kv_block_offsets", "paged_decode_v1_kernel"}))
    assert all(ok for ok, _ in results["paged_decode_v1_kernel"]), results["paged_decode_v1_kernel"]
    assert not all(ok for ok, _ in results["kv_block_offsets"])


def test_a_wrong_exercise_1_costs_exercise_2_nothing_under_pagedkv_grade(tmp_path) -> None:
    """The same under ``pagedkv grade``, where the learner's kernel lives in the sandbox: the check's scenario
    (``drive_decode_v1``) launches it there, as a copy whose ``kv_block_offsets`` is exercise 1's answer.
    Exercise 2 alone is graded (``--only``): one sandbox."""
    root = SOURCE.parents[2]
    nb = json.loads((root / "solutions" / SOURCE.name).read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code" and "def kv_block_offsets(" in "".join(c["source"])]
    assert len(cells) == 1 and LE[0] in "".join(cells[0]["source"])
    cells[0]["source"] = "".join(cells[0]["source"]).replace(*LE)  # ex. 2's check fails with this one in the loop
    (tmp_path / "nb").mkdir()
    (tmp_path / "nb" / SOURCE.name).write_text(json.dumps(nb))
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "grade", str(tmp_path / "nb"), "--only",
                           "paged_decode_v1_kernel", "--json", str(tmp_path / "out.json"), "--no-progress", "-q"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [notebook] = json.loads((tmp_path / "out.json").read_text())["notebooks"]
    [exercise] = notebook["exercises"]
    assert exercise["name"] == "paged_decode_v1_kernel" and exercise["possible"] == 3, exercise
    assert exercise["score"] == 3, [c["message"] for c in exercise["cases"] if not c["passed"]]


def test_decode_loop_without_rescaling_is_named() -> None:
    wrong = _broken("paged_decode_v1_kernel", "acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)",
                    "acc = acc + tl.sum(p[:, None] * v, axis=0)")
    results = _by_question(NB.grade({"paged_decode_v1_kernel": wrong}, only={"paged_decode_v1_kernel"},
                                    public_only=True))["paged_decode_v1_kernel"]
    assert not any(ok for ok, _ in results)
    assert "exp2(m_i - m_new)" in results[0][1]


def test_query_group_hints_name_the_row_that_is_wrong() -> None:
    shifted = _broken("load_query_group", "heads = kv_head * GROUP + r", "heads = kv_head + r")
    results = _by_question(NB.grade({"load_query_group": shifted}, only={"load_query_group"},
                                    public_only=True))["load_query_group"]
    assert not any(ok for ok, _ in results)
    assert "first query head is g * GROUP, not g" in results[0][1]
    # A real row read from a wrong address (the row mask is right): the hint is about the address, not padding.
    bad_address = _broken("load_query_group", "q_ptr + b * stride_qb + heads[:, None] * stride_qh",
                          "q_ptr + b * stride_qb + heads[:, None] * stride_qh * 7")
    results = _by_question(NB.grade({"load_query_group": bad_address}, only={"load_query_group"},
                                    public_only=True))["load_query_group"]
    first = next(msg for ok, msg in results if not ok)
    assert "padding row" not in first and ("address is off" in first or "tile row" in first), first
