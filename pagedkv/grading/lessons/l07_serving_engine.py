"""Checks for lesson 7's exercises (``grading/source/07_serving_engine.ipynb``): ``prepare_inputs`` (a step
flattened into one batch) and the attention glue (transformers' attention call on the paged cache).

Each ``check_*`` function is one test case: the source's test cell calls it with the learner's function.
Random schedules come from the library's ``Scheduler`` driven with random requests and random samples; the
expected answers from the library's ``pagedkv.engine`` (``prepare_inputs``, ``paged_attention_forward``).
End to end, the learner's function is plugged into the engine (the other piece stays the library's, so each
exercise is judged on its own) and must reproduce transformers' greedy tokens.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass

import torch

from pagedkv import KVCacheManager, Request
from pagedkv.attention import make_paged_kv
from pagedkv.engine import model_runner as runner_module
from pagedkv.engine.attention import AttentionMetadata, paged_attention_forward
from pagedkv.engine.model_runner import prepare_inputs
from pagedkv.grading.checks import describe, fail, require_function, run
from pagedkv.scheduler import Scheduler

__all__ = [
    "check_attention_end_to_end",
    "check_attention_hidden",
    "check_attention_random_steps",
    "check_attention_writes_the_cache",
    "check_prepare_inputs_end_to_end",
    "check_prepare_inputs_example",
    "check_prepare_inputs_hidden",
    "check_prepare_inputs_random",
    "Layer",
    "example_step",
    "plain_output",
    "plugged",
    "random_metadata",
    "random_steps",
    "tiny_llama",
]

FIELDS = ("req_ids", "input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
          "sample_req_ids", "logits_indices")
HINTS = {
    "positions": "request r's new tokens sit at positions num_computed_tokens[r], num_computed_tokens[r] + 1, ...",
    "input_ids": "the new tokens of r are token_ids[r][start:start + n], start = num_computed_tokens[r]",
    "slot_mapping": "slot = block_table[p // block_size] * block_size + p % block_size for each position p",
    "seq_lens": "seq_len = tokens in the cache after this step = num_computed_tokens[r] + num_scheduled_tokens[r]",
    "query_start_loc": "it starts at 0 and adds each request's num_scheduled_tokens: B + 1 entries",
    "sample_req_ids": "every scheduled request except those in partial_prefill_req_ids, in scheduling order",
    "logits_indices": "the packed row of the last new token of each sampled request: query_start_loc[b + 1] - 1",
    "req_ids": "the scheduled requests in scheduling order: list(scheduler_output.num_scheduled_tokens)",
    "block_tables": "each request's block table, scheduler_output.block_tables[r], as a list",
}


# ---------------------------------------------------------------------------------------------------------
# What the learner's functions receive (plain library data: the grader sends it to the learner's process)
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Layer:
    """What the attention function reads from transformers' attention module."""

    layer_idx: int
    num_key_value_groups: int = 1
    is_causal: bool = True


def plain_output(so):
    """A copy of a ``SchedulerOutput`` whose fields are plain containers (what the learner receives)."""
    out = copy.copy(so)
    out.preempted_req_ids = list(so.preempted_req_ids)
    return out


# ---------------------------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------------------------
def example_step():
    """The lesson's step: A (9 tokens), B (6), C (14, chunked to 9) in a budget of 24, blocks of 4."""
    sched = Scheduler(KVCacheManager(32, 4), 8, 24)
    for rid, n in [("A", 9), ("B", 6), ("C", 14)]:
        sched.add_request(Request(rid, [random.Random(rid).randrange(1, 512) for _ in range(n)], max_tokens=4))
    so = sched.schedule()
    return so, {rid: list(sched.requests[rid].all_token_ids) for rid in so.num_scheduled_tokens}, 4


