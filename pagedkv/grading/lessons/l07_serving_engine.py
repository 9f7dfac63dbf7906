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
import re
from dataclasses import dataclass

import torch

from pagedkv import KVCacheManager, Request
from pagedkv.attention import make_paged_kv
from pagedkv.engine import model_runner as runner_module
from pagedkv.engine.attention import AttentionMetadata, paged_attention_forward
from pagedkv.engine.model_runner import prepare_inputs
from pagedkv.engine.tiny_models import TINY_CONFIG, seeded_tiny_model  # the lesson's tiny model, shared
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
    "TINY_CONFIG",
    "seeded_tiny_model",
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
    names = rng.sample("BDFHKMPRTX", 7)  # ids whose sorted order is not the scheduling order
    for i in range(rng.randint(3, 7)):
        prompt = shared + [rng.randrange(1, 500) for _ in range(rng.randint(1, 3 * bs))]
        with contextlib.suppress(ValueError):
            sched.add_request(Request(f"{names[i]}{seed}", prompt, max_tokens=rng.randint(1, 6)))
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


def _run_shown(fn, args, kwargs=None, *, shown: str, timeout: float):
    """``run``, with the call shown as ``shown`` in its failure (the arguments themselves are tensors and
    scheduler outputs, pages long)."""
    try:
        return run(fn, args, kwargs, timeout=timeout)
    except AssertionError as exc:
        text = str(exc)
        cut = min((i for i in (text.find(" raised "), text.find(" did not return within ")) if i >= 0), default=-1)
        fail(shown + text[cut:] if cut >= 0 else text)


def _describe_step(so, bs: int, with_tables: bool = False) -> str:
    text = (f"num_scheduled_tokens={dict(so.num_scheduled_tokens)}, "
            f"num_computed_tokens={dict(so.num_computed_tokens)}, "
            f"partial_prefill_req_ids={sorted(so.partial_prefill_req_ids or [])}, block_size={bs}")
    if with_tables:
        text += f", block_tables={ {r: list(so.block_tables[r]) for r in so.num_scheduled_tokens} }"
    return text


ROW_FIELDS = ("input_ids", "positions", "slot_mapping")


def _first_difference(name: str, value: list, expected: list, want) -> str:
    """Where a field first differs: a row (and its request and position) for per-token fields, an entry
    otherwise."""
    if len(value) != len(expected):
        per = "scheduled token" if name in ROW_FIELDS else "scheduled request"
        if name == "query_start_loc":
            per = "scheduled request, plus the leading 0"
        elif name in ("sample_req_ids", "logits_indices"):
            per = "sampled request"
        return f"it has {len(value)} entries, expected {len(expected)} (one per {per})"
    i = next(i for i, (a, b) in enumerate(zip(value, expected, strict=True)) if a != b)
    if name in ROW_FIELDS:
        b = next(b for b in range(len(want.req_ids)) if want.query_start_loc[b + 1] > i)
        return (f"it first differs at row {i} (request {want.req_ids[b]!r}, position {want.positions[i]}): "
                f"{describe(value[i], 60)}, expected {describe(expected[i], 60)}")
    return f"it first differs at entry {i}: {describe(value[i], 80)}, expected {describe(expected[i], 80)}"


