"""Checks for lesson 7's exercises (``grading/source/07_serving_engine.ipynb``): ``prepare_inputs`` (a step
flattened into one batch) and the attention glue (transformers' attention call on the paged cache).

Each ``check_*`` function is one test case: the source's test cell calls it with the learner's function. The
learner's function is called only inside a scenario (``drive_*``, through :func:`pagedkv.grading.checks.drive`):
under ``pagedkv grade`` it runs in the sandbox, beside the learner's code, builds the inputs itself from plain
data (the example step, seeds, one call's inputs), calls the learner's function and returns what it saw as plain
data (the fields returned, the output tensor and the caches after the call, or what was raised). The check then
builds the same inputs here, independently, computes the expected answer with the library (``pagedkv.engine``'s
``prepare_inputs``, ``paged_attention_forward``) and compares. Random schedules come from the library's
``Scheduler`` driven with random requests and random samples.

End to end, the engine runs here, in the check's process, with the learner's function plugged in
(:func:`plugged`; the other piece stays the library's, so each exercise is judged on its own): each call the
engine makes of it is one scenario (:func:`drive_prepare_call`, :func:`drive_attention_call`) whose inputs go to
the learner's process as plain data and whose results come back as plain data, copied into the engine's own
tensors and ``ModelInputs``. The engine's tokens must be transformers' greedy ones, computed here too: nothing in
the learner's process can hand the check tokens it did not earn.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import re
import types
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv import KVCacheManager, Request
from pagedkv.attention import make_paged_kv
from pagedkv.engine import model_runner as runner_module
from pagedkv.engine.attention import AttentionMetadata, paged_attention_forward
from pagedkv.engine.model_runner import ModelInputs, prepare_inputs
from pagedkv.engine.tiny_models import TINY_CONFIG, seeded_tiny_model  # the lesson's tiny model, shared
from pagedkv.grading.checks import (
    CallTimeout,
    all_came_back,
    describe,
    drive,
    fail,
    format_call,
    is_int,
    require_function,
    scenario_records,
    time_limit,
    where,
)
from pagedkv.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
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
    "drive_attention",
    "drive_attention_call",
    "drive_prepare_call",
    "drive_prepare_inputs",
    "end_to_end_prompts",
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

#: Seconds one call of the learner's function may take (prepare_inputs, paged_attention), and a whole
#: end-to-end generate (each call inside it too).
PREPARE_TIMEOUT, ATTENTION_TIMEOUT, GENERATE_TIMEOUT = 5.0, 10.0, 60.0

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
# What the learner's functions receive (the scenarios build it beside the learner's code)
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


# ---------------------------------------------------------------------------------------------------------
# What a scenario records (plain data: the learner's process sends it to the check)
# ---------------------------------------------------------------------------------------------------------
def raised_record(exc: BaseException) -> dict:
    """A call of the learner's code that raised, as data: the exception's type name, message and line."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        message = f"<{type(exc).__name__} whose str() raised>"
    return {"raised": type(exc).__name__, "message": message, "where": where(exc)}


def plain_items(value) -> list:
    """``list(value)`` with each item as plain data: numbers stay numbers, a tensor becomes its values
    (``tensor(3)`` is 3), a NumPy scalar its Python value, a nested list or tuple a list; any other object is
    shown by its ``repr`` (it compares equal to no number). ``TypeError`` when ``value`` is not iterable."""
    out = []
    for item in list(value):
        if item is None or type(item) in (bool, int, float, str):
            out.append(item)
        elif isinstance(item, torch.Tensor):
            out.append(item.detach().cpu().tolist())
        elif type(item).__module__.startswith("numpy") and getattr(item, "shape", None) == ():
            out.append(item.item())
        elif isinstance(item, (list, tuple)):
            out.append(plain_items(item))
        else:
            out.append(describe(item, 40))
    return out


def _call_failure(shown: str, record: dict, timeout: float) -> str | None:
    """The failure message for a call the scenario recorded as raised or timed out (``shown``: the call as
    the learner should read it), else None."""
    if "timeout" in record:
        return f"{shown} did not return within {timeout:g} s: is there an infinite loop?"
    if "raised" in record:
        return f"{shown} raised {record['raised']}: {record['message']}{record.get('where') or ''}"
    return None


# ---------------------------------------------------------------------------------------------------------
# prepare_inputs
# ---------------------------------------------------------------------------------------------------------
def steps_of(spec):
    """The steps a spec names: ``"example"`` (:func:`example_step`) or ``(seed, num_steps)``
    (:func:`random_steps`); a list of ``(scheduler_output, token_ids, block_size)``."""
    if spec == "example":
        return [example_step()]
    seed, num_steps = spec
    return random_steps(int(seed), int(num_steps))


