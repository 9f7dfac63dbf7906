"""Checks for lesson 2's exercises (``grading/source/02_block_pool.ipynb``): the free queue, the pool's
allocation and freeing, ``allocate_slots`` and the slot mapping.

Each ``check_*`` function is one test case of the set: the source's test cell calls it with the learner's
objects (looked up by name in the notebook). The checks drive the learner's code on the library's
``BlockPool`` and ``KVCacheManager``, compare every state a call may change with what vLLM's rules give, and
fail (``pagedkv.grading.checks.fail``) with a message that names the call, the state and the usual mistake.
"""

from __future__ import annotations

import random

from pagedkv import BlockPool, KVCacheBlock, KVCacheManager, Request
from pagedkv.grading.checks import STUB_NOTE, describe, expect_equal, expect_raises, fail, require_function, run

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


def walk(q, limit, after):
    """Block ids head to tail along next links, and tail to head along prev links (checked)."""
    head, tail = q.fake_free_list_head, q.fake_free_list_tail
    fwd, b = [], head.next_free_block
    while b is not tail:
        if b is None:
            fail(f"after {after}, walking from the head, the block after {fwd[-1] if fwd else 'the head sentinel'} has "
                 "next_free_block None before the tail sentinel was reached: a link is missing")
        fwd.append(b.block_id)
        if len(fwd) > limit:
            fail(f"after {after}, walking from the head along next_free_block never reaches the tail sentinel "
                 f"(a cycle?): {fwd[:12]}...")
        b = b.next_free_block
    bwd, b = [], tail.prev_free_block
    while b is not head:
        if b is None:
            fail(f"after {after}, walking back from the tail, the block before "
                 f"{bwd[-1] if bwd else 'the tail sentinel'} has prev_free_block None: a prev link is missing "
                 "(each insert and removal must fix the prev link of the neighbour too)")
        bwd.append(b.block_id)
        if len(bwd) > limit:
            fail(f"after {after}, walking back from the tail along prev_free_block never reaches the head (a cycle?): "
                 f"{bwd[:12]}...")
        b = b.prev_free_block
    bwd.reverse()
    return fwd, bwd


def check(q, expected, after, blocks):
    fwd, bwd = walk(q, len(blocks) + 2, after)
    if fwd != expected:
        hint = ""
        if fwd == list(reversed(expected)) and len(expected) > 1:
            hint = " (the exact reverse: are head and tail swapped?)"
        elif sorted(fwd) == sorted(expected):
            hint = " (the right blocks in the wrong order)"
        elif not fwd and expected:
            hint = (". Is FreeQueue still the stub (...)? The given __init__ calls your append for each block, so "
                    "an append that does nothing leaves the queue empty")
        fail(f"after {after}, the queue from head to tail is {fwd}, expected {expected}{hint}")
    if bwd != expected:
        fail(f"after {after}, the next links give {fwd} but walking back along prev_free_block gives "
             f"{bwd}: each insert and removal must fix the prev link of the neighbour too")
    if q.num_free_blocks != len(expected):
        fail(f"after {after}, num_free_blocks is {q.num_free_blocks}, expected {len(expected)} "
             f"(the queue holds {expected})")
    inside = set(expected)
    for blk in blocks:
        if blk.block_id not in inside and (blk.prev_free_block is not None or blk.next_free_block is not None):
            fail(f"after {after}, block {blk.block_id} is not in the queue but still has links "
                 f"(prev_free_block / next_free_block should both be None once it leaves the queue)")


def diff(before, after):
    names = ["free queue", "ref counts", "block hashes", "cache map"]
    return "; ".join(f"{n} went from {describe(a, 70)} to {describe(b, 70)}"
                     for n, a, b in zip(names, before, after, strict=True) if a != b)


def cache(pool, block, h):
    block.block_hash = h
    pool.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block


def queue(pool):
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def free_hint(got, given):
    """Name the usual mistake when the queue after free_blocks is wrong."""
    back = [b for b in given if b.ref_cnt == 0]
    plain = [b.block_id for b in back if b.block_hash is None]
    cached = [b.block_id for b in back if b.block_hash is not None]
    if len(plain) > 1 and got[: len(plain)] == plain[::-1]:
        return (" Hint: the uncached blocks came back in reverse: appendleft one at a time makes the last one "
                "the head; they must reach the head as a group in the order given (first given = new head)")
    if plain and got[: len(plain)] != plain and set(plain) <= set(got[len(got) - len(back):]):
        return " Hint: blocks without a hash go to the head (reused first), not the tail"
    if cached and set(cached) & set(got[: len(back)]):
        return " Hint: cached blocks (with a hash) go to the tail, so they are evicted last"
    return ""