def _compare_inputs(fn, so, token_ids, bs) -> None:
    want = prepare_inputs(so, token_ids, bs)  # first; the learner's function gets copies
    got = _run_shown(fn, (plain_output(copy.deepcopy(so)), copy.deepcopy(token_ids), bs), timeout=5,
                     shown=f"prepare_inputs(scheduler_output, token_ids, {bs}) for the step {_describe_step(so, bs)}")
    if got is None:
        fail("prepare_inputs returned None: is it still the stub? Return a ModelInputs(...)")
    for name in FIELDS:
        if not hasattr(got, name):
            what = (f"a {type(got).__name__} of {len(got)} items" if isinstance(got, (tuple, list, dict))
                    else describe(got, 60))
            fail(f"prepare_inputs returned {what}, which has no field {name!r}: return "
                 "ModelInputs(req_ids, input_ids, positions, slot_mapping, block_tables, seq_lens, "
                 "query_start_loc, sample_req_ids, logits_indices)")
        value = getattr(got, name)
        try:
            value = [list(v) for v in value] if name == "block_tables" else list(value)
        except TypeError:
            fail(f"{name} should be a list, got {describe(value, 60)}")
        expected = getattr(want, name)
        if value != expected:
            fail(f"for the step {_describe_step(so, bs, with_tables=name == 'slot_mapping')}: {name} is "
                 f"{describe(value, 200)}, expected {describe(expected, 200)}; "
                 f"{_first_difference(name, value, expected, want)}. Hint: {HINTS[name]}")


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
    """A deep copy: what the learner's function gets, and what the reference runs on, share no tensor (a
    ``slot_mapping.fill_(-1)`` in the learner's call must not reach the reference or the check)."""
    return copy.deepcopy(meta)


def _attend(q, key_cache, value_cache, meta, scale, *, gqa="interleave", causal="offset", prefix=True):
    """Attention of the step computed one plain way, with one known mistake switched on or none (float64):
    ``gqa`` "interleave" (query head h reads KV head h // group) or "modulo" (h % Hkv); ``causal`` "offset"
    (new token i at position seq_len - q_len + i), "none" or "from_zero" (the mask not offset by the cached
    prefix); ``prefix`` False: only the step's own tokens are attended to."""
    t, hq, d = q.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    heads = torch.arange(hq) // (hq // hkv) if gqa == "interleave" else torch.arange(hq) % hkv
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    qsl = meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        first = 0 if prefix else seq_len - (hi - lo)
        pos = torch.arange(first, seq_len)
        slots = meta.block_tables[b][pos // bs].long() * bs + pos % bs
        k = key_cache.reshape(-1, hkv, d)[slots].double()[:, heads]  # [L, Hq, D]
        v = value_cache.reshape(-1, hkv, d)[slots].double()[:, heads]
        scores = torch.einsum("thd,lhd->htl", q[lo:hi].double(), k) * scale
        if causal != "none":
            qpos = torch.arange(hi - lo) + (seq_len - (hi - lo) if causal == "offset" else 0)
            scores = scores.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))
        out[lo:hi] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
    return out


def _request_of_row(meta, row: int) -> tuple[int, int, int]:
    """(request index, q_len, seq_len) of a packed row."""
    qsl = meta.query_start_loc.tolist()
    b = next(b for b in range(len(qsl) - 1) if qsl[b + 1] > row)
    return b, qsl[b + 1] - qsl[b], int(meta.seq_lens[b])


