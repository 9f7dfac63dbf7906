"""Checks for lesson 2's exercises (``grading/source/02_block_pool.ipynb``): the free queue, the pool's
allocation and freeing, ``allocate_slots`` and the slot mapping.

Each ``check_*`` function is one test case of the set: the source's test cell calls it with the learner's
objects (looked up by name in the notebook). The learner's code runs in *scenarios*, the ``drive_*`` functions,
run by :func:`pagedkv.grading.checks.drive` where that code lives (the sandbox under ``pagedkv grade``, the
kernel in a check cell): they build the library's blocks, ``BlockPool`` and ``KVCacheManager``, make the calls
and return what they saw as plain data (block ids walked head to tail and tail to head, ref counts, hashes, what
each call returned or raised). A scenario makes either the fixed calls of an example, or random ones it chooses
itself, from a seed and from the state it sees (never from a model of the right answer: what a scenario is
given or computes, the learner's code could read). Each check runs the same scenario on the library
(``FreeKVCacheBlockQueue``, ``BlockPool.get_new_blocks`` / ``free_blocks``, ``KVCacheManager.allocate_slots``)
here, and fails (``pagedkv.grading.checks.fail``) at the first step whose record differs from the library's,
with a message that names the call, the state and the usual mistake. Up to that step both saw the same states,
so both made the same calls.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from pagedkv import BlockPool, KVCacheBlock, KVCacheManager, Request
from pagedkv.grading.checks import (
    STUB_NOTE,
    CallTimeout,
    describe,
    drive,
    expect_equal,
    fail,
    format_call,
    require_function,
    scenario_records,
    where,
)
from pagedkv.kv_cache_utils import FreeKVCacheBlockQueue

__all__ = [
    "check_allocate_slots_examples",
    "check_allocate_slots_hidden",
    "check_allocate_slots_random",
    "check_free_blocks_alone",
    "check_free_blocks_refuses_without_change",
    "check_free_queue_examples",
    "check_free_queue_hidden",
    "check_free_queue_in_the_block_pool",
    "check_free_queue_random",
    "check_get_new_blocks_alone",
    "check_pool_state_machine",
    "check_pool_state_machine_hidden",
    "check_slot_mapping_examples",
    "check_slot_mapping_hidden",
]


def reference(table, positions, bs):
    return [table[p // bs] * bs + p % bs for p in positions]


# --------------------------------------------------------------------------------------------------------
# Scenarios: what runs where the learner's code runs (the sandbox under grading), and returns plain records
# --------------------------------------------------------------------------------------------------------
def raised(exc: BaseException) -> dict[str, Any]:
    """A call of the learner's code that raised, as data (``value_error``: whether it is a ValueError)."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        message = f"<{type(exc).__name__} whose str() raised>"
    return {"raised": type(exc).__name__, "message": message, "where": where(exc),
            "value_error": isinstance(exc, ValueError)}


def attempt(fn: Any, args: tuple, label: str) -> tuple[Any, dict[str, Any]]:
    """``fn(*args)``: (its result, a record). The record holds ``label`` (the call as the messages show it) and
    ``returned`` (how the result reads), or :func:`raised`'s fields, or ``timeout``: the seconds of the
    scenario's time limit (:func:`pagedkv.grading.checks.drive`'s), which ran out during this call; the scenario
    then stops (one limit for the whole scenario: a time limit for each call would cost more than the calls)."""
    record: dict[str, Any] = {"label": label}
    if not callable(fn):
        record.update(raised(TypeError(f"{describe(fn)} is not callable")))
        return None, record
    try:
        got = fn(*args)
    except CallTimeout as exc:
        seconds = re.search(r"within ([0-9.e+]+) s", str(exc))
        record["timeout"] = float(seconds.group(1)) if seconds else None
        return None, record
    except Exception as exc:  # noqa: BLE001 - recorded for the check to report
        record.update(raised(exc))
        return None, record
    record["returned"] = describe(got)
    return got, record


def failed(record: dict[str, Any]) -> bool:
    return "raised" in record or "timeout" in record


def pack(value: Any) -> str:
    """A record's state as JSON text (one string crosses faster than thousands of small values); what is not
    JSON (a learner's odd ref_cnt) as how it reads."""
    return json.dumps(value, separators=(",", ":"), default=describe)


def block_label(block: Any) -> Any:
    """A block as its id; anything else found in a link as how it reads."""
    return block.block_id if isinstance(block, KVCacheBlock) else describe(block)


def block_ids(got: Any) -> list | None:
    """The ids of a list of blocks (None for an entry without one); None when ``got`` is not a list."""
    if not isinstance(got, list):
        return None
    ids = [getattr(b, "block_id", None) for b in got]
    return [i if isinstance(i, int) else None for i in ids]


def usable_ids(ids: Any, num_blocks: int) -> bool:
    """Whether ``ids`` are distinct ids of usable blocks (1..num_blocks-1): what a random scenario can go on
    with (it stops a case where the learner's code gave anything else; that step already differs)."""
    return isinstance(ids, list) and all(type(i) is int for i in ids) and len(set(ids)) == len(ids) and \
        (not ids or 0 < min(ids) and max(ids) < num_blocks)


# --- 1. the free queue ------------------------------------------------------------------------------
def walk_links(q: Any, limit: int) -> tuple[list, str, list, str]:
    """Block ids from the head sentinel along ``next_free_block`` and from the tail sentinel along
    ``prev_free_block`` (tail first), each with how the walk ended: ``"tail"``/``"head"`` (the other sentinel),
    ``"none"`` (a link was None), ``"cycle"`` (more than ``limit`` blocks)."""
    head, tail = q.fake_free_list_head, q.fake_free_list_tail
    fwd: list = []
    fwd_end, b = "tail", head.next_free_block
    while b is not tail:
        if b is None:
            fwd_end = "none"
            break
        fwd.append(block_label(b))
        if len(fwd) > limit:
            fwd_end = "cycle"
            break
        b = b.next_free_block
    bwd: list = []
    bwd_end, b = "head", tail.prev_free_block
    while b is not head:
        if b is None:
            bwd_end = "none"
            break
        bwd.append(block_label(b))
        if len(bwd) > limit:
            bwd_end = "cycle"
            break
        b = b.prev_free_block
    return fwd, fwd_end, bwd, bwd_end


def queue_state(q: Any, blocks: list[KVCacheBlock]) -> dict[str, Any]:
    """A free queue as the queue checks see it: ``fwd`` (ids head to tail), ``num`` (its num_free_blocks),
    ``stray`` (ids of ``blocks`` outside the queue that still have a link); and, only when the walks were not
    clean, ``fwd_end``, ``bwd`` (ids tail to head) and ``bwd_end`` (:func:`walk_links`). ``{"unreadable": why}``
    when the queue could not be read."""
    try:
        fwd, fwd_end, bwd, bwd_end = walk_links(q, len(blocks) + 2)
        num = q.num_free_blocks
    except Exception as exc:  # noqa: BLE001 - the learner's queue could not be read: said as data
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
    inside = set(fwd)
    state: dict[str, Any] = {"fwd": fwd, "num": num, "stray": [
        b.block_id for b in blocks
        if b.block_id not in inside and (b.prev_free_block is not None or b.next_free_block is not None)]}
    if fwd_end != "tail":
        state["fwd_end"] = fwd_end
    if bwd_end != "head" or bwd[::-1] != fwd:
        state["bwd"], state["bwd_end"] = bwd, bwd_end
    return state


def queued_ids(state: dict[str, Any], num_blocks: int, first: int = 0) -> list[int] | None:
    """The ids a queue holds head to tail (:func:`queue_state`), or None when its walk was not clean or it holds
    anything but distinct blocks ``first``..``num_blocks - 1``: a random scenario cannot go on from there."""
    fwd = state.get("fwd")
    if "fwd_end" in state or not isinstance(fwd, list) or len(set(fwd)) != len(fwd) or \
            not all(type(i) is int and first <= i < num_blocks for i in fwd):
        return None
    return fwd


def queue_call(q: Any, name: str, i: int | None, blocks: list[KVCacheBlock]) -> tuple[dict[str, Any], dict]:
    """``q.<name>()`` or ``q.<name>(blocks[i])``: :func:`attempt`'s record with ``op``, ``got`` for a popleft
    (which block it returned, by position; None for anything else) and the queue after it (``state``,
    :func:`pack`ed); and that state."""
    args = () if i is None else (blocks[i],)
    label = format_call(name, args)
    method = getattr(q, name, None)
    if method is None:
        got, rec = None, {"label": label, **raised(AttributeError(f"{type(q).__name__!r} object has no attribute "
                                                                  f"{name!r}"))}
    else:
        got, rec = attempt(method, args, label)
    rec["op"] = [name, i]
    if name == "popleft" and not failed(rec):
        rec["got"] = next((j for j, b in enumerate(blocks) if b is got), None)
    state = queue_state(q, blocks)
    rec["state"] = pack(state)
    return rec, state


def new_queue(FreeQueue, blocks: list[KVCacheBlock], ids: list[int]) -> tuple[Any, dict[str, Any], dict]:
    """``FreeQueue(the blocks of ids)``: the queue (None if that raised), the record and the queue's state."""
    given = [blocks[i] for i in ids]
    q, rec = attempt(FreeQueue, (given,), format_call("FreeQueue", (given,)))
    state = {} if failed(rec) else queue_state(q, blocks)
    if not failed(rec):
        rec["state"] = pack(state)
    return q, rec, state