def observe_inputs(got) -> dict:
    """What ``prepare_inputs`` returned, field by field in :data:`FIELDS` order, as plain lists; stops at the
    first field that is missing (``"missing"``, with what was returned) or is not a sequence (``"not_list"``)."""
    if got is None:
        return {"none": True}
    fields: dict = {}
    for name in FIELDS:
        if not hasattr(got, name):
            what = (f"a {type(got).__name__} of {len(got)} items" if isinstance(got, (tuple, list, dict))
                    else describe(got, 60))
            return {"fields": fields, "missing": name, "what": what}
        value = getattr(got, name)
        try:
            fields[name] = [plain_items(v) for v in value] if name == "block_tables" else plain_items(value)
        except TypeError:
            return {"fields": fields, "not_list": name, "what": describe(value, 60)}
    return {"fields": fields}


def drive_prepare_inputs(fn, specs) -> list:
    """Scenario: ``fn`` (the learner's ``prepare_inputs``) on every step of ``specs`` (see :func:`steps_of`),
    each call on copies of the step (the scheduler output's fields as plain containers). One record per step
    (:func:`observe_inputs`), or a raise / timeout record, which ends the scenario."""
    records = []
    for spec in specs:
        for so, token_ids, bs in steps_of(spec):
            record = call_prepare(fn, plain_output(copy.deepcopy(so)), copy.deepcopy(token_ids), bs, PREPARE_TIMEOUT)
            records.append(record)
            if "raised" in record or "timeout" in record:
                return records
    return records


def _changed_arguments(so, token_ids, before: tuple) -> str | None:
    """What a call changed in its arguments, ``before`` being (:func:`scheduler_output_fields` of ``so``, a copy
    of ``token_ids``) as they were: the first field that differs, as text, or None."""
    try:
        fields, tokens = before
        after = scheduler_output_fields(so)
        for name, value in fields.items():
            if after.get(name) != value:
                return (f"scheduler_output.{name} was {describe(value, 120)} before the call, "
                        f"{describe(after.get(name), 120)} after it")
        for rid, ids in tokens.items():
            now = token_ids.get(rid) if isinstance(token_ids, dict) else None
            if now != ids:
                return f"token_ids[{rid!r}] was {describe(ids, 120)} before the call, {describe(now, 120)} after it"
        if isinstance(token_ids, dict) and set(token_ids) != set(tokens):
            return f"token_ids had the keys {sorted(tokens)} before the call, {sorted(map(str, token_ids))} after it"
    except Exception as exc:  # noqa: BLE001 - a scheduler output the call left unreadable
        return f"the scheduler output could not be read after the call ({type(exc).__name__}: {exc})"
    return None


def call_prepare(fn, so, token_ids, block_size: int, limit: float) -> dict:
    """One call of ``fn`` (the learner's ``prepare_inputs``) within ``limit`` seconds: what it returned
    (:func:`observe_inputs`), with ``"changed"`` when the call changed its arguments (:func:`_changed_arguments`),
    or a raise / timeout record."""
    before = (scheduler_output_fields(so), copy.deepcopy(token_ids))
    try:
        with time_limit(limit, "prepare_inputs"):
            got = fn(so, token_ids, block_size)
        record = observe_inputs(got)
        changed = _changed_arguments(so, token_ids, before)
        if changed is not None:
            record["changed"] = changed
        return record
    except CallTimeout:
        return {"timeout": True}
    except Exception as exc:  # noqa: BLE001 - the learner's code raised: a record
        return raised_record(exc)


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


def _judge_inputs(record: dict, so, token_ids, bs, check_arguments: bool = True) -> None:
    """Fail unless ``record`` (what the learner's ``prepare_inputs`` returned for this step) is the library's
    answer for it, computed here, and (``check_arguments``) the call left its arguments as they were."""
    want = prepare_inputs(so, token_ids, bs)
    shown = f"prepare_inputs(scheduler_output, token_ids, {bs}) for the step {_describe_step(so, bs)}"
    failure = _call_failure(shown, record, PREPARE_TIMEOUT)
    if failure is not None:
        fail(failure)
    if record.get("none"):
        fail("prepare_inputs returned None: is it still the stub? Return a ModelInputs(...)")
    fields = record.get("fields") or {}
    for name in FIELDS:
        if name not in fields:
            if record.get("not_list") == name:
                fail(f"{name} should be a list, got {record['what']}")
            fail(f"prepare_inputs returned {record.get('what')}, which has no field {name!r}: return "
                 "ModelInputs(req_ids, input_ids, positions, slot_mapping, block_tables, seq_lens, "
                 "query_start_loc, sample_req_ids, logits_indices)")
        value, expected = fields[name], getattr(want, name)
        if value != expected:
            fail(f"for the step {_describe_step(so, bs, with_tables=name == 'slot_mapping')}: {name} is "
                 f"{describe(value, 200)}, expected {describe(expected, 200)}; "
                 f"{_first_difference(name, value, expected, want)}. Hint: {HINTS[name]}")
        slip = _type_slip(value, expected)
        if slip is not None:  # equal values of another type: 1.0 == 1 and True == 1 in Python, not to the engine
            fail(f"for the step {_describe_step(so, bs)}: {name} is {describe(value, 200)}: {slip}. The engine "
                 "indexes its tokens, cache slots and tables with these numbers: ints (a tensor's values count as "
                 "their Python numbers: use an integer dtype)")
    if check_arguments and record.get("changed"):
        fail(f"prepare_inputs(scheduler_output, token_ids, {bs}) for the step {_describe_step(so, bs)} returned "
             f"the right inputs, but changed its arguments: {record['changed']}. Hint: the scheduler reads its "
             "output again once the step has run (update_from_output), and token_ids are the requests' own "
             "tokens: read them, and build new lists of your own")