def _cache_problem(mine, before, layer_idx: int, key, value, meta) -> str | None:
    """What is wrong in the caches after the learner's call, or None: ``mine`` the learner's caches,
    ``before`` the caches as they were, ``key``/``value`` transformers' ``[1, Hkv, T, D]``."""
    for layer, ((kc, vc), (ok, ov)) in enumerate(zip(mine.kv_caches, before.kv_caches, strict=True)):
        if layer != layer_idx and not (torch.equal(kc, ok) and torch.equal(vc, ov)):
            return (f"layer {layer}'s cache was changed, but this call is for layer {layer_idx}. Hint: read and "
                    "write only meta.kv_caches[module.layer_idx], the pair of the layer transformers is running")
    hkv, t, d = key.shape[1], key.shape[2], key.shape[3]
    new = {"key": key[0].transpose(0, 1), "value": value[0].transpose(0, 1)}  # [T, Hkv, D]
    reshaped = {"key": key[0].reshape(t, hkv, d), "value": value[0].reshape(t, hkv, d)}
    slots = meta.slot_mapping.tolist()
    for which, cache, old in (("key", mine.kv_caches[layer_idx][0], before.kv_caches[layer_idx][0]),
                              ("value", mine.kv_caches[layer_idx][1], before.kv_caches[layer_idx][1])):
        flat, flat_old = cache.reshape(-1, hkv, d), old.reshape(-1, hkv, d)
        other = "value" if which == "key" else "key"
        for row, slot in enumerate(slots):
            got = flat[slot]
            if torch.equal(got, new[which][row]):
                continue
            b, q_len, seq_len = _request_of_row(meta, row)
            where = (f"flat slot {slot} of layer {layer_idx}'s {which} cache (row {row} of the step: request {b}, "
                     f"position {seq_len - q_len + row - int(meta.query_start_loc[b])})")
            if torch.equal(got, flat_old[slot]):
                return (f"{where} still holds its old contents: this step's {which}s were not written. Hint: "
                        f"write {which}[0].transpose(0, 1)[t] ([Hkv, D]) at flat slot slot_mapping[t] of "
                        f"meta.kv_caches[module.layer_idx][{0 if which == 'key' else 1}], viewed as "
                        "[num_blocks * block_size, Hkv, D], before attending")
            if torch.equal(got, new[other][row]):
                return f"{where} holds the token's {other}, not its {which}. Hint: keys go to the key cache " \
                       "(kv_caches[layer][0]), values to the value cache (kv_caches[layer][1])"
            if t > 1 and hkv > 1 and torch.equal(got, reshaped[which][row]):
                return (f"{where} holds numbers mixed from several tokens. Hint: {which} is [1, Hkv, T, D]; bring "
                        f"it to [T, Hkv, D] with {which}[0].transpose(0, 1), not with reshape or view, which "
                        "keep the memory order")
            match = next((r for r in range(t) if torch.equal(got, new[which][r])), None)
            if match is not None:
                return (f"{where} holds row {match}'s {which}, not row {row}'s. Hint: row t goes to flat slot "
                        "slot_mapping[t]")
            return (f"{where} holds {describe(got.flatten().tolist(), 80)}, expected row {row}'s {which}, "
                    f"{which}[0, :, {row}, :] = {describe(new[which][row].flatten().tolist(), 80)}")
        written = set(slots)
        changed = [s for s in range(flat.shape[0]) if s not in written and not torch.equal(flat[s], flat_old[s])]
        if changed:
            return (f"flat slot {changed[0]} of layer {layer_idx}'s {which} cache was changed, but no row of the "
                    f"step maps to it (slot_mapping is {describe(slots, 120)}). Hint: write row t at flat slot "
                    f"slot_mapping[t] only: every other slot holds another token's cached {which}")
    return None