def drive_free_queue(FreeQueue, cases) -> list[dict[str, Any]]:
    """For each case ``{"blocks": n, "init": ids, "ops": [[name, id or None], ...]}``: blocks 0..n-1,
    ``FreeQueue(the init blocks)``, then each call (``popleft()``, ``remove/append/appendleft(block)``). One
    record per case: ``init`` and ``steps`` (:func:`queue_call`'s records). A call past the scenario's time limit
    ends the scenario; a FreeQueue that cannot be built ends its case."""
    records: list[dict[str, Any]] = []
    for case in cases:
        blocks = [KVCacheBlock(i) for i in range(case["blocks"])]
        q, init, _ = new_queue(FreeQueue, blocks, case["init"])
        steps: list[dict[str, Any]] = []
        records.append({"init": init, "steps": steps})
        if "timeout" in init:
            return records
        if failed(init):
            continue
        for name, i in case["ops"]:
            rec, _ = queue_call(q, name, i, blocks)
            steps.append(rec)
            if "timeout" in rec:
                return records
    return records


def drive_free_queue_random(FreeQueue, cases) -> list[dict[str, Any]]:
    """For each case ``{"seed": s, "blocks": n (or a list to draw n from), "ops": k}``, with
    ``random.Random(s)``: blocks 0..n-1, ``FreeQueue`` of a random few of them in a random order (``init_ids``),
    then k random calls chosen from what the queue holds now (its walk from the head): ``popleft()``,
    ``remove`` of a block in it, ``append`` or ``appendleft`` of one outside it. Records as
    :func:`drive_free_queue`'s; a queue that cannot be walked cleanly ends its case."""
    records: list[dict[str, Any]] = []
    for case in cases:
        rng = random.Random(case["seed"])
        n = case["blocks"] if isinstance(case["blocks"], int) else rng.choice(case["blocks"])
        start = list(range(n))
        rng.shuffle(start)
        init_ids = start[: rng.randrange(0, n + 1)]
        blocks = [KVCacheBlock(i) for i in range(n)]
        q, init, state = new_queue(FreeQueue, blocks, init_ids)
        steps: list[dict[str, Any]] = []
        records.append({"init_ids": init_ids, "init": init, "steps": steps})
        if "timeout" in init:
            return records
        if failed(init):
            continue
        for _ in range(case["ops"]):
            inside = queued_ids(state, n)
            if inside is None:
                break
            outside = [i for i in range(n) if i not in inside]
            name = rng.choice(["popleft", "remove", "append", "appendleft"])
            if name == "popleft" and inside:
                i = None
            elif name == "remove" and inside:
                i = rng.choice(inside)
            elif name in ("append", "appendleft") and outside:
                i = rng.choice(outside)
            else:
                continue
            rec, state = queue_call(q, name, i, blocks)
            steps.append(rec)
            if "timeout" in rec:
                return records
    return records


def bare_pool(num_blocks: int) -> BlockPool:
    """A ``BlockPool`` of ``num_blocks`` blocks as ``BlockPool.__init__`` makes it, but with no free queue yet
    (block 0 is the null block; blocks 1.. are unlinked): ``__init__`` builds the library's queue, which grading
    hides while it tests the learner's."""
    pool = BlockPool.__new__(BlockPool)
    pool.num_gpu_blocks = num_blocks
    pool.enable_caching = True
    pool.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    pool.free_block_queue = None
    pool.cached_block_hash_to_block = {}
    pool.null_block = pool.blocks[0]
    pool.null_block.is_null = True
    pool.num_evictions = 0
    pool.enable_kv_cache_events = False
    pool.kv_event_queue = []
    return pool


def drive_queue_in_pool(FreeQueue, cases) -> list[dict[str, Any]]:
    """For each case ``{"seed": s, "sizes": [n, ...], "steps": k}``, with ``random.Random(s)``: a pool of n blocks
    (:func:`bare_pool`) whose free queue is ``FreeQueue(blocks 1..n-1)``, then k random steps on the pool's own
    methods, which use that queue: allocations (``get_new_blocks``), frees of what a holder holds
    (``free_blocks``), a held block taking a hash, and cache hits on a free block with a hash (``touch``). The
    steps are chosen from what the scenario holds and from the queue it sees. Records as
    :func:`drive_free_queue`'s, each step with ``step`` and ``kind``."""
    records: list[dict[str, Any]] = []
    for case in cases:
        rng = random.Random(case["seed"])
        n = rng.choice(case["sizes"])
        pool = bare_pool(n)
        q, init, state = new_queue(FreeQueue, pool.blocks, list(range(1, n)))
        steps: list[dict[str, Any]] = []
        records.append({"init": init, "steps": steps})
        if "timeout" in init:
            return records
        if failed(init):
            continue
        pool.free_block_queue = q
        held: list[list[int]] = []  # the block ids of each holder
        hashes = 0
        for step in range(case["steps"]):
            queued = queued_ids(state, n, 1)
            if queued is None:
                break
            kind = rng.choice(["alloc", "alloc", "free", "cache", "hit"])
            if kind == "alloc":
                k = rng.randrange(0, 4)
                if k > len(queued):
                    continue
                op: list = ["alloc", k]
            elif kind == "free" and held:
                op = ["free", list(reversed(held.pop(rng.randrange(len(held)))))]
            elif kind == "cache" and any(held):
                b = rng.choice(rng.choice([h for h in held if h]))
                if pool.blocks[b].block_hash is not None:
                    continue
                hashes += 1
                op = ["cache", b, hashes]
            elif kind == "hit":
                cached = [i for i in queued if pool.blocks[i].block_hash is not None]
                if not cached:
                    continue
                op = ["touch", [rng.choice(cached)]]
            else:
                continue
            rec = pool_op(pool, op, None, None)
            rec.update(step=step, kind=kind, op=op)
            state = queue_state(q, pool.blocks)
            rec["state"] = pack(state)
            steps.append(rec)
            if "timeout" in rec:
                return records
            if kind == "alloc" and not failed(rec):
                if not usable_ids(rec["ids"], n):
                    break
                held.append(rec["ids"])
            elif kind == "hit" and not failed(rec):
                held.append(op[1])
    return records


# --- 2. get_new_blocks and free_blocks -------------------------------------------------------------------
def queue_ids(q: Any, limit: int) -> list:
    """A free queue's block ids head to tail, read along ``next_free_block``; a walk that meets a None link or
    goes on past ``limit`` blocks ends with a string that says so."""
    ids: list = []
    tail, b = q.fake_free_list_tail, q.fake_free_list_head.next_free_block
    for _ in range(limit + 1):
        if b is tail:
            return ids
        if b is None:
            return [*ids, "(a next_free_block link is None before the tail)"]
        ids.append(b.block_id if type(b) is KVCacheBlock else block_label(b))
        b = b.next_free_block
    return [*ids, "(the links form a cycle)"]


def pool_state(pool: BlockPool) -> list | dict:
    """Everything a call may change: the free queue head to tail, every block's ref count and hash, and the
    cache map (``[hash, sorted block ids]`` pairs, by hash); ``{"unreadable": why}`` when the learner's code left
    it unreadable."""
    try:
        pairs = [[h, sorted(m)] for h, m in pool.cached_block_hash_to_block.items()]
        try:
            pairs.sort()
        except TypeError:  # hashes that do not compare (not the ints these scenarios give)
            pairs.sort(key=repr)
        blocks = pool.blocks
        return [queue_ids(pool.free_block_queue, len(blocks) + 2), [b.ref_cnt for b in blocks],
                [b._block_hash for b in blocks], pairs]  # (the block_hash property, read faster)
    except Exception as exc:  # noqa: BLE001 - the learner's code left the pool unreadable: said as data
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def pool_op(pool: BlockPool, op: list, get_new_blocks: Any, free_blocks: Any) -> dict[str, Any]:
    """One step on a pool: ``["alloc", k]`` (``get_new_blocks(pool, k)``, or the pool's own method when
    ``get_new_blocks`` is None; ``ids``: the blocks it returned), ``["free", ids]`` (likewise), ``["touch", ids]``
    (the library's ``BlockPool.touch``), ``["cache", id, hash]`` (the block takes the hash and enters the cache
    map, unless it has one), ``["ref", id, delta]`` (another holder: its ref_cnt changes by delta)."""
    kind = op[0]
    if kind == "cache":
        block = pool.blocks[op[1]]
        if block.block_hash is None:
            block.block_hash = op[2]
            pool.cached_block_hash_to_block.setdefault(op[2], {})[block.block_id] = block
        return {}
    if kind == "ref":
        pool.blocks[op[1]].ref_cnt += op[2]
        return {}
    if kind == "touch":
        blocks = [pool.blocks[i] for i in op[1]]
        return attempt(pool.touch, (blocks,), format_call("BlockPool.touch", (blocks,)))[1]
    arg = op[1] if kind == "alloc" else [pool.blocks[i] for i in op[1]]
    fn = get_new_blocks if kind == "alloc" else free_blocks
    name = "get_new_blocks" if kind == "alloc" else "free_blocks"
    if fn is None:
        fn, args, label = getattr(pool, name), (arg,), format_call(f"BlockPool.{name}", (arg,))
    else:  # format_call(name, (pool, arg)), the pool's part read once
        args = (pool, arg)
        label = f"{name}({describe(pool, 100)}, {describe(arg, 100)})"
    got, rec = attempt(fn, args, label)
    if kind == "alloc" and not failed(rec):
        rec["ids"] = block_ids(got)
    return rec


