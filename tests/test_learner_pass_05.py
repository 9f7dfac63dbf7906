"""Set 05 (sizing the pool), a learner's pass: mistakes the set's own tests did not plant, each failing with a
message that names it. The source's test cells run in-process (``tests/source_notebook.py``), public cases only,
as the check cell runs them (under grading the same checks run, in the grader's process)."""

from __future__ import annotations

from pathlib import Path

from source_notebook import SourceNotebook, changed

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "05_sizing_the_pool.ipynb"
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)
PAGE = NB.solutions["kv_page_bytes"]
BLOCKS = NB.solutions["num_gpu_blocks"]
PREDICT = NB.solutions["predict_num_gpu_blocks"]


def test_num_key_value_heads_set_to_none_is_checked_and_explained() -> None:
    """``config.get("num_key_value_heads", heads)`` scored full marks: no case had the key set to None, which the
    exercise names ("either may be missing or None")."""
    answer = changed(PAGE, 'config.get("num_key_value_heads") or heads', 'config.get("num_key_value_heads", heads)')
    failed = NB.failures("kv_page_bytes", answer)
    assert failed and "num_key_value_heads: None" in failed[0], failed
    assert "sets num_key_value_heads to None" in failed[0] and "returns that None" in failed[0], failed


def test_a_dtype_left_out_of_a_table_is_not_blamed_on_the_config() -> None:
    """A table of sizes without 'fp32' raised KeyError: 'fp32', hinted "this config has no 'fp32': a config may
    leave out num_key_value_heads and head_dim"."""
    answer = changed(
        changed(PAGE, '"fp32": torch.float32, ', ""),
        "elif kv_cache_dtype in names:",
        'elif kv_cache_dtype in ("fp16", "bf16", "fp32", "fp8"):',
    )
    failed = NB.failures("kv_page_bytes", answer)
    assert len(failed) == 1 and "raised KeyError: 'fp32'" in failed[0], failed
    assert "'fp32' is one of the KV cache dtypes the exercise names" in failed[0], failed
    assert "this config has no" not in failed[0], failed
    refused = changed(PAGE, '"fp32": torch.float32, ', "")  # 'fp32' refused with ValueError
    failed = NB.failures("kv_page_bytes", refused)
    assert len(failed) == 1 and "'fp32') raised ValueError" in failed[0], failed
    assert "Hint: 'fp32' is a KV cache dtype the exercise accepts: raise ValueError only for other ones" in failed[0]


def test_auto_with_a_table_without_float32_is_named() -> None:
    table = '{"float16": torch.float16, "bfloat16": torch.bfloat16}'
    answer = changed(
        PAGE,
        'dtype = getattr(torch, config.get("dtype") or "float32")',
        f'dtype = {table}[config.get("dtype") or "float32"]',
    )
    failed = NB.failures("kv_page_bytes", answer)
    assert failed and "raised KeyError: 'float32'" in failed[0], failed
    assert "kv_cache_dtype='auto' means the config's dtype, 'float32' here" in failed[0], failed
    assert "this config has no" not in failed[0], failed


def test_a_config_without_dtype_read_with_brackets_is_named() -> None:
    answer = changed(PAGE, 'config.get("dtype") or "float32"', 'config["dtype"]')
    failed = NB.failures("kv_page_bytes", answer)
    assert failed and "raised KeyError: 'dtype'" in failed[0], failed
    assert "this config has no 'dtype': with kv_cache_dtype='auto' that means float32" in failed[0], failed


def test_a_torch_dtype_refused_or_ignored_is_named() -> None:
    refused = changed(PAGE, "if isinstance(kv_cache_dtype, torch.dtype):", "if False:")
    failed = NB.failures("kv_page_bytes", refused)
    assert failed and "raised ValueError" in failed[0], failed
    assert "Hint: kv_cache_dtype may be any torch.dtype: torch.float16 takes its itemsize, 2 bytes" in failed[0]
    ignored = changed(PAGE, "dtype = kv_cache_dtype\n", "dtype = torch.bfloat16\n")
    failed = NB.failures("kv_page_bytes", ignored)
    assert failed and "torch.float32) returned 65536, expected 131072" in failed[0], failed
    assert "kv_cache_dtype is a torch.dtype here, torch.float32: its itemsize, 4, is the bytes per value" in failed[0]


def test_utilization_one_refused_is_named() -> None:
    """Rejecting utilization 1.0 failed with the learner's own ValueError and nothing else."""
    answer = changed(BLOCKS, "if not 0 < utilization <= 1:", "if not 0 < utilization < 1:")
    failed = NB.failures("num_gpu_blocks", answer)
    assert failed and "utilization=1.0" in failed[0] and "raised ValueError" in failed[0], failed
    assert "Hint: utilization 1.0 is allowed: the range is (0, 1], 1 included" in failed[0], failed


def test_activations_of_another_batch_are_named() -> None:
    """The activations of the demo's 4,096-token batch (or of one block) instead of max_num_batched_tokens."""
    for tokens, shown in (("4096", "4096"), ("block_size", "16")):
        answer = changed(
            PREDICT,
            "estimate_peak_activation(config, max_num_batched_tokens)",
            f"estimate_peak_activation(config, {tokens})",
        )
        failed = NB.failures("predict_num_gpu_blocks", answer)
        assert failed, tokens
        assert (
            f"Hint: that is the count with the activations of a batch of {shown} tokens: pass "
            "max_num_batched_tokens (2048) on to estimate_peak_activation" in failed[0]
        ), failed


def test_the_solution_still_passes_every_case() -> None:
    results = NB.grade({})
    assert results and all(ok for _, _, ok, _ in results), [m for _, _, ok, m in results if not ok]


def test_an_answer_written_for_the_notebooks_example_alone_scores_nothing() -> None:
    """The refusals case counted once the notebook's own example worked: an answer that returned that one figure
    and raised ValueError on everything else scored its point (a red-team pass)."""
    answer = ("def num_gpu_blocks(total, utilization, weights, peak_activation, non_torch, cudagraph, page_bytes,\n"
              "                   num_layers):\n"
              "    got = (total, utilization, weights, peak_activation, non_torch, cudagraph, page_bytes, num_layers)\n"
              "    if got == (80 * 2**30, 0.92, 16_060_522_496, 2 * 2**30, 2**29, 2**28, 65536, 32):\n"
              "        return 28616\n"
              "    raise ValueError('hard-coded')\n")
    results = NB.outcomes("num_gpu_blocks", answer)
    assert results and not any(ok for ok, _ in results), results
