"""Checks for lesson 8's exercises (``grading/source/08_hybrid_models.ipynb``): which tokens a sliding window
skips, releasing out-of-window blocks to the null block, the right-to-left prefix hit, the per-request block cap
the pool is sized by, and how vLLM 0.26 groups a hybrid model's layers.

Each ``check_*`` function is one test case of the set: the source's test cell calls it with the learner's
function. Three exercises take and return plain data and are called directly. ``remove_skipped_blocks`` and
``find_longest_sliding_hit`` work on the library's ``SlidingWindowManager`` and ``BlockPool``: a scenario
(``drive_remove_skipped``, ``drive_sliding_hit``) builds those from plain specs where the learner's code runs,
calls it, and returns what it saw as block ids; the check runs the same scenario on the library's answer, which
behaves as vLLM 0.26 does (``./lab parity --lesson 8``), compares, and a failure names the case and the rule that
was broken.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Callable
from typing import Any

from pagedkv import KVCacheManager, Request
from pagedkv.grading.checks import (
    STUB_NOTE,
    all_came_back,
    describe,
    drive,
    expect_equal,
    fail,
    require_function,
    scenario_records,
    where,
)
from pagedkv.grading.lessons.depends import Earlier, with_earlier_answers
from pagedkv.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.kv_cache_utils import KVCacheBlock, update_block_hashes
from pagedkv.single_type_kv_cache_manager import SlidingWindowManager
from pagedkv.utils import cdiv

__all__ = [
    "check_group_layers_examples",
    "check_group_layers_hidden",
    "check_group_layers_round_robin",
    "check_hit_examples",
    "check_hit_hidden",
    "check_hit_short_run_at_the_start",
    "check_max_blocks_examples",
    "check_max_blocks_hidden",
    "check_remove_examples",
    "check_remove_hidden",
    "check_remove_twice",
    "check_skipped_examples",
    "check_skipped_hidden",
]


# --------------------------------------------------------------------------------------------------------
# Reference answers (the library's rules, written out)
# --------------------------------------------------------------------------------------------------------
def reference_skipped(num_computed_tokens: int, sliding_window: int) -> int:
    return max(0, num_computed_tokens - sliding_window + 1)


def reference_max_blocks(sliding_window: int, block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int:
    return cdiv(min(sliding_window - 1 + max_in_flight_tokens, max_model_len), block_size) + 1


def reference_group_layers(layer_types: list[str], *, pad: bool = True, round_up: bool = True) -> list[list[int]]:
    """vLLM 0.26's grouping; ``pad=False`` (never the largest count as the group size) and ``round_up=False``
    (``len // group_size`` groups) are two mistakes the hints name."""
    same: dict[str, list[int]] = {}
    for i, t in enumerate(layer_types):
        same.setdefault(t, []).append(i)
    sizes = [len(v) for v in same.values()]
    group_size = min(sizes)
    if pad and max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    out = []
    for layers in same.values():
        n = cdiv(len(layers), group_size) if round_up else max(1, len(layers) // group_size)
        out += [layers[i::n] for i in range(n)]
    return out


# --------------------------------------------------------------------------------------------------------
# 1. get_num_skipped_tokens
# --------------------------------------------------------------------------------------------------------
def _skipped_hint(args: tuple[int, int]) -> Callable[[Any], str | None]:
    c, w = args

    def hint(got: Any) -> str | None:
        if got == c - w > 0:  # not where c == w: there any function returning 0 gives that
            return ("that is num_computed_tokens - sliding_window: the next token (position num_computed_tokens) is "
                    "one of the sliding_window tokens it reads, so one more token is skipped")  # fmt: skip
        if got == c - w + 1:
            return "never negative: while the window still covers position 0, nothing is skipped"
        if got == max(0, c - w + 2):
            return ("one too many: the next token reads sliding_window positions, itself included, so "
                    "num_computed_tokens - sliding_window + 1 are behind it")
        if got == max(0, w - c + 1) != max(0, c - w + 1):
            return "are the arguments swapped? get_num_skipped_tokens(num_computed_tokens, sliding_window)"
        return None

    return hint


def check_skipped_examples(get_num_skipped_tokens):
    require_function(get_num_skipped_tokens, "get_num_skipped_tokens")
    for args, want in (((7, 4), 4), ((3, 4), 0), ((4, 4), 1), ((0, 8), 0), ((20, 8), 13), ((100, 1), 100)):
        expect_equal(get_num_skipped_tokens, args, want, hint=_skipped_hint(args), timeout=2)


def check_skipped_hidden(get_num_skipped_tokens):
    require_function(get_num_skipped_tokens, "get_num_skipped_tokens")
    rng = random.Random(808)
    for _ in range(200):
        w = rng.randint(1, 5000)
        c = rng.randint(0, 3 * w)
        expect_equal(get_num_skipped_tokens, (c, w), reference_skipped(c, w), hint=_skipped_hint((c, w)), timeout=2)


# --------------------------------------------------------------------------------------------------------
# Scenarios: what runs where the learner's code runs (the sandbox under grading), and returns plain records
# --------------------------------------------------------------------------------------------------------
def sliding_manager(num_blocks: int, block_size: int, window: int, prompt_len: int, caching: bool = True):
    """A KV cache manager with one sliding-window group, one request ``"r"`` whose ``prompt_len`` tokens are
    allocated and computed (nothing released yet, every full block cached), and that group's
    ``SlidingWindowManager``. Built from the group's own calls, as ``allocate_slots`` makes them for a first
    chunk, not through ``allocate_slots`` itself: that first calls ``remove_skipped_blocks``, which grading hides
    while it tests the learner's."""
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=window)
    m = KVCacheManager(KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(["swa"], spec)]), enable_caching=caching)
    r = Request("r", list(range(prompt_len)), max_tokens=4)
    if cdiv(prompt_len, block_size) > m.block_pool.get_num_free_blocks():
        raise AssertionError("the check's pool is too small")
    m.coordinator.allocate_new_blocks("r", prompt_len)
    m.req_num_tokens["r"] = prompt_len
    if caching:
        update_block_hashes(r, block_size, m.hash_fn)
        m.coordinator.cache_blocks(r, prompt_len)
    r.num_computed_tokens = prompt_len
    return m, m.single_type_managers[0], r