def _type_slip(value: Any, expected: Any, at: str = "") -> str | None:
    """Where ``value``, equal to ``expected`` under ``==``, holds an item of another type (a float or a bool where
    the library has an int), or None."""
    if isinstance(expected, list):
        for i, (v, e) in enumerate(zip(value, expected, strict=True)):
            slip = _type_slip(v, e, f"{at}[{i}]")
            if slip is not None:
                return slip
        return None
    if is_int(expected) and not is_int(value):
        return f"entry {at} is {describe(value, 40)} (a {type(value).__name__}), expected the int {expected}"
    return None


def _compare_inputs(fn, specs, timeout: float = 30.0, check_arguments: bool = True) -> None:
    """One scenario over every step of ``specs``, then each step judged here, in order (:func:`_judge_inputs`)."""
    records = drive(drive_prepare_inputs, fn, list(specs), timeout=timeout, name="prepare_inputs on the steps")
    steps = [step for spec in specs for step in steps_of(spec)]
    records = scenario_records(records, at_most=len(steps), unit="steps")
    for record, (so, token_ids, bs) in zip(records, steps, strict=False):
        _judge_inputs(record, so, token_ids, bs, check_arguments)
    all_came_back(records, len(steps), "steps")


def check_prepare_inputs_example(fn) -> None:
    require_function(fn, "prepare_inputs")
    _compare_inputs(fn, ["example"])


def check_prepare_inputs_random(fn) -> None:
    require_function(fn, "prepare_inputs")
    _compare_inputs(fn, [(seed, 12) for seed in range(20)], timeout=60.0)


def check_prepare_inputs_hidden(fn) -> None:
    require_function(fn, "prepare_inputs")
    _compare_inputs(fn, [(seed, 20) for seed in range(1000, 1060)], timeout=120.0)


# ---------------------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------------------
def random_metadata(seed: int, num_layers: int = 2, dtype: torch.dtype = torch.float32):
    """A random mixed step: ``(module, query, key, value, metadata)`` in transformers' layout
    (``query [1, Hq, T, D]``, ``key``/``value [1, Hkv, T, D]``), caches that hold each request's cached prefix;
    every tensor of floats in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    bs = rng.choice([2, 4, 8])
    hkv, group, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([4, 8])
    b = rng.randint(1, 5)
    q_lens = [1 if rng.random() < 0.5 else rng.randint(1, 9) for _ in range(b)]
    seq_lens = [q + rng.randint(0, 12) for q in q_lens]
    key_cache, value_cache, tables, _ = make_paged_kv(seq_lens, hkv, d, bs, generator=g, extra_blocks=2)
    kv_caches = [(key_cache.to(dtype), value_cache.to(dtype))] + [
        (torch.randn(key_cache.shape, generator=g).to(dtype), torch.randn(value_cache.shape, generator=g).to(dtype))
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
    query = torch.randn(1, hkv * group, t, d, generator=g).to(dtype)
    key = torch.randn(1, hkv, t, d, generator=g).to(dtype)
    value = torch.randn(1, hkv, t, d, generator=g).to(dtype)
    module = Layer(layer_idx=rng.randrange(num_layers), num_key_value_groups=group)
    return module, query, key, value, meta


def step_dtype(seed: int) -> torch.dtype:
    """The dtype of the random step of ``seed``: float32, and bfloat16 on every fifth seed (a model served in
    bfloat16 hands its attention bfloat16), so that an output made in float32 whatever the query is seen."""
    return torch.bfloat16 if int(seed) % 5 == 4 else torch.float32


def close_enough(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``got`` is ``want`` up to rounding in ``dtype`` (bfloat16 keeps 8 bits of mantissa: a sum in
    another order differs by a few of its steps)."""
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    return torch.allclose(got.double(), want.double(), atol=tol, rtol=tol)


def step_scaling(seed: int, head_dim: int) -> float:
    """The softmax scale transformers passes on the random step of ``seed``: ``head_dim ** -0.5`` (Llama's), and
    ``1 / head_dim`` on every fourth seed (a model may set its own: Granite's ``attention_multiplier``, Gemma 2's
    ``query_pre_attn_scalar``), so that an answer that ignores ``scaling`` is seen."""
    return 1.0 / head_dim if int(seed) % 4 == 3 else head_dim ** -0.5


