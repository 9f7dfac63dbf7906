"""Set 06 (a Triton paged-attention kernel), a learner's pass: first-kernel mistakes the set's own tests did not
plant, each failing with a message that names it. The source's test cells run in-process
(``tests/source_notebook.py``), public cases only, as the check cell runs them (under grading the same checks run,
in the grader's process, on the scenario's record); the kernels run in Triton's interpreter on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pagedkv.kernels  # noqa: F401 - sets TRITON_INTERPRET=1 without a GPU, before any kernel is defined
import pytest
import torch
from source_notebook import SourceNotebook, changed

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the checks run in the interpreter on CPU"),
]

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "06_paged_attention_kernel.ipynb"
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)
OFFSETS = NB.solutions["kv_block_offsets"]
DECODE = NB.solutions["paged_decode_v1_kernel"]
GROUP = NB.solutions["load_query_group"]
MASK = "mask = j * BLOCK_SIZE + slot < seq_len"
SUM_PV = "acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)"


def test_offsets_and_mask_returned_the_other_way_round_say_what_to_return() -> None:
    """A shape error in the check's own kernel read "raised InterpreterError: ValueError('Cannot
    make_shape_compatible: ...')" with no line and no word of what the function must return."""
    failed = NB.failures("kv_block_offsets", changed(OFFSETS, "return offsets, mask", "return mask, offsets"))
    assert len(failed) == 2, failed
    assert "must return (offsets, mask), in this order" in failed[0], failed[0]
    assert "[BLOCK_SIZE, HEAD_DIM]" in failed[0] and "(in the check's kernel" in failed[0], failed[0]


def test_a_shape_error_in_the_loop_names_the_learners_line() -> None:
    answer = changed(DECODE, "l_i = l_i * alpha + tl.sum(p, axis=0)", "l_i = l_i * alpha + p")
    failed = NB.failures("paged_decode_v1_kernel", answer)
    # No line number: under grading the kernels are compiled from the notebook's source in one file.
    assert failed and "(in paged_decode_v1_kernel: out = acc / l_i)" in failed[0], failed[0]
    assert "m_i and l_i are scalars" in failed[0], failed[0]


def test_a_mask_one_token_short_is_named() -> None:
    failed = NB.failures("kv_block_offsets", changed(OFFSETS, MASK, "mask = j * BLOCK_SIZE + slot < seq_len - 1"))
    assert len(failed) == 1 and "Position 36, the sequence's last token, is masked off" in failed[0], failed


def test_a_mask_that_lets_every_slot_through_is_not_blamed_on_the_slot_index() -> None:
    """``slot < BLOCK_SIZE`` was told "Your mask compares the slot index with seq_len"."""
    failed = NB.failures("kv_block_offsets", changed(OFFSETS, MASK, "mask = slot < BLOCK_SIZE"))
    assert len(failed) == 1 and "lets every slot of block j=2 through" in failed[0], failed
    assert "compares the slot index" not in failed[0], failed


def test_offset_mistakes_without_a_hint_get_one() -> None:
    swapped = changed(
        OFFSETS, "slot[:, None] * stride_kt + kv_head * stride_kh", "slot[:, None] * stride_kh + kv_head * stride_kt"
    )
    failed = NB.failures("kv_block_offsets", swapped)
    assert len(failed) == 1 and "slot t moves by stride_kt, the KV head by stride_kh" in failed[0], failed
    strided = changed(OFFSETS, "tl.load(table_row_ptr + j)", "tl.load(table_row_ptr + j * BLOCK_SIZE)")
    failed = NB.failures("kv_block_offsets", strided)
    assert len(failed) == 1 and "That is physical block 0, not block_table[1]" in failed[0], failed
    no_dims = changed(OFFSETS, " + d[None, :]", "")
    failed = NB.failures("kv_block_offsets", no_dims)
    assert len(failed) == 1 and "Every dim of slot 0 has the same offset" in failed[0], failed


@pytest.mark.parametrize(
    ("scores", "hint"),
    [
        ("s = tl.sum(k * q[None, :], axis=1)  # [BLOCK_SIZE]", "never multiplied by qk_scale"),
        ("s = tl.sum(k * q[None, :], axis=1) * qk_scale * qk_scale  # [BLOCK_SIZE]", "multiplied by qk_scale twice"),
    ],
)
def test_the_scale_left_out_or_applied_twice_is_named(scores: str, hint: str) -> None:
    """The "not multiplied by qk_scale" hint compared with exp and no scale; with exp2 and no scale (what a
    learner writes) it never fired, and the scale applied twice had no hint at all."""
    answer = changed(DECODE, "s = tl.sum(k * q[None, :], axis=1) * qk_scale  # [BLOCK_SIZE]", scores)
    failed = NB.failures("paged_decode_v1_kernel", answer)
    assert len(failed) == 2 and all(hint in m for m in failed), failed


