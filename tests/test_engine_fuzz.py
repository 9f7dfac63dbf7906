"""Randomized differential test of ``LLM.generate`` against transformers, over every tiny family the engine serves.

Each seed draws one family (``pagedkv.engine.tiny_models``: Llama, Mistral with a window shorter than the
prompts, Qwen2 and Qwen3 with a sliding layer, Qwen3, Gemma 3, OLMo 3), a window shorter or longer than the
context, a block size, a workload (single-token prompts, prompts ending exactly on a block boundary, a shared
prefix with prefix caching, requests that run into ``max_model_len``) and an engine shape (chunked prefill with a
small ``max_num_batched_tokens``, a pool too small for all requests so that they preempt by recompute or swap,
sync or async scheduling), then which decoder runs the model (``model_impl`` "lab" for the Llama family, or
"transformers") and whether the compiled CPU decode attention serves the decode rows (``PAGEDKV_CPU_KERNEL``).

Greedy requests must give transformers' greedy ``generate`` tokens (``test_engine.assert_matches_hf``: a
divergence only after an HF near-tie, reported). Seeded sampling (``n > 1``) has no transformers counterpart
to call, so its tokens are checked teacher-forced: transformers' logits over prompt + completion, one forward,
sampled again with a fresh generator of the child's seed (``SamplingParams.for_child``) through the engine's
``Sampler``, must give the same tokens (vLLM 0.26's promise: a seeded request's tokens depend on nothing else in
the batch, nor on preemption). Seeded loops, not hypothesis: each case is reproduced from its seed alone
(``python tests/test_engine_fuzz.py SEED`` prints it and runs it).

The compiled kernel is also checked directly against the float64 reference on the edge shapes: head sizes
8/24/64/80/128, GQA ratios 1/2/4/8, block sizes 1/16/32, a one-token context.
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from test_engine import assert_matches_hf, hf_greedy, one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from test_engine_cpu_kernel import needs_kernel

from pagedkv.attention import ref_paged_prefill_attention
from pagedkv.block_table import make_block_table_tensor
from pagedkv.engine import LLM, SamplingParams, cpu_kernel
from pagedkv.engine.sampler import Sampler, make_generator
from pagedkv.engine.tiny_models import TINY_CONFIG, tiny_model

FAMILIES = ["llama", "mistral", "qwen2-sliding", "qwen3", "qwen3-sliding", "gemma3", "olmo3"]
LAB_FAMILIES = {"llama", "mistral", "qwen2-sliding"}  # the lab's own decoder covers these (pagedkv.engine.llama)
SLIDING = {"mistral", "qwen2-sliding", "qwen3-sliding", "gemma3", "olmo3"}
VOCAB = TINY_CONFIG["vocab_size"]
#: a sampled token may differ from the teacher-forced replay only where the replay's two best
#: ``probs / noise`` are this close (relative): the engine's logits differ from HF's in the last bits
SAMPLE_NEAR_TIE = 1e-4
#: (query heads, KV heads, head size) beyond the tiny models' own (4, 2, 16): GQA ratios 1/2/4/8, head sizes that
#: are not a multiple of 16 (the compiled kernel's scalar loop)
HEAD_SHAPES = [(8, 1, 8), (4, 4, 24), (2, 1, 40), (8, 2, 8)]
EXPLICIT_HEAD_DIM = {"qwen3", "qwen3-sliding", "gemma3"}  # the others derive it from hidden_size / heads


@dataclass
class Case:
    """One random workload on one random engine: everything a run needs, drawn from ``seed``."""

    seed: int
    family: str = ""
    window: int | None = None
    block_size: int = 4
    prompts: list[list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)
    kernel: str = "on"  # "on"; "env-off": PAGEDKV_CPU_KERNEL=0; "meta-off": AttentionMetadata.decode_kernel=False
    model_impl: str = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)  # config fields: another head shape

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.family = FAMILIES[self.seed % len(FAMILIES)]
        if self.family in SLIDING:
            self.window = rng.choice([1, 3, 8, 13, 200])  # shorter than most prompts, or longer than all
        bs = self.block_size = rng.choice([1, 2, 4, 8, 16])
        prefix = [rng.randrange(1, VOCAB) for _ in range(rng.choice([0, bs, 2 * bs + 1, rng.randint(1, 20)]))]
        for _ in range(rng.randint(1, 5)):
            kind = rng.choice(["single", "boundary", "prefix", "prefix", "random"])
            if kind == "single":
                p = [rng.randrange(1, VOCAB)]
            elif kind == "boundary":  # ends exactly on a block boundary
                p = [rng.randrange(1, VOCAB) for _ in range(bs * rng.randint(1, max(1, 24 // bs)))]
            elif kind == "prefix" and prefix:
                p = prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
            else:
                p = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 30))]
            self.prompts.append(p)
        if rng.random() < 0.3:  # some requests run into max_model_len (max_tokens None or beyond it)
            self.engine["max_model_len"] = max(len(p) for p in self.prompts) + rng.randint(1, 4)
        for _ in self.prompts:
            max_tokens = rng.choice([1, 3, 6, 9, None if "max_model_len" in self.engine else 5])
            if rng.random() < 0.3:
                n = rng.choice([1, 2, 3])
                self.params.append(SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.7, 1.0, 1.5]),
                                                  top_k=rng.choice([0, 0, 20]), top_p=rng.choice([1.0, 0.9]),
                                                  seed=rng.randrange(1000), n=n))
            else:
                self.params.append(SamplingParams(max_tokens=max_tokens, temperature=0.0))
        shape = rng.choice(["roomy", "chunked", "tight", "tight"])
        if shape == "chunked" or rng.random() < 0.3:
            self.engine["max_num_batched_tokens"] = rng.randint(2, 16)
        if shape == "tight":
            self.engine["num_gpu_blocks"] = "tight"  # resolved against the pool's own rule in make_llm
            self.engine["preemption_mode"] = rng.choice(["recompute", "swap"])
        else:
            self.engine["num_gpu_blocks"] = 400
        self.engine["enable_prefix_caching"] = rng.random() < 0.85
        self.engine["async_scheduling"] = rng.random() < 0.5
        if rng.random() < 0.3:
            self.engine["max_num_seqs"] = rng.randint(1, 4)
        self.kernel = rng.choice(["on", "on", "env-off", "meta-off"])
        self.model_impl = rng.choice(["lab", "transformers"]) if self.family in LAB_FAMILIES else "transformers"
        heads = random.Random(self.seed + 10**6)  # its own stream: the draws above stay what they were
        if heads.random() < 0.4:
            hq, hkv, d = heads.choice(HEAD_SHAPES)
            self.overrides = dict(num_attention_heads=hq, num_key_value_heads=hkv)
            if self.family in EXPLICIT_HEAD_DIM:
                self.overrides["head_dim"] = d
                if self.family == "gemma3":
                    self.overrides["query_pre_attn_scalar"] = d
            else:
                self.overrides["hidden_size"] = hq * d

    def model(self) -> torch.nn.Module:
        kwargs = dict(self.overrides) if self.window is None else {**self.overrides, "sliding_window": self.window}
        return tiny_model(self.family, seed=self.seed % 5, **kwargs)

    def max_new(self, i: int, max_model_len: int) -> int:
        room = max_model_len - len(self.prompts[i])
        return room if self.params[i].max_tokens is None else min(self.params[i].max_tokens, room)


def make_llm(case: Case, model: torch.nn.Module) -> LLM:
    """The case's engine; a ``"tight"`` pool is the fewest blocks the largest request needs, plus 0 to 2: the
    requests then take turns (preemption) wherever they do not all fit."""
    engine = dict(case.engine)
    if engine["num_gpu_blocks"] != "tight":
        return LLM(model, block_size=case.block_size, model_impl=case.model_impl, **engine)
    probe = LLM(model, block_size=case.block_size, model_impl=case.model_impl, **{**engine, "num_gpu_blocks": 400})
    mml = probe.max_model_len
    need = max(probe.kv_cache_manager.max_num_blocks_for(len(p) + case.max_new(i, mml))
               if probe.kv_cache_config is not None else -(-(len(p) + case.max_new(i, mml)) // case.block_size)
               for i, p in enumerate(case.prompts))
    engine["num_gpu_blocks"] = need + 1 + random.Random(case.seed).randint(0, 2)
    return LLM(model, block_size=case.block_size, model_impl=case.model_impl, **engine)


def hf_refs(model: torch.nn.Module, case: Case, max_model_len: int):
    """HF's greedy tokens and logits (``test_engine.hf_greedy``'s form) for the greedy prompts, one at a time."""
    refs = {}
    for i, (p, params) in enumerate(zip(case.prompts, case.params, strict=True)):
        if params.temperature == 0.0 and case.window == 1:
            refs[i] = hf_greedy_without_cache(model, p, case.max_new(i, max_model_len))
        elif params.temperature == 0.0:
            refs[i] = hf_greedy(model, [p], max_new=case.max_new(i, max_model_len))[0]
    return refs


def hf_greedy_without_cache(model: torch.nn.Module, prompt: list[int], max_new: int):
    """HF's greedy tokens and logits from a full forward over the whole sequence at every step (no KV cache).

    The reference for a window of 1: transformers 5's ``DynamicSlidingWindowLayer.update``
    (``transformers/cache_utils.py``) keeps ``states[:, :, -self.sliding_window + 1 :]``, which for a window of 1
    is ``[-0:]``, every token, while its mask allows one; so ``generate`` attends to the wrong keys from the
    second decode step on. Its own forward without a cache masks ``kv_idx > q_idx - W`` (the query alone), as
    vLLM 0.26's FlashAttention ``window_size = (W - 1, 0)`` does."""
    seq, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits.append(model(torch.tensor([seq]), use_cache=False).logits[0, -1])
            seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):], logits