def _clone_meta(meta: AttentionMetadata) -> AttentionMetadata:
    """A deep copy: the check's reference and its picture of the caches before the call run on copies of the
    check's own step, which share no tensor with each other (nor with the learner's call, which runs on a step
    the scenario built itself)."""
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
            if slot < 0:  # padding: no token is written there (write_kv_torch skips it), so nothing to check
                continue
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
        written = {s for s in slots if s >= 0}
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
        return close_enough(got, x, q.dtype)

    ok, ov = before.kv_caches[layer_idx]
    if same(_attend(qt, ok, ov, meta, scale)):
        return ("Your output is attention over the cache as it was BEFORE this step's keys and values were "
                "written. Hint: write the cache first, then attend: a new token attends to itself and to the "
                "earlier tokens of its chunk, and they are in the cache only once written")
    d = qt.shape[-1]
    if scale != d ** -0.5 and same(_attend(qt, kc, vc, meta, d ** -0.5)):
        return (f"Your output is attention with softmax scale 1/sqrt(head_dim) = {d ** -0.5:.4g}, not the `scaling` "
                f"this call passes, {scale:.4g}. Hint: use `scaling`: transformers passes the model's own scale "
                "(module.scaling), and not every model uses 1/sqrt(head_dim)")
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


def drive_attention(fn, seeds) -> list:
    """Scenario: ``fn`` (the learner's ``paged_attention``) on the random step of each seed
    (:func:`random_metadata`, built here), as transformers calls it. One record per seed: the output
    (``"out"``, a tensor; ``"out_desc"`` when it is not one; ``"result"`` when the call did not return a pair)
    and ``"caches"``, every layer's key and value cache after the call; or a raise / timeout record, which ends
    the scenario."""
    records = []
    for seed in seeds:
        module, q, k, v, meta = random_metadata(int(seed), dtype=step_dtype(seed))
        record = call_attention(fn, module, q, k, v, None, step_scaling(seed, q.shape[-1]), meta, ATTENTION_TIMEOUT)
        records.append(record)
        if "raised" in record or "timeout" in record:
            return records
    return records


def call_attention(fn, module, query, key, value, attention_mask, scaling, meta, limit: float) -> dict:
    """One call of ``fn`` (the learner's ``paged_attention``) as transformers makes it, within ``limit`` seconds:
    the output (``"out"``, a tensor; ``"out_desc"`` when it is not one; ``"result"`` when the call did not return
    a pair) and ``"caches"``, every layer's key and value cache after the call; or a raise / timeout record."""
    caches = [(kc, vc) for kc, vc in meta.kv_caches]  # the tensors the call should write, whatever it rebinds
    try:
        with time_limit(limit, "paged_attention"):
            result = fn(module, query, key, value, attention_mask, scaling=scaling, pagedkv_metadata=meta)
    except CallTimeout:
        return {"timeout": True}
    except Exception as exc:  # noqa: BLE001 - the learner's code raised: a record
        return raised_record(exc)
    record: dict = {"caches": [[plain_tensor(kc), plain_tensor(vc)] for kc, vc in caches]}
    if result is None:
        record["result"] = None
    elif not isinstance(result, tuple) or len(result) != 2:
        record["result"] = describe(result, 60)
    elif isinstance(result[0], torch.Tensor):
        record["out"] = plain_tensor(result[0])
    else:
        record["out_desc"] = describe(result[0], 60)
    return record


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of ``t``'s values (a tensor subclass, a view, a tensor needing grad: its values only)."""
    return t.detach().to("cpu").as_subclass(torch.Tensor).contiguous().clone()


def _step_label(meta, module, hq: int, hkv: int) -> str:
    return (f"a step of {meta.num_reqs} requests with q_lens "
            f"{(meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()}, seq_lens {meta.seq_lens.tolist()}, "
            f"block_size {meta.kv_caches[0][0].shape[1]}, Hq {hq}, Hkv {hkv}, layer {module.layer_idx}"
            + ("" if meta.kv_caches[0][0].dtype == torch.float32 else f", in {describe(meta.kv_caches[0][0].dtype)}"))