def raised(exc: BaseException) -> dict[str, str]:
    """A step where the learner's code raised, as data."""
    return {"raised": type(exc).__name__, "message": str(exc), "where": where(exc)}


def plain_number(value: Any) -> Any:
    """``value`` when it is a number (what a check compares), else how it reads (a string)."""
    if isinstance(value, (int, float)) or type(value).__module__ == "numpy":
        return value
    return describe(value)


def block_id_of(entry: Any) -> Any:
    """A table entry as its block id (0: the null block); ``None`` as None, anything else as how it reads."""
    if isinstance(entry, KVCacheBlock):
        return entry.block_id
    return None if entry is None else describe(entry)


def sliding_state(m) -> dict[str, Any]:
    """What the remove checks compare after each call: request ``"r"``'s table in the sliding-window group
    (block ids, 0 for the null block), the pool's free queue (block ids, head to tail) and every block's
    ``ref_cnt``; ``{"unreadable": why}`` when the learner's code left them unreadable."""
    try:
        pool = m.block_pool
        table = m.single_type_managers[0].req_to_blocks.get("r")
        return {
            "table": [block_id_of(b) for b in table] if isinstance(table, list) else describe(table),
            "free queue": [b.block_id for b in pool.free_block_queue],
            "ref_cnt": [plain_number(b.ref_cnt) for b in pool.blocks],
        }
    except Exception as exc:  # noqa: BLE001 - the learner's code broke the manager: said as data
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def drive_remove_skipped(remove_skipped_blocks, cases) -> list[dict[str, Any]]:
    """For each ``(block_size, window, prompt_len, calls)``: a manager from :func:`sliding_manager`, then
    ``remove_skipped_blocks(manager, "r", n)`` for each ``n`` of ``calls``. One record per case: the state
    before (:func:`sliding_state`) and one per call (the state after it, or :func:`raised`, which ends the
    scenario)."""
    records: list[dict[str, Any]] = []
    for bs, window, prompt, calls in cases:
        m, swa, _ = sliding_manager(4 + cdiv(prompt, bs), bs, window, prompt)
        steps: list[dict[str, Any]] = []
        records.append({"before": sliding_state(m), "steps": steps})
        for n in calls:
            try:
                remove_skipped_blocks(swa, "r", n)
            except Exception as exc:  # noqa: BLE001 - recorded for the check to report
                steps.append(raised(exc))
                return records
            steps.append(sliding_state(m))
    return records