def tables(manager):
    return {rid: [b.block_id for b in t] for rid, t in manager.req_to_blocks.items() if t}


def reference(table, positions, bs):
    return [table[p // bs] * bs + p % bs for p in positions]


def hint(table, positions, bs):
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


def _free_queue_random_run(FreeQueue, rng, n_blocks, n_ops, label):
    """Random operations on a FreeQueue against a model list; the queue is checked after each."""
    blocks = [KVCacheBlock(i) for i in range(n_blocks)]
    start = list(range(n_blocks))
    rng.shuffle(start)
    k = rng.randrange(0, n_blocks + 1)
    model = start[:k]
    q = run(FreeQueue, ([blocks[i] for i in model],), name="FreeQueue")
    check(q, model, f"{label}: FreeQueue(blocks {model})", blocks)
    history = [f"FreeQueue({model})"]
    for _ in range(n_ops):
        outside = [i for i in range(n_blocks) if i not in model]
        op = rng.choice(["popleft", "remove", "append", "appendleft"])
        if op == "popleft" and model:
            got = run(q.popleft, name="popleft")
            want = model.pop(0)
            history.append("popleft()")
            if got is not blocks[want]:
                fail(f"{label}: after {'; '.join(history[-6:])}, popleft() returned {got!r}, expected block {want}")
        elif op == "remove" and model:
            i = rng.choice(model)
            model.remove(i)
            history.append(f"remove({i})")
            run(q.remove, (blocks[i],), name="remove")
        elif op in ("append", "appendleft") and outside:
            i = rng.choice(outside)
            history.append(f"{op}({i})")
            if op == "append":
                model.append(i)
                run(q.append, (blocks[i],), name="append")
            else:
                model.insert(0, i)
                run(q.appendleft, (blocks[i],), name="appendleft")
        else:
            continue
        check(q, model, f"{label}: {'; '.join(history[-6:])}", blocks)


def _pool_state(pool):
    """Everything a call may change: queue order, ref counts, hashes and the cache map."""
    return (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        {h: sorted(m) for h, m in pool.cached_block_hash_to_block.items()},
    )


def check_free_queue_examples(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    blocks = [KVCacheBlock(i) for i in range(6)]
    q = run(FreeQueue, (blocks,), name="FreeQueue")
    check(q, [0, 1, 2, 3, 4, 5], "FreeQueue(blocks 0..5) (the given __init__ appends each block)", blocks)

    got = run(q.popleft, name="popleft")
    if got is not blocks[0]:
        extra = " (that is the tail: popleft takes the head)" if got is blocks[5] else ""
        fail(f"popleft() on the queue [0, 1, 2, 3, 4, 5] returned {got!r}, expected block 0{extra}")
    check(q, [1, 2, 3, 4, 5], "popleft()", blocks)
    run(q.remove, (blocks[3],), name="remove")
    check(q, [1, 2, 4, 5], "remove(block 3) from [1, 2, 3, 4, 5]", blocks)
    run(q.append, (blocks[0],), name="append")
    check(q, [1, 2, 4, 5, 0], "append(block 0) to [1, 2, 4, 5]", blocks)
    run(q.appendleft, (blocks[3],), name="appendleft")
    check(q, [3, 1, 2, 4, 5, 0], "appendleft(block 3) to [1, 2, 4, 5, 0]", blocks)
    run(q.remove, (blocks[3],), name="remove")
    check(q, [1, 2, 4, 5, 0], "remove(block 3), the head, from [3, 1, 2, 4, 5, 0]", blocks)
    run(q.remove, (blocks[0],), name="remove")
    check(q, [1, 2, 4, 5], "remove(block 0), the tail, from [1, 2, 4, 5, 0]", blocks)
    for want in (1, 2, 4, 5):
        got = run(q.popleft, name="popleft")
        if got is not blocks[want]:
            fail(f"popleft() returned {got!r}, expected block {want}")
    check(q, [], "popping every block", blocks)
    expect_raises(ValueError, q.popleft, (), name="popleft", why="the queue is empty")
    check(q, [], "popleft() on an empty queue (which must raise ValueError and change nothing)", blocks)
    run(q.appendleft, (blocks[2],), name="appendleft")
    check(q, [2], "appendleft(block 2) to an empty queue", blocks)
    run(q.append, (blocks[4],), name="append")
    check(q, [2, 4], "append(block 4) to [2]", blocks)
    expect_raises(ValueError, q.remove, (blocks[1],), name="remove", why="block 1 is not in the queue")
    expect_raises(ValueError, q.append, (blocks[2],), name="append", why="block 2 is already in the queue")
    expect_raises(ValueError, q.appendleft, (blocks[4],), name="appendleft", why="block 4 is already in the queue")
    check(q, [2, 4], "the refused calls above (which must change nothing)", blocks)


def check_free_queue_random(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    rng = random.Random(2002)
    for case in range(100):  # small queues first, so the first failure reported is a small one
        _free_queue_random_run(FreeQueue, rng, n_blocks=1 + case // 8, n_ops=25, label=f"random case {case}")


def check_free_queue_hidden(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    rng = random.Random(918273)
    # (sized for the sandboxed grader, where every call and attribute read is a round trip to the learner's process)
    for case in range(20):
        _free_queue_random_run(FreeQueue, rng, n_blocks=rng.choice([1, 2, 3, 40, 120]), n_ops=120,
                               label=f"hidden random case {case}")
    # Every refused call leaves the queue exactly as it was.
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = run(FreeQueue, (blocks[:2],), name="FreeQueue")
    for meth, arg, why in [("append", blocks[0], "block 0 is already in the queue"),
                           ("appendleft", blocks[1], "block 1 is already in the queue"),
                           ("remove", blocks[3], "block 3 is not in the queue")]:
        expect_raises(ValueError, getattr(q, meth), (arg,), name=meth, why=why)
        check(q, [0, 1], f"{meth}(block {arg.block_id}), refused (it must change nothing)", blocks)
    run(q.popleft, name="popleft")
    run(q.popleft, name="popleft")
    expect_raises(ValueError, q.popleft, (), name="popleft", why="the queue is empty")
    check(q, [], "popleft() on an empty queue", blocks)


def check_free_queue_in_the_block_pool(FreeQueue):
    require_function(FreeQueue, "FreeQueue")

    # Your queue inside the library's BlockPool: allocations pop it, frees append to either end, cache hits
    # remove from the middle. A model list says what the order must be after every step.
    rng = random.Random(5150)
    for case in range(20):
        n = rng.choice([4, 9, 33])
        pool = BlockPool(n)
        free = pool.free_block_queue.get_all_free_blocks()
        for b in free:
            b.prev_free_block = b.next_free_block = None
        pool.free_block_queue = run(FreeQueue, (free,), name="FreeQueue")
        model = [b.block_id for b in free]
        held = []  # lists of blocks, one per holder
        hashes = 0
        for step in range(120):
            op = rng.choice(["alloc", "alloc", "free", "cache", "hit"])
            if op == "alloc":
                k = rng.randrange(0, 4)
                if k > len(model):
                    continue
                got = run(pool.get_new_blocks, (k,), name="BlockPool.get_new_blocks")
                want, model = model[:k], model[k:]
                if [b.block_id for b in got] != want:
                    fail(f"in a BlockPool, case {case} step {step}: get_new_blocks({k}) gave blocks "
                         f"{[b.block_id for b in got]}, expected {want} (the first {k} of your queue)")
                held.append(got)
            elif op == "free" and held:
                blocks = held.pop(rng.randrange(len(held)))
                order = list(reversed(blocks))
                run(pool.free_blocks, (order,), name="BlockPool.free_blocks")
                back = [b for b in order if b.ref_cnt == 0]
                model = [b.block_id for b in back if b.block_hash is None] + model
                model += [b.block_id for b in back if b.block_hash is not None]
            elif op == "cache" and any(held):
                b = rng.choice(rng.choice([h for h in held if h]))
                if b.block_hash is None:
                    hashes += 1
                    b.block_hash = hashes
                    pool.cached_block_hash_to_block.setdefault(hashes, {})[b.block_id] = b
            elif op == "hit":
                cached = [i for i in model if pool.blocks[i].block_hash is not None]
                if not cached:
                    continue
                b = pool.blocks[rng.choice(cached)]
                run(pool.touch, ([b],), name="BlockPool.touch")
                model.remove(b.block_id)
                held.append([b])
            else:
                continue
            check(pool.free_block_queue, model, f"case {case}, step {step} ({op}) in a BlockPool using your queue",
                  pool.blocks[1:])


def check_get_new_blocks_alone(get_new_blocks):
    require_function(get_new_blocks, "get_new_blocks")
    # Allocation alone: the pool's own free_blocks (the library's) puts blocks back where needed.
    pool = BlockPool(8)
    got = run(get_new_blocks, (pool, 3), name="get_new_blocks")
    if not isinstance(got, list) or [getattr(b, "block_id", None) for b in got] != [1, 2, 3]:
        fail(f"get_new_blocks(pool, 3) on a fresh pool of 8 returned {describe(got)}, expected blocks [1, 2, 3] "
             "(the head of the free queue, in order; block 0 is the null block and is never free)"
             + (f". {STUB_NOTE}" if got is None else ""))
    if [b.ref_cnt for b in got] != [1, 1, 1]:
        fail(f"after get_new_blocks(pool, 3) the blocks' ref_cnt are {[b.ref_cnt for b in got]}, expected [1, 1, 1]")
    if queue(pool) != [4, 5, 6, 7]:
        fail(f"after get_new_blocks(pool, 3) the free queue is {queue(pool)}, expected [4, 5, 6, 7]")
    empty = run(get_new_blocks, (pool, 0), name="get_new_blocks")
    if empty != []:
        fail(f"get_new_blocks(pool, 0) returned {describe(empty)}, expected []")
    # A free block that still holds a cached prefix is evicted when it is popped for reuse.
    cache(pool, pool.blocks[4], 12345)
    got = run(get_new_blocks, (pool, 2), name="get_new_blocks")
    if [getattr(b, "block_id", None) for b in got or []] != [4, 5]:
        fail(f"get_new_blocks(pool, 2) on the free queue [4, 5, 6, 7] returned {describe(got)}, expected blocks [4, 5]")
    if pool.blocks[4].block_hash is not None or pool.cached_block_hash_to_block:
        fail("block 4 held a cached prefix and was popped for reuse, but it was not evicted (its block_hash is "
             f"{pool.blocks[4].block_hash!r}, the cache map {describe(pool.cached_block_hash_to_block)}): call "
             "evict_if_cached(pool, block) on every block you pop")
    # Refusals change nothing.
    pool = BlockPool(6)
    run(get_new_blocks, (pool, 2), name="get_new_blocks")
    cache(pool, pool.blocks[5], 777)  # a free block holding a cached prefix
    before = _pool_state(pool)
    for n in (4, 5, 100):  # 3 are free
        try:
            got = get_new_blocks(pool, n)
        except ValueError:
            got = "ValueError"
        except Exception as exc:
            fail(f"get_new_blocks(pool, {n}) with 3 free blocks raised {type(exc).__name__}: {exc}, "
                 "expected ValueError")
        after = _pool_state(pool)
        if after != before:
            fail(f"get_new_blocks(pool, {n}) with only 3 blocks free changed the pool: {diff(before, after)}. "
                 "Check the free count before popping anything: a failed call must change nothing")
        if got != "ValueError":
            fail(f"get_new_blocks(pool, {n}) with only 3 blocks free returned {describe(got)}, expected ValueError")
    expect_raises(ValueError, get_new_blocks, (pool, -1), name="get_new_blocks", why="a negative count")
    if _pool_state(pool) != before:
        fail(f"get_new_blocks(pool, -1) changed the pool: {diff(before, _pool_state(pool))}")


def check_free_blocks_alone(free_blocks):
    require_function(free_blocks, "free_blocks")

    # Freeing alone: the blocks are handed out by the pool's own get_new_blocks (the library's).
    pool = BlockPool(8)
    b1, b2, b3 = pool.get_new_blocks(3)
    cache(pool, b2, 12345)
    given = [b3, b2, b1]
    run(free_blocks, (pool, given), name="free_blocks")
    want = [3, 1, 4, 5, 6, 7, 2]
    if queue(pool) != want:
        fail(f"queue [4, 5, 6, 7], blocks 1, 2, 3 held once, block 2 cached: after free_blocks(pool, [3, 2, 1]) the "
             f"free queue is {queue(pool)}, expected {want}." + (
                 " Is free_blocks still the stub (...)? Nothing came back to the queue" if queue(pool) == [4, 5, 6, 7]
                 else free_hint(queue(pool), given)))
    if [b.ref_cnt for b in pool.blocks] != [0] * 8:
        fail(f"after freeing every block the ref counts are {[b.ref_cnt for b in pool.blocks]}, expected all 0")
    # A block held twice (shared) returns only when its last holder frees it.
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt += 1  # a second holder
    run(free_blocks, (pool, [b]), name="free_blocks")
    if b.ref_cnt != 1 or 1 in queue(pool):
        fail(f"a block held twice, freed once, must stay held with ref_cnt 1; got ref_cnt {b.ref_cnt} and free "
             f"queue {queue(pool)}")
    run(free_blocks, (pool, [b]), name="free_blocks")
    if b.ref_cnt != 0 or queue(pool) != [1, 2, 3]:
        fail(f"freed by its last holder, block 1 must return to the head: ref_cnt {b.ref_cnt}, queue {queue(pool)}")


def check_free_blocks_refuses_without_change(free_blocks):
    require_function(free_blocks, "free_blocks")

    pool = BlockPool(6)
    held = pool.get_new_blocks(2)
    cache(pool, pool.blocks[5], 777)  # a free block holding a cached prefix
    before = _pool_state(pool)
    free_one = pool.blocks[4]
    for args, why in [
        ([free_one], "block 4 is free (ref_cnt 0): freeing it again"),
        ([held[0], held[0]], "block 1 is held once but freed twice in one call"),
        ([held[1], held[0], free_one], "the last block is free; nothing may change, not even blocks 2 and 1"),
        ([pool.blocks[0]], "block 0 is the null block"),
    ]:
        try:
            expect_raises(ValueError, free_blocks, (pool, args), name="free_blocks", why=why)
        except AssertionError as exc:  # the pool by what it holds, not as <BlockPool object>
            fail(str(exc).replace(describe(pool), "pool (6 blocks: 1 and 2 held once, 3 to 5 free, 5 cached)", 1))
        after = _pool_state(pool)
        if after != before:
            fail(f"free_blocks refused {[b.block_id for b in args]} ({why}) but changed the pool first: "
                 f"{diff(before, after)}. Check every block before changing any")


def _pool_state_machine(get_new_blocks, free_blocks, seed, cases, steps, sizes, label):
    """Random operation sequences against a model; the invariants are checked after every step."""
    require_function(get_new_blocks, "get_new_blocks")
    require_function(free_blocks, "free_blocks")
    rng = random.Random(seed)
    for case in range(cases):
        n = rng.choice(sizes)
        pool = BlockPool(n)
        model = list(range(1, n))  # free queue, head first
        holders = []  # each holder: the blocks it holds, in table order
        next_hash = 0
        log = []
        for step in range(steps):
            op = rng.choice(["alloc", "alloc", "free", "free", "share", "cache", "hit", "bad_alloc", "bad_free"])
            before = _pool_state(pool)
            if op == "alloc":
                k = rng.randrange(0, 5)
                if k > len(model):
                    continue
                got = run(get_new_blocks, (pool, k), name="get_new_blocks")
                want = model[:k]
                if [getattr(b, "block_id", None) for b in (got or [])] != want or not isinstance(got, list):
                    fail(f"{label} case {case} step {step}: get_new_blocks(pool, {k}) with free queue "
                         f"{model} returned {describe(got)}, expected blocks {want}")
                model = model[k:]
                holders.append(got)
                log.append(f"get_new_blocks({k}) -> {want}")
                for b in got:
                    cached = pool.cached_block_hash_to_block.values()
                    if b.block_hash is not None or any(b.block_id in m for m in cached):
                        fail(f"{label} case {case} step {step}: block {b.block_id} held a cached prefix and was "
                             "popped by get_new_blocks, but it was not evicted (hash still set or still in "
                             "the cache map): call evict_if_cached(pool, block) on every block you pop")
            elif op == "free" and holders:
                blocks = holders.pop(rng.randrange(len(holders)))
                order = list(reversed(blocks))
                run(free_blocks, (pool, order), name="free_blocks")
                counts = {}
                for b in order:
                    counts[b.block_id] = counts.get(b.block_id, 0) + 1
                remaining = {b.block_id for h in holders for b in h}
                back = []
                for b in order:
                    if b.block_id not in remaining and b.block_id not in [x.block_id for x in back]:
                        back.append(b)
                model = [b.block_id for b in back if b.block_hash is None] + model
                model += [b.block_id for b in back if b.block_hash is not None]
                log.append(f"free_blocks({[b.block_id for b in order]})")
            elif op == "share" and holders:
                blocks = list(rng.choice(holders))
                pool.touch(blocks)
                holders.append(blocks)
                log.append(f"share {[b.block_id for b in blocks]}")
            elif op == "cache" and holders:
                nonempty = [h for h in holders if h]
                if not nonempty:
                    continue
                b = rng.choice(rng.choice(nonempty))
                if b.block_hash is not None:
                    continue
                next_hash += 1
                cache(pool, b, next_hash)
                log.append(f"cache block {b.block_id}")
            elif op == "hit":
                cached = [i for i in model if pool.blocks[i].block_hash is not None]
                if not cached:
                    continue
                b = pool.blocks[rng.choice(cached)]
                pool.touch([b])
                model.remove(b.block_id)
                holders.append([b])
                log.append(f"cache hit on free block {b.block_id}")
            elif op == "bad_alloc":
                k = len(model) + rng.randrange(1, 3)
                try:
                    get_new_blocks(pool, k)
                except ValueError:
                    pass
                except Exception as exc:
                    fail(f"{label} case {case} step {step}: get_new_blocks(pool, {k}) with {len(model)} free "
                         f"raised {type(exc).__name__}: {exc}, expected ValueError")
                else:
                    fail(f"{label} case {case} step {step}: get_new_blocks(pool, {k}) with {len(model)} free "
                         "returned instead of raising ValueError")
                if _pool_state(pool) != before:
                    fail(f"{label} case {case} step {step}: the refused get_new_blocks(pool, {k}) changed the "
                         f"pool: {diff(before, _pool_state(pool))}")
                continue
            elif op == "bad_free" and model:
                b = pool.blocks[rng.choice(model)]
                try:
                    free_blocks(pool, [b])
                except ValueError:
                    pass
                except Exception as exc:
                    fail(f"{label} case {case} step {step}: free_blocks(pool, [block {b.block_id}]) on a free "
                         f"block raised {type(exc).__name__}: {exc}, expected ValueError")
                else:
                    fail(f"{label} case {case} step {step}: free_blocks(pool, [block {b.block_id}]) on a free "
                         "block (ref_cnt 0) returned instead of raising ValueError")
                if _pool_state(pool) != before:
                    fail(f"{label} case {case} step {step}: the refused free_blocks changed the pool: "
                         f"{diff(before, _pool_state(pool))}")
                continue
            else:
                continue
            where = f"{label} case {case}, after {'; '.join(log[-5:])}"
            q = queue(pool)
            if q != model:
                hint = ""
                if sorted(q) == sorted(model):
                    hint = (" (the right blocks in the wrong order: uncached blocks go to the head as a group in "
                            "the order given; cached blocks to the tail)")
                fail(f"{where}: the free queue is {q}, expected {model}{hint}")
            holds = {}
            for h in holders:
                for b in h:
                    holds[b.block_id] = holds.get(b.block_id, 0) + 1
            for b in pool.blocks[1:]:
                want_ref = holds.get(b.block_id, 0)
                if b.ref_cnt != want_ref:
                    fail(f"{where}: block {b.block_id} has ref_cnt {b.ref_cnt}, but {want_ref} holder(s) hold it")
                if (b.block_id in model) != (want_ref == 0):
                    fail(f"{where}: block {b.block_id} is {'free' if b.block_id in model else 'held'} with "
                         f"{want_ref} holder(s)")
            if len(q) + len(holds) != n - 1:
                fail(f"{where}: {len(q)} free + {len(holds)} held blocks != num_blocks - 1 = {n - 1}")
            for h, m in pool.cached_block_hash_to_block.items():
                for bid, b in m.items():
                    if b.block_hash != h:
                        fail(f"{where}: block {bid} is in the cache map under {h} but its hash is "
                             f"{b.block_hash!r}: a popped cached block must be evicted (evict_if_cached)")


def check_pool_state_machine(get_new_blocks, free_blocks):
    _pool_state_machine(get_new_blocks, free_blocks, seed=42, cases=40, steps=60, sizes=[2, 5, 12], label="random")


def check_pool_state_machine_hidden(get_new_blocks, free_blocks):
    _pool_state_machine(get_new_blocks, free_blocks, seed=60606, cases=40, steps=250, sizes=[3, 17, 64],
                        label="hidden random")


def _allocate_slots_grow(allocate_slots):
    """grow(manager, req, computed, new, label): the learner's allocate_slots, checked against the model."""
    require_function(allocate_slots, "allocate_slots")

    def state(manager):
        pool = manager.block_pool
        return (tables(manager), [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
                [b.ref_cnt for b in pool.blocks])

    def grow(manager, req, computed, new, label):
        """allocate_slots(manager, req, new) at `computed` computed tokens, checked against the model."""
        req.num_computed_tokens = computed
        bs = manager.block_size
        table = [b.block_id for b in manager.req_to_blocks.get(req.request_id, [])]
        need = -(-(computed + new) // bs)
        missing = max(0, need - len(table))
        free = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
        before = state(manager)
        call = (f"{label}: allocate_slots(manager, request {req.request_id!r}, {new}) at {computed} computed tokens "
                f"(block_size {bs}, table of {len(table)} blocks, {len(free)} free)")
        try:
            got = run(allocate_slots, (manager, req, new), name="allocate_slots")
        except AssertionError as exc:
            if missing <= len(free):
                raise
            text = str(exc)
            text = text[text.find(" raised "):] if " raised " in text else f": {text}"
            fail(f"{call}{text}. Hint: {missing} block(s) are missing and only {len(free)} free: all or nothing, "
                 "so return None (before taking any block) instead of asking the pool for more than it has")
        if missing > len(free):
            if got is not None:
                fail(f"{call} returned {describe(got)}, expected None: {missing} more block(s) needed, "
                     f"{len(free)} free")
            if state(manager) != before:
                fail(f"{call} returned None but changed the manager first (tables {tables(manager)}, was {before[0]}):"
                     " check the free count before taking any block")
            return None
        if got is None:
            hint = f". {STUB_NOTE}"
            if table and need > len(free) >= missing:
                hint = (f". Hint: the table already has {len(table)} block(s), so only {missing} are missing "
                        f"(not {need}), and {len(free)} are free")
            fail(f"{call} returned None, expected {missing} new block(s): {len(free)} are free{hint}")
        if not isinstance(got, list):
            fail(f"{call} returned {describe(got)}, expected a list of the new blocks")
        got_ids = [getattr(b, "block_id", None) for b in got]
        now = [b.block_id for b in manager.req_to_blocks.get(req.request_id, [])]
        if len(now) != len(table) + missing:
            hint = ""
            if len(now) == (computed + new) // bs and (computed + new) % bs:
                hint = (f" Hint: {computed + new} tokens in blocks of {bs} need ceil({computed + new} / {bs}) = {need}"
                        " blocks: round up, the last block may be partly filled")
            elif len(now) == len(table) + need:
                hint = (f" Hint: the table already had {len(table)} block(s); only {missing} more "
                        f"{'is' if missing == 1 else 'are'} needed, not {need}")
            fail(f"{call}: the table now has {len(now)} blocks ({now}), expected {len(table) + missing} "
                 f"for {computed + new} tokens.{hint}")
        if now != table + free[:missing]:
            fail(f"{call}: the table is {now}, expected {table + free[:missing]} (the old table, then the blocks "
                 "popped from the head of the free queue)")
        if got_ids != free[:missing]:
            fail(f"{call} returned blocks {got_ids}, expected the new blocks {free[:missing]}")
        return got

    return grow


def _allocate_slots_lifecycle(allocate_slots, seed, cases, label, sizes, block_sizes):
    """Requests admitted, grown by prefill chunks and decode steps, and finished, in random order."""
    grow = _allocate_slots_grow(allocate_slots)
    rng = random.Random(seed)
    for case in range(cases):
        bs = rng.choice(block_sizes)
        n = rng.choice(sizes)
        manager = KVCacheManager(num_blocks=n, block_size=bs, enable_caching=False)
        live = {}  # request id -> request
        for step in range(60):
            op = rng.choice(["new", "grow", "grow", "grow", "finish"])
            if op == "new":
                rid = f"r{case}.{step}"
                req = Request(rid, [1] * rng.randrange(1, 4 * bs))
                # the whole prompt or a chunk
                first = rng.choice([req.num_tokens, rng.randrange(1, req.num_tokens + 1)])
                if grow(manager, req, 0, first, f"{label} case {case}") is not None:
                    live[rid] = req
            elif op == "grow" and live:
                rid = rng.choice(sorted(live))
                req = live[rid]
                table = len(manager.req_to_blocks.get(rid, []))
                computed = rng.randrange(max(0, table * bs - bs), table * bs + 1)
                new = rng.choice([1, 1, 1, rng.randrange(0, 3 * bs)])
                grow(manager, req, computed, new, f"{label} case {case}")
            elif op == "finish" and live:
                rid = rng.choice(sorted(live))
                req = live.pop(rid)
                if rid in manager.req_to_blocks:
                    manager.free(req)
            pool = manager.block_pool
            held = [b.block_id for t in manager.req_to_blocks.values() for b in t]
            if len(held) != len(set(held)):
                fail(f"{label} case {case} step {step}: a block is in two tables at once: {tables(manager)}")
            if pool.get_num_free_blocks() + len(held) != n - 1:
                fail(f"{label} case {case} step {step}: {pool.get_num_free_blocks()} free + {len(held)} held "
                     f"!= num_blocks - 1 = {n - 1}")
            for b in pool.blocks[1:]:
                if b.ref_cnt != (1 if b.block_id in held else 0):
                    fail(f"{label} case {case} step {step}: block {b.block_id} has ref_cnt {b.ref_cnt}")



def check_allocate_slots_examples(allocate_slots):
    grow = _allocate_slots_grow(allocate_slots)

    manager = KVCacheManager(num_blocks=6, block_size=16, enable_caching=False)
    a = Request("A", list(range(17)))
    grow(manager, a, 0, 17, "a 17-token prompt")
    grow(manager, a, 17, 15, "prompt then 15 decode tokens, 32 in all")
    grow(manager, a, 32, 1, "the 33rd token crosses into a third block")
    grow(manager, a, 33, 1, "the 34th token fits in the third block")
    grow(manager, a, 34, 0, "no new tokens")
    b = Request("B", list(range(40)))
    grow(manager, b, 0, 40, "a 40-token prompt with 2 blocks free: short by one")
    grow(manager, b, 0, 32, "a 32-token chunk of it: exactly 2 blocks")
    grow(manager, b, 32, 8, "the rest of the prompt with no block free")
    manager.free(a)
    grow(manager, b, 32, 8, "the rest once A has finished and freed its 3 blocks")
    expect_raises(ValueError, allocate_slots, (manager, b, -1), name="allocate_slots", why="a negative token count")

def check_allocate_slots_random(allocate_slots):
    _allocate_slots_lifecycle(allocate_slots, seed=77, cases=40, label="random", sizes=[3, 6, 20],
                              block_sizes=[1, 2, 4, 16])


def check_allocate_slots_hidden(allocate_slots):
    _allocate_slots_lifecycle(allocate_slots, seed=31415, cases=30, label="hidden random", sizes=[2, 9, 50],
                              block_sizes=[1, 3, 8, 16, 32])


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
    for table, positions, bs in cases:
        expect_equal(slot_mapping, (list(table), list(positions), bs), reference(table, positions, bs),
                     hint=hint(table, positions, bs), timeout=2)
    expect_equal(slot_mapping, ([4, 1], range(3, 6), 4), [19, 4, 5], hint="positions may be a range", timeout=2)
    expect_raises(ValueError, slot_mapping, ([7, 2], [8], 4), why="position 8 is past the 8 slots of the table",
                  timeout=2)
    expect_raises(ValueError, slot_mapping, ([7, 2], [-1], 4), why="a negative position", timeout=2)
    expect_raises(ValueError, slot_mapping, ([], [0], 16), why="an empty table has no slots", timeout=2)


def check_slot_mapping_hidden(slot_mapping):
    require_function(slot_mapping, "slot_mapping")

    rng = random.Random(271828)
    for _ in range(300):
        bs = rng.choice([1, 2, 3, 8, 16, 32, 128])
        table = rng.sample(range(1, 5000), rng.randrange(1, 12))
        cap = len(table) * bs
        positions = [rng.randrange(cap) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.3:
            start = rng.randrange(cap)
            positions = list(range(start, min(cap, start + rng.randrange(1, 3 * bs))))
        expect_equal(slot_mapping, (list(table), list(positions), bs), reference(table, positions, bs),
                     hint=hint(table, positions, bs), timeout=2)
    expect_raises(ValueError, slot_mapping, ([3, 4, 5], [0, 47, 48], 16), why="position 48 is past the table",
                  timeout=2)
    expect_raises(ValueError, slot_mapping, ([3], [0], 0), why="block_size 0", timeout=2)