def _judge_attention(record: dict, seed: int, check_cache: bool) -> None:
    """Fail unless ``record`` (what the learner's call did on the step of ``seed``) matches the reference, run
    here on inputs built here: the check's own step, a deep copy of it for the reference, another for the
    caches as they were before the call (none of them ever reached the learner's code)."""
    module, q, k, v, meta = random_metadata(seed, dtype=step_dtype(seed))
    before, ref = _clone_meta(meta), _clone_meta(meta)
    scale = step_scaling(seed, q.shape[-1])
    hq, hkv = q.shape[1], k.shape[1]
    label = _step_label(meta, module, hq, hkv)
    shown = (f"for {label}: paged_attention(module, query, key, value, None, scaling={scale:.4g}, "
             "pagedkv_metadata=meta)")
    failure = _call_failure(shown, record, ATTENTION_TIMEOUT)
    if failure is not None:
        if "raised" in record and hq != hkv and _SHAPE_ERROR.search(failure):
            fail(f"{failure}. Hint: query has Hq = {hq} heads, keys and values Hkv = {hkv} (grouped-query "
                 f"attention): each KV head serves Hq // Hkv = {hq // hkv} consecutive query heads, so repeat the "
                 "keys and values along the head dimension with repeat_interleave before attending (lesson 6's "
                 "attention does it for you)")
        fail(failure)
    want, _ = paged_attention_forward(module, q.clone(), k.clone(), v.clone(), None, scaling=scale,
                                      pagedkv_metadata=ref)
    if "result" in record and record["result"] is None:
        fail("paged_attention returned None: is it still the stub? Return (output, None)")
    if "result" in record:
        fail(f"paged_attention must return a pair (output, None) as transformers' attention functions do, "
             f"got {record['result']}")
    out = record.get("out")
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want.shape):
        fail(f"for {label}: the output should be a tensor of shape {tuple(want.shape)} = [1, T, Hq, D], got "
             f"{tuple(out.shape) if isinstance(out, torch.Tensor) else record.get('out_desc')}. Hint: transformers "
             "hands you query as [1, Hq, T, D] and expects [1, T, Hq, D] back")
    mine = types.SimpleNamespace(kv_caches=[tuple(pair) for pair in record["caches"]])
    cache = _cache_problem(mine, before, module.layer_idx, k, v, meta)
    if check_cache and cache is not None:
        fail(f"for {label}: {cache}")
    if out.dtype != q.dtype:
        fail(f"for {label}: the output is {describe(out.dtype)}, the query {describe(q.dtype)}. Hint: make the "
             "output in the query's dtype (torch.empty_like on the query, or new_empty): a model served in "
             "bfloat16 hands its attention bfloat16 and reads bfloat16 back")
    if not close_enough(out, want, q.dtype):
        err = (out.float() - want.float()).abs().max().item()
        why = (f"Its cause: {cache}" if cache is not None
               else _output_problem(out, q, ref, before, module.layer_idx, scale))
        fail(f"for {label}: the output differs from the reference by up to {err:.3g}. {why}")


def _compare_attention(fn, seeds, check_cache: bool = True) -> None:
    """One scenario over the steps of ``seeds``, then each judged here, in order."""
    seeds = list(seeds)
    records = drive(drive_attention, fn, seeds, timeout=30.0 + ATTENTION_TIMEOUT * len(seeds),
                    name="paged_attention on random steps")
    records = scenario_records(records, at_most=len(seeds), unit="steps")
    for record, seed in zip(records, seeds, strict=False):
        _judge_attention(record, seed, check_cache)
    all_came_back(records, len(seeds), "steps")


def check_attention_random_steps(fn) -> None:
    require_function(fn, "paged_attention")
    _compare_attention(fn, range(8), check_cache=False)


def check_attention_writes_the_cache(fn) -> None:
    require_function(fn, "paged_attention")
    _compare_attention(fn, range(100, 108), check_cache=True)


def check_attention_hidden(fn) -> None:
    require_function(fn, "paged_attention")
    _compare_attention(fn, range(5000, 5030), check_cache=True)