def test_the_query_head_passed_for_the_kv_head_is_named_not_blamed_on_nan() -> None:
    """``kv_block_offsets(..., h, ...)``: query heads past the KV heads read other memory; the hint was the
    softmax's "exp2(-inf - (-inf)) is NaN", which this loop does right."""
    answer = changed(
        DECODE, "kv_block_offsets(table_row, j, seq_len, kv_head,", "kv_block_offsets(table_row, j, seq_len, h,"
    )
    failed = NB.failures("paged_decode_v1_kernel", answer)
    assert len(failed) == 1 and "KV head h, the query head itself" in failed[0], failed  # GROUP=1 is right
    assert "exp2(-inf" not in failed[0] and "h // GROUP" in failed[0], failed


def test_nan_everywhere_from_the_old_max_is_not_called_a_stub() -> None:
    failed = NB.failures("paged_decode_v1_kernel", changed(DECODE, "p = tl.exp2(s - m_new)", "p = tl.exp2(s - m_i)"))
    assert len(failed) == 2 and "never the old m_i" in failed[0] and "If the loop is still the stub" in failed[0]


def test_an_output_divided_twice_or_not_at_all_is_named() -> None:
    for answer in (
        changed(DECODE, SUM_PV, f"{SUM_PV.replace('acc = ', 'acc = (')}) / l_i"),
        changed(DECODE, "    out = acc / l_i\n", "    out = acc\n"),
    ):
        failed = NB.failures("paged_decode_v1_kernel", answer)
        assert len(failed) == 2 and "divided by l_i exactly once" in failed[0], failed


def test_float16_accumulation_is_named() -> None:
    answer = changed(
        DECODE, SUM_PV, "acc = acc * alpha + tl.sum((p[:, None] * v).to(tl.float16), axis=0).to(tl.float32)"
    )
    failed = NB.failures("paged_decode_v1_kernel", answer)
    assert len(failed) == 1 and "float16 arithmetic" in failed[0], failed


def test_a_forgotten_m_i_update_is_in_the_rescale_hint() -> None:
    failed = NB.failures("paged_decode_v1_kernel", changed(DECODE, "        m_i = m_new\n", ""))
    assert failed and "set m_i = m_new for the next block" in failed[0], failed


def test_heads_and_row_mask_returned_the_other_way_round_are_named() -> None:
    failed = NB.failures("load_query_group", changed(GROUP, "return q, heads, row_mask", "return q, row_mask, heads"))
    assert len(failed) == 2 and "return them as q, heads, row_mask, in this order" in failed[0], failed


def test_swapped_query_strides_read_inside_the_probe_buffer() -> None:
    """With stride_qb and stride_qh swapped, query head h reads row h of the buffer: the probe's NaN-filled buffer
    had batch + BLOCK_G + 2 rows, fewer than 24 heads + 16, so the load read memory past it (garbage, or a
    crash of the notebook's kernel). Every value read now is a query's or the buffer's NaN."""
    from pagedkv.grading.lessons.l06_paged_attention_kernel import drive_query_group_probe

    ns: dict = {}
    exec("import triton\nimport triton.language as tl\n", ns)
    code = changed(GROUP, "b * stride_qb + heads[:, None] * stride_qh", "b * stride_qh + heads[:, None] * stride_qb")
    import linecache

    linecache.cache["<swapped strides>"] = (len(code), None, code.splitlines(True), "<swapped strides>")
    exec(compile(code, "<swapped strides>", "exec"), ns)
    q = torch.randn(2, 24, 16, generator=torch.Generator().manual_seed(0))
    record = drive_query_group_probe(ns["load_query_group"], 3, [(8, 16, 1, q)])
    [case] = record["cases"]
    got = case["q"][:, :8]  # the real rows of each KV head's tile
    known = set(q.flatten().tolist())
    assert all(x != x or x in known for x in got.flatten().tolist())


def test_a_query_tile_loaded_as_float32_scores_full_marks() -> None:
    """Loading the group's rows ``.to(tl.float32)``, as exercise 2's given code loads q, lost the hidden point:
    the fp16 case's ``tl.dot(q, kᵀ)`` in the check's kernel refused an fp32 tile against fp16 keys."""
    answer = changed(GROUP, "other=0.0)\n", "other=0.0).to(tl.float32)\n")
    results = NB.grade({"load_query_group": answer}, only={"load_query_group"})
    assert len(results) == 3 and all(ok for _, _, ok, _ in results), results
