"""The engine on Qwen3 and on models with sliding-window layers, against transformers' own greedy ``generate``.

Tiny seeded models (``pagedkv.engine.tiny_models``: fp32, CPU, no downloads) whose sliding layers see 8 tokens;
prompts of 20 to 70 tokens run far past the window. Each family runs under three shapes: a roomy pool, chunked
prefill (chunks of 12 tokens, which cross the window's edge mid-chunk) and a tight pool (preemption), then with
a shared prefix found in the prefix cache. Token identity is ``test_engine.assert_matches_hf``'s: a divergence
only where HF's own top-two logits are closer than ``NEAR_TIE``, reported.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import assert_matches_hf, hf_greedy, make_prompts, one_thread  # noqa: F401 (an autouse fixture)

from pagedkv.engine import LLM, SUPPORTED_ARCHITECTURES, SamplingParams
from pagedkv.engine.tiny_models import FAMILIES, TINY_WINDOW, tiny_model
from pagedkv.utils import cdiv

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
HYBRID = ["qwen3", "qwen3-sliding", "qwen2-sliding", "mistral", "gemma3", "olmo3"]
SHAPES = {
    "roomy": dict(num_gpu_blocks=200, block_size=4),
    "chunked": dict(num_gpu_blocks=200, block_size=4, max_num_batched_tokens=12),
    "tight": dict(block_size=4, max_num_batched_tokens=8, async_scheduling=False),
}
#: The tight pool of each family (blocks of 4 tokens, block 0 the null block): a few blocks more than one request of
#: 80 tokens needs, so the six requests preempt one another. A sliding group holds at most its window's worth
#: (``max_admission_blocks_per_request``): Mistral's 6 blocks hold 20 tokens, for 80-token requests. The tight
#: shape schedules synchronously: with async scheduling two steps' chunks are in flight and the admission cap
#: counts both (vLLM's ``VllmConfig.max_in_flight_tokens``), so a pool small enough to preempt a sliding family is
#: refused, and one that admits it never preempts (``test_engine_fuzz``'s async cases cover async preemption).
TIGHT_POOL = {"qwen3": 24, "qwen3-sliding": 32, "qwen2-sliding": 32, "mistral": 6, "gemma3": 56, "olmo3": 46}
#: Families whose requests grow after admission (a full-attention group), so a tight pool preempts. Mistral's layers
#: all slide and every prompt is past the window: a request holds its window's worth from admission on and never
#: grows, so no pool the gate admits it to ever preempts (vLLM's ``scheduler_reserve_full_isl`` admits on the
#: whole current sequence); the tight shape shows instead that 80-token requests run in 20 tokens of KV.
GROWS = {"qwen3", "qwen3-sliding", "qwen2-sliding", "gemma3", "olmo3"}


@pytest.fixture(scope="module")
def long_prompts():
    return make_prompts(6, lo=20, hi=70, seed=4)


_CACHE: dict = {}


def model_and_refs(family, prompts):
    """The family's tiny model and HF's greedy references on ``prompts`` (computed once per module)."""
    key = (family, tuple(map(tuple, prompts)))
    if key not in _CACHE:
        model = tiny_model(family, seed=3)
        _CACHE[key] = model, hf_greedy(model, prompts, max_new=MAX_NEW)
    return _CACHE[key]


def test_every_family_is_supported_and_slides_where_its_config_says():
    windows = {}
    for family in HYBRID:
        model = tiny_model(family)
        assert model.config.model_type in SUPPORTED_ARCHITECTURES
        windows[family] = [layer.self_attn.sliding_window if hasattr(layer.self_attn, "sliding_window")
                           else model.config.sliding_window for layer in model.model.layers]
    w = TINY_WINDOW
    assert windows == {
        "qwen3": [None, None],
        "qwen3-sliding": [None, w],
        "qwen2-sliding": [None, w],
        "mistral": [w, w],
        "gemma3": [w, w, w, w, w, None],
        "olmo3": [w, w, w, None],
    }
    assert set(HYBRID) < set(FAMILIES)
    with pytest.raises(ValueError, match="unknown family"):
        tiny_model("gpt2")


@pytest.mark.parametrize("family", [f for f in HYBRID if f != "qwen3"])
def test_the_window_changes_hfs_tokens(family, long_prompts):
    """The prompts run far enough past the window that attending to everything would give other tokens: a test
    that ignored the window could not pass the token-identity tests below."""
    _, refs = model_and_refs(family, long_prompts)
    wide = tiny_model(family, seed=3, sliding_window=1000)
    assert [t for t, _ in hf_greedy(wide, long_prompts, max_new=MAX_NEW)] != [t for t, _ in refs]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_families_match_hf_generate(family, shape, long_prompts):
    model, refs = model_and_refs(family, long_prompts)
    llm = LLM(model, **SHAPES[shape], **({"num_gpu_blocks": TIGHT_POOL[family]} if shape == "tight" else {}))
    outputs = llm.generate(long_prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, refs, f"{family} {shape}")
    if shape == "tight" and family in GROWS:
        assert llm.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if shape == "chunked":  # some chunk starts inside a prompt, past the window
        assert llm.stats["steps"] > sum(len(p) for p in long_prompts) / 12
    assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == llm.num_gpu_blocks - 1  # all freed


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_families_with_prefix_caching(family):
    """A 24-token shared prefix (three windows): later prompts hit the cache; the second call hits it again."""
    system = list(range(100, 124))
    ps = make_prompts(5, lo=4, hi=30, seed=6, prefix=system)
    model, refs = model_and_refs(family, ps)
    llm = LLM(model, num_gpu_blocks=200, block_size=4, max_num_batched_tokens=16)
    outputs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, refs, f"{family} prefix caching")
    assert sum(o.num_cached_tokens for o in outputs) > 0
    again = llm.generate(ps[:2], GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 20 for o in again)
    assert_matches_hf(again, refs[:2], f"{family} prefix caching, second call")


@pytest.mark.parametrize("family, groups", [("qwen3", None), ("mistral", "S"), ("qwen3-sliding", "FS"),
                                            ("gemma3", "FSSSSS"), ("olmo3", "FSSS")])
def test_one_kv_cache_group_per_attention_type(family, groups):
    """vLLM 0.26's grouping (``get_kv_cache_groups``): one group per type, the types' layers dealt into groups of the
    smaller type's layer count; the layers of different groups share the K/V tensors (one per group member)."""
    llm = LLM(tiny_model(family), num_gpu_blocks=50, block_size=4)
    if groups is None:
        assert llm.kv_cache_groups is None and llm.kv_cache_config is None  # lesson 2-7's manager, unchanged
        assert len({id(k) for k, _ in llm.runner.kv_caches}) == llm.model.config.num_hidden_layers
        return
    kinds = ["S" if w else "F" for w in llm.runner.group_windows]
    assert sorted(kinds) == sorted(groups) and llm.kv_cache_manager.num_kv_cache_groups == len(groups)
    assert all(w in (None, TINY_WINDOW) for w in llm.runner.group_windows)
    group_size = max(len(g.layer_names) for g in llm.kv_cache_groups)
    assert len({id(k) for k, _ in llm.runner.kv_caches}) == group_size
    assert llm.runner.kv_cache_bytes() == group_size * 50 * llm.kv_cache_groups[0].kv_cache_spec.page_size_bytes