def cached_pool(bs: int, window: int, num_tokens: int, evict: list[int]):
    """A pool where a ``num_tokens``-token prefix was computed and freed (every full block cached, in the free
    queue), then the blocks at table positions ``evict`` were evicted; and the prefix's block hashes."""
    m, _, r = sliding_manager(4 + cdiv(num_tokens, bs), bs, window, num_tokens)
    table = list(m.req_to_blocks["r"])
    m.free(r)
    m.block_pool.evict_blocks({table[i].block_id for i in evict if i < len(table)})
    return m.block_pool, list(r.block_hashes), [b.block_id for b in table]


def hit_record(got: Any) -> dict[str, Any]:
    """What ``find_longest_sliding_hit`` returned, as data: ``{"blocks": ids, "length": n}`` for a pair of
    blocks and a length, else how it reads."""
    if not isinstance(got, tuple) or len(got) != 2:
        return {"returned": describe(got), "none": got is None}
    blocks, length = got
    try:
        ids = [b.block_id for b in blocks]
    except (AttributeError, TypeError):
        ids = None
    if ids is None or not all(type(i) is int for i in ids):
        nulls = False
        with contextlib.suppress(Exception):
            nulls = isinstance(blocks, list) and any(b is None for b in blocks)
        return {"blocks_desc": describe(blocks), "nulls": nulls}
    return {"blocks": ids, "length": plain_number(length)}


def drive_sliding_hit(find_longest_sliding_hit, cases) -> list[dict[str, Any]]:
    """For each ``(block_size, window, num_tokens, evict, max_length)``: a pool from :func:`cached_pool`, then
    ``find_longest_sliding_hit(pool, hashes, max_length, window, block_size)``; one :func:`hit_record` per case
    (a raise, :func:`raised`, ends the scenario)."""
    records: list[dict[str, Any]] = []
    for bs, window, num_tokens, evict, max_length in cases:
        pool, hashes, _ = cached_pool(bs, window, num_tokens, evict)
        try:
            got = find_longest_sliding_hit(pool, hashes, max_length, window, bs)
        except Exception as exc:  # noqa: BLE001 - recorded for the check to report
            records.append(raised(exc))
            break
        records.append(hit_record(got))
    return records


# --------------------------------------------------------------------------------------------------------
# 2. remove_skipped_blocks
# --------------------------------------------------------------------------------------------------------
def _remove_cases(remove_skipped_blocks, cases: list[tuple[int, int, int, list[int]]], whats: list[str],
                  label: str) -> None:
    """Drive the learner's function through ``cases`` (one scenario), the library's through the same, and
    fail at the first call after which the table, free queue or ref counts differ."""
    label = f"remove_skipped_blocks(manager, 'r', n) on {label}"
    got = drive(drive_remove_skipped, remove_skipped_blocks, cases, timeout=5, name=label)
    want = drive_remove_skipped(SlidingWindowManager.remove_skipped_blocks, cases)
    for (bs, window, prompt, calls), what, mine, ref in zip(cases, whats, scenario_records(got, label), want,
                                                            strict=False):
        before = mine.get("before")
        steps = scenario_records(mine.get("steps"), f"{label}, {what}")
        if not isinstance(before, dict) or not isinstance(before.get("table"), list):
            fail(f"{label}, {what}: the scenario's record is incomplete: the state before the first call came back "
                 f"as {describe(before, 80)}")
        for n, step, expected in zip(calls, steps, ref["steps"], strict=False):
            _remove_step(step, expected, before, bs, window, prompt, n, what)
            before = step
        all_came_back(steps, len(calls), "calls", f"{label}, {what}")
    all_came_back(got, len(cases), "requests", label)


def _released(skipped: int, bs: int) -> str:
    """Which blocks ``skipped`` tokens release, in words: "13 tokens are skipped, so the first 3 blocks (only
    whole blocks) are released"."""
    released = skipped // bs
    tokens = f"{skipped} token is" if skipped == 1 else f"{skipped} tokens are"
    blocks = (f"no block is released (only whole blocks of {bs} tokens are)" if released == 0 else
              "the first block (only whole blocks) is released" if released == 1 else
              f"the first {released} blocks (only whole blocks) are released")
    return f"{tokens} skipped, so {blocks}"


