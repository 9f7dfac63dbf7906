"""``max_model_len=-1`` (``--max-model-len auto``) and human-readable integers on the command line, as vLLM 0.26
has them: ``_auto_fit_max_model_len`` / ``_estimate_max_model_len_from_groups`` (``vllm/v1/core/kv_cache_utils.py``)
and ``human_readable_int`` / ``human_readable_int_or_auto`` (``vllm/utils/argparse_utils.py``)."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.tiny_models import tiny_model
from pagedkv.entrypoints.cli_args import make_arg_parser
from pagedkv.sizing import estimate_max_model_len
from pagedkv.sizing.hybrid import max_memory_usage_bytes_from_groups
from pagedkv.utils import cdiv
from pagedkv.utils.argparse_utils import human_readable_int, human_readable_int_or_auto

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.mark.parametrize(("text", "want"), [
    ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2M", 2 * 2**20), ("3g", 3 * 10**9), (" 42 ", 42), ("0", 0),
])
def test_human_readable_ints_are_vllms(text, want):
    assert human_readable_int(text) == want
    assert human_readable_int_or_auto(text) == want


def test_auto_and_minus_one_mean_fit_and_bad_spellings_are_refused():
    assert human_readable_int_or_auto("auto") == human_readable_int_or_auto("AUTO") == human_readable_int_or_auto("-1")
    assert human_readable_int_or_auto("-1") == -1
    with pytest.raises(argparse.ArgumentTypeError, match="Did you mean to use 1.5k"):
        human_readable_int("1.5K")
    for bad in ("lots", "1kb", "k", "1.5", "auto"):
        with pytest.raises(ValueError):
            human_readable_int(bad)


def test_the_server_flags_read_them(capsys):
    parser = make_arg_parser()
    args = parser.parse_args(["tiny", "--max-model-len", "auto", "--kv-cache-memory-bytes", "64M",
                              "--max-num-batched-tokens", "2k"])
    assert (args.max_model_len, args.kv_cache_memory_bytes, args.max_num_batched_tokens) == (-1, 64 * 2**20, 2000)
    assert parser.parse_args(["tiny", "--max-model-len", "32K"]).max_model_len == 32768
    with pytest.raises(SystemExit):
        parser.parse_args(["tiny", "--max-model-len", "1.5K"])
    assert "Decimals are not allowed with binary suffixes like K" in capsys.readouterr().err


@given(st.integers(1, 5000), st.integers(1, 64), st.integers(1, 10**6), st.integers(1, 4096))
def test_the_estimate_is_the_longest_length_that_fits(original, block_size, available, page):
    def usage(n: int) -> int:
        return cdiv(n, block_size) * page

    got = estimate_max_model_len(usage, available, original)
    if usage(1) > available:
        assert got == 0
    else:
        assert 1 <= got <= original and usage(got) <= available
        assert got == original or usage(got + 1) > available


def test_a_small_pool_shortens_the_length_to_what_it_holds(llama, capsys):
    llm = LLM(llama, max_model_len=-1, num_gpu_blocks=10)  # vLLM counts the null block too: 10 * 16 tokens
    assert llm.max_model_len == 160 < llama.config.max_position_embeddings
    assert f"Auto-fit max_model_len: reduced from {llama.config.max_position_embeddings} to 160" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match="maximum model length of 160"):
        llm.generate([[1] * 160], GREEDY, use_tqdm=False)
    # vLLM's fit counts block 0 (the null block) as room: a request of all 160 tokens needs a tenth usable block
    with pytest.raises(ValueError, match="the pool has 9 usable blocks"):
        llm.generate([[1] * 150], GREEDY, use_tqdm=False)
    assert len(llm.generate([[1] * 142], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_a_pool_that_holds_the_whole_context_keeps_it(llama, capsys):
    full = llama.config.max_position_embeddings
    assert LLM(llama, max_model_len=-1, num_gpu_blocks=full // 16).max_model_len == full
    assert f"Auto-fit max_model_len: full model context length {full} fits" in capsys.readouterr().out


def test_a_byte_budget_too_small_for_the_context_is_fitted_not_refused(llama):
    block = LLM(llama, num_gpu_blocks=4)._block_bytes()
    with pytest.raises(ValueError, match="To serve at least one request"):
        LLM(llama, kv_cache_memory_bytes=5 * block)  # without auto-fit: vLLM's refusal
    assert LLM(llama, max_model_len=-1, kv_cache_memory_bytes=5 * block).max_model_len == 5 * 16


def test_a_sliding_window_model_fits_by_its_groups():
    model = tiny_model("mistral")  # every layer slides: one group of sliding-window pages
    llm = LLM(model, max_model_len=-1, num_gpu_blocks=12)
    assert llm.kv_cache_groups is not None
    available = 12 * llm._block_bytes()
    in_flight = 2 * llm.max_num_batched_tokens  # async scheduling: two batches in flight (max_in_flight_tokens)

    def usage(n: int) -> int:
        return max_memory_usage_bytes_from_groups(llm.kv_cache_groups, n, in_flight)

    assert usage(llm.max_model_len) <= available < usage(llm.max_model_len + 1)


def test_other_negative_lengths_are_refused(llama):
    for bad in (-2, 0, 1):
        with pytest.raises(ValueError, match="max_model_len must be an int in 2"):
            LLM(llama, max_model_len=bad, num_gpu_blocks=10)