def drive_pool(get_new_blocks, free_blocks, cases) -> list[dict[str, Any]]:
    """For each case ``{"blocks": n, "ops": [...]}``: ``BlockPool(n)``, then each op (:func:`pool_op`) with these
    functions. One record per case: ``state`` (:func:`pool_state`, before the first op, :func:`pack`ed) and
    ``steps``, each the op's record with the pool after it (``state``). A call past the scenario's time limit
    ends the scenario."""
    records: list[dict[str, Any]] = []
    for case in cases:
        pool = BlockPool(case["blocks"])
        steps: list[dict[str, Any]] = []
        records.append({"state": pack(pool_state(pool)), "steps": steps})
        for op in case["ops"]:
            rec = pool_op(pool, op, get_new_blocks, free_blocks)
            rec["state"] = pack(pool_state(pool))
            steps.append(rec)
            if "timeout" in rec:
                return records
    return records


def drive_pool_random(get_new_blocks, free_blocks, cases) -> list[dict[str, Any]]:
    """For each case ``{"seed": s, "sizes": [n, ...], "steps": k}``, with ``random.Random(s)``: ``BlockPool(n)``,
    then k random steps, chosen from what the holders hold and from the pool the scenario sees: allocations
    (``get_new_blocks``; each gives a new holder), a holder freeing its blocks (``free_blocks``, last block
    first), a holder sharing another's blocks (``touch``), a held block taking a hash, cache hits on a free block
    with a hash (``touch``), and refused calls (more blocks than are free; freeing a free block). Records as
    :func:`drive_pool`'s, each step with ``step``, ``kind`` and ``op``; a pool that cannot be read, or an
    allocation that returned anything but usable blocks, ends its case."""
    records: list[dict[str, Any]] = []
    for case in cases:
        rng = random.Random(case["seed"])
        n = rng.choice(case["sizes"])
        pool = BlockPool(n)
        state = pool_state(pool)
        steps: list[dict[str, Any]] = []
        records.append({"state": pack(state), "steps": steps})
        holders: list[list[int]] = []  # each holder: the block ids it holds, in table order
        next_hash = 0
        for step in range(case["steps"]):
            if not isinstance(state, list) or not usable_ids(state[0], n):
                break
            queued, hashes = state[0], state[2]
            kind = rng.choice(["alloc", "alloc", "free", "free", "share", "cache", "hit", "bad_alloc", "bad_free"])
            if kind == "alloc":
                k = rng.randrange(0, 5)
                if k > len(queued):
                    continue
                op: list = ["alloc", k]
            elif kind == "free" and holders:
                op = ["free", list(reversed(holders.pop(rng.randrange(len(holders)))))]
            elif kind == "share" and holders:
                blocks = list(rng.choice(holders))
                holders.append(blocks)
                op = ["touch", blocks]
            elif kind == "cache" and holders:
                nonempty = [h for h in holders if h]
                if not nonempty:
                    continue
                b = rng.choice(rng.choice(nonempty))
                if hashes[b] is not None:
                    continue
                next_hash += 1
                op = ["cache", b, next_hash]
            elif kind == "hit":
                cached = [i for i in queued if hashes[i] is not None]
                if not cached:
                    continue
                op = ["touch", [rng.choice(cached)]]
                holders.append(op[1])
            elif kind == "bad_alloc":
                op = ["alloc", len(queued) + rng.randrange(1, 3)]
            elif kind == "bad_free" and queued:
                op = ["free", [rng.choice(queued)]]
            else:
                continue
            rec = pool_op(pool, op, get_new_blocks, free_blocks)
            rec.update(step=step, kind=kind, op=op)
            state = pool_state(pool)
            rec["state"] = pack(state)
            steps.append(rec)
            if "timeout" in rec:
                return records
            if kind == "alloc" and not failed(rec):
                if not usable_ids(rec["ids"], n):
                    break
                holders.append(rec["ids"])
    return records


# --- 3. allocate_slots --------------------------------------------------------------------------------------
def manager_state(manager: KVCacheManager) -> dict[str, Any]:
    """A manager as the allocate_slots checks see it: each request's non-empty table (block ids), the free queue
    head to tail, the pool's free count and every block's ref count."""
    try:
        pool = manager.block_pool
        return {
            "tables": {rid: block_ids(list(t)) for rid, t in manager.req_to_blocks.items() if t},
            "free": queue_ids(pool.free_block_queue, len(pool.blocks) + 2),
            "num_free": pool.get_num_free_blocks(),
            "refs": [b.ref_cnt for b in pool.blocks],
        }
    except Exception as exc:  # noqa: BLE001 - the learner's code left the manager unreadable: said as data
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def allocate_call(allocate_slots: Any, manager: KVCacheManager, req: Request, computed: int, new: int) -> dict:
    """``allocate_slots(manager, req, new)`` at ``computed`` computed tokens: :func:`attempt`'s record with
    ``ids`` (the blocks it returned)."""
    req.num_computed_tokens = computed
    args = (manager, req, new)
    got, rec = attempt(allocate_slots, args, format_call("allocate_slots", args))
    if not failed(rec):
        rec["ids"] = block_ids(got)
    return rec


def free_call(manager: KVCacheManager, req: Request) -> dict:
    """``manager.free(req)`` (the library's) when the request holds a table: the record of that call."""
    if req.request_id not in manager.req_to_blocks:
        return {}
    return attempt(manager.free, (req,), format_call("manager.free", (req,)))[1]


def drive_allocate_slots(allocate_slots, cases) -> list[dict[str, Any]]:
    """For each case ``{"num_blocks": n, "block_size": bs, "ops": [...]}``: a ``KVCacheManager`` without prefix
    caching, then each op: ``["grow", rid, tokens, computed, new]`` (the request, made on first use from the
    token ids ``tokens``, then :func:`allocate_call`), ``["free", rid]`` (:func:`free_call`). One record per case:
    ``state`` (:func:`manager_state`, :func:`pack`ed) and ``steps``, each the op's record with the state after
    it. A call past the scenario's time limit ends the scenario."""
    records: list[dict[str, Any]] = []
    for case in cases:
        manager = KVCacheManager(num_blocks=case["num_blocks"], block_size=case["block_size"], enable_caching=False)
        requests: dict[str, Request] = {}
        steps: list[dict[str, Any]] = []
        records.append({"state": pack(manager_state(manager)), "steps": steps})
        for op in case["ops"]:
            if op[0] == "grow":
                _, rid, tokens, computed, new = op
                if rid not in requests:
                    requests[rid] = Request(rid, list(tokens))
                rec = allocate_call(allocate_slots, manager, requests[rid], computed, new)
            else:
                rec = free_call(manager, requests[op[1]])
            rec["state"] = pack(manager_state(manager))
            steps.append(rec)
            if "timeout" in rec:
                return records
    return records


def drive_allocate_slots_random(allocate_slots, cases) -> list[dict[str, Any]]:
    """For each case ``{"case": i, "seed": s, "sizes": [n, ...], "block_sizes": [bs, ...], "steps": k}``, with
    ``random.Random(s)``: a ``KVCacheManager`` of n blocks of bs tokens without prefix caching, then k random
    steps: a new request of a few blocks' worth of tokens asking for its whole prompt or a chunk, a request the
    scenario holds growing by a decode token or a chunk from a number of computed tokens its table covers, or
    one finishing (``manager.free``). The steps are chosen from the requests whose allocation returned blocks
    and from their tables. Records as :func:`drive_allocate_slots`'s (with ``num_blocks`` and ``block_size``),
    each step with ``step`` and ``op`` (``["grow", rid, computed, new]`` or ``["free", rid]``)."""
    records: list[dict[str, Any]] = []
    for case in cases:
        rng = random.Random(case["seed"])
        bs = rng.choice(case["block_sizes"])
        n = rng.choice(case["sizes"])
        manager = KVCacheManager(num_blocks=n, block_size=bs, enable_caching=False)
        requests: dict[str, Request] = {}
        live: set[str] = set()
        steps: list[dict[str, Any]] = []
        records.append({"num_blocks": n, "block_size": bs, "state": pack(manager_state(manager)), "steps": steps})
        for step in range(case["steps"]):
            kind = rng.choice(["new", "grow", "grow", "grow", "finish"])
            if kind == "new":
                rid = f"r{case['case']}.{step}"
                num_tokens = rng.randrange(1, 4 * bs)
                first = rng.choice([num_tokens, rng.randrange(1, num_tokens + 1)])  # the whole prompt or a chunk
                requests[rid] = Request(rid, [1] * num_tokens)
                op: list = ["grow", rid, 0, first]
                rec = allocate_call(allocate_slots, manager, requests[rid], 0, first)
                if not failed(rec) and rec["returned"] != "None":
                    live.add(rid)
            elif kind == "grow" and live:
                rid = rng.choice(sorted(live))
                try:
                    table = len(manager.req_to_blocks.get(rid, []))
                except Exception:  # noqa: BLE001 - the learner's code left a table that is not a list
                    break
                computed = rng.randrange(max(0, table * bs - bs), table * bs + 1)
                new = rng.choice([1, 1, 1, rng.randrange(0, 3 * bs)])
                op = ["grow", rid, computed, new]
                rec = allocate_call(allocate_slots, manager, requests[rid], computed, new)
            elif kind == "finish" and live:
                rid = rng.choice(sorted(live))
                live.remove(rid)
                op = ["free", rid]
                rec = free_call(manager, requests[rid])
            else:
                continue
            rec.update(step=step, op=op)
            rec["state"] = pack(manager_state(manager))
            steps.append(rec)
            if "timeout" in rec:
                return records
    return records