def test_an_all_sliding_model_serves_requests_whose_full_kv_would_not_fit():
    """Mistral (every layer slides, one sliding-window group) on 7 usable blocks of 4 tokens: 28 tokens of KV for
    requests of up to 80. Full attention would need up to 20 blocks per request; the sliding group releases each
    block once the window has moved past it (the null block takes its place), so every request runs, token for
    token as HF's."""
    prompts = make_prompts(6, lo=20, hi=70, seed=4)
    model, refs = model_and_refs("mistral", prompts)
    llm = LLM(model, num_gpu_blocks=8, block_size=4, max_num_batched_tokens=8)
    full_need = [-(-(len(p) + MAX_NEW) // 4) for p in prompts]
    assert max(full_need) > llm.num_gpu_blocks - 1  # what every-block-kept attention could not hold
    seen = []
    execute = llm.runner.execute_model

    def spy(so):
        seen.extend(so.tables_per_group(r)[0] for r in so.num_scheduled_tokens)
        return execute(so)

    llm.runner.execute_model = spy
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, refs, "mistral, a 7-block pool")
    assert any(t and t[0] == 0 for t in seen)  # out-of-window entries are the null block
    # at most the window's worth held: cdiv(window - 1 + tokens in flight, block_size) + 1 blocks, where with async
    # scheduling (the default) two steps of up to 8 tokens each can be in flight
    assert max(sum(b != 0 for b in t) for t in seen) <= cdiv(TINY_WINDOW - 1 + 2 * 8, 4) + 1
    assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == llm.num_gpu_blocks - 1


def test_gemma_final_logit_softcapping_is_applied():
    model = tiny_model("gemma3", seed=3, final_logit_softcapping=2.0)
    ps = make_prompts(3, lo=20, hi=40, seed=7)
    refs = hf_greedy(model, ps, max_new=MAX_NEW)
    llm = LLM(model, num_gpu_blocks=100, block_size=4)
    assert_matches_hf(llm.generate(ps, GREEDY, use_tqdm=False), refs, "gemma3 soft cap")
    # hidden states far larger than any real one: uncapped, the logits would be far beyond +-2
    head = llm.runner.model.get_output_embeddings()
    hidden = 1e3 * torch.randn(4, head.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((hidden @ head.weight.T).abs().max()) > 2.0
        logits = llm.runner.compute_logits(hidden.to(head.weight.dtype))
    assert float(logits.abs().max()) <= 2.0  # capped at +-2


def test_attention_soft_capping_is_refused():
    model = tiny_model("gemma3", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="soft-capping"):
        LLM(model, num_gpu_blocks=20, block_size=4)


TRITON_ON_CPU = r"""
import sys
import pagedkv.kernels  # first: Triton's interpreter must be chosen before transformers loads anything
import torch
sys.path.insert(0, sys.argv[1])
from test_engine import hf_greedy, make_prompts
from pagedkv.engine import LLM, SamplingParams
from pagedkv.engine.tiny_models import tiny_model
torch.set_num_threads(1)
for family in ("olmo3", "mistral"):
    model = tiny_model(family, seed=3)
    prompts = make_prompts(3, lo=14, hi=24, seed=2)
    refs = [tokens for tokens, _ in hf_greedy(model, prompts, max_new=4)]
    llm = LLM(model, num_gpu_blocks=30, block_size=4, max_num_batched_tokens=10)
    llm.runner.backend = "triton"  # the CUDA backend's code path, run by Triton's interpreter
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    print(f"{family} MATCH" if got == refs else f"{family} DIFFER {got} {refs}")
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the Triton backend runs natively")
def test_triton_backend_with_windows_under_the_interpreter():
    """The Triton backend (decode and prefill kernels with a window) end to end on a hybrid and an all-sliding
    model, chunked across the window's edge, in a fresh process so that Triton's interpreter is chosen first."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", TRITON_ON_CPU, here], capture_output=True, text=True, env=env,
                          timeout=900, cwd=here)
    out = proc.stdout
    assert "olmo3 MATCH" in out and "mistral MATCH" in out, out[-2000:] + proc.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_triton_backend_on_cuda_matches_hf_with_windows(family):
    model = tiny_model(family, seed=3).to("cuda")
    ps = make_prompts(6, lo=20, hi=70, seed=4)
    refs = hf_greedy(model, ps, max_new=MAX_NEW)
    for enforce_eager in (True, False):
        llm = LLM(model, num_gpu_blocks=40, block_size=4, max_num_batched_tokens=32, enforce_eager=enforce_eager)
        assert_matches_hf(llm.generate(ps, GREEDY, use_tqdm=False), refs, f"{family} triton eager={enforce_eager}")