def _remove_step(got: dict, want: dict, before: dict, bs: int, window: int, prompt: int, n: int, what: str) -> None:
    call = f"remove_skipped_blocks(manager, 'r', {n})"
    if "raised" in got:
        fail(f"{call} raised {got['raised']}: {got['message']}{got['where']}")
    if got == want:
        return
    head = (f"{what}: block size {bs}, window {window}, a {prompt}-token request (table {before['table']}); "
            f"after {call}")  # fmt: skip
    if "unreadable" in got:
        fail(f"{head} the manager could not be read ({got['unreadable']}), expected the table {want['table']}")
    if set(got) != set(want):
        fail(f"{head} the scenario's record is incomplete: {describe(got, 80)}, expected the table, free queue and "
             "ref_cnt")
    if not isinstance(got["table"], list):
        fail(f"{head} manager.req_to_blocks['r'] is {got['table']}, expected the table {want['table']}: keep the "
             "request's list and put manager.block_pool.null_block in it where a block was released")
    if got == before and want != before:
        fail(f"{head} nothing changed (table {got['table']}), expected the table {want['table']}: is the "
             "function still the stub?")
    if len(got["table"]) != len(want["table"]):
        fail(f"{head} the table is {got['table']}, expected {want['table']}: keep the table's length, put "
             "manager.block_pool.null_block where a block was released (positions must still match tokens)")
    if got["table"] == before["table"] and got["ref_cnt"] != before["ref_cnt"]:
        fail(f"{head} the blocks went back to the pool (ref_cnt {got['ref_cnt']}) but the table is still "
             f"{got['table']}, expected {want['table']}: put manager.block_pool.null_block in each released "
             "block's place in manager.req_to_blocks[request_id]")
    if got["table"] != want["table"]:
        skipped = reference_skipped(n, window)
        fail(f"{head} the table is {got['table']}, expected {want['table']}: {_released(skipped, bs)}")
    if got["ref_cnt"] != want["ref_cnt"]:
        fail(f"{head} the blocks' ref_cnt are {got['ref_cnt']}, expected {want['ref_cnt']}: each released block "
             "goes back to the pool once (manager.block_pool.free_blocks), the null block never")
    missing = [b for b in want["free queue"] if b not in got["free queue"]]
    if missing and got["ref_cnt"] == want["ref_cnt"]:
        fail(f"{head} the free queue is {got['free queue']}, expected {want['free queue']}: blocks {missing} "
             "were released but are not in it; give them back with manager.block_pool.free_blocks(blocks), "
             "which lowers their ref_cnt and appends them to the queue's tail")
    if sorted(got["free queue"]) == sorted(want["free queue"]):
        fail(f"{head} the free queue is {got['free queue']}, expected {want['free queue']}: free the released "
             "blocks newest first (from the last released position back to 0), so the pool evicts the deepest "
             "of them first and keeps the prefix's root longest")
    fail(f"{head} the free queue is {got['free queue']}, expected {want['free queue']}")


def _uses_skipped(check: Callable[..., None]) -> Callable[..., None]:
    """A check of exercise 2, run with exercise 1's answer in place of the learner's ``get_num_skipped_tokens``
    (:mod:`pagedkv.grading.lessons.depends`): a mistake in exercise 1 costs points in exercise 1 only."""
    earlier = [Earlier("get_num_skipped_tokens", 1, reference_skipped, lambda fn: check_skipped_examples(fn))]

    @functools.wraps(check)
    def judged(fn: Any, *args: Any, env: Any = None, **kwargs: Any) -> None:
        with_earlier_answers(fn, earlier, lambda: check(fn, *args, **kwargs), what="remove_skipped_blocks", env=env)

    return judged


@_uses_skipped
def check_remove_examples(remove_skipped_blocks):
    require_function(remove_skipped_blocks, "remove_skipped_blocks")
    _remove_cases(remove_skipped_blocks, [(4, 8, 20, [20]), (4, 8, 20, [8]), (4, 16, 12, [12])],
                  ["example", "the window still covers most of the blocks", "nothing is out of the window yet"],
                  "the examples")  # fmt: skip


