"""Exercise set 07 (the engine): its checks pass the solution, fail the stub, and fail plausible wrong answers
in a public test with a message that names the mistake.

The test cells of ``grading/source/07_serving_engine.ipynb`` run here in-process (``tests/source_notebook.py``);
``tests/test_grading.py`` grades the built notebooks end to end through ``pagedkv grade``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from source_notebook import SourceNotebook, stub

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "07_serving_engine.ipynb"
QUESTIONS = ["prepare_inputs", "paged_attention"]
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)
ITEMS, SOLUTIONS = NB.items, NB.solutions


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_source_has_every_question_with_public_and_hidden_tests() -> None:
    assert list(SOLUTIONS) == QUESTIONS
    for q in QUESTIONS:
        tests = [hidden for kind, qq, _, hidden in ITEMS if kind == "test" and qq == q]
        assert False in tests and True in tests, f"{q} needs public and hidden tests"


def test_solution_passes_and_stub_fails_every_test() -> None:
    results = NB.grade({})
    assert len(results) == 8 and all(ok for *_, ok, _ in results), [(q, m) for q, _, ok, m in results if not ok]
    results = NB.grade({q: stub(src) for q, src in SOLUTIONS.items()})
    assert not [q for q, _, ok, _ in results if ok] and all(msg for *_, msg in results)


# (id, question, text in the solution, replaced by, a phrase the learner must see in the first public failure)
WRONG = [
    ("positions_from_zero", "prepare_inputs", "out.positions.append(p)", "out.positions.append(p - start)",
     "positions"),
    ("slot_without_table", "prepare_inputs", "table[p // block_size] * block_size + p % block_size", "p",
     "slot_mapping"),
    ("seq_len_is_chunk", "prepare_inputs", "out.seq_lens.append(start + n)", "out.seq_lens.append(n)", "seq_lens"),
    ("samples_partial_prefills", "prepare_inputs", "if rid not in partial:", "if True:", "sample_req_ids"),
    ("logits_row_off_by_one", "prepare_inputs", "out.query_start_loc[-1] - 1)", "out.query_start_loc[-1])",
     "logits_indices"),
    ("attends_before_writing", "paged_attention", "    key_cache.view(-1, hkv, d)[meta.slot_mapping] = k\n"
     "    value_cache.view(-1, hkv, d)[meta.slot_mapping] = v\n", "", "write the cache first"),
    ("wrong_layer", "paged_attention", "meta.kv_caches[module.layer_idx]", "meta.kv_caches[0]", "layer"),
    ("forgets_transpose_back", "paged_attention", "return out.to(query.dtype)[None], None",
     "return out.to(query.dtype).transpose(0, 1)[None], None", "[1, T, Hq, D]"),
]


@pytest.mark.parametrize("wid, question, old, new, phrase", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_answer_fails_a_public_test_with_a_clear_message(wid, question, old, new, phrase) -> None:
    assert old in SOLUTIONS[question], f"{wid}: the solution no longer contains the text to break"
    results = NB.grade({question: SOLUTIONS[question].replace(old, new)}, only={question}, public_only=True)
    failures = [msg for q, _, ok, msg in results if not ok]
    assert failures, f"{wid}: no public test of {question} catches this mistake"
    assert phrase in failures[0], f"{wid}: the first failure does not say {phrase!r}: {failures[0]}"