def random_steps(seed: int, num_steps: int = 12):
    """``num_steps`` consecutive steps of a random workload (chunked prefill, prefix hits, preemption):
    ``[(scheduler_output, token_ids, block_size)]``."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    sched = Scheduler(KVCacheManager(rng.randint(12, 30), bs), rng.randint(2, 6), rng.randint(6, 40))
    shared = [rng.randrange(1, 500) for _ in range(rng.randint(0, 2 * bs))]
    steps = []
    for i in range(rng.randint(3, 7)):
        prompt = shared + [rng.randrange(1, 500) for _ in range(rng.randint(1, 3 * bs))]
        with contextlib.suppress(ValueError):
            sched.add_request(Request(f"r{seed}-{i}", prompt, max_tokens=rng.randint(1, 6)))
    for _ in range(num_steps):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        tokens = {rid: list(sched.requests[rid].all_token_ids) for rid in so.num_scheduled_tokens}
        steps.append((so, tokens, bs))
        partial = so.partial_prefill_req_ids or set()
        sched.update_from_output(so, {rid: rng.randrange(1, 500) for rid in so.num_scheduled_tokens
                                      if rid not in partial})
    return steps


def _describe_step(so) -> str:
    return (f"num_scheduled_tokens={dict(so.num_scheduled_tokens)}, "
            f"num_computed_tokens={dict(so.num_computed_tokens)}, "
            f"partial_prefill_req_ids={sorted(so.partial_prefill_req_ids or [])}")


def _compare_inputs(fn, so, token_ids, bs) -> None:
    got = run(fn, (plain_output(so), token_ids, bs), timeout=5)
    want = prepare_inputs(so, token_ids, bs)
    if got is None:
        fail("prepare_inputs returned None: is it still the stub? Return a ModelInputs(...)")
    for name in FIELDS:
        if not hasattr(got, name):
            fail(f"prepare_inputs returned {describe(got, 60)}, which has no field {name!r}: return a ModelInputs")
        value = getattr(got, name)
        try:
            value = [list(v) for v in value] if name == "block_tables" else list(value)
        except TypeError:
            fail(f"{name} should be a list, got {describe(value, 60)}")
        expected = getattr(want, name)
        if value != expected:
            fail(f"for the step {_describe_step(so)} (block_size={bs}): {name} is {describe(value, 200)}, expected "
                 f"{describe(expected, 200)}. Hint: {HINTS[name]}")


def check_prepare_inputs_example(fn) -> None:
    require_function(fn, "prepare_inputs")
    so, token_ids, bs = example_step()
    _compare_inputs(fn, so, token_ids, bs)


def check_prepare_inputs_random(fn) -> None:
    require_function(fn, "prepare_inputs")
    for seed in range(20):
        for so, token_ids, bs in random_steps(seed):
            _compare_inputs(fn, so, token_ids, bs)


def check_prepare_inputs_hidden(fn) -> None:
    require_function(fn, "prepare_inputs")
    for seed in range(1000, 1060):
        for so, token_ids, bs in random_steps(seed, num_steps=20):
            _compare_inputs(fn, so, token_ids, bs)


# ---------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------
def random_metadata(seed: int, num_layers: int = 2):
    """A random mixed step: ``(module, query, key, value, metadata)`` in transformers' layout
    (``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]``), caches that hold each request's cached prefix."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    hkv, group, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([4, 8])
    b = rng.randint(1, 5)
    q_lens = [1 if rng.random() < 0.5 else rng.randint(1, 9) for _ in range(b)]
    seq_lens = [q + rng.randint(0, 12) for q in q_lens]
    key_cache, value_cache, tables, _ = make_paged_kv(seq_lens, hkv, d, bs, generator=g, extra_blocks=2)
    kv_caches = [(key_cache, value_cache)] + [
        (torch.randn(key_cache.shape, generator=g), torch.randn(value_cache.shape, generator=g))
        for _ in range(num_layers - 1)
    ]
    slot_mapping, qsl, decodes, prefills = [], [0], [], []
    for i, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for p in range(s - q, s):
            slot_mapping.append(int(tables[i, p // bs]) * bs + p % bs)
        qsl.append(qsl[-1] + q)
        (decodes if q == 1 else prefills).append(i)
    t = qsl[-1]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        kv_caches=kv_caches,
        decode_req_idx=torch.tensor(decodes, dtype=torch.long),
        prefill_reqs=[(i, qsl[i], qsl[i + 1], seq_lens[i]) for i in prefills],
    )
    query = torch.randn(1, hkv * group, t, d, generator=g)
    key = torch.randn(1, hkv, t, d, generator=g)
    value = torch.randn(1, hkv, t, d, generator=g)
    module = Layer(layer_idx=rng.randrange(num_layers), num_key_value_groups=group)
    return module, query, key, value, meta


def _clone_meta(meta: AttentionMetadata) -> AttentionMetadata:
    m = copy.copy(meta)
    m.kv_caches = [(k.clone(), v.clone()) for k, v in meta.kv_caches]
    return m


def _compare_attention(fn, seed: int, check_cache: bool = True) -> None:
    module, q, k, v, meta = random_metadata(seed)
    mine, ref = _clone_meta(meta), _clone_meta(meta)
    scale = q.shape[-1] ** -0.5
    label = (f"a step of {meta.num_reqs} requests with q_lens "
             f"{(meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()}, seq_lens {meta.seq_lens.tolist()}, "
             f"block_size {meta.kv_caches[0][0].shape[1]}, layer {module.layer_idx}")
    result = run(fn, (module, q.clone(), k.clone(), v.clone(), None),
                 kwargs={"scaling": scale, "pagedkv_metadata": mine}, timeout=10)
    want, _ = paged_attention_forward(module, q, k, v, None, scaling=scale, pagedkv_metadata=ref)
    if result is None:
        fail("paged_attention returned None: is it still the stub? Return (output, None)")
    if not isinstance(result, tuple) or len(result) != 2:
        fail(f"paged_attention must return a pair (output, None) as transformers' attention functions do, "
             f"got {describe(result, 60)}")
    out = result[0]
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want.shape):
        fail(f"for {label}: the output should be a tensor of shape {tuple(want.shape)} = [1, T, Hq, D], got "
             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else describe(out, 60)}. Hint: transformers "
             "hands you query as [1, Hq, T, D] and expects [1, T, Hq, D] back")
    if check_cache:
        for layer, ((kc, vc), (rk, rv)) in enumerate(zip(mine.kv_caches, ref.kv_caches, strict=True)):
            if not (torch.equal(kc, rk) and torch.equal(vc, rv)):
                what = ("was changed" if layer != module.layer_idx
                        else "does not hold the new keys/values where expected")
                fail(f"for {label}: layer {layer}'s cache {what}. Hint: write key[0].transpose(0, 1)[t] "
                     "to flat slot slot_mapping[t] of meta.kv_caches[module.layer_idx] (viewed as "
                     "[num_blocks * block_size, Hkv, D]), and only there")
    if not torch.allclose(out.float(), want.float(), atol=1e-4, rtol=1e-4):
        err = (out.float() - want.float()).abs().max().item()
        fail(f"for {label}: the output differs from the reference by up to {err:.3g}. Hint: write the cache "
             "first (the new tokens attend to themselves), then attend with each request's block table, seq_len "
             "and query_start_loc")