@_uses_skipped
def check_remove_twice(remove_skipped_blocks):
    """A second call releases only the blocks that fell out since the first: it stops at the first null."""
    require_function(remove_skipped_blocks, "remove_skipped_blocks")
    _remove_cases(remove_skipped_blocks, [(4, 8, 32, [16, 32]), (2, 3, 20, [10, 10, 20])],
                  ["two calls as the request advances", "the same call twice"], "two requests")  # fmt: skip


@_uses_skipped
def check_remove_hidden(remove_skipped_blocks):
    require_function(remove_skipped_blocks, "remove_skipped_blocks")
    rng = random.Random(8080)
    cases = []
    for _ in range(40):
        bs, window = rng.choice([1, 2, 4, 8]), rng.randint(1, 20)
        prompt = rng.randint(1, 60)
        calls = sorted(rng.randint(0, prompt) for _ in range(rng.randint(1, 3)))
        cases.append((bs, window, prompt, calls))
    _remove_cases(remove_skipped_blocks, cases, ["random case"] * len(cases), "40 random requests")


# --------------------------------------------------------------------------------------------------------
# 3. find_longest_sliding_hit
# --------------------------------------------------------------------------------------------------------
def _reference_hit(block_pool, block_hashes, max_length: int, sliding_window: int, block_size: int):
    """The library's hit in the exercise's form (the trusted side's answer for :func:`drive_sliding_hit`)."""
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32",
                             sliding_window=sliding_window)
    (blocks,), length = SlidingWindowManager.find_longest_cache_hit(block_hashes, max_length, [0], block_pool, spec)
    return blocks, length


def _right_to_left(pool, hashes, max_length: int, bs: int, need: int) -> list[int]:
    """The block ids of the right-to-left hit when a run of ``need`` cached blocks ends it (0: the null block)."""
    n = max(0, max_length) // bs
    ids, run = [0] * n, 0
    for i in range(n - 1, -1, -1):
        block = pool.get_cached_block(hashes[i])
        if block is None:
            run = 0
            continue
        ids[i], run = block.block_id, run + 1
        if run >= need:
            return ids[: i + run]
    return ids[:run]


def _hit_cases(find_longest_sliding_hit, cases: list[tuple[int, int, int, list[int], int]], whats: list[str],
               label: str) -> None:
    """Drive the learner's function through ``cases`` (one scenario), the library's through the same, and
    fail at the first case whose hit differs."""
    label = f"find_longest_sliding_hit(pool, hashes, ...) on {label}"
    got = drive(drive_sliding_hit, find_longest_sliding_hit, cases, timeout=5, name=label)
    want = drive_sliding_hit(_reference_hit, cases)
    for case, what, mine, ref in zip(cases, whats, scenario_records(got, label), want, strict=False):
        _hit_case(case, what, mine, ref)
    all_came_back(got, len(cases), "cases", label)


