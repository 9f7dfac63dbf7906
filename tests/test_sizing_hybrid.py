"""Sizing a hybrid model's pool (lesson 8): groups, page-size unification, per-spec memory and concurrency,
fixed cases by hand and, when vLLM 0.26's sources are available, against vLLM's own ``kv_cache_utils``."""

from __future__ import annotations

import pytest

from pagedkv.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec, cdiv
from pagedkv.sizing import HYBRID_SHAPES, hybrid_sizing
from pagedkv.sizing.hybrid import (
    get_kv_cache_groups,
    get_kv_cache_spec,
    layer_is_sliding,
    unify_kv_cache_spec_page_size,
)
from pagedkv.sizing.model import model_shape

GiB = 1 << 30


def test_layer_types_decide_which_layers_slide():
    gemma = HYBRID_SHAPES["Gemma 3 27B"]
    sliding = layer_is_sliding(gemma)
    assert sliding.count(False) == 10 and sliding.count(True) == 52 and sliding[5] is False
    assert layer_is_sliding(HYBRID_SHAPES["gpt-oss-20b"]) == [True, False] * 12
    assert all(layer_is_sliding(HYBRID_SHAPES["Mistral 7B v0.1"]))
    qwen = {**HYBRID_SHAPES["Mistral 7B v0.1"], "use_sliding_window": False}
    assert not any(layer_is_sliding(qwen))
    with pytest.raises(ValueError, match="sliding_window"):
        layer_is_sliding({**HYBRID_SHAPES["gpt-oss-20b"], "sliding_window": None})


def test_gemma3_groups_and_padding_warning():
    grouping = get_kv_cache_groups(get_kv_cache_spec(HYBRID_SHAPES["Gemma 3 27B"]))
    sizes = [(len(g.layer_names), type(g.kv_cache_spec).__name__) for g in grouping.groups]
    # 52 sliding layers dealt round-robin into cdiv(52, 10) = 6 groups, then the 10 full layers.
    assert sizes == [(9, "SlidingWindowSpec")] * 4 + [(8, "SlidingWindowSpec")] * 2 + [(10, "FullAttentionSpec")]
    assert grouping.warnings == ["Add 8 padding layers, may waste at most 15.38% KV cache memory"]


def test_page_sizes_are_unified_by_scaling_the_block_size():
    common = {"num_kv_heads": 8, "dtype": "bfloat16"}
    specs = {
        "full": FullAttentionSpec(block_size=16, head_size=256, **common),
        "swa": SlidingWindowSpec(block_size=16, head_size=128, sliding_window=512, **common),
    }
    out = unify_kv_cache_spec_page_size(specs)
    assert out["swa"].block_size == 32 and out["swa"].page_size_bytes == out["full"].page_size_bytes
    bad = {**specs, "odd": FullAttentionSpec(block_size=16, head_size=96, **common)}
    with pytest.raises(NotImplementedError, match="does not divide"):
        unify_kv_cache_spec_page_size(bad)