def check_attention_random_steps(fn) -> None:
    require_function(fn, "paged_attention")
    for seed in range(8):
        _compare_attention(fn, seed, check_cache=False)


def check_attention_writes_the_cache(fn) -> None:
    require_function(fn, "paged_attention")
    for seed in range(100, 108):
        _compare_attention(fn, seed, check_cache=True)


def check_attention_hidden(fn) -> None:
    require_function(fn, "paged_attention")
    for seed in range(5000, 5030):
        _compare_attention(fn, seed, check_cache=True)


# ---------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0):
    """The lesson's tiny Llama (2 layers, hidden 64, GQA 4/2), seeded, eager attention, no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@contextlib.contextmanager
def plugged(prepare=None, attention=None):
    """The engine with the learner's ``prepare_inputs`` and/or attention function in place of the library's."""
    from transformers import AttentionInterface

    from pagedkv.engine.attention import ATTN_IMPLEMENTATION, register_pagedkv_attention

    register_pagedkv_attention()
    saved_prepare = runner_module.prepare_inputs
    if prepare is not None:
        def prepare_plain(so, token_ids, block_size):
            return prepare(plain_output(so), {r: list(t) for r, t in token_ids.items()}, block_size)

        runner_module.prepare_inputs = prepare_plain
    if attention is not None:
        def attention_plain(module, query, key, value, attention_mask, scaling=None, **kwargs):
            # Fresh tensors every call (the learner's process gets whole copies), the caches copied back after.
            layer = Layer(module.layer_idx, getattr(module, "num_key_value_groups", 1))
            meta = kwargs["pagedkv_metadata"]
            mine = copy.copy(meta)
            mine.kv_caches = [(k.clone(), v.clone()) for k, v in meta.kv_caches]
            out = attention(layer, query.clone(), key.clone(), value.clone(), attention_mask, scaling=scaling,
                            pagedkv_metadata=mine)
            for (k, v), (mk, mv) in zip(meta.kv_caches, mine.kv_caches, strict=True):
                k.copy_(mk)
                v.copy_(mv)
            return out

        AttentionInterface.register(ATTN_IMPLEMENTATION, attention_plain)
    try:
        yield
    finally:
        runner_module.prepare_inputs = saved_prepare
        register_pagedkv_attention()


def _end_to_end(seed: int, prepare=None, attention=None) -> None:
    from pagedkv.engine import LLM, SamplingParams

    model = tiny_llama(seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 512) for _ in range(rng.randint(3, 20))] for _ in range(5)]
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
            want.append(out[0, len(p):].tolist())
    llm = LLM(model, num_gpu_blocks=10, block_size=4, max_num_batched_tokens=16)  # registers the library's
    with plugged(prepare, attention):
        outs = run(llm.generate, (prompts, SamplingParams(max_tokens=5, temperature=0.0)),
                   kwargs={"use_tqdm": False}, timeout=60)
    for i, (o, w) in enumerate(zip(outs, want, strict=True)):
        got = o.outputs[0].token_ids
        if got != w:
            fail(f"end to end (5 prompts, chunked prefill and preemption on a 10-block pool): prompt {i} "
                 f"({len(prompts[i])} tokens) generated {got}, Hugging Face's generate gives {w}")


def check_prepare_inputs_end_to_end(fn) -> None:
    require_function(fn, "prepare_inputs")
    _compare_inputs(fn, *example_step())  # a clear message first, if it is wrong on one step
    _end_to_end(0, prepare=fn)


def check_attention_end_to_end(fn) -> None:
    require_function(fn, "paged_attention")
    _compare_attention(fn, 0)  # a clear message first, if it is wrong on one step
    _end_to_end(1, attention=fn)