def check_sampled(model: torch.nn.Module, prompt: list[int], params: SamplingParams, completion, label: str):
    """Teacher-forced replay of one seeded completion: HF's logits over prompt + tokens, one forward, sampled
    step by step with a fresh generator of the child's seed. Divergence only at a near-tie (reported)."""
    tokens = completion.token_ids
    child = params.for_child(completion.index) if params.n > 1 else params
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    gen = make_generator(child.seed)
    sampler = Sampler()
    for j, tok in enumerate(tokens):
        state = gen.get_state()
        want = int(sampler.sample(logits[j : j + 1].clone(), [child], [gen])[0])
        if want != tok:
            # how close was it: the replay's probs / noise at both tokens, with the same noise
            g2 = torch.Generator().set_state(state)
            sub = logits[j].double() / child.temperature
            noise = torch.empty(sub.shape[0], dtype=torch.float32).exponential_(generator=g2).double()
            ratio = sub.softmax(-1) / noise
            gap = float((ratio[want] - ratio[tok]) / ratio[want])
            assert gap < SAMPLE_NEAR_TIE, f"{label} completion {completion.index}: token {j} is {tok}, the " \
                                          f"teacher-forced replay says {want} (relative gap {gap:.3g})"
            warnings.warn(f"{label}: sampled near-tie at token {j} (gap {gap:.3g})", stacklevel=2)
            return