# --- 4. slot_mapping ---------------------------------------------------------------------------------------
def drive_slot_mapping(slot_mapping, calls) -> list[dict[str, Any]]:
    """``slot_mapping(*args)`` for each ``args`` of ``calls`` (an argument ``{"range": [start, stop]}`` is passed
    as that range). One record per call: ``value`` (what it returned, when that is plain data), else
    :func:`attempt`'s record (``returned`` and ``type`` for a result that is not). A call past the scenario's time
    limit ends the scenario."""
    from pagedkv.grading.plain import encode

    records: list[dict[str, Any]] = []
    for args in calls:
        args = tuple(range(*a["range"]) if isinstance(a, dict) else a for a in args)
        got, rec = attempt(slot_mapping, args, format_call("slot_mapping", args))
        if not failed(rec):
            try:
                encode(got)
            except TypeError:
                rec["type"] = type(got).__name__
            else:
                rec = {"value": got}
        records.append(rec)
        if "timeout" in rec:
            break
    return records


# --------------------------------------------------------------------------------------------------------
# Judging records (the trusted side)
# --------------------------------------------------------------------------------------------------------
def _unpack(records: list[dict[str, Any]], pool: bool = False, memo: dict | None = None) -> list[dict[str, Any]]:
    """The records of a scenario with each ``state`` read back from its JSON text (a pool's cache map as a dict
    again), in place; ``memo`` (text -> state, shared and never changed) reads each text once."""
    memo = {} if memo is None else memo

    def read(holder: dict[str, Any]) -> None:
        text = holder.get("state")
        if isinstance(text, str) and len(text) > STATE_LIMIT and text not in memo:  # never what pack writes
            holder["state"] = {"unreadable": f"a state of {len(text)} characters, not what the scenario writes"}
        elif isinstance(text, str):
            if text not in memo:
                state = json.loads(text)
                if pool and isinstance(state, list):
                    state[3] = {h: ids for h, ids in state[3]}
                memo[text] = state
            holder["state"] = memo[text]

    for case in records:
        read(case)
        read(case.get("init") or {})
        for step in case.get("steps") or []:
            read(step)
    return records


_REFERENCE_RECORDS: dict[tuple, tuple] = {}

#: The longest state text :func:`_unpack` reads: many times the longest a scenario writes (a pool of 64 blocks:
#: about 2 KB), so that a record made elsewhere cannot make the check parse megabytes.
STATE_LIMIT = 100_000


def _records(records: Any, name: str) -> list[dict[str, Any]]:
    """``records`` (a scenario's list, as it came back) when it is a list of dicts, each case's ``steps`` (where
    it has them) a list of dicts too (:func:`~pagedkv.grading.checks.scenario_records`); the checks also count
    what came back (:func:`_compared`, :func:`_paired`)."""
    for record in scenario_records(records, name):
        scenario_records(record.get("steps", []), name)
    return records

#: Seconds a scenario may run (CPU seconds under grading, where one test case has 60 in all): what the
#: solution needs many times over (the longest, the hidden pool scenario, about 1 s). An infinite loop in the
#: learner's code ends the scenario at that limit, and the check names the call it was in.
EXAMPLE_SECONDS, RANDOM_SECONDS, HIDDEN_SECONDS = 10.0, 15.0, 30.0


def _compared(scenario, mine: tuple, reference: tuple, cases: list, *, name: str, timeout: float,
              pool: bool = False):
    """(case number, the learner's record, the library's) for each case: ``scenario(*mine, cases)`` driven where
    the learner's code runs, ``scenario(*reference, cases)`` here (kept: the same scenario gives the same
    records). In two drives, the first case alone and then the rest, so that an answer that fails at once costs
    one short scenario; a check that fails stops the generator, and with it the drives."""
    batches = [(0, 1), (1, len(cases))] if len(cases) > 2 else [(0, len(cases))]
    for lo, hi in batches:
        batch = cases[lo:hi]
        got = _records(drive(scenario, *mine, batch, timeout=timeout, name=name), name)
        if len(got) > len(batch):
            fail(f"{name}: the scenario's record is incomplete: {len(got)} records came back for {len(batch)} cases")
        key = (scenario.__name__, tuple(getattr(r, "__qualname__", repr(r)) for r in reference),
               json.dumps(batch))
        if key not in _REFERENCE_RECORDS:
            memo: dict = {}
            _REFERENCE_RECORDS[key] = (_unpack(scenario(*reference, batch), pool, memo), memo)
        ref, memo = _REFERENCE_RECORDS[key]
        got = _unpack(got, pool, dict(memo))  # the states that match the library's are read once
        for i, (m, r) in enumerate(zip(got, ref, strict=False)):
            yield lo + i, m, r
        if len(got) != len(ref):  # cut short by its time limit: the call that ran past it is its last record
            _stopped(got[-1]["steps"] if got else [], f"{name}: the scenario's record is incomplete: {len(got)} of "
                     f"{len(ref)} cases came back" + (f" (case {lo} on)" if lo else ""))


def _stopped(steps: list[dict[str, Any]], otherwise: str) -> None:
    """Fail for a scenario that stopped early: with the call that ran past its time limit, when that is the
    last record (a scenario stops there), else with ``otherwise``."""
    last = steps[-1] if steps else {}
    fail(_call_failed(last) if "timeout" in last else otherwise)


def _at(case: dict[str, Any], i: int) -> dict[str, Any]:
    """Step ``i`` of a case of a fixed script (:func:`_stopped` when the scenario stopped before it)."""
    if i >= len(case["steps"]):
        _stopped(case["steps"], f"the scenario stopped after step {len(case['steps']) - 1}")
    return case["steps"][i]


def _paired(mine: dict[str, Any], ref: dict[str, Any], what: str):
    """The (learner's, library's) records of a case's steps. Up to the first step whose records differ, both
    scenarios saw the same states and so made the same calls; a check fails at that step, so the calls below
    always agree and both lists have the same length (checked all the same)."""
    for m, r in zip(mine["steps"], ref["steps"], strict=False):
        if m.get("op") != r.get("op"):
            fail(f"{what}: the scenario made {m.get('op')} where the library's state led to {r.get('op')}")
        yield m, r
    if len(mine["steps"]) != len(ref["steps"]):
        fail(f"{what}: the scenario stopped after {len(mine['steps'])} of {len(ref['steps'])} steps")


def _call_failed(rec: dict[str, Any]) -> str:
    """What :func:`pagedkv.grading.checks.run` says of a call that raised or hung."""
    if "timeout" in rec:
        within = f" within {rec['timeout']:g} s" if isinstance(rec["timeout"], (int, float)) else ""
        return f"{rec['label']} did not return{within}: is there an infinite loop?"
    return f"{rec['label']} raised {rec['raised']}: {rec['message']}{rec['where']}"


def _judge_call(mine: dict[str, Any], ref: dict[str, Any], why: str = "", label: str | None = None) -> None:
    """Fail as ``run`` would when the learner's call raised (or hung) and the library's did not; as
    ``expect_raises(ValueError, ...)`` would when the library's raised ValueError and the learner's did not."""
    label = label or mine.get("label")  # (a step that calls nothing, such as caching a block, has none)
    if "raised" not in ref:
        if failed(mine):
            fail(_call_failed({**mine, "label": label}))
        return
    assert ref["value_error"], ref  # the library refuses with ValueError
    reason = f" ({why})" if why else ""
    if "timeout" in mine:
        fail(_call_failed({**mine, "label": label}))
    if mine.get("value_error"):
        return
    if "raised" in mine:
        fail(f"{label} raised {mine['raised']}: {mine['message']}, expected ValueError{reason}{mine['where']}")
    fail(f"{label} returned {mine['returned']}, expected it to raise ValueError{reason}")