# ---------------------------------------------------------------------------------------------------------
# End to end: the engine runs in the check's process; each call it makes of the learner's function is one
# scenario, its inputs sent as plain data, what the call returned and wrote copied back into the engine
# ---------------------------------------------------------------------------------------------------------
def tiny_llama(seed: int = 0):
    """The lesson's tiny Llama (:data:`TINY_CONFIG`), seeded, eager attention, no EOS."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return seeded_tiny_model(LlamaConfig, LlamaForCausalLM, seed)


def plain_containers(value):
    """``value`` with every dict, list, tuple and set copied as the built-in container (``ReqIdList`` is a list)."""
    if isinstance(value, dict):
        return {k: plain_containers(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return {plain_containers(v) for v in value}
    if isinstance(value, tuple):
        return tuple(plain_containers(v) for v in value)
    if isinstance(value, list):
        return [plain_containers(v) for v in value]
    return value


def scheduler_output_fields(so) -> dict:
    """A ``SchedulerOutput`` as plain data, every field (:func:`scheduler_output_from` rebuilds it): the new and
    cached requests as dicts of their fields, the new requests' sampling parameters left out (the sampler's,
    nothing the flattening reads)."""
    fields = {f.name: plain_containers(getattr(so, f.name)) for f in dataclasses.fields(so)
              if f.name not in ("scheduled_new_reqs", "scheduled_cached_reqs")}
    fields["scheduled_new_reqs"] = [{f.name: plain_containers(getattr(r, f.name)) for f in dataclasses.fields(r)
                                     if f.name != "sampling_params"} for r in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    fields["scheduled_cached_reqs"] = {f.name: plain_containers(getattr(cached, f.name))
                                       for f in dataclasses.fields(cached)}
    return fields


def scheduler_output_from(fields: dict) -> SchedulerOutput:
    """The ``SchedulerOutput`` that :func:`scheduler_output_fields` describes."""
    fields = dict(fields)
    fields["scheduled_new_reqs"] = [NewRequestData(**r) for r in fields.get("scheduled_new_reqs") or []]
    fields["scheduled_cached_reqs"] = CachedRequestData(**(fields.get("scheduled_cached_reqs") or {}))
    return SchedulerOutput(**fields)


#: The fields of the engine's ``AttentionMetadata`` that the learner's attention receives (the rest are the
#: library backends' own: decode groups, the pool's decode rows, timings; left at their defaults).
META_FIELDS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "max_query_len", "max_seq_len",
               "decode_req_idx", "prefill_reqs", "sliding_window")


def metadata_fields(meta: AttentionMetadata) -> dict:
    """:data:`META_FIELDS` of ``meta`` as plain data (tensors as CPU copies)."""
    out = {}
    for name in META_FIELDS:
        value = getattr(meta, name)
        out[name] = plain_tensor(value) if isinstance(value, torch.Tensor) else plain_containers(value)
    return out


def drive_prepare_call(fn, fields: dict, token_ids: dict, block_size: int) -> dict:
    """Scenario: one call of ``fn`` (the learner's ``prepare_inputs``) as the engine makes it during an end-to-end
    run, on the step rebuilt from plain data (:func:`scheduler_output_from`; its fields as plain containers):
    what it returned (:func:`observe_inputs`), or a raise / timeout record."""
    so = plain_output(scheduler_output_from(fields))
    return call_prepare(fn, so, {r: list(t) for r, t in token_ids.items()}, int(block_size), GENERATE_TIMEOUT)


def drive_attention_call(fn, layer_idx: int, num_key_value_groups: int, query, key, value, attention_mask,
                         scaling, meta_fields: dict, kv_caches: list) -> dict:
    """Scenario: one call of ``fn`` (the learner's ``paged_attention``) as transformers makes it in the engine
    during an end-to-end run, on the layer, tensors and metadata rebuilt from plain data
    (:data:`META_FIELDS`, every layer's caches): :func:`call_attention`'s record (the output and the caches
    after the call), or a raise / timeout record."""
    module = Layer(int(layer_idx), int(num_key_value_groups))
    meta = AttentionMetadata(kv_caches=[(kc, vc) for kc, vc in kv_caches], **meta_fields)
    return call_attention(fn, module, query, key, value, attention_mask, scaling, meta, GENERATE_TIMEOUT)


class PluggedCallFailed(Exception):
    """A call of the learner's function inside the engine (:func:`plugged`) that raised, ran out of time, or
    returned what the engine cannot use: ``record`` is the scenario's raise / timeout record, or
    ``{"message": why}``. It ends the engine's ``generate``."""

    def __init__(self, name: str, record: dict) -> None:
        self.record = record
        if "timeout" in record:
            text = f"{name} did not return within {GENERATE_TIMEOUT:g} s"
        elif "raised" in record:
            text = f"{name} raised {record['raised']}: {record['message']}{record.get('where') or ''}"
        else:
            text = str(record.get("message"))
        super().__init__(text)


def inputs_from_record(record: dict, so, token_ids: dict, block_size: int) -> ModelInputs:
    """The ``ModelInputs`` the engine runs on, made here from the plain values the learner's ``prepare_inputs``
    returned for the step ``so`` (:func:`observe_inputs`); :class:`PluggedCallFailed` when it raised, ran out of
    time, returned no ``ModelInputs``, or one the engine cannot run (:func:`unrunnable_inputs`)."""
    if "raised" in record or "timeout" in record:
        raise PluggedCallFailed("prepare_inputs", record)
    if record.get("none"):
        raise PluggedCallFailed("prepare_inputs", {"message": "prepare_inputs returned None: is it still the stub? "
                                                              "Return a ModelInputs(...)"})
    fields = record.get("fields") or {}
    missing = next((name for name in FIELDS if name not in fields), None)
    if missing is not None:
        message = (f"{missing} should be a list, got {record.get('what')}" if record.get("not_list") == missing else
                   f"prepare_inputs returned {record.get('what')}, which has no field {missing!r}: return "
                   "ModelInputs(req_ids, input_ids, positions, slot_mapping, block_tables, seq_lens, "
                   "query_start_loc, sample_req_ids, logits_indices)")
        raise PluggedCallFailed("prepare_inputs", {"message": message})
    inputs = ModelInputs(**{name: fields[name] for name in FIELDS})
    why = unrunnable_inputs(inputs, so, token_ids, block_size)
    if why is not None:
        raise PluggedCallFailed("prepare_inputs", {"message": (
            f"prepare_inputs returned inputs the engine cannot run for the step {_describe_step(so, block_size)}: "
            f"{why}")})
    return inputs


def unrunnable_inputs(inputs: ModelInputs, so, token_ids: dict, block_size: int) -> str | None:
    """Why the engine cannot run ``inputs`` (the learner's, for the step ``so``) safely, or None. Not a verdict on
    them (wrong inputs that are well formed run, and give wrong tokens): the engine's kernels index its pool, its
    rows and its tables with these numbers, so each must be a number the step allows: ids of scheduled requests,
    tokens of ``token_ids``, blocks the step's tables hold, rows of the batch."""
    def ints(name: str, values, low: int, high: int) -> str | None:
        for i, x in enumerate(values):
            if not is_int(x) or isinstance(x, bool) or not low <= x < high:
                return f"{name}[{i}] is {describe(x, 40)}, outside {low} .. {high - 1}"
        return None

    req_ids, n = inputs.req_ids, len(inputs.input_ids)
    scheduled = set(so.num_scheduled_tokens)
    if not all(isinstance(r, str) and r in scheduled for r in req_ids) or len(set(req_ids)) != len(req_ids):
        return f"req_ids is {describe(req_ids, 80)}: each scheduled request once, by its id"
    if not all(isinstance(r, str) and r in req_ids for r in inputs.sample_req_ids) or \
            len(set(inputs.sample_req_ids)) != len(inputs.sample_req_ids):
        return f"sample_req_ids is {describe(inputs.sample_req_ids, 80)}: some of req_ids, each once"
    b = len(req_ids)
    for name, size in (("block_tables", b), ("seq_lens", b), ("query_start_loc", b + 1), ("positions", n),
                       ("slot_mapping", n), ("logits_indices", len(inputs.sample_req_ids))):
        if len(getattr(inputs, name)) != size:
            return f"{name} has {len(getattr(inputs, name))} entries for {b} requests and {n} tokens"
    blocks = {int(x) for r in scheduled for x in so.block_tables[r]}
    tokens = {int(x) for ids in token_ids.values() for x in ids} | {0}
    longest = max((len(ids) for ids in token_ids.values()), default=0)
    qsl = inputs.query_start_loc
    checks = [ints("input_ids", inputs.input_ids, 0, max(tokens) + 1), ints("positions", inputs.positions, 0, longest),
              ints("query_start_loc", qsl, 0, n + 1), ints("seq_lens", inputs.seq_lens, 1, longest + 1),
              ints("logits_indices", inputs.logits_indices, 0, n),
              ints("slot_mapping", inputs.slot_mapping, -1, (max(blocks) + 1) * block_size if blocks else 0)]
    checks += [ints(f"block_tables[{i}]", table if isinstance(table, list) else [table], 0, max(blocks) + 1)
               for i, table in enumerate(inputs.block_tables)] if blocks else ["the step's tables hold no block"]
    why = next((c for c in checks if c is not None), None)
    if why is not None:
        return why
    if any(x not in tokens for x in inputs.input_ids):
        return "input_ids holds a number that is no token of token_ids"
    if any(x not in blocks for table in inputs.block_tables for x in table) or \
            any(s != -1 and s // block_size not in blocks for s in inputs.slot_mapping):
        return "a block table or a slot names a block that the step's tables do not hold"
    if qsl[0] != 0 or qsl[-1] != n or any(qsl[i] >= qsl[i + 1] for i in range(b)):
        return f"query_start_loc is {describe(qsl, 80)}: 0, then each request's end row, increasing, up to {n}"
    for i in range(b):
        q_len, seq_len = qsl[i + 1] - qsl[i], inputs.seq_lens[i]
        if seq_len < q_len or -(-seq_len // block_size) > len(inputs.block_tables[i]):
            return (f"request {req_ids[i]!r} has {q_len} new tokens, seq_len {seq_len} and a table of "
                    f"{len(inputs.block_tables[i])} blocks of {block_size}: its seq_len counts its new tokens, and "
                    "its table covers its seq_len")
    return None


def output_from_record(record: dict, query: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The output the engine goes on with, from the learner's call's record (:func:`call_attention`), after
    copying the caches as the call left them into ``meta``'s, the engine's own; :class:`PluggedCallFailed` when
    it raised, ran out of time or returned what transformers cannot use."""
    if "raised" in record or "timeout" in record:
        raise PluggedCallFailed("paged_attention", record)
    if "result" in record:
        raise PluggedCallFailed("paged_attention", {"message": (
            "paged_attention returned None: is it still the stub? Return (output, None)" if record["result"] is None
            else "paged_attention must return a pair (output, None) as transformers' attention functions do, got "
                 f"{record['result']}")})
    out, want = record.get("out"), (1, query.shape[2], query.shape[1], query.shape[3])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else record.get("out_desc")
        raise PluggedCallFailed("paged_attention", {"message": (
            f"the output of paged_attention should be a tensor of shape {want} = [1, T, Hq, D], got {got}. Hint: "
            "transformers hands you query as [1, Hq, T, D] and expects [1, T, Hq, D] back")})
    caches = record.get("caches")
    if not isinstance(caches, list) or len(caches) != len(meta.kv_caches) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, torch.Tensor) and t.shape == c.shape
                                                              for t, c in zip(pair, mine, strict=True))
            for pair, mine in zip(caches, meta.kv_caches, strict=False)):
        raise PluggedCallFailed("paged_attention", {"message": (
            "paged_attention changed the shape of a KV cache: write into meta.kv_caches[module.layer_idx]'s "
            "tensors in place")})
    for (k, v), (mk, mv) in zip(meta.kv_caches, caches, strict=True):
        k.copy_(mk)
        v.copy_(mv)
    return out.to(device=query.device, dtype=query.dtype)


@contextlib.contextmanager
def plugged(prepare=None, attention=None):
    """The engine with the learner's ``prepare_inputs`` and/or attention function in place of the library's.
    The engine and its tensors stay in this process: each call the engine makes goes to the learner's function
    as one scenario (:func:`drive_prepare_call`, :func:`drive_attention_call`; in the learner's process under
    ``pagedkv grade``, here in a notebook) with its inputs as plain data, and what the call returned and wrote
    comes back as plain data, copied into the engine's own objects (nothing the learner's code made runs
    here). A call that raises, runs out of time or returns what the engine cannot use ends the run with
    :class:`PluggedCallFailed`."""
    from transformers import AttentionInterface

    from pagedkv.engine.attention import ATTN_IMPLEMENTATION, register_pagedkv_attention

    register_pagedkv_attention()
    saved_prepare = runner_module.prepare_inputs
    if prepare is not None:
        def prepare_plain(so, token_ids, block_size):
            record = drive(drive_prepare_call, prepare, scheduler_output_fields(so),
                           {str(r): [int(t) for t in ids] for r, ids in token_ids.items()}, int(block_size),
                           timeout=GENERATE_TIMEOUT + 30.0, name="prepare_inputs, called by the engine")
            return inputs_from_record(record, so, token_ids, block_size)

        runner_module.prepare_inputs = prepare_plain
    if attention is not None:
        def attention_plain(module, query, key, value, attention_mask, scaling=None, **kwargs):
            meta = kwargs["pagedkv_metadata"]
            if isinstance(meta, dict):  # several KV cache groups: the layer's
                meta = meta[module.layer_idx]
            record = drive(
                drive_attention_call, attention, int(module.layer_idx),
                int(getattr(module, "num_key_value_groups", 1)), plain_tensor(query), plain_tensor(key),
                plain_tensor(value), plain_tensor(attention_mask) if isinstance(attention_mask, torch.Tensor) else None,
                None if scaling is None else float(scaling), metadata_fields(meta),
                [[plain_tensor(kc), plain_tensor(vc)] for kc, vc in meta.kv_caches],
                timeout=GENERATE_TIMEOUT + 30.0, name="paged_attention, called by the engine")
            return output_from_record(record, query, meta), None

        AttentionInterface.register(ATTN_IMPLEMENTATION, attention_plain)
    try:
        yield
    finally:
        runner_module.prepare_inputs = saved_prepare
        register_pagedkv_attention()


def end_to_end_prompts(seed: int) -> list[list[int]]:
    """The five prompts of the end-to-end run of ``seed`` (3 to 20 tokens each)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(3, 20))] for _ in range(5)]


#: The end-to-end run: greedy, 5 new tokens per prompt, a 10-block pool of 4-token blocks, 16 tokens a step
#: (chunked prefill and preemption on the way).
E2E_ENGINE = dict(num_gpu_blocks=10, block_size=4, max_num_batched_tokens=16)
E2E_MAX_TOKENS = 5


def _end_to_end(seed: int, prepare=None, attention=None) -> None:
    """The engine, here, on the tiny Llama of ``seed`` with the learner's function plugged in (:func:`plugged`:
    each of its calls a scenario), generating greedily for :func:`end_to_end_prompts`; its tokens must be
    transformers' ``generate``'s."""
    from pagedkv.engine import LLM, SamplingParams

    prompts = end_to_end_prompts(seed)
    params = SamplingParams(max_tokens=E2E_MAX_TOKENS, temperature=0.0)
    shown = format_call("generate", (prompts, params), {"use_tqdm": False})
    llm = LLM(tiny_llama(seed), **E2E_ENGINE)  # registers the library's attention
    try:
        with plugged(prepare, attention), time_limit(GENERATE_TIMEOUT, "generate"):
            outs = llm.generate(prompts, params, use_tqdm=False)
    except CallTimeout:
        fail(f"{shown} did not return within {GENERATE_TIMEOUT:g} s: is there an infinite loop?")
    except PluggedCallFailed as exc:
        fail(_call_failure(shown, exc.record, GENERATE_TIMEOUT) or f"{shown} failed: {exc}")
    except AssertionError:  # a check's failure (a scenario past its time limit): its own message
        raise
    except Exception as exc:  # noqa: BLE001 - the engine could not use what the learner's function returned
        fail(f"{shown} raised {type(exc).__name__}: {exc}{where(exc)}")
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    model = tiny_llama(seed)
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=E2E_MAX_TOKENS,
                                 do_sample=False)
            want.append(out[0, len(p):].tolist())
    if len(tokens) != len(prompts):
        fail(f"end to end: the engine returned {describe(tokens, 80)}, expected one output per prompt")
    for i, (got, w) in enumerate(zip(tokens, want, strict=True)):
        if got != w:
            fail(f"end to end (5 prompts, chunked prefill and preemption on a 10-block pool): prompt {i} "
                 f"({len(prompts[i])} tokens) generated {got}, Hugging Face's generate gives {w}")


def check_prepare_inputs_end_to_end(fn) -> None:
    require_function(fn, "prepare_inputs")
    # a clear message first, if it is wrong on one step; its arguments are the other cases' to judge: the engine
    # goes on with copies of what the call returned, whatever it did to its inputs
    _compare_inputs(fn, ["example"], check_arguments=False)
    _end_to_end(0, prepare=fn)


def check_attention_end_to_end(fn) -> None:
    require_function(fn, "paged_attention")
    _compare_attention(fn, [0])  # a clear message first, if it is wrong on one step
    _end_to_end(1, attention=fn)