def run_case(case: Case) -> LLM:
    """Run ``case`` and check every request; returns the engine (for the caller's further checks)."""
    label = f"seed {case.seed} ({case.family}, window {case.window}, bs {case.block_size}, {case.model_impl}, " \
            f"kernel {case.kernel}, {case.overrides}, {case.engine})"
    old = os.environ.get(cpu_kernel.ENV_SWITCH)
    os.environ[cpu_kernel.ENV_SWITCH] = "0" if case.kernel == "env-off" else "1"
    cpu_kernel.load.cache_clear()
    try:
        model = case.model()
        llm = make_llm(case, model)
        if case.kernel == "meta-off":  # the kernel built, each step's metadata turning it off
            build = llm.runner.build_metadata

            def without_kernel(*args, **kwargs):
                meta = build(*args, **kwargs)
                meta.decode_kernel = False
                return meta

            llm.runner.build_metadata = without_kernel
        outputs = llm.generate(case.prompts, case.params, use_tqdm=False)
        refs = hf_refs(model, case, llm.max_model_len)
        greedy = sorted(refs)
        assert_matches_hf([outputs[i] for i in greedy], [refs[i] for i in greedy], label)
        for i, (out, params) in enumerate(zip(outputs, case.params, strict=True)):
            assert len(out.outputs) == params.n, label
            for comp in out.outputs:
                assert len(comp.token_ids) == case.max_new(i, llm.max_model_len), f"{label} prompt {i}"
                if params.temperature > 0.0:
                    check_sampled(model, case.prompts[i], params, comp, f"{label} prompt {i}")
        assert not llm.scheduler.has_unfinished_requests()
        assert llm.kv_cache_manager.block_pool.get_num_free_blocks() == llm.num_gpu_blocks - 1, label  # all freed
        return llm
    finally:
        if old is None:
            os.environ.pop(cpu_kernel.ENV_SWITCH, None)
        else:
            os.environ[cpu_kernel.ENV_SWITCH] = old
        cpu_kernel.load.cache_clear()


#: Seeds run in the fast suite: two per family (seed % 7 picks the family), a few seconds in all.
FAST_SEEDS = list(range(14))


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_engine_matches_transformers_on_random_workloads(seed):
    run_case(Case(seed))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(14, 61))
def test_engine_matches_transformers_on_more_random_workloads(seed):
    run_case(Case(seed))