# --------------------------------------------------------------------------------------------------------
# 1. The free queue
# --------------------------------------------------------------------------------------------------------
def _judge_queue(mine: dict[str, Any], ref: dict[str, Any], after: str) -> None:
    """The learner's queue after a step against the library's (``expected``: its ids head to tail)."""
    expected = ref["fwd"]
    if "unreadable" in mine:
        fail(f"after {after}, the queue could not be read ({mine['unreadable']}), expected {expected}")
    fwd, fwd_end = mine["fwd"], mine.get("fwd_end", "tail")
    bwd, bwd_end = (mine["bwd"], mine["bwd_end"]) if "bwd" in mine else (fwd[::-1], "head")  # tail first
    if fwd_end == "none":
        fail(f"after {after}, walking from the head, the block after {fwd[-1] if fwd else 'the head sentinel'} has "
             "next_free_block None before the tail sentinel was reached: a link is missing")
    if fwd_end == "cycle":
        fail(f"after {after}, walking from the head along next_free_block never reaches the tail sentinel "
             f"(a cycle?): {fwd[:12]}...")
    if bwd_end == "none":
        fail(f"after {after}, walking back from the tail, the block before "
             f"{bwd[-1] if bwd else 'the tail sentinel'} has prev_free_block None: a prev link is missing "
             "(each insert and removal must fix the prev link of the neighbour too)")
    if bwd_end == "cycle":
        fail(f"after {after}, walking back from the tail along prev_free_block never reaches the head (a cycle?): "
             f"{bwd[:12]}...")
    bwd = bwd[::-1]
    if fwd != expected:
        hint = ""
        if fwd == list(reversed(expected)) and len(expected) > 1:
            hint = " (the exact reverse: are head and tail swapped?)"
        elif sorted(fwd, key=repr) == sorted(expected, key=repr):
            hint = " (the right blocks in the wrong order)"
        elif not fwd and expected:
            hint = (". Is FreeQueue still the stub (...)? The given __init__ calls your append for each block, so "
                    "an append that does nothing leaves the queue empty")
        fail(f"after {after}, the queue from head to tail is {fwd}, expected {expected}{hint}")
    if bwd != expected:
        fail(f"after {after}, the next links give {fwd} but walking back along prev_free_block gives "
             f"{bwd}: each insert and removal must fix the prev link of the neighbour too")
    if mine["num"] != ref["num"]:
        fail(f"after {after}, num_free_blocks is {mine['num']}, expected {ref['num']} "
             f"(the queue holds {expected})")
    for block_id in mine["stray"]:
        fail(f"after {after}, block {block_id} is not in the queue but still has links "
             f"(prev_free_block / next_free_block should both be None once it leaves the queue)")


def _judge_queue_case(mine: dict[str, Any], ref: dict[str, Any], init_after: str, steps: list) -> None:
    """One case of :func:`drive_free_queue`: ``steps`` says, for each call, the text of the state check after
    it (None: no check there), why the library refuses it (when it does) and, for a popleft whose result is
    checked, the message for a wrong block (a function of what was returned, which block that is and the block
    expected)."""
    _judge_call(mine["init"], ref["init"])
    _judge_queue(mine["init"]["state"], ref["init"]["state"], init_after)
    for (after, why, popped), (m, r) in zip(steps, _paired(mine, ref, init_after), strict=False):
        _judge_call(m, r, why)
        if popped is not None and m.get("got") != r.get("got"):
            fail(popped(m["returned"], m.get("got"), r["got"]))
        if after is not None:
            _judge_queue(m["state"], r["state"], after)


def _judge_random_queue(mine: dict[str, Any], ref: dict[str, Any], label: str) -> None:
    """One case of :func:`drive_free_queue_random`; ``label`` names it ("random case 3")."""
    init = ref["init_ids"]
    _judge_call(mine["init"], ref["init"])
    _judge_queue(mine["init"]["state"], ref["init"]["state"], f"{label}: FreeQueue(blocks {init})")
    history = [f"FreeQueue({init})"]
    for m, r in _paired(mine, ref, label):
        name, i = r["op"]
        history.append("popleft()" if name == "popleft" else f"{name}({i})")
        recent = "; ".join(history[-6:])
        _judge_call(m, r)
        if name == "popleft" and m.get("got") != r.get("got"):
            fail(f"{label}: after {recent}, popleft() returned {m['returned']}, expected block {r['got']}")
        _judge_queue(m["state"], r["state"], f"{label}: {recent}")


def _random_queue_cases(FreeQueue, cases: list[dict], label: str, name: str, timeout: float) -> None:
    for i, m, r in _compared(drive_free_queue_random, (FreeQueue,), (FreeKVCacheBlockQueue,), cases, name=name,
                             timeout=timeout):
        _judge_random_queue(m, r, f"{label} {i}")


