"""An adversarial pass over the public API: each test pins one bug found there (it failed before its fix).

- a stop string that is (or ends in) a character whose UTF-8 bytes are split over several tokens was never seen,
  so the text ran on past it (vLLM 0.26's detokenizer emits the character once complete and stops there);
- ``BlockPool.cache_full_blocks`` with a negative ``num_cached_blocks`` cached the table's last block under another
  position's hash, and with ``num_full_blocks`` beyond the table it cached part of it and then failed;
- ``LLM.generate([[]])`` said an empty list of token ids is "not a list of token ids" instead of "empty".
"""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv import KVCacheManager, Request
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.output_processor import RequestState
from pagedkv.entrypoints.tiny import tiny_tokenizer
from pagedkv.kv_cache_utils import get_hash_fn, update_block_hashes


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("stop", ["中", "é", "😀", "x中"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_completed_by_a_split_character_is_seen(tok, stop, include):
    """The tiny byte-level tokenizer spells "中" as three byte tokens: the text reads "a\\ufffd" after the first two
    and "a中" after the third, no longer than before. The stop string must still be found there, as vLLM's
    ``IncrementalDetokenizer.update`` finds it (``vllm/v1/engine/detokenizer.py``)."""
    ids = tok("a" + stop + "b")["input_ids"]
    assert len(ids) > len("a" + stop + "b")  # some character is split over tokens
    state = RequestState("r", 0, [1], SamplingParams(stop=[stop]), [stop], include, tok)
    streamed = ""
    for t in ids:
        delta = state.add_tokens([t], None, None, 0.0)
        streamed += delta.text if delta is not None else ""
        if state.finished:
            break
    assert (state.finish_reason, state.stop_reason) == ("stop", stop)
    assert state.text == streamed == ("a" + stop if include else "a")


def test_a_stop_string_of_plain_text_still_stops_once(tok):
    ids = tok("hello world")["input_ids"]
    state = RequestState("r", 0, [1], SamplingParams(stop=["wor"]), ["wor"], False, tok)
    for t in ids:
        state.add_tokens([t], None, None, 0.0)
        if state.finished:
            break
    assert (state.finish_reason, state.stop_reason, state.text) == ("stop", "wor", "hello ")


def _manager_with_table(enable_caching: bool) -> tuple[KVCacheManager, Request]:
    m = KVCacheManager(10, 4, enable_caching=enable_caching)
    r = Request("a", list(range(1, 13)), 5)
    assert m.allocate_slots(r, 12) is not None
    update_block_hashes(r, 4, get_hash_fn("builtin"))
    return m, r


@pytest.mark.parametrize("args", [(-1, 2), (0, 4), (1, 4)])
def test_cache_full_blocks_refuses_a_range_outside_the_table_and_changes_nothing(args):
    m, r = _manager_with_table(enable_caching=False)  # three full blocks, none cached yet
    blocks = m.req_to_blocks["a"]
    before = json.dumps(m.snapshot(), sort_keys=True)
    with pytest.raises(ValueError, match="num_cached_blocks must be an int|num_full_blocks=4 is past the end"):
        m.block_pool.cache_full_blocks(r, blocks, *args)
    assert json.dumps(m.snapshot(), sort_keys=True) == before
    assert not m.block_pool.cached_block_hash_to_block


def test_cache_full_blocks_refuses_a_table_shorter_than_num_full_blocks_before_caching_any():
    m, r = _manager_with_table(enable_caching=False)
    blocks = m.req_to_blocks["a"]
    with pytest.raises(ValueError, match=r"num_full_blocks=3 is past the end of the blocks given: the table has 2"):
        m.block_pool.cache_full_blocks(r, blocks[:2], 0, 3)
    assert [b.block_hash for b in blocks] == [None, None, None]


def test_cache_full_blocks_still_caches_a_valid_range():
    m, r = _manager_with_table(enable_caching=False)
    blocks = m.req_to_blocks["a"]
    m.block_pool.cache_full_blocks(r, blocks, 1, 3)
    assert [b.block_hash is not None for b in blocks] == [False, True, True]
    m.block_pool.cache_full_blocks(r, blocks, 3, 3)  # nothing to do
    m.block_pool.cache_full_blocks(r, blocks, 5, 3)  # nothing to do (vLLM returns too)


def test_an_empty_token_list_prompt_is_called_empty():
    from pagedkv.grading.lessons.l07_serving_engine import tiny_llama

    torch.set_num_threads(1)
    llm = LLM(tiny_llama(), num_gpu_blocks=16, block_size=8, max_model_len=64)
    for prompts in ([[]], [[5, 6], []], [()]):
        with pytest.raises(ValueError, match=r"prompt \d: The decoder prompt cannot be empty"):
            llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert llm.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 15
    assert not llm.scheduler.requests