def test_async_sliding_window_admission_counts_two_steps_in_flight():
    """Shrunk from seed 72: Qwen2 with a sliding layer, async scheduling, chunks of 15, one request of 35 + 9
    tokens. Out-of-window blocks are freed on the processed-token basis, so with two steps in flight the
    sliding group holds both chunks: 3 blocks, not 2, and with the full group's 3 the request needs 6. A
    5-block pool admitted it, and the lone request preempted itself forever. vLLM 0.26 counts
    ``max_concurrent_batches · max_num_batched_tokens`` (``VllmConfig.max_in_flight_tokens``) in
    ``SlidingWindowSpec.max_admission_blocks_per_request``."""
    model = tiny_model("qwen2-sliding", seed=2, sliding_window=1)
    prompt, params = [5] * 35, SamplingParams(max_tokens=9, temperature=0.0)
    kwargs = dict(block_size=16, max_num_batched_tokens=15, max_num_seqs=1, enable_prefix_caching=False)
    llm = LLM(model, num_gpu_blocks=6, **kwargs)
    assert llm.kv_cache_manager.max_num_blocks_for(44) == 3 + 3  # the full group's 3, the sliding group's 3
    with pytest.raises(ValueError, match="num_gpu_blocks >= 7"):
        llm.generate([prompt], params, use_tqdm=False)
    sync = LLM(model, num_gpu_blocks=6, async_scheduling=False, **kwargs)  # one step in flight: 5 blocks do
    assert sync.kv_cache_manager.max_num_blocks_for(44) == 3 + 2
    want, _ = hf_greedy_without_cache(model, prompt, 9)
    for engine in (LLM(model, num_gpu_blocks=7, **kwargs), sync):
        assert engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_the_cases_cover_every_feature():
    """The fast seeds reach what the test is for: every family, both decoders, the kernel on and off, preemption,
    chunked prefill, prefix hits, sampling with n > 1, single-token and block-boundary prompts, max_model_len."""
    cases = [Case(s) for s in FAST_SEEDS]
    assert {c.family for c in cases} == set(FAMILIES)
    assert {c.model_impl for c in cases} == {"lab", "transformers"}
    assert {c.kernel for c in cases} == {"on", "env-off", "meta-off"}
    assert any(c.engine["num_gpu_blocks"] == "tight" for c in cases)
    assert any(c.engine.get("max_num_batched_tokens", 99) < 8 for c in cases)
    assert any(p.n > 1 and p.temperature > 0 for c in cases for p in c.params)
    assert any(len(p) == 1 for c in cases for p in c.prompts)
    assert any(len(p) > 1 and len(p) % c.block_size == 0 for c in cases for p in c.prompts)
    assert any("max_model_len" in c.engine for c in cases)
    ratios = {c.overrides.get("num_attention_heads", 4) // c.overrides.get("num_key_value_heads", 2) for c in cases}
    assert ratios == {1, 2, 4, 8}  # GQA ratios (the tiny models' own: 2)
    assert any(c.window is not None and c.window < max(map(len, c.prompts)) for c in cases)
    assert any(c.window is not None and c.window > max(map(len, c.prompts)) + 10 for c in cases)


# ---------------------------------------------------------------------------------------------------------
# The compiled kernel on the edge shapes
# ---------------------------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [8, 24, 64, 80, 128])
def test_kernel_edge_shapes_match_the_float64_reference(head_dim, group, block_size):
    """Decode rows of lengths 1 (the one-token context), bs - 1, bs, bs + 1 and a few blocks, their blocks
    shuffled over the pool, 2 KV heads of ``group`` query heads each, with and without a window."""
    rng = random.Random(head_dim * 100 + group * 10 + block_size)
    hkv, hq = 2, 2 * group
    lens = sorted({1, max(1, block_size - 1), block_size, block_size + 1, 3 * block_size + 2, rng.randint(1, 70)})
    nblk = [-(-n // block_size) for n in lens]
    ids = list(range(1, sum(nblk) + 1))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(n)] for n in nblk]
    gen = torch.Generator().manual_seed(len(ids))
    shape = (len(ids) + 1, block_size, hkv, head_dim)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(len(lens), hq, head_dim, generator=gen)
    bt = make_block_table_tensor(tables)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    rows = torch.arange(len(lens))
    scale = head_dim ** -0.5
    for window in (None, 1, 5):
        want = ref_paged_prefill_attention(query, key_cache, value_cache, bt, seq_lens, qsl, scale,
                                           compute_dtype=torch.float64, sliding_window=window)
        out = torch.full_like(query, float("nan"))
        cpu_kernel.decode_attention(query, key_cache, value_cache, bt, seq_lens, qsl, rows, out, scale, window)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # a one-token context is that token's value, whatever the query (query head h·G + g reads KV head h)
    assert lens[0] == 1 and torch.allclose(out[0], value_cache[bt[0, 0], 0].repeat_interleave(group, 0))

if __name__ == "__main__":  # python tests/test_engine_fuzz.py SEED [SEED...]: print and run cases
    torch.set_num_threads(1)
    for s in map(int, sys.argv[1:]):
        c = Case(s)
        print(c)
        run_case(c)
        print("ok")