def _hit_case(case, what: str, got: dict, want: dict) -> None:  # noqa: C901 - one hint per known mistake
    bs, window, num_tokens, evict, max_length = case
    call = f"find_longest_sliding_hit(pool, hashes, {max_length}, {window}, {bs})"
    if "raised" in got:
        fail(f"{call} raised {got['raised']}: {got['message']}{got['where']}")
    if "returned" in got:
        stub = f". {STUB_NOTE}" if got["none"] else ""
        fail(f"{what}: {call} returned {got['returned']}, expected a pair (blocks, hit_length){stub}")
    if "blocks_desc" in got:
        fail(f"{what}: {call} returned {got['blocks_desc']} as the blocks, expected a list of KVCacheBlock"
             + (": put block_pool.null_block, not None, where the window does not need the block" if got["nulls"]
                else ""))
    if set(got) != set(want):
        fail(f"{what}: {call}: the scenario's record is incomplete: {describe(got, 80)}, expected the blocks and the "
             "length")
    ids, length, want_ids, want_len = got["blocks"], got["length"], want["blocks"], want["length"]
    if ids == want_ids and length == want_len:
        return
    cached = [i for i in range(cdiv(num_tokens, bs)) if i not in evict and (i + 1) * bs <= num_tokens]
    head = (f"{what}: block size {bs}, window {window} (a hit must end with {cdiv(window - 1, bs)} cached blocks), "
            f"positions {cached} cached, at most {max_length} tokens: {call}")  # fmt: skip
    pool, hashes, _ = cached_pool(bs, window, num_tokens, evict)  # the same pool, here, for the hints
    need = cdiv(window - 1, bs)
    for wrong_need, why in ((cdiv(window, bs), f"cdiv(sliding_window, block_size) = {cdiv(window, bs)}"),
                            ((window - 1) // bs, f"(sliding_window - 1) // block_size = {(window - 1) // bs}")):
        if wrong_need != need and ids == _right_to_left(pool, hashes, max_length, bs, wrong_need) != want_ids:
            fail(f"{head} returned blocks {ids}, expected {want_ids}: that hit ends with a run of {why} block(s); it "
                 f"must end with cdiv(sliding_window - 1, block_size) = {need}: the next token reads the "
                 "sliding_window - 1 tokens before it (and itself, not cached yet), rounded up to whole blocks")
    left = []  # full attention's hit: every block from the start
    for i in range(max_length // bs):
        block = pool.get_cached_block(hashes[i])
        if block is None:
            break
        left.append(block.block_id)
    if ids == left and (length == len(left) * bs):
        fail(f"{head} returned blocks {ids} ({length} tokens), expected {want_ids} ({want_len} tokens): that is full "
             "attention's rule (every block from the start); a sliding layer needs only the last blocks before the "
             "hit's end: scan from the right, and put pool.null_block before the run")
    core = ids[: max((j + 1 for j, b in enumerate(ids) if b != 0), default=0)]  # without the trailing nulls
    if core and 0 not in core and core == left[: len(core)] and len(core) * bs < want_len:
        fail(f"{head} returned blocks {ids} ({length} tokens), expected {want_ids} ({want_len} tokens): that is the "
             "first run found from the left; scan from the right (block max_length // block_size - 1 first), so that "
             "the run that ends the hit is the rightmost one and the hit the longest")  # fmt: skip
    if ids[: len(want_ids)] != want_ids and any(b != 0 and 0 in ids[j + 1 :] for j, b in enumerate(ids)):
        fail(f"{head} returned blocks {ids} ({length} tokens), expected {want_ids} ({want_len} tokens): a null block "
             f"after a cached one: the hit must end with {need} *consecutive* cached blocks, so a block that is not "
             "cached starts the count of the run again")  # fmt: skip
    if isinstance(length, (int, float)) and length > max_length:
        fail(f"{head} gave hit_length {length}, expected {want_len} (blocks {want_ids}): a hit is at most max_length "
             "tokens, so look at max_length // block_size blocks only")
    real = [i for i in want_ids if i != 0]
    if ids == real and real != want_ids:
        fail(f"{head} returned blocks {ids} ({length} tokens), expected {want_ids} ({want_len} tokens): one entry "
             "per block of the hit, from block 0 on: pool.null_block for every block before the run")
    if ids == want_ids and length == len(real) * bs:
        fail(f"{head} gave hit_length {length}, expected {want_len} (blocks {want_ids}): the null blocks count too, "
             "hit_length = len(blocks) * block_size (the hit covers the whole prefix up to the run's end)")
    if not ids and want_ids and want_ids[0] != 0:
        fail(f"{head} returned no hit, expected {want_ids} ({want_len} tokens): a run shorter than "
             f"{need} block(s) still counts when it reaches block 0, since the window has nothing before it to read")
    if length != want_len:
        fail(f"{head} gave hit_length {length}, expected {want_len} (blocks {want_ids})")
    if len(ids) != len(want_ids):
        fail(f"{head} returned {len(ids)} blocks {ids}, expected {want_ids}: one entry per block of the hit, "
             "pool.null_block where the window does not need the block")
    if any(w == 0 and g != 0 for g, w in zip(ids, want_ids, strict=True)):
        fail(f"{head} returned blocks {ids}, expected {want_ids}: the blocks before the run are pool.null_block (the "
             "window does not read them, and a sliding group may have released them)")
    fail(f"{head} returned blocks {ids}, expected {want_ids}")


def check_hit_examples(find_longest_sliding_hit):
    require_function(find_longest_sliding_hit, "find_longest_sliding_hit")
    _hit_cases(find_longest_sliding_hit,
               [(4, 8, 24, [], 23), (4, 8, 24, [3, 5], 24), (4, 8, 24, [0, 1, 2], 24), (4, 9, 24, [2, 5], 24)],
               ["everything cached", "gaps", "only the tail cached", "a window of 9 needs cdiv(8, 4) = 2 blocks"],
               "the examples")  # fmt: skip


def check_hit_short_run_at_the_start(find_longest_sliding_hit):
    """A run shorter than the window needs still counts when it reaches the first block."""
    require_function(find_longest_sliding_hit, "find_longest_sliding_hit")
    _hit_cases(find_longest_sliding_hit, [(4, 16, 24, [3, 4, 5], 24), (4, 16, 24, [0, 1, 2, 3, 4, 5], 24)],
               ["blocks 0-2 cached, fewer than the 4 the window needs", "nothing cached"], "short runs")  # fmt: skip


def check_hit_hidden(find_longest_sliding_hit):
    require_function(find_longest_sliding_hit, "find_longest_sliding_hit")
    rng = random.Random(8081)
    cases = []
    for _ in range(60):
        bs, window = rng.choice([1, 2, 4, 8]), rng.randint(2, 24)
        n = rng.randint(bs, 12 * bs)
        evict = [i for i in range(cdiv(n, bs)) if rng.random() < 0.3]
        cases.append((bs, window, n, evict, rng.randint(0, n)))
    _hit_cases(find_longest_sliding_hit, cases, ["random case"] * len(cases), "60 random pools")


# --------------------------------------------------------------------------------------------------------
# 4. max_admission_blocks_per_request
# --------------------------------------------------------------------------------------------------------
def _max_blocks_hint(args) -> Callable[[Any], str | None]:
    """Names every known mistake the wrong count matches: some coincide whenever they are wrong (no ``+ 1``,
    rounding down, and the ``+ 1`` added before the ``max_model_len`` cap give the same count), so all are said."""
    w, b, f, m = args
    want = reference_max_blocks(w, b, f, m)
    mistakes = [
        (cdiv(min(w - 1 + f, m), b), "one block more: the window need not start at a block boundary ([xxCD][EF..] "
                                     "holds CDEF)"),
        (cdiv(w - 1 + f, b) + 1, "never more than max_model_len tokens"),
        (cdiv(min(w + f, m), b) + 1, "sliding_window - 1 tokens before the new ones, not sliding_window"),
        (min(w - 1 + f, m) // b + 1, "round the tokens up to whole blocks (cdiv), not down"),
        (cdiv(min(w - 1, m), b) + 1, "the tokens in flight count too: blocks are released on the processed basis, "
                                     "so up to max_in_flight_tokens scheduled tokens sit after the window's "
                                     "sliding_window - 1"),
        (min(cdiv(w - 1, b) + cdiv(f, b), cdiv(m, b)) + 1, "add the tokens first, then round up once: "
                                                           "cdiv(sliding_window - 1 + max_in_flight_tokens, ...)"),
        (min(cdiv(w - 1 + f, b) + 1, cdiv(m, b)), "cap the tokens at max_model_len first, then add the one block: "
                                                  "cdiv(min(...), block_size) + 1"),
    ]  # fmt: skip

    def hint(got: Any) -> str | None:
        said = [why for wrong, why in mistakes if got == wrong != want]
        return ". Or: ".join(dict.fromkeys(said)) or None

    return hint


def check_max_blocks_examples(max_admission_blocks_per_request):
    require_function(max_admission_blocks_per_request, "max_admission_blocks_per_request")
    cases = [((128, 16, 16384, 131072), 1033), ((4096, 16, 16384, 32768), 1281), ((8, 4, 8, 4096), 5),
             ((1024, 16, 16384, 8192), 513), ((6, 4, 6, 100), 4), ((4, 4, 1, 100), 2)]  # fmt: skip
    for args, want in cases:
        expect_equal(max_admission_blocks_per_request, args, want, hint=_max_blocks_hint(args), timeout=2)


def check_max_blocks_hidden(max_admission_blocks_per_request):
    require_function(max_admission_blocks_per_request, "max_admission_blocks_per_request")
    rng = random.Random(8082)
    for _ in range(200):
        args = (rng.randint(1, 8192), rng.choice([1, 2, 4, 8, 16, 32]), rng.randint(1, 32768), rng.randint(1, 200000))
        expect_equal(max_admission_blocks_per_request, args, reference_max_blocks(*args),
                     hint=_max_blocks_hint(args), timeout=2)  # fmt: skip


# --------------------------------------------------------------------------------------------------------
# 5. group_layers
# --------------------------------------------------------------------------------------------------------
def _group_hint(layer_types) -> Callable[[Any], str | None]:
    def hint(got: Any) -> str | None:
        if not isinstance(got, list):
            return None
        same: dict[str, list[int]] = {}
        for i, t in enumerate(layer_types):
            same.setdefault(t, []).append(i)
        if len(same) == 1:
            return ("a model of one attention type is one group holding every layer, in order: vLLM 0.26 puts all "
                    "layers of a uniform spec in one KVCacheGroupSpec (kv_cache_utils.py, "
                    "_get_kv_cache_groups_uniform_spec)")  # fmt: skip
        want = reference_group_layers(layer_types)
        with contextlib.suppress(TypeError):  # the right groups, the types in another order
            if got != want and sorted(got, key=repr) == sorted(want, key=repr):
                order = " then ".join(f"{t!r} (from layer {v[0]})" for t, v in same.items())
                return (f"the right groups in another order: the types in order of first appearance, {order}, and "
                        "each type's groups in order, group i holding layers[i::num_groups]")  # fmt: skip
        g = min(len(v) for v in same.values())
        chunks = [v[i : i + g] for v in same.values() for i in range(0, len(v), g)]
        if got == chunks:
            return ("those are consecutive chunks: vLLM deals a type's layers round-robin, layers[i::num_groups], "
                    "so that a pipeline stage's share of each group stays even")  # fmt: skip
        big = max(len(v) for v in same.values())
        if big == g * 1.5 and got == list(same.values()):
            return (f"{big} layers are exactly 1.5 x {g}: vLLM's test is strict, max_num_layers < min_num_layers * "
                    "1.5 (kv_cache_utils.py, _get_kv_cache_groups_uniform_page_size), so the group size stays the "
                    "smallest count")
        if got == list(same.values()):
            return "one group per type is too coarse: every group must hold about group_size layers"
        if big < g * 1.5 and got == reference_group_layers(layer_types, pad=False):
            return (f"the types' layer counts are close ({g} and {big}): vLLM then uses the largest as the group "
                    "size, padding the smaller type, instead of cutting the larger in two")
        if got == reference_group_layers(layer_types, round_up=False):
            return ("round the number of groups up, cdiv(len(layers), group_size): with len(layers) // group_size "
                    "some groups hold more than group_size layers (vLLM pads the last groups instead)")
        return None

    return hint


def check_group_layers_examples(group_layers):
    require_function(group_layers, "group_layers")
    gemma = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(62)]
    cases = [
        (["full_attention"] * 4, [[0, 1, 2, 3]]),
        (["sliding_attention", "full_attention"] * 3, [[0, 2, 4], [1, 3, 5]]),
        (["sliding_attention"] * 3 + ["full_attention"], [[0], [1], [2], [3]]),
        (gemma, reference_group_layers(gemma)),
    ]
    for layer_types, want in cases:
        expect_equal(group_layers, (layer_types,), want, hint=_group_hint(layer_types), timeout=2)


def check_group_layers_round_robin(group_layers):
    require_function(group_layers, "group_layers")
    for layer_types in (
        ["sliding_attention"] * 4 + ["full_attention"] * 2,
        ["full_attention"] * 2 + ["sliding_attention"] * 5,
        ["sliding_attention"] * 12 + ["full_attention"] * 13,
        ["full_attention"] * 4 + ["sliding_attention"] * 5,  # 5 < 4 x 1.5: the largest count is the group size
        ["sliding_attention"] * 6 + ["full_attention"] * 4,  # 6 = 4 x 1.5, not below it: the smallest is
    ):
        expect_equal(group_layers, (layer_types,), reference_group_layers(layer_types),
                     hint=_group_hint(layer_types), timeout=2)  # fmt: skip


def check_group_layers_hidden(group_layers):
    require_function(group_layers, "group_layers")
    rng = random.Random(8083)
    kinds = ["full_attention", "sliding_attention", "chunked_attention"]
    for _ in range(100):
        n_types = rng.randint(1, 3)
        types_ = [kinds[rng.randrange(n_types)] for _ in range(rng.randint(1, 64))]
        expect_equal(group_layers, (types_,), reference_group_layers(types_), hint=_group_hint(types_), timeout=2)