def _output_problem(out, q, meta, before, layer_idx: int, scale: float) -> str:
    """Why the output differs, when it matches attention with one known mistake; else where it first differs."""
    qt = q[0].transpose(0, 1)  # [T, Hq, D]
    kc, vc = meta.kv_caches[layer_idx]  # written by the reference
    hq, hkv = qt.shape[1], kc.shape[2]
    got = out[0].double()

    def same(x):
        return torch.allclose(got, x, atol=1e-4, rtol=1e-4)

    ok, ov = before.kv_caches[layer_idx]
    if same(_attend(qt, ok, ov, meta, scale)):
        return ("Your output is attention over the cache as it was BEFORE this step's keys and values were "
                "written. Hint: write the cache first, then attend: a new token attends to itself and to the "
                "earlier tokens of its chunk, and they are in the cache only once written")
    if same(_attend(qt, kc, vc, meta, 1.0)):
        return ("Your output is attention with softmax scale 1. Hint: multiply the scores q·k by `scaling`, the "
                "scale transformers passes (pass it on to the attention function)")
    if hq != hkv and hkv > 1 and same(_attend(qt, kc, vc, meta, scale, gqa="modulo")):
        return (f"Your output has query head h reading KV head h % Hkv (Hq = {hq}, Hkv = {hkv}). Hint: with "
                f"grouped-query attention consecutive query heads share a KV head: query head h reads KV head "
                f"h // (Hq // Hkv) (repeat_interleave, as transformers' repeat_kv does, not repeat)")
    if same(_attend(qt, kc, vc, meta, scale, causal="none")):
        return ("Your output lets a chunk's tokens see the tokens after them in the same chunk. Hint: attention "
                "is causal: new token i of a chunk of q_len tokens sits at position seq_len - q_len + i and "
                "attends to positions 0 .. seq_len - q_len + i only")
    if same(_attend(qt, kc, vc, meta, scale, causal="from_zero")):
        return ("Your causal mask is not offset by the cached prefix. Hint: new token i of a chunk of q_len tokens "
                "sits at position seq_len - q_len + i, not i: it attends to the whole cached prefix and to the "
                "chunk's tokens up to itself")
    if same(_attend(qt, kc, vc, meta, scale, prefix=False)):
        return ("Your output attends only to the step's new tokens, not to the cached prefix. Hint: each request "
                "attends to all seq_len tokens of its sequence, read from the cache through its block table")
    bad = ((got - _attend(qt, kc, vc, meta, scale)).abs() > 1e-4 + 1e-4 * got.abs()).nonzero()
    if len(bad) == 0:  # NaN somewhere
        return "Hint: your output holds NaN or infinite values"
    row, head = int(bad[0, 0]), int(bad[0, 1])
    b, q_len, seq_len = _request_of_row(meta, row)
    kind = "a decode" if q_len == 1 else f"a chunk of {q_len} new tokens"
    return (f"It first differs at row {row}, query head {head}: request {b}, {kind} over seq_len {seq_len}. Hint: "
            "write the cache first (the new tokens attend to themselves), then attend with each request's "
            "block table, seq_len and query_start_loc, causally")


_SHAPE_ERROR = re.compile(r"size of tensor|must match|shape|dimension|broadcast|has size", re.IGNORECASE)


def _compare_attention(fn, seed: int, check_cache: bool = True) -> None:
    module, q, k, v, meta = random_metadata(seed)
    before, mine, ref = _clone_meta(meta), _clone_meta(meta), _clone_meta(meta)
    scale = q.shape[-1] ** -0.5
    hq, hkv = q.shape[1], k.shape[1]
    label = (f"a step of {meta.num_reqs} requests with q_lens "
             f"{(meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()}, seq_lens {meta.seq_lens.tolist()}, "
             f"block_size {meta.kv_caches[0][0].shape[1]}, Hq {hq}, Hkv {hkv}, layer {module.layer_idx}")
    try:
        result = _run_shown(fn, (module, q.clone(), k.clone(), v.clone(), None),
                            {"scaling": scale, "pagedkv_metadata": mine}, timeout=10,
                            shown=f"for {label}: paged_attention(module, query, key, value, None, scaling={scale:.4g}, "
                                  "pagedkv_metadata=meta)")
    except AssertionError as exc:
        if hq != hkv and _SHAPE_ERROR.search(str(exc)):
            fail(f"{exc}. Hint: query has Hq = {hq} heads, keys and values Hkv = {hkv} (grouped-query "
                 f"attention): each KV head serves Hq // Hkv = {hq // hkv} consecutive query heads, so repeat the "
                 "keys and values along the head dimension with repeat_interleave before attending (lesson 6's "
                 "attention does it for you)")
        raise
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
    cache = _cache_problem(mine, before, module.layer_idx, k, v, meta)
    if check_cache and cache is not None:
        fail(f"for {label}: {cache}")
    if not torch.allclose(out.float(), want.float(), atol=1e-4, rtol=1e-4):
        err = (out.float() - want.float()).abs().max().item()
        why = (f"Its cause: {cache}" if cache is not None
               else _output_problem(out, q, ref, before, module.layer_idx, scale))
        fail(f"for {label}: the output differs from the reference by up to {err:.3g}. {why}")


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
    """The lesson's tiny Llama (:data:`TINY_CONFIG`), seeded, eager attention, no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return seeded_tiny_model(LlamaConfig, LlamaForCausalLM, seed)


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
            mine = _clone_meta(meta)  # the engine's own metadata stays out of the learner's reach
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