def check_free_queue_examples(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    def first(got, index, want):
        extra = " (that is the tail: popleft takes the head)" if index == 5 else ""
        return f"popleft() on the queue [0, 1, 2, 3, 4, 5] returned {got}, expected block 0{extra}"

    def plain(got, index, want):
        return f"popleft() returned {got}, expected block {want}"

    script = [  # (op, block, the state check's text, why the library refuses it, the popleft message)
        ("popleft", None, "popleft()", None, first),
        ("remove", 3, "remove(block 3) from [1, 2, 3, 4, 5]", None, None),
        ("append", 0, "append(block 0) to [1, 2, 4, 5]", None, None),
        ("appendleft", 3, "appendleft(block 3) to [1, 2, 4, 5, 0]", None, None),
        ("remove", 3, "remove(block 3), the head, from [3, 1, 2, 4, 5, 0]", None, None),
        ("remove", 0, "remove(block 0), the tail, from [1, 2, 4, 5, 0]", None, None),
        ("popleft", None, None, None, plain),
        ("popleft", None, None, None, plain),
        ("popleft", None, None, None, plain),
        ("popleft", None, "popping every block", None, plain),
        ("popleft", None, "popleft() on an empty queue (which must raise ValueError and change nothing)",
         "the queue is empty", None),
        ("appendleft", 2, "appendleft(block 2) to an empty queue", None, None),
        ("append", 4, "append(block 4) to [2]", None, None),
        ("remove", 1, None, "block 1 is not in the queue", None),
        ("append", 2, None, "block 2 is already in the queue", None),
        ("appendleft", 4, "the refused calls above (which must change nothing)", "block 4 is already in the queue",
         None),
    ]
    case = {"blocks": 6, "init": list(range(6)), "ops": [[op, i] for op, i, *_ in script]}
    ((_, mine, ref),) = _compared(drive_free_queue, (FreeQueue,), (FreeKVCacheBlockQueue,), [case],
                                  name="FreeQueue on the examples", timeout=EXAMPLE_SECONDS)
    _judge_queue_case(mine, ref, "FreeQueue(blocks 0..5) (the given __init__ appends each block)",
                      [(after, why, popped) for _, _, after, why, popped in script])


def check_free_queue_random(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    # small queues first, so the first failure reported is a small one
    cases = [{"seed": f"2002/{case}", "blocks": 1 + case // 8, "ops": 25} for case in range(100)]
    _random_queue_cases(FreeQueue, cases, "random case", "FreeQueue on 100 random cases", RANDOM_SECONDS)


def check_free_queue_hidden(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    cases = [{"seed": f"918273/{case}", "blocks": [1, 2, 3, 40, 120], "ops": 120} for case in range(20)]
    _random_queue_cases(FreeQueue, cases, "hidden random case", "FreeQueue on 20 hidden random cases",
                        HIDDEN_SECONDS)
    # Every refused call leaves the queue exactly as it was.
    refused = {"blocks": 4, "init": [0, 1], "ops": [["append", 0], ["appendleft", 1], ["remove", 3], ["popleft", None],
                                                    ["popleft", None], ["popleft", None]]}
    steps = [("append(block 0), refused (it must change nothing)", "block 0 is already in the queue", None),
             ("appendleft(block 1), refused (it must change nothing)", "block 1 is already in the queue", None),
             ("remove(block 3), refused (it must change nothing)", "block 3 is not in the queue", None),
             (None, None, None), (None, None, None),
             ("popleft() on an empty queue", "the queue is empty", None)]
    ((_, mine, ref),) = _compared(drive_free_queue, (FreeQueue,), (FreeKVCacheBlockQueue,), [refused],
                                  name="FreeQueue on refused calls", timeout=EXAMPLE_SECONDS)
    _judge_queue_case(mine, ref, "FreeQueue(blocks [0, 1])", steps)


def check_free_queue_in_the_block_pool(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    # Your queue inside the library's BlockPool: allocations pop it, frees append to either end, cache hits
    # remove from the middle. The library's queue in the same pool says what the order must be after every step.
    cases = [{"seed": f"5150/{case}", "sizes": [4, 9, 33], "steps": 120} for case in range(20)]
    for case, m, r in _compared(drive_queue_in_pool, (FreeQueue,), (FreeKVCacheBlockQueue,), cases,
                                name="your FreeQueue in 20 random BlockPools", timeout=HIDDEN_SECONDS):
        _judge_call(m["init"], r["init"])
        blocks = len(r["init"]["state"]["fwd"])
        _judge_queue(m["init"]["state"], r["init"]["state"],
                     f"FreeQueue(blocks 1..{blocks}) in a BlockPool of {blocks + 1} blocks (case {case})")
        for ms, rs in _paired(m, r, f"in a BlockPool, case {case}"):
            step, kind, op = rs["step"], rs["kind"], rs["op"]
            _judge_call(ms, rs)
            if kind == "alloc" and ms["ids"] != rs["ids"]:
                fail(f"in a BlockPool, case {case} step {step}: get_new_blocks({op[1]}) gave blocks {ms['ids']}, "
                     f"expected {rs['ids']} (the first {op[1]} of your queue)")
            _judge_queue(ms["state"], rs["state"], f"case {case}, step {step} ({kind}) in a BlockPool using your queue")


# --------------------------------------------------------------------------------------------------------
# 2. get_new_blocks and free_blocks
# --------------------------------------------------------------------------------------------------------
_STATE_NAMES = ["free queue", "ref counts", "block hashes", "cache map"]


def _readable(rec: dict[str, Any], text: str) -> list:
    """The pool state of a step's record; fails when the learner's code left the pool unreadable."""
    if isinstance(rec["state"], dict):
        fail(f"{text}: the pool could not be read afterwards ({rec['state']['unreadable']})")
    return rec["state"]


def _diff(before, after):
    if isinstance(after, dict):
        return f"it could not be read afterwards ({after['unreadable']})"
    return "; ".join(f"{n} went from {describe(a, 70)} to {describe(b, 70)}"
                     for n, a, b in zip(_STATE_NAMES, before, after, strict=True) if a != b)


def _free_hint(got, given, state):
    """Name the usual mistake when the queue after free_blocks is wrong (``state``: the learner's pool after)."""
    _, refs, hashes, _ = state
    back = [i for i in given if refs[i] == 0]
    plain = [i for i in back if hashes[i] is None]
    cached = [i for i in back if hashes[i] is not None]
    if len(plain) > 1 and got[: len(plain)] == plain[::-1]:
        return (" Hint: the uncached blocks came back in reverse: appendleft one at a time makes the last one "
                "the head; they must reach the head as a group in the order given (first given = new head)")
    if plain and got[: len(plain)] != plain and set(plain) <= set(got[len(got) - len(back):]):
        return " Hint: blocks without a hash go to the head (reused first), not the tail"
    if cached and set(cached) & set(got[: len(back)]):
        return " Hint: cached blocks (with a hash) go to the tail, so they are evicted last"
    return ""


def _map_text(state) -> str:
    """The cache map as ``describe`` shows the pool's own (hash -> {block id: block}), from a pool state."""
    _, refs, hashes, cache_map = state
    shown = {}
    for h, ids in cache_map.items():
        blocks = {}
        for i in ids:
            b = KVCacheBlock(i)
            b.ref_cnt = refs[i]
            if hashes[i] is not None:
                b.block_hash = hashes[i]
            blocks[i] = b
        shown[h] = blocks
    return describe(shown)


def _pool_records(get_new_blocks, free_blocks, cases, reference_get, reference_free, name):
    """The learner's records and the library's, of a short pool script (one drive)."""
    pairs = list(_compared(drive_pool, (get_new_blocks, free_blocks), (reference_get, reference_free), cases,
                           name=name, timeout=EXAMPLE_SECONDS, pool=True))
    return [m for _, m, _ in pairs], [r for _, _, r in pairs]


def check_get_new_blocks_alone(get_new_blocks):
    require_function(get_new_blocks, "get_new_blocks")
    cases = [
        # Allocation alone, on a fresh pool; then a free block that still holds a cached prefix is evicted when it
        # is popped for reuse.
        {"blocks": 8, "ops": [["alloc", 3], ["alloc", 0], ["cache", 4, 12345], ["alloc", 2]]},
        # Refusals change nothing: 3 blocks are free, one of them (5) cached.
        {"blocks": 6, "ops": [["alloc", 2], ["cache", 5, 777], ["alloc", 4], ["alloc", 5], ["alloc", 100],
                              ["alloc", -1]]},
    ]
    (a, b), (ra, rb) = _pool_records(get_new_blocks, None, cases, BlockPool.get_new_blocks, None,
                                     "get_new_blocks on the examples")
    got, want = _at(a, 0), _at(ra, 0)
    _judge_call(got, want)
    _readable(got, got["label"])
    if got["ids"] != want["ids"]:
        fail(f"get_new_blocks(pool, 3) on a fresh pool of 8 returned {got['returned']}, expected blocks [1, 2, 3] "
             "(the head of the free queue, in order; block 0 is the null block and is never free)"
             + (f". {STUB_NOTE}" if got["returned"] == "None" else ""))
    refs = [got["state"][1][i] for i in got["ids"]]
    if refs != [want["state"][1][i] for i in want["ids"]]:
        fail(f"after get_new_blocks(pool, 3) the blocks' ref_cnt are {refs}, expected [1, 1, 1]")
    if got["state"][0] != want["state"][0]:
        fail(f"after get_new_blocks(pool, 3) the free queue is {got['state'][0]}, expected [4, 5, 6, 7]")
    got, want = _at(a, 1), _at(ra, 1)
    _judge_call(got, want)
    _readable(got, got["label"])
    if got["ids"] != want["ids"]:
        fail(f"get_new_blocks(pool, 0) returned {got['returned']}, expected []")
    got, want = _at(a, 3), _at(ra, 3)
    _judge_call(got, want)
    _readable(got, got["label"])
    if (got["ids"] or []) != want["ids"]:
        fail(f"get_new_blocks(pool, 2) on the free queue [4, 5, 6, 7] returned {got['returned']}, expected blocks "
             "[4, 5]")
    if got["state"][2][4] is not None or got["state"][3]:
        fail("block 4 held a cached prefix and was popped for reuse, but it was not evicted (its block_hash is "
             f"{got['state'][2][4]!r}, the cache map {_map_text(got['state'])}): call "
             "evict_if_cached(pool, block) on every block you pop")
    _judge_call(_at(b, 0), _at(rb, 0))
    before = _at(rb, 1)["state"]
    for n, i in zip((4, 5, 100), (2, 3, 4), strict=True):  # 3 are free
        got, want = _at(b, i), _at(rb, i)
        if "timeout" in got:
            fail(_call_failed(got))
        if "raised" in got and not got["value_error"]:
            fail(f"get_new_blocks(pool, {n}) with 3 free blocks raised {got['raised']}: {got['message']}, "
                 "expected ValueError")
        if got["state"] != want["state"]:
            fail(f"get_new_blocks(pool, {n}) with only 3 blocks free changed the pool: "
                 f"{_diff(before, got['state'])}. Check the free count before popping anything: a failed call must "
                 "change nothing")
        if "raised" not in got:
            fail(f"get_new_blocks(pool, {n}) with only 3 blocks free returned {got['returned']}, expected ValueError")
    got, want = _at(b, 5), _at(rb, 5)
    _judge_call(got, want, "a negative count")
    if got["state"] != want["state"]:
        fail(f"get_new_blocks(pool, -1) changed the pool: {_diff(before, got['state'])}")


def check_free_blocks_alone(free_blocks):
    require_function(free_blocks, "free_blocks")

    # Freeing alone: the blocks are taken from the free queue by the pool's own touch (as a cache hit takes
    # them), which leaves them as get_new_blocks would on a fresh pool: held once, out of the queue.
    cases = [
        {"blocks": 8, "ops": [["touch", [1, 2, 3]], ["cache", 2, 12345], ["free", [3, 2, 1]]]},
        # A block held twice (shared) returns only when its last holder frees it.
        {"blocks": 4, "ops": [["touch", [1]], ["ref", 1, 1], ["free", [1]], ["free", [1]]]},
    ]
    (a, b), (ra, rb) = _pool_records(None, free_blocks, cases, None, BlockPool.free_blocks,
                                     "free_blocks on the examples")
    got, want = _at(a, 2), _at(ra, 2)
    _judge_call(got, want)
    _readable(got, got["label"])
    queue, expected = got["state"][0], want["state"][0]
    if queue != expected:
        fail(f"queue [4, 5, 6, 7], blocks 1, 2, 3 held once, block 2 cached: after free_blocks(pool, [3, 2, 1]) the "
             f"free queue is {queue}, expected {expected}." + (
                 " Is free_blocks still the stub (...)? Nothing came back to the queue"
                 if queue == _at(a, 1)["state"][0] else _free_hint(queue, [3, 2, 1], got["state"])))
    if got["state"][1] != want["state"][1]:
        fail(f"after freeing every block the ref counts are {got['state'][1]}, expected all 0")
    got, want = _at(b, 2), _at(rb, 2)
    _judge_call(got, want)
    _readable(got, got["label"])
    if got["state"][1][1] != want["state"][1][1] or 1 in got["state"][0]:
        fail(f"a block held twice, freed once, must stay held with ref_cnt 1; got ref_cnt {got['state'][1][1]} and "
             f"free queue {got['state'][0]}")
    got, want = _at(b, 3), _at(rb, 3)
    _judge_call(got, want)
    _readable(got, got["label"])
    if got["state"][1][1] != want["state"][1][1] or got["state"][0] != want["state"][0]:
        fail(f"freed by its last holder, block 1 must return to the head: ref_cnt {got['state'][1][1]}, queue "
             f"{got['state'][0]}")


def check_free_blocks_refuses_without_change(free_blocks):
    require_function(free_blocks, "free_blocks")

    refusals = [
        ([4], "block 4 is free (ref_cnt 0): freeing it again"),
        ([1, 1], "block 1 is held once but freed twice in one call"),
        ([2, 1, 4], "the last block is free; nothing may change, not even blocks 2 and 1"),
        ([0], "block 0 is the null block"),
    ]
    # blocks 1 and 2 held (taken with the pool's touch), 3 to 5 free, 5 holding a cached prefix
    cases = [{"blocks": 6, "ops": [["touch", [1, 2]], ["cache", 5, 777]] + [["free", ids] for ids, _ in refusals]}]
    (a,), (ra,) = _pool_records(None, free_blocks, cases, None, BlockPool.free_blocks, "free_blocks on refused calls")
    before = _at(ra, 1)["state"]
    shown = describe(BlockPool(1))  # the pool by what it holds, not as <BlockPool object>
    for i, (ids, why) in enumerate(refusals, 2):
        got, want = _at(a, i), _at(ra, i)
        try:
            _judge_call(got, want, why)
        except AssertionError as exc:
            fail(str(exc).replace(shown, "pool (6 blocks: 1 and 2 held once, 3 to 5 free, 5 cached)", 1))
        if got["state"] != before:
            fail(f"free_blocks refused {ids} ({why}) but changed the pool first: "
                 f"{_diff(before, got['state'])}. Check every block before changing any")


def _pool_state_machine(get_new_blocks, free_blocks, seed, cases, steps, sizes, label, timeout):
    """Random operation sequences (:func:`drive_pool_random`), the learner's get_new_blocks and free_blocks
    against the library's: the pool is compared after every step."""
    require_function(get_new_blocks, "get_new_blocks")
    require_function(free_blocks, "free_blocks")
    script = [{"seed": f"{seed}/{case}", "sizes": sizes, "steps": steps} for case in range(cases)]
    for case, m, r in _compared(drive_pool_random, (get_new_blocks, free_blocks),
                                (BlockPool.get_new_blocks, BlockPool.free_blocks), script,
                                name=f"get_new_blocks and free_blocks on {cases} {label} cases", timeout=timeout,
                                pool=True):
        log: list[str] = []
        before = r["state"]
        for got, want in _paired(m, r, f"{label} case {case}"):
            _judge_pool_step(got, want, before, log, f"{label} case {case}")
            before = want["state"]


def _judge_pool_step(got: dict, want: dict, before: list, log: list[str], label: str) -> None:
    """One step of :func:`drive_pool_random` (``before``: the library's pool before it; ``log``: what the steps
    so far did, for the messages)."""
    step, kind, op = want["step"], want["kind"], want["op"]
    at = f"{label} step {step}"
    if kind == "bad_alloc":
        k, free = op[1], len(before[0])
        if "timeout" in got:
            fail(f"{at}: {_call_failed(got)}")
        if "raised" in got and not got["value_error"]:
            fail(f"{at}: get_new_blocks(pool, {k}) with {free} free raised {got['raised']}: {got['message']}, "
                 "expected ValueError")
        if "raised" not in got:
            fail(f"{at}: get_new_blocks(pool, {k}) with {free} free returned instead of raising ValueError")
        if got["state"] != before:
            fail(f"{at}: the refused get_new_blocks(pool, {k}) changed the pool: {_diff(before, got['state'])}")
        return
    if kind == "bad_free":
        b = op[1][0]
        if "timeout" in got:
            fail(f"{at}: {_call_failed(got)}")
        if "raised" in got and not got["value_error"]:
            fail(f"{at}: free_blocks(pool, [block {b}]) on a free block raised {got['raised']}: {got['message']}, "
                 "expected ValueError")
        if "raised" not in got:
            fail(f"{at}: free_blocks(pool, [block {b}]) on a free block (ref_cnt 0) returned instead of raising "
                 "ValueError")
        if got["state"] != before:
            fail(f"{at}: the refused free_blocks changed the pool: {_diff(before, got['state'])}")
        return
    _judge_call(got, want)
    state = _readable(got, at)
    if kind == "alloc":
        if got["ids"] != want["ids"]:
            fail(f"{at}: get_new_blocks(pool, {op[1]}) with free queue {before[0]} returned {got['returned']}, "
                 f"expected blocks {want['ids']}")
        for i in got["ids"]:
            if state[2][i] is not None or any(i in ids for ids in state[3].values()):
                fail(f"{at}: block {i} held a cached prefix and was popped by get_new_blocks, but it was not evicted "
                     "(hash still set or still in the cache map): call evict_if_cached(pool, block) on every block "
                     "you pop")
    if kind == "alloc":
        log.append(f"get_new_blocks({op[1]}) -> {want['ids']}")
    elif kind == "free":
        log.append(f"free_blocks({op[1]})")
    elif kind == "share":
        log.append(f"share {op[1]}")
    elif kind == "cache":
        log.append(f"cache block {op[1]}")
    else:
        log.append(f"cache hit on free block {op[1][0]}")
    where_ = f"{label}, after {'; '.join(log[-5:])}"
    q, model = state[0], want["state"][0]
    if q != model:
        hint = ""
        if sorted(q, key=repr) == sorted(model, key=repr):
            hint = (" (the right blocks in the wrong order: uncached blocks go to the head as a group in "
                    "the order given; cached blocks to the tail)")
        fail(f"{where_}: the free queue is {q}, expected {model}{hint}")
    for i, (ref_cnt, want_ref) in enumerate(zip(state[1], want["state"][1], strict=True)):
        if i and ref_cnt != want_ref:
            fail(f"{where_}: block {i} has ref_cnt {ref_cnt}, but {want_ref} holder(s) hold it")
    for h, ids in state[3].items():
        for i in ids:
            if state[2][i] != h:
                fail(f"{where_}: block {i} is in the cache map under {h} but its hash is "
                     f"{state[2][i]!r}: a popped cached block must be evicted (evict_if_cached)")
    if state != want["state"]:
        fail(f"{where_}: the pool is not what the library's get_new_blocks and free_blocks leave: "
             f"{_diff(want['state'], state)}")


def check_pool_state_machine(get_new_blocks, free_blocks):
    _pool_state_machine(get_new_blocks, free_blocks, seed=42, cases=40, steps=60, sizes=[2, 5, 12], label="random",
                        timeout=RANDOM_SECONDS)


def check_pool_state_machine_hidden(get_new_blocks, free_blocks):
    _pool_state_machine(get_new_blocks, free_blocks, seed=60606, cases=40, steps=250, sizes=[3, 17, 64],
                        label="hidden random", timeout=HIDDEN_SECONDS)


# --------------------------------------------------------------------------------------------------------
# 3. allocate_slots
# --------------------------------------------------------------------------------------------------------
def _judge_grow(got, want, before, bs, rid, computed, new, label):
    """One allocate_slots call (the learner's record ``got``, the library's ``want``; ``before``: the library's
    state before it): what the table, the result and the pool must be."""
    table = before["tables"].get(rid, [])
    free = before["free"]
    need = -(-(computed + new) // bs)
    missing = max(0, need - len(table))
    call = (f"{label}: allocate_slots(manager, request {rid!r}, {new}) at {computed} computed tokens "
            f"(block_size {bs}, table of {len(table)} blocks, {len(free)} free)")
    short = want["returned"] == "None"
    if failed(got):
        text = _call_failed(got)
        if not short:
            fail(text)
        text = text[text.find(" raised "):] if " raised " in text else f": {text}"
        fail(f"{call}{text}. Hint: {missing} block(s) are missing and only {len(free)} free: all or nothing, "
             "so return None (before taking any block) instead of asking the pool for more than it has")
    if "unreadable" in got["state"]:
        fail(f"{call}: the manager could not be read afterwards ({got['state']['unreadable']})")
    if short:
        if got["returned"] != "None":
            fail(f"{call} returned {got['returned']}, expected None: {missing} more block(s) needed, "
                 f"{len(free)} free")
        state = got["state"]
        if [state.get(k) for k in ("tables", "free", "refs")] != [before[k] for k in ("tables", "free", "refs")]:
            fail(f"{call} returned None but changed the manager first (tables {state.get('tables')}, was "
                 f"{before['tables']}): check the free count before taking any block")
        return
    if got["returned"] == "None":
        hint = f". {STUB_NOTE}"
        if table and need > len(free) >= missing:
            hint = (f". Hint: the table already has {len(table)} block(s), so only {missing} are missing "
                    f"(not {need}), and {len(free)} are free")
        elif missing == len(free):
            hint = (f". Hint: exactly as many blocks are free as are missing ({missing}): that is enough, so "
                    "compare with >, not >=")
        fail(f"{call} returned None, expected {missing} new block(s): {len(free)} are free{hint}")
    if got["ids"] is None:
        fail(f"{call} returned {got['returned']}, expected a list of the new blocks")
    now = got["state"].get("tables", {}).get(rid, [])
    expected = want["state"]["tables"].get(rid, [])
    if len(now) != len(expected):
        hint = ""
        if computed and len(now) == max(len(table), -(-new // bs)) == len(table) + len(got["ids"]):
            hint = (f" Hint: the table must hold num_computed_tokens + num_new_tokens = {computed} + {new} = "
                    f"{computed + new} tokens, not only the {new} new one(s)")
        elif len(now) == (computed + new) // bs and (computed + new) % bs:
            hint = (f" Hint: {computed + new} tokens in blocks of {bs} need ceil({computed + new} / {bs}) = {need}"
                    " blocks: round up, the last block may be partly filled")
        elif len(now) == len(table) + need:
            hint = (f" Hint: the table already had {len(table)} block(s); only {missing} more "
                    f"{'is' if missing == 1 else 'are'} needed, not {need}")
        fail(f"{call}: the table now has {len(now)} blocks ({now}), expected {len(expected)} "
             f"for {computed + new} tokens.{hint}")
    if now != expected:
        fail(f"{call}: the table is {now}, expected {expected} (the old table, then the blocks "
             "popped from the head of the free queue)")
    if got["ids"] != want["ids"]:
        fail(f"{call} returned blocks {got['ids']}, expected the new blocks {want['ids']}")


def _judge_manager(got: dict, want: dict, where_: str) -> None:
    """What the specific checks did not name: the learner's manager against the library's."""
    if got != want:
        parts = [f"{k} {describe(got.get(k), 70)}, expected {describe(want[k], 70)}" for k in want
                 if got.get(k) != want[k]]
        fail(f"{where_}: the manager is not what the library's allocate_slots leaves: {'; '.join(parts)}")


def _allocate_slots_lifecycle(allocate_slots, seed, cases, label, sizes, block_sizes, timeout):
    """Requests admitted, grown by prefill chunks and decode steps, and finished, in random order
    (:func:`drive_allocate_slots_random`), the learner's allocate_slots against the library's."""
    require_function(allocate_slots, "allocate_slots")
    script = [{"case": case, "seed": f"{seed}/{case}", "sizes": sizes, "block_sizes": block_sizes, "steps": 60}
              for case in range(cases)]
    for case, m, r in _compared(drive_allocate_slots_random, (allocate_slots,), (KVCacheManager.allocate_slots,),
                                script, name=f"allocate_slots on {cases} {label} cases", timeout=timeout):
        n, bs = r["num_blocks"], r["block_size"]
        before = r["state"]
        for got, want in _paired(m, r, f"{label} case {case}"):
            op, at = want["op"], f"{label} case {case} step {want['step']}"
            if op[0] == "grow":
                _judge_grow(got, want, before, bs, op[1], op[2], op[3], f"{label} case {case}")
            elif failed(got):
                fail(f"{at}: {_call_failed(got)}")
            before = want["state"]
            state = got["state"]
            if "unreadable" in state:
                fail(f"{at}: the manager could not be read ({state['unreadable']})")
            held = [i for t in state["tables"].values() for i in t]
            if len(held) != len(set(held)):
                fail(f"{at}: a block is in two tables at once: {state['tables']}")
            if state["num_free"] + len(held) != n - 1:
                fail(f"{at}: {state['num_free']} free + {len(held)} held != num_blocks - 1 = {n - 1}")
            for i, ref_cnt in enumerate(state["refs"]):
                if i and ref_cnt != (1 if i in held else 0):
                    fail(f"{at}: block {i} has ref_cnt {ref_cnt}")
            _judge_manager(state, want["state"], at)


def check_allocate_slots_examples(allocate_slots):
    require_function(allocate_slots, "allocate_slots")

    script = [  # (op, the text of the call)
        (["grow", "A", list(range(17)), 0, 17], "a 17-token prompt"),
        (["grow", "A", None, 17, 15], "prompt then 15 decode tokens, 32 in all"),
        (["grow", "A", None, 32, 1], "the 33rd token crosses into a third block"),
        (["grow", "A", None, 33, 1], "the 34th token fits in the third block"),
        (["grow", "A", None, 34, 0], "no new tokens"),
        (["grow", "B", list(range(40)), 0, 40], "a 40-token prompt with 2 blocks free: short by one"),
        (["grow", "B", None, 0, 32], "a 32-token chunk of it: exactly 2 blocks"),
        (["grow", "B", None, 32, 8], "the rest of the prompt with no block free"),
        (["free", "A"], "A finishes"),
        (["grow", "B", None, 32, 8], "the rest once A has finished and freed its 3 blocks"),
        (["grow", "B", None, 32, -1], None),
    ]
    cases = [{"num_blocks": 6, "block_size": 16, "ops": [op for op, _ in script]}]
    ((_, mine, ref),) = _compared(drive_allocate_slots, (allocate_slots,), (KVCacheManager.allocate_slots,), cases,
                                  name="allocate_slots on the examples", timeout=EXAMPLE_SECONDS)
    before = ref["state"]
    for (op, text), (got, want) in zip(script, _paired(mine, ref, "allocate_slots on the examples"), strict=False):
        if text is None:
            _judge_call(got, want, "a negative token count")
        elif op[0] == "grow":
            _judge_grow(got, want, before, 16, op[1], op[3], op[4], text)
        elif failed(got):
            fail(f"{text}: {_call_failed(got)}")
        before = want["state"]
        _judge_manager(got["state"], want["state"], text or "allocate_slots(manager, B, -1)")


def check_allocate_slots_random(allocate_slots):
    _allocate_slots_lifecycle(allocate_slots, seed=77, cases=40, label="random", sizes=[3, 6, 20],
                              block_sizes=[1, 2, 4, 16], timeout=RANDOM_SECONDS)


def check_allocate_slots_hidden(allocate_slots):
    _allocate_slots_lifecycle(allocate_slots, seed=31415, cases=30, label="hidden random", sizes=[2, 9, 50],
                              block_sizes=[1, 3, 8, 16, 32], timeout=HIDDEN_SECONDS)


# --------------------------------------------------------------------------------------------------------
# 4. slot_mapping
# --------------------------------------------------------------------------------------------------------
def _slot_hint(table, positions, bs):
    def explain(got):
        if not isinstance(got, list) or len(got) != len(positions):
            return None
        want = reference(table, positions, bs)
        if all(g == w + 1 for g, w in zip(got, want, strict=True)):
            return "every slot is one too high: offsets inside a block start at 0"
        if got == [table[p // bs] + p % bs for p in positions]:
            return "multiply the block id by block_size: block b's slots start at b * block_size"
        if got == list(positions):
            return "those are the logical positions: look up each position's physical block in the table"
        if got == [(p // bs) * bs + p % bs for p in positions]:
            return "that uses the logical block index p // block_size, not the physical block in the table"
        return None
    return explain


def _slot_calls(slot_mapping, calls: list[tuple[tuple, Any, Any]], name: str, timeout: float) -> None:
    """``calls``: (args, the expected slots or ValueError, the hint or why it must raise). One scenario makes
    every call; each is judged as ``expect_equal`` / ``expect_raises`` would judge it, in order."""
    # copies: in a check cell the learner's code gets these very lists, and may change them
    sent = [[{"range": [a.start, a.stop]} if isinstance(a, range) else list(a) if isinstance(a, list) else a
             for a in args] for args, _, _ in calls]
    records = _records(drive(drive_slot_mapping, slot_mapping, sent, timeout=timeout, name=name), name)
    for (args, expected, note), rec in zip(calls, records, strict=False):
        label = format_call("slot_mapping", args)
        if expected is ValueError:
            _judge_call({"returned": describe(rec.get("value")), **rec, "label": label},
                        {"raised": "ValueError", "value_error": True}, note)
            continue
        if failed(rec):
            fail(_call_failed({**rec, "label": label}))
        if "value" not in rec:
            fail(f"{label} returned {rec['returned']}, expected {describe(expected)} (expected a list, got "
                 f"{rec['type']})")
        expect_equal(lambda *a, _v=rec["value"]: _v, args, expected, name="slot_mapping", hint=note, timeout=None)
    if len(records) != len(calls):  # (a scenario cut short has failed at its last record already)
        fail(f"{name}: the scenario's record is incomplete: {len(records)} of {len(calls)} calls came back")


def check_slot_mapping_examples(slot_mapping):
    require_function(slot_mapping, "slot_mapping")

    cases = [
        ([7, 2], list(range(6)), 4),
        ([7, 2], [5, 0, 3], 4),
        ([3], [0], 16),
        ([3, 9, 1], list(range(48)), 16),
        ([0, 5], [4], 4),
        ([12, 4, 8], [2, 0], 1),
        ([5, 6], [], 16),
    ]
    calls = [((list(t), list(p), bs), reference(t, p, bs), _slot_hint(t, p, bs)) for t, p, bs in cases]
    calls += [
        (([4, 1], range(3, 6), 4), [19, 4, 5], "positions may be a range"),
        (([7, 2], [8], 4), ValueError, "position 8 is past the 8 slots of the table"),
        (([7, 2], [-1], 4), ValueError, "a negative position"),
        (([], [0], 16), ValueError, "an empty table has no slots"),
    ]
    _slot_calls(slot_mapping, calls, "slot_mapping on the examples", EXAMPLE_SECONDS)


def check_slot_mapping_hidden(slot_mapping):
    require_function(slot_mapping, "slot_mapping")

    rng = random.Random(271828)
    calls = []
    for _ in range(300):
        bs = rng.choice([1, 2, 3, 8, 16, 32, 128])
        table = rng.sample(range(1, 5000), rng.randrange(1, 12))
        cap = len(table) * bs
        positions = [rng.randrange(cap) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.3:
            start = rng.randrange(cap)
            positions = list(range(start, min(cap, start + rng.randrange(1, 3 * bs))))
        calls.append(((list(table), list(positions), bs), reference(table, positions, bs),
                      _slot_hint(table, positions, bs)))
    calls += [
        (([3, 4, 5], [0, 47, 48], 16), ValueError, "position 48 is past the table"),
        (([3], [0], 0), ValueError, "block_size 0"),
    ]
    _slot_calls(slot_mapping, calls, "slot_mapping on 302 hidden cases", HIDDEN_SECONDS)