def test_gpt_oss_20b_numbers():
    """12 sliding (window 128) + 12 full layers, 8 KV heads of 64, bf16, block 16: a page is 32 KiB; with
    vllm serve's defaults (8192 batched tokens, two batches in flight) a sliding group needs
    cdiv(min(127 + 16384, M), 16) + 1 = 1033 blocks per request."""
    cfg = HYBRID_SHAPES["gpt-oss-20b"]
    h = hybrid_sizing(cfg, 70 * GiB, max_model_len=131072)
    page = 2 * 16 * 8 * 64 * 2
    assert h.page_size_bytes == page and h.group_size == 12
    assert h.kv_cache_config.num_blocks == 70 * GiB // page // 12
    assert h.blocks_per_request == [cdiv(127 + 16384, 16) + 1, 131072 // 16]
    assert h.max_concurrency == pytest.approx(h.kv_cache_config.num_blocks / (1033 + 8192))
    assert not hasattr(h, "num_blocks")  # one name for the count: vLLM's KVCacheConfig.num_blocks (issue 27)
    assert h.log_lines == [
        f"INFO GPU KV cache size: {int(h.max_concurrency * 131072):,} tokens",
        f"INFO Maximum concurrency for 131,072 tokens per request: {h.max_concurrency:.2f}x",
    ]
    full = hybrid_sizing(cfg, 70 * GiB, max_model_len=131072, disable_hybrid_kv_cache_manager=True)
    assert full.max_concurrency == pytest.approx((70 * GiB // page // 24) / 8192)
    assert h.max_concurrency / full.max_concurrency == pytest.approx(1.78, abs=0.01)


def test_short_contexts_gain_nothing_and_long_ones_a_lot():
    """The sliding cap counts the tokens in flight: at 4k tokens a window group needs as much as a full one."""
    for name in ("Gemma 3 27B", "gpt-oss-120b"):
        cfg = HYBRID_SHAPES[name]
        gains = []
        for m in (4096, 131072):
            h = hybrid_sizing(cfg, 80 * GiB, max_model_len=m)
            f = hybrid_sizing(cfg, 80 * GiB, max_model_len=m, every_layer_full=True)
            gains.append(h.max_concurrency / f.max_concurrency)
        assert gains[0] <= 1.0 < 1.5 < gains[1], (name, gains)


def test_all_sliding_mistral_and_the_every_layer_full_baseline():
    cfg = HYBRID_SHAPES["Mistral 7B v0.1"]
    h = hybrid_sizing(cfg, 40 * GiB, max_model_len=32768)
    assert len(h.kv_cache_config.kv_cache_groups) == 1 and h.group_size == 32
    same = hybrid_sizing(cfg, 40 * GiB, max_model_len=32768, disable_hybrid_kv_cache_manager=True)
    assert same.max_concurrency == h.max_concurrency  # the flag only acts with full layers present
    full = hybrid_sizing(cfg, 40 * GiB, max_model_len=32768, every_layer_full=True)
    assert h.blocks_per_request == [cdiv(4095 + 16384, 16) + 1] and full.blocks_per_request == [2048]
    assert h.max_concurrency / full.max_concurrency == pytest.approx(2048 / 1281)


def test_too_little_memory_is_refused_with_vllms_message():
    with pytest.raises(ValueError, match="To serve at least one request with the model's max seq len"):
        hybrid_sizing(HYBRID_SHAPES["Gemma 3 27B"], 4 * GiB, max_model_len=131072)


@pytest.mark.parity
@pytest.mark.slow
def test_sizing_agrees_with_vllms_own_functions():
    from pagedkv.parity import available
    from pagedkv.parity.sizing_worker import compare_with_vllm

    ok, reason = available()
    if not ok:
        pytest.skip(f"vLLM 0.26's sources are unavailable: {reason}")
    cases = []
    for cfg in HYBRID_SHAPES.values():
        shape = model_shape(cfg)
        layers = [[shape.head_dim, cfg["sliding_window"] if s else None] for s in layer_is_sliding(cfg)]
        for m in (4096, 32768, 131072):
            for disable in (False, True):
                cases.append({"layers": layers, "kv_heads": shape.num_kv_heads, "block_size": 16, "max_model_len": m,
                              "in_flight": 16384, "disable": disable, "available": 90 * GiB})  # fmt: skip
    # Mixed page sizes (unification) and a 20 : 30 layer split (padding).
    mixed = [[256, None]] * 20 + [[128, 1024]] * 30
    cases.append({"layers": mixed, "kv_heads": 4, "block_size": 16, "max_model_len": 8192, "in_flight": 4096,
                  "disable": False, "available": 8 * GiB})  # fmt: skip
    for theirs, mine in compare_with_vllm(cases):
        assert theirs["groups"] == mine["groups"]
        assert theirs["num_blocks"] == mine["num_blocks"] and theirs["needed"] == mine["needed"]
        assert theirs["concurrency"] == pytest.approx(mine["concurrency"], rel=1e-12)


def test_make_kv_cache_config_feeds_the_manager():
    from pagedkv import KVCacheManager, Request
    from pagedkv.kv_cache_coordinator import HybridKVCacheCoordinator
    from pagedkv.sizing.hybrid import layer_to_group, make_kv_cache_config

    cfg = HYBRID_SHAPES["gpt-oss-20b"]
    kv = make_kv_cache_config(cfg, 64, block_size=4)
    where = layer_to_group(kv)
    assert len(kv.kv_cache_groups) == 2 and len(where) == 24
    assert where["model.layers.0.self_attn.attn"] == 0 and where["model.layers.1.self_attn.attn"] == 1
    assert len(kv.kv_cache_tensors) == 12 and kv.kv_cache_tensors[0].shared_by == [
        "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    m = KVCacheManager(kv, max_model_len=1024)
    assert isinstance(m.coordinator, HybridKVCacheCoordinator)
    r = Request("r", list(range(120)), max_tokens=4)  # 30 blocks in each group: 60 of the 63 usable
    assert m.allocate_slots(r, 120) is not None and m.get_num_free_blocks() == 3
    one = make_kv_cache_config(HYBRID_SHAPES["Mistral 7B v0.1"], 16)
    assert len(one.kv_cache_groups) == 1


def test_capacity_table_rows():
    from pagedkv.sizing.hybrid import capacity_table

    rows = capacity_table(70 * GiB)
    by = {(r["model"], r["max_model_len"]): r for r in rows}
    assert set(HYBRID_SHAPES) == {r["model"] for r in rows}
    assert ("Mistral 7B v0.1", 131072) not in by  # past its 32,768-token context
    r = by[("gpt-oss-20b", 131072)]
    assert (r["groups"], r["group_size"]) == (2, 12)
    assert r["gain"] == pytest.approx(r["concurrency"] / r["concurrency_all_full"]) == pytest.approx(1.78, abs=0.01)
    assert by[("Gemma 3 27B", 131072)]["gain"] > 3
