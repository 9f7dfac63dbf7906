"""Set 07 (the engine), a learner's pass: two answers that scored full marks although a real engine would go
wrong with them. The source's test cells run in-process (``tests/source_notebook.py``), public cases only, as the
check cell runs them (under grading the same scenarios run in the sandbox and are judged in the grader)."""

from __future__ import annotations

from pathlib import Path

from source_notebook import SourceNotebook, changed
from test_engine import one_thread  # noqa: F401 (an autouse fixture: one torch thread)

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "07_serving_engine.ipynb"
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)
PREPARE = NB.solutions["prepare_inputs"]
ATTENTION = NB.solutions["paged_attention"]


def test_prepare_inputs_that_empties_the_scheduler_output_fails() -> None:
    """Popping each request off ``scheduler_output.num_scheduled_tokens`` gave the right inputs and full marks
    (every call ran on a copy); the scheduler reads that dict again in ``update_from_output``."""
    answer = changed(
        PREPARE, "n = scheduler_output.num_scheduled_tokens[rid]", "n = scheduler_output.num_scheduled_tokens.pop(rid)"
    )
    failed = NB.failures("prepare_inputs", answer)
    # the example and the random steps fail; the end-to-end case judges the engine's tokens (it runs on copies)
    assert len(failed) == 2 and "returned the right inputs, but changed its arguments" in failed[0], failed
    assert (
        "scheduler_output.num_scheduled_tokens was {'A': 9, 'B': 6, 'C': 9} before the call, {} after it" in failed[0]
    ), failed
    assert "update_from_output" in failed[0], failed


def test_prepare_inputs_that_writes_into_token_ids_fails() -> None:
    answer = changed(PREPARE, "return out\n", "token_ids.clear()\n    return out\n")
    failed = NB.failures("prepare_inputs", answer)
    assert failed and "changed its arguments: token_ids" in failed[0], failed


def test_attention_that_ignores_scaling_fails_and_is_named() -> None:
    """``1/sqrt(head_dim)`` in place of ``scaling`` scored full marks: every step passed that very scale."""
    answer = changed(
        ATTENTION,
        "scale = scaling if scaling is not None else query.shape[-1] ** -0.5",
        "scale = query.shape[-1] ** -0.5",
    )
    failed = NB.failures("paged_attention", answer)
    assert failed, "an answer that ignores scaling passed"
    assert "Your output is attention with softmax scale 1/sqrt(head_dim)" in failed[0], failed
    assert "not the `scaling` this call passes" in failed[0], failed


def test_attention_whose_output_is_always_float32_fails_on_a_bfloat16_step() -> None:
    """``torch.zeros(q.shape)`` for the output (float32 whatever the query) scored full marks: every step was
    float32. Every fifth random step is now bfloat16."""
    answer = changed(ATTENTION, "    out = torch.empty_like(q)\n", "    out = torch.zeros(q.shape)\n")
    answer = changed(answer, "return out.to(query.dtype)[None], None", "return out[None], None")
    failed = NB.failures("paged_attention", answer)
    assert failed, "an output always in float32 passed"
    assert "in torch.bfloat16" in failed[0] and "the output is torch.float32, the query torch.bfloat16" in failed[0]
    assert "make the output in the query's dtype" in failed[0], failed


def test_the_solution_still_passes_every_case() -> None:
    results = NB.grade({})
    assert results and all(ok for _, _, ok, _ in results), [m for _, _, ok, m in results if not ok]
