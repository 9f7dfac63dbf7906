"""Checks for lesson 3's exercises (``grading/source/03_prefix_caching.ipynb``): the hash chain, the prefix
lookup and caching of full blocks, eviction on reuse with the free queue's order, and copy-on-write.

Each ``check_*`` function is one test case of the set: the source's test cell calls it with the learner's
objects (looked up by name in the notebook). The checks drive the learner's code on the library's pool and
manager, step by step against vLLM's rules, and fail (``pagedkv.grading.checks.fail``) with a message that
names the request, the block and the rule.
"""

from __future__ import annotations

import random
import types

from pagedkv import BlockPool, KVCacheManager, Request
from pagedkv.grading.checks import STUB_NOTE, CallTimeout, describe, fail, require_function, run, time_limit
from pagedkv.kv_cache_utils import NONE_HASH, builtin_hash, hash_request_tokens, sha256_hash, short_hash
from pagedkv.shadow import ShadowKVCache

__all__ = [
    "check_cache_only_full_blocks",
    "check_cow_hidden",
    "check_cow_only_what_is_written",
    "check_cow_parallel_sampling",
    "check_eviction_hidden",
    "check_eviction_with_the_manager",
    "check_free_blocks_bad_input",
    "check_free_blocks_order",
    "check_get_new_blocks_evicts_on_reuse",
    "check_hash_chain_examples",
    "check_hash_chain_hidden",
    "check_hash_chain_is_a_chain",
    "check_lookup_examples",
    "check_lookup_outputs_and_stats",
    "check_prefix_lookup_hidden",
    "check_reads",
]


def label(tokens, bs, fn, extra):
    return (f"hash_chain({len(tokens)} tokens {describe(list(tokens[:4]), 40)[:-1]}, ...], "
            f"{bs}, {fn.__name__}, extra_keys={extra!r})")


def shorts(hashes):
    return [short_hash(h) if isinstance(h, (int, bytes)) else describe(h, 20) for h in hashes]


def ids(blocks):
    return [getattr(b, "block_id", b) for b in blocks]


def cached_state(m):
    """Each table entry that is cached, as {(request, index): block id}; and the map, as {hash: ids}."""
    pool = m.block_pool
    table = {(rid, i): b.block_id for rid, bl in m.req_to_blocks.items() for i, b in enumerate(bl)
             if b.block_hash is not None}
    mapping = {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items() if d}
    return table, mapping


def expect_cached(m, r, want_full, what):
    """The first want_full blocks of r's table are cached with r's hashes; the rest are not."""
    table = m.req_to_blocks[r.request_id]
    hashes = r.block_hashes
    for i, b in enumerate(table):
        if i < want_full:
            if b.block_hash is None:
                nothing = not m.num_cached_block and all(x.block_hash is None for x in m.block_pool.blocks)
                fail(f"after {what}, block {b.block_id} (index {i} of the table of {r.request_id!r}, tokens "
                     f"{i * m.block_size}-{(i + 1) * m.block_size - 1}) is full but not cached"
                     + (". Nothing is cached at all: is _cache_blocks still the stub (...)?" if nothing else ""))
            if i >= len(hashes) or b.block_hash != hashes[i]:
                fail(f"after {what}, block {b.block_id} (index {i}) is cached under the wrong hash: it must be "
                     f"request.block_hashes[{i}]")
            if m.block_pool.get_cached_block(b.block_hash) is None:
                fail(f"after {what}, block {b.block_id} has a hash but the pool's map does not find it: use "
                     "self.block_pool.cache_full_blocks, which does both")
        elif b.block_hash is not None:
            start = i * m.block_size
            fail(f"after {what}, block {b.block_id} (index {i} of the table of {r.request_id!r}, tokens from {start}) "
                 f"is cached but it is not full (only the first {want_full} are): only full blocks are "
                 "cached, a partly filled block's tokens (and KV) are not final")
    got = m.num_cached_block.get(r.request_id, 0)
    if got != want_full:
        fail(f"after {what}, num_cached_block[{r.request_id!r}] is {got}, expected {want_full}: once the blocks "
             "are cached, record their count (self.num_cached_block[request_id] = the number of full blocks)")


def queue(pool):
    return [b.block_id for b in pool.free_block_queue]


def cache(pool, block, h):
    """Enter a held block in the prefix cache under hash h (what cache_full_blocks does)."""
    block.block_hash = h
    pool.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block


def state(pool):
    return (queue(pool), [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()}, pool.num_evictions)


def diff(mine, ref):
    names = ["free queue (head to tail)", "ref_cnt of blocks 0..", "block hashes", "cached_block_hash_to_block",
             "num_evictions"]
    for nm, a, b in zip(names, mine, ref, strict=True):
        if a != b:
            return f"{nm} is {describe(a, 200)}, expected {describe(b, 200)}"
    return None


def check_reads(w, what):
    for rid, r in w.reqs.items():
        if rid not in w.m.req_to_blocks:
            continue
        got, want = w.read(rid), r.all_token_ids[: r.num_computed_tokens]
        if got != want:
            pos = next(i for i, (g, x) in enumerate(zip(got, want, strict=False)) if g != x)
            bs = w.m.block_size
            block = w.m.get_block_ids(rid)[pos // bs]
            holders = [o for o, t in w.m.req_to_blocks.items() if any(b.block_id == block for b in t)]
            fail(f"{what}: {rid!r} reads back token {got[pos]} at position {pos}, but its own token there is "
                 f"{want[pos]} (block {block}, now held by {holders}). A branch wrote into a block it shared "
                 "(ref_cnt > 1) in place, or a copy was lost: the writer must get a private copy first, put it in "
                 "its table in place of the shared block, and record the copy in manager.pending_copies")


def _expect_chain(hash_chain, tokens, bs, fn=builtin_hash, extra=None, hint=True):
    """Call the learner's hash_chain and compare with the library's chain of the same tokens.

    Hashes made with ``builtin_hash`` differ from process to process (Python's hash of None and of strings), so
    when the learner's function runs in another process (the sandboxed grader hands a proxy, not a function),
    those are checked for their shape only (one int per full block), and the chain's properties by the cases
    that compare the learner's own results; ``sha256_hash`` results are compared exactly everywhere."""
    if fn is builtin_hash and not isinstance(hash_chain, types.FunctionType):
        got = run(hash_chain, (tokens, bs, fn, extra), name="hash_chain")
        n_full = len(tokens) // bs
        if got is None:
            fail(f"{label(tokens, bs, fn, extra)} returned None. {STUB_NOTE}")
        if not isinstance(got, list) or not all(isinstance(h, int) for h in got):
            fail(f"{label(tokens, bs, fn, extra)} returned {describe(got)}, expected a list of int hashes")
        if len(got) != n_full:
            fail(f"{label(tokens, bs, fn, extra)} returned {len(got)} hashes, expected {n_full}: {len(tokens)} tokens "
                 f"fill {n_full} blocks of {bs}, and only full blocks are hashed")
        return got
    want = hash_request_tokens(fn, bs, list(tokens), extra)
    got = run(hash_chain, (list(tokens) if isinstance(tokens, list) else tokens, bs, fn, extra), name="hash_chain")
    if got is None:
        fail(f"{label(tokens, bs, fn, extra)} returned None. {STUB_NOTE}")
    if not isinstance(got, list):
        fail(f"{label(tokens, bs, fn, extra)} returned a {type(got).__name__}, expected a list of hashes")
    if got == want:
        return got
    msg = (f"{label(tokens, bs, fn, extra)} returned {len(got)} hashes {shorts(got)}, expected {len(want)} "
           f"{shorts(want)}")
    n_full = len(tokens) // bs
    if hint and len(got) > n_full and len(got) == -(-len(tokens) // bs):
        msg += (f". {len(tokens)} tokens fill {n_full} blocks of {bs} and leave {len(tokens) % bs} over: "
                "a partly filled block is never hashed (its tokens, and so its KV, are not final)")
    elif hint and len(got) == n_full:
        blocks = [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n_full)]
        if got == [fn((NONE_HASH, blk, extra)) for blk in blocks]:
            msg += (". Every block was hashed with NONE_HASH as its parent: block i's parent is the hash of "
                    "block i - 1 (the previous one in the chain); NONE_HASH is only block 0's parent")
        elif got and got[0] == fn((blocks[0], NONE_HASH, extra)):
            msg += ". Hash the tuple in the order (parent_hash, tuple(block_tokens), extra_keys): parent first"
        elif got and got[0] == fn((None, blocks[0], extra)):
            msg += ". Block 0's parent is NONE_HASH (the fixed seed), not None"
        elif got and got[0] == fn((NONE_HASH, blocks[0], None)) and extra is not None:
            msg += ". extra_keys is part of every block's key: hash (parent, tokens, extra_keys)"
        elif got and got[0] == fn((NONE_HASH, blocks[0])):
            msg += ". Hash the 3-tuple (parent_hash, tuple(block_tokens), extra_keys), extra_keys included"
    fail(msg)


def check_hash_chain_examples(hash_chain):
    require_function(hash_chain, "hash_chain")

    toks = list(range(100, 140))
    _expect_chain(hash_chain, toks, 16)  # 2 full blocks, 8 tokens over
    _expect_chain(hash_chain, toks[:32], 16)  # exactly 2 blocks
    _expect_chain(hash_chain, toks[:15], 16)  # no full block: no hash
    _expect_chain(hash_chain, [], 16)
    _expect_chain(hash_chain, toks[:16], 16)
    _expect_chain(hash_chain, toks, 4)
    _expect_chain(hash_chain, toks, 1)
    _expect_chain(hash_chain, toks, 16, sha256_hash)
    _expect_chain(hash_chain, toks, 8, builtin_hash, ("salt", "tenant-a"))
    _expect_chain(hash_chain, tuple(toks), 16)  # a tuple of tokens works as a list does
    for bs in (16, 4, 1):  # the same chains with a hash that is the same in every process
        _expect_chain(hash_chain, toks, bs, sha256_hash)
    _expect_chain(hash_chain, toks, 8, sha256_hash, ("salt", "tenant-a"))
    try:
        hash_chain(toks, 0)
    except ValueError:
        pass
    except Exception as exc:  # noqa: BLE001
        fail(f"hash_chain(..., block_size=0) raised {type(exc).__name__}, expected ValueError")
    else:
        fail("hash_chain(..., block_size=0) returned, expected it to raise ValueError")


def check_hash_chain_is_a_chain(hash_chain):
    require_function(hash_chain, "hash_chain")

    rng = random.Random(5)
    x = [rng.randrange(32000) for _ in range(16)]
    y = [rng.randrange(32000) for _ in range(16)]
    z = [rng.randrange(32000) for _ in range(16)]
    for fn in (builtin_hash, sha256_hash):
        xz = _expect_chain(hash_chain, x + z, 16, fn)
        yz = _expect_chain(hash_chain, y + z, 16, fn)
        if xz[1] == yz[1]:
            fail(f"with {fn.__name__}: the second blocks of x + z and y + z got the same hash although their "
                 "prefixes differ (x vs y): a block's hash must depend on its parent's hash")
        again = _expect_chain(hash_chain, x + z + [1, 2], 16, fn)
        if again != xz:
            fail(f"with {fn.__name__}: x + z and x + z + 2 more tokens must give the same 2 hashes (the same full "
                 f"blocks), got {shorts(xz)} and {shorts(again)}")
        salted = _expect_chain(hash_chain, x + z, 16, fn, ("salt", "tenant-b"))
        if salted[0] == xz[0] or salted[1] == xz[1]:
            fail(f"with {fn.__name__}: a different cache salt must change every block's hash: "
                 f"{shorts(xz)} without the salt, {shorts(salted)} with it")


def check_hash_chain_hidden(hash_chain):
    require_function(hash_chain, "hash_chain")

    rng = random.Random(314159)
    for _ in range(120):
        bs = rng.choice([1, 2, 3, 4, 8, 16, 32])
        n = rng.choice([0, bs - 1, bs, 2 * bs, 3 * bs + 1, rng.randrange(0, 300)])
        toks = [rng.randrange(50000) for _ in range(n)]
        fn = rng.choice([builtin_hash, sha256_hash])
        extra = rng.choice([None, ("salt", f"s{rng.randrange(9)}"), (("lora", rng.randrange(3)),)])
        _expect_chain(hash_chain, toks, bs, fn, extra)


def _learner_class(cls, name: str, base: type, methods: tuple[str, ...]):
    """The learner's class ``name``: defined, a subclass of ``base``, with its own ``methods``."""
    if cls is None:
        fail(f"{name} is not defined: run the cell that defines it (and the cells above) first")
    if not (isinstance(cls, type) and issubclass(cls, base)):
        fail(f"{name} should be a subclass of {base.__name__}, got {describe(cls)}")
    for meth in methods:
        if (getattr(getattr(cls, meth), "__module__", "") or "").startswith("pagedkv."):
            fail(f"{name}.{meth} is the library's: define it in your class")
    return cls


def _learner_manager(PrefixCachingKVCacheManager):
    """The learner's PrefixCachingKVCacheManager: defined, a KVCacheManager, with its own lookup and caching."""
    return _learner_class(PrefixCachingKVCacheManager, "PrefixCachingKVCacheManager", KVCacheManager,
                          ("get_computed_blocks", "_cache_blocks"))


def _make_manager(cls, *args, **kwargs):
    return run(cls, args, kwargs, name=cls.__name__)


def _attempt(fn, args, what):
    try:
        with time_limit(5, what):
            return fn(*args)
    except CallTimeout:
        fail(f"{what} did not return within 5 s: is there an infinite loop?")
    except Exception as exc:  # noqa: BLE001
        fail(f"{what} raised {type(exc).__name__}: {exc}")


def _lookup(m, r, what):
    """Your get_computed_blocks, as (block ids, tokens); the pool must not change."""
    before = m.snapshot()
    stats_before = (m.prefix_cache_stats.requests, m.prefix_cache_stats.queries, m.prefix_cache_stats.hits)
    got = _attempt(m.get_computed_blocks, (r,), f"get_computed_blocks({what})")
    if got is None:
        fail(f"get_computed_blocks({what}) returned None. {STUB_NOTE}")
    if not (isinstance(got, tuple) and len(got) == 2):
        fail(f"get_computed_blocks({what}) returned {describe(got)}, expected a tuple (blocks, "
             "num_computed_tokens)")
    blocks, n = got
    if not isinstance(blocks, list) or any(m.block_pool.blocks[getattr(b, "block_id", 0)] is not b for b in blocks):
        fail(f"get_computed_blocks({what}) returned {describe(blocks)} as its blocks: expected a list of the "
             "pool's KVCacheBlock objects (from self.block_pool.get_cached_block)")
    after = m.snapshot()
    for key in ("blocks", "free_queue", "block_tables"):
        if before[key] != after[key]:
            changed = ""
            if key == "blocks":
                for x, y in zip(before["blocks"], after["blocks"], strict=True):
                    if x != y:
                        what_changed = ", ".join(f"{k} {x[k]!r} -> {y[k]!r}" for k in x if x[k] != y.get(k))
                        changed = f" (block {x['block_id']}: {what_changed})"
                        break
            fail(f"get_computed_blocks({what}) changed the pool's {key}{changed}: a lookup only finds the "
                 "blocks; allocate_slots takes them (touch)")
    return ids(blocks), n, stats_before


def _expect_hit(m, r, want_ids, want_n, what, hint=None):
    got_ids, n, _ = _lookup(m, r, what)
    if (got_ids, n) != (want_ids, want_n):
        msg = (f"get_computed_blocks({what}) found blocks {got_ids} ({describe(n)} tokens), expected "
               f"{want_ids} ({want_n} tokens)")
        text = (hint(got_ids, n) if callable(hint) else hint) or _hit_hint(m, r, got_ids, n, want_ids)
        fail(msg + (f". {text}" if text else ""))


def _hit_hint(m, r, got_ids, n, want_ids):
    """The usual slips of a lookup, named when the result shows one (or ``None``)."""
    if got_ids == want_ids:
        return ("the blocks are right: num_computed_tokens is the tokens they hold, len(blocks) * block_size = "
                f"{len(got_ids)} * {m.block_size}")
    if len(got_ids) * m.block_size >= r.num_tokens:
        return ("the hit covers every token, but the last token must still be computed (its forward pass samples "
                "the next token): look at most at the first (num_tokens - 1) // block_size blocks")
    return None


def _allocate_caching(m, r, n, hits=None, what=""):
    label = what or f"allocate_slots({r.request_id!r}, {n})"
    try:
        return _attempt(m.allocate_slots, (r, n, hits), label)
    except AssertionError as exc:
        text = str(exc)
        if "IndexError" in text:
            text += (". Cache the blocks that are full once num_tokens tokens are computed: in a chunked "
                     "prefill that "
                     "is fewer than the request's tokens (and fewer than its table might suggest)")
        if "block hashes" in text:
            text += (". request.block_hashes only has the full blocks' hashes: a partly filled block is never "
                     "cached, so cache num_tokens // block_size blocks")
        raise AssertionError(text) from None


def _learner_pool(EvictingBlockPool):
    """The learner's EvictingBlockPool: defined, a BlockPool, with its own free_blocks and get_new_blocks."""
    return _learner_class(EvictingBlockPool, "EvictingBlockPool", BlockPool, ("free_blocks", "get_new_blocks"))


def _attempt_on_pool(fn, args, what):
    try:
        with time_limit(5, what):
            return fn(*args)
    except CallTimeout:
        fail(f"{what} did not return within 5 s: is there an infinite loop?")
    except Exception as exc:  # noqa: BLE001
        stub = " (is one of your methods still the stub, returning None?)" if "NoneType" in str(exc) else ""
        fail(f"{what} raised {type(exc).__name__}: {exc}{stub}")


def _call(pool, meth, arg, what):
    return _attempt_on_pool(getattr(pool, meth), (arg,), what)


def _make_pool(cls, n):
    return run(cls, (n,), name=cls.__name__)


def _cow_manager(copy_on_write):
    """A KVCacheManager that calls the learner's copy_on_write before a running request's allocate_slots."""
    class CoW(KVCacheManager):
        def _blocks_written(self, request, blocks, num_new_tokens):
            return []

        def allocate_slots(self, request, num_new_tokens, new_computed_blocks=None):
            if request.request_id in self.req_to_blocks and not new_computed_blocks:
                run(copy_on_write, (self, request, num_new_tokens),
                    name=f"copy_on_write(manager, {request.request_id!r}, {num_new_tokens})")
                # the copy must be the learner's: a method planted on the manager would hand it to the library's
                planted = sorted(n for n in vars(self) if callable(getattr(type(self), n, None)))
                for name in planted:
                    vars(self).pop(name)
                if planted:
                    fail(f"copy_on_write set {', '.join(planted)} on the manager: change its block tables and the "
                         "pool's blocks, not its methods")
            return super().allocate_slots(request, num_new_tokens, new_computed_blocks)

    return CoW


class _World:
    """A manager (yours or the library's) and its shadow cache: each slot holds the token written there."""

    def __init__(self, cls, num_blocks, bs):
        self.m = cls(num_blocks, bs)
        self.shadow = ShadowKVCache(num_blocks, bs)
        self.reqs = {}
        self.copies = []

    def prefill(self, rid, tokens, extra_slots=0):
        r = Request(rid, tokens)
        self.reqs[rid] = r
        self.m.allocate_slots(r, len(tokens) + extra_slots)
        self.shadow.write(self.m.get_slot_mapping(rid, 0, len(tokens)), tokens)
        r.num_computed_tokens = len(tokens)

    def fork(self, parent, child):
        p = self.reqs[parent]
        c = Request(child, p.prompt_token_ids)
        c.append_output_token_ids(p.output_token_ids)
        self.reqs[child] = c
        self.m.fork(p, c)

    def write(self, rid, tokens):
        """rid appends tokens and computes them (their KV is written at their slots)."""
        r = self.reqs[rid]
        start = r.num_computed_tokens
        r.append_output_token_ids(tokens)
        if self.m.allocate_slots(r, len(tokens)) is None:
            fail("the pool ran out of blocks (more copies than expected?)")
        pairs = self.m.get_pending_copies()
        self.copies += pairs
        self.shadow.copy_blocks(pairs)
        self.shadow.write(self.m.get_slot_mapping(rid, start, start + len(tokens)), tokens)
        r.num_computed_tokens += len(tokens)
        return pairs

    def read(self, rid):
        r = self.reqs[rid]
        return self.shadow.read(self.m.get_block_ids(rid), r.num_computed_tokens)


def check_lookup_examples(PrefixCachingKVCacheManager):
    Learner = _learner_manager(PrefixCachingKVCacheManager)

    # Lookups use your get_computed_blocks; caching uses the library's _cache_blocks.
    LookupOnly = type("LookupOnly", (Learner,), {"_cache_blocks": KVCacheManager._cache_blocks})

    m = _make_manager(LookupOnly, 32, 4)
    a = Request("a", list(range(18)))  # 4 full blocks of 4 and 2 tokens over
    m.allocate_slots(a, 18)
    a_ids = m.get_block_ids("a")

    _expect_hit(m, Request("b", list(range(18)) + [90, 91, 92]), a_ids[:4], 16,
                "b = a's 18 tokens + 3 more (a's 4 full blocks are cached)")
    _expect_hit(m, Request("c", list(range(16))), a_ids[:3], 12, "c = a's first 16 tokens (all 4 blocks cached)",
                hint=lambda got, n: ("every token of c is cached, but the last token must still be computed (its "
                                     "forward pass samples the next token): a full hit is cut back by one block, so "
                                     "look at most at the first (num_tokens - 1) // block_size blocks")
                if got == a_ids[:4] else None)
    _expect_hit(m, Request("d", list(range(17))), a_ids[:4], 16, "d = a's first 17 tokens",
                hint=lambda got, n: ("d's 17th token is not in a full block, so all 4 full blocks are usable: cut "
                                     "back only when the hit would cover every token") if got == a_ids[:3] else None)
    _expect_hit(m, Request("e", [999] + list(range(1, 18))), [], 0, "e: a's tokens with another first token")
    _expect_hit(m, Request("f", list(range(4)) + [77, 78, 79, 80] + list(range(8, 18))), a_ids[:1], 4,
                "f: a's tokens with block 1 changed")
    _expect_hit(m, Request("g", [5]), [], 0, "g: a single token")

    # a middle block evicted: the hit stops there
    m.free(a)
    pool = m.block_pool
    middle = pool.blocks[a_ids[1]]
    pool.free_block_queue.remove(middle)
    pool._maybe_evict_cached_block(middle)
    pool.free_block_queue.appendleft(middle)
    _expect_hit(m, Request("h", list(range(18))), a_ids[:1], 4,
                "h = a's tokens, after a finished and a's block 1 was evicted",
                hint=lambda got, n: ("block 1's hash is no longer cached: stop at the first miss. Blocks 2 and 3 "
                                     "are still cached, but without block 1's KV they are useless")
                if len(got) > 1 else None)

    off = _make_manager(LookupOnly, 32, 4, enable_caching=False)
    x = Request("x", list(range(18)))
    off.allocate_slots(x, 18)
    _expect_hit(off, Request("y", list(range(18))), [], 0, "y, on a manager with enable_caching=False")
    s = off.prefix_cache_stats
    if (s.requests, s.queries, s.hits) != (0, 0, 0):
        fail(f"get_computed_blocks(y, on a manager with enable_caching=False) counted the lookup in "
             f"prefix_cache_stats (requests {s.requests}, queries {s.queries}, hits {s.hits}): with caching off there "
             "is no lookup, so return ([], 0) before counting anything")


def check_lookup_outputs_and_stats(PrefixCachingKVCacheManager):
    Learner = _learner_manager(PrefixCachingKVCacheManager)

    # Lookups use your get_computed_blocks; caching uses the library's _cache_blocks.
    LookupOnly = type("LookupOnly", (Learner,), {"_cache_blocks": KVCacheManager._cache_blocks})

    ref = KVCacheManager(64, 4)
    m = _make_manager(LookupOnly, 64, 4)
    # a request computes its 10-token prompt and 9 generated tokens (the last one sampled has no KV yet)
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    outputs = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    for mgr in (ref, m):
        r = Request("a", prompt)
        mgr.allocate_slots(r, 10)
        r.num_computed_tokens = 10
        for t in outputs:
            r.append_output_token_ids(t)
            if len(r.output_token_ids) < len(outputs):
                mgr.allocate_slots(r, 1)
                r.num_computed_tokens += 1
    # it was preempted: it comes back with its prompt and outputs, and looks them up
    back = Request("a-again", prompt)
    back.append_output_token_ids(outputs)
    want_blocks, want_n = ref.get_computed_blocks(Request("a-again", prompt + outputs))
    _expect_hit(m, back, ids(want_blocks), want_n, "a preempted request: 10 prompt tokens + 9 outputs",
                hint=lambda got, n: ("the lookup covers all of the request's tokens, its outputs included "
                                     "(request.all_token_ids; update_block_hashes hashes them)")
                if len(got) < len(want_blocks) else None)

    # counters: requests, queries (tokens looked up) and hits (tokens found)
    m2 = _make_manager(LookupOnly, 64, 4)
    first = Request("p", list(range(30)))
    m2.allocate_slots(first, 30)
    m2.prefix_cache_stats.requests = m2.prefix_cache_stats.queries = m2.prefix_cache_stats.hits = 0
    cases = [(list(range(30)) + [5], 28), (list(range(9)), 8), ([3, 2, 1], 0), (list(range(24)), 20)]
    want = [0, 0, 0]
    for k, (toks, hit) in enumerate(cases):
        got_ids, n, _ = _lookup(m2, Request(f"q{k}", toks), f"q{k}: {len(toks)} tokens")
        if n != hit:
            cut = (": every token of it is cached, but the last token must still be computed, so look at most at "
                   "the first (num_tokens - 1) // block_size blocks") if n == len(toks) else ""
            fail(f"get_computed_blocks(q{k}: {len(toks)} tokens) found {n} tokens, expected {hit}{cut}")
        want = [want[0] + 1, want[1] + len(toks), want[2] + hit]
        s = m2.prefix_cache_stats
        got = [s.requests, s.queries, s.hits]
        if got != want:
            names = ["requests", "queries", "hits"]
            bad = [f"{nm} is {g} (expected {w})" for nm, g, w in zip(names, got, want, strict=True) if g != w]
            fail(f"after {k + 1} lookup{'s' if k else ''}, prefix_cache_stats: {', '.join(bad)}. Each lookup adds 1 "
                 "to requests, the request's num_tokens to queries and the tokens found to hits")


def check_cache_only_full_blocks(PrefixCachingKVCacheManager):
    Learner = _learner_manager(PrefixCachingKVCacheManager)

    # Caching uses your _cache_blocks; lookups use the library's get_computed_blocks.
    CacheOnly = type("CacheOnly", (Learner,), {"get_computed_blocks": KVCacheManager.get_computed_blocks})

    m = _make_manager(CacheOnly, 32, 4)
    a = Request("a", list(range(18)))
    _allocate_caching(m, a, 18)
    a.num_computed_tokens = 18
    expect_cached(m, a, 4, "allocate_slots(a, 18): 4 full blocks and 2 tokens over")

    # decode: block 4 fills up when token 19 gets its slot
    a.append_output_token_ids(100)
    _allocate_caching(m, a, 1, what="allocate_slots(a, 1) for token 18")
    a.num_computed_tokens += 1
    expect_cached(m, a, 4, "a's decode step for token 18 (block 4 holds 3 tokens)")
    a.append_output_token_ids(101)
    _allocate_caching(m, a, 1, what="allocate_slots(a, 1) for token 19")
    a.num_computed_tokens += 1
    expect_cached(m, a, 5, "a's decode step for token 19 (block 4 is now full)")

    # a request with cache hits: its own new full blocks are cached after the hits
    b = Request("b", a.all_token_ids[:20] + list(range(200, 211)))  # a's 20 tokens, then 11 of its own
    hits, n = m.get_computed_blocks(b)
    _allocate_caching(m, b, b.num_tokens - n, hits, what=f"allocate_slots(b, {b.num_tokens - n}, 5 hit blocks)")
    b.num_computed_tokens = b.num_tokens
    expect_cached(m, b, 7, "allocate_slots for b (5 hit blocks, then 11 new tokens: 2 more full blocks)")
    if m.get_block_ids("b")[:5] != m.get_block_ids("a")[:5]:
        fail("b's first 5 blocks should be a's (cache hits)")

    # a chunked prefill: 22 tokens computed in chunks of 6, 6 and 10
    d = Request("d", list(range(700, 722)))
    for chunk, full in ((6, 1), (6, 3), (10, 5)):
        start = d.num_computed_tokens
        _allocate_caching(m, d, chunk, what=f"allocate_slots(d, {chunk}) (a prefill chunk: tokens "
                                            f"{start}-{start + chunk - 1} of 22)")
        d.num_computed_tokens += chunk
        expect_cached(m, d, full, f"d's prefill chunk of tokens {start}-{start + chunk - 1} (of 22)")

    # exactly full
    c = Request("c", list(range(500, 524)))
    _allocate_caching(m, c, 24)
    c.num_computed_tokens = 24
    expect_cached(m, c, 6, "allocate_slots(c, 24): exactly 6 full blocks")


def check_prefix_lookup_hidden(PrefixCachingKVCacheManager, half="both"):
    """Random workloads on your manager beside the library's: ``half`` "lookup" judges your get_computed_blocks
    (with the library's _cache_blocks), "caching" your _cache_blocks (with the library's lookup). Graded, each
    half is a test case of its own: a sandbox that holds the library's lookup for one half must not also hold its
    caching, or your methods could call them (``super()``) and pass both."""
    Learner = _learner_manager(PrefixCachingKVCacheManager)
    wanted = {"lookup": (0,), "caching": (1,), "both": (0, 1)}[half]
    makers = [
        lambda: type("LookupOnly", (Learner,), {"_cache_blocks": KVCacheManager._cache_blocks}),
        # Caching uses your _cache_blocks; lookups use the library's get_computed_blocks.
        lambda: type("CacheOnly", (Learner,), {"get_computed_blocks": KVCacheManager.get_computed_blocks}),
    ]
    classes = {p: makers[p]() for p in wanted}
    # Random workloads, your manager and the library's side by side: every lookup and every cache must agree.
    rng = random.Random(2718)
    for trial in range(12):
        bs = rng.choice([2, 4, 8, 16])
        nblocks = rng.randrange(40, 160)
        caching = trial != 0
        # (yours, the library's): one pair checks your lookup, the other your caching
        pairs = [(p, (_make_manager(cls, nblocks, bs, enable_caching=caching),
                      KVCacheManager(nblocks, bs, enable_caching=caching))) for p, cls in classes.items()]
        running = [([], []), ([], [])]
        prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6 * bs))] for _ in range(4)]
        for op in range(60):
            u = rng.random()
            if u < 0.5:
                toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * bs))]
                rid = f"t{trial}-r{op}"
                what = (f"{rid}: {len(toks)} tokens (random workload {trial}"
                        f"{'' if caching else ', a manager with enable_caching=False'}, step {op})")
                for p, (mine, ref) in pairs:
                    r_ref, r_mine = Request(rid, toks), Request(rid, toks)
                    want_blocks, want_n = ref.get_computed_blocks(r_ref)
                    if p == 0:
                        got_ids, got_n, _ = _lookup(mine, r_mine, what)
                        if (got_ids, got_n) != (ids(want_blocks), want_n):
                            why = _hit_hint(mine, r_mine, got_ids, got_n, ids(want_blocks))
                            fail(f"get_computed_blocks({what}) found blocks {got_ids} ({got_n} tokens), expected "
                                 f"{ids(want_blocks)} ({want_n} tokens)" + (f". {why}" if why else ""))
                        s, t = mine.prefix_cache_stats, ref.prefix_cache_stats
                        if (s.requests, s.queries, s.hits) != (t.requests, t.queries, t.hits):
                            fail(f"after get_computed_blocks({what}), prefix_cache_stats is {s}, expected {t}")
                        new_mine = mine.allocate_slots(r_mine, len(toks) - want_n,
                                                       [mine.block_pool.blocks[i] for i in got_ids])
                    else:
                        hits, n = mine.get_computed_blocks(r_mine)
                        new_mine = _allocate_caching(mine, r_mine, len(toks) - n, hits, what=f"allocate_slots({what})")
                    new_ref = ref.allocate_slots(r_ref, len(toks) - want_n, want_blocks)
                    if (new_ref is None) != (new_mine is None):
                        fail(f"allocate_slots({what}) succeeded on one manager and failed on the other")
                    if new_ref is not None:
                        r_ref.num_computed_tokens = r_mine.num_computed_tokens = len(toks)
                        running[p][0].append(r_mine)
                        running[p][1].append(r_ref)
                    if p == 1 and cached_state(mine) != cached_state(ref):
                        fail(f"after allocate_slots({what}), the cached blocks differ from the library's: "
                             f"yours {cached_state(mine)[0]}, expected {cached_state(ref)[0]}")
            else:
                for p, (mine, ref) in pairs:
                    live_mine, live_ref = running[p]
                    if not live_mine:
                        continue
                    k = rng.randrange(len(live_mine))
                    if u < 0.85:  # a decode step
                        tok = rng.randrange(1000)
                        outs = []
                        for mgr, r in ((mine, live_mine[k]), (ref, live_ref[k])):
                            r.append_output_token_ids(tok)
                            if p == 1 and mgr is mine:
                                out = _allocate_caching(mgr, r, 1,
                                                        what=f"allocate_slots({r.request_id!r}, 1) (a decode step)")
                            else:
                                out = mgr.allocate_slots(r, 1)
                            if out is not None:
                                r.num_computed_tokens += 1
                            outs.append(out is None)
                        if outs[0] != outs[1]:
                            fail("a decode step's allocate_slots succeeded on one manager and failed on the other")
                        if p == 1 and cached_state(mine) != cached_state(ref):
                            fail(f"after a decode step of {live_mine[k].request_id!r}, the cached blocks differ from "
                                 f"the library's: yours {cached_state(mine)[0]}, expected {cached_state(ref)[0]}")
                    else:
                        mine.free(live_mine.pop(k))
                        ref.free(live_ref.pop(k))


def check_free_blocks_order(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    FreeOnly = type("FreeOnly", (Learner,), {"get_new_blocks": BlockPool.get_new_blocks})  # your free_blocks
    pool = _make_pool(FreeOnly, 10)  # usable blocks 1..9
    b = pool.get_new_blocks(6)  # blocks 1..6 held; queue [7, 8, 9]
    cache(pool, b[0], 101)
    cache(pool, b[2], 103)
    _call(pool, "free_blocks", [b[0], b[1], b[2], b[3]], "free_blocks([1 (cached), 2, 3 (cached), 4])")
    got, want = queue(pool), [2, 4, 7, 8, 9, 1, 3]
    if got != want:
        hints = {
            (7, 8, 9, 1, 2, 3, 4): "every block went to the tail: blocks without a hash go to the head",
            (1, 2, 3, 4, 7, 8, 9): "every block went to the head: cached blocks go to the tail (evicted last)",
            (4, 2, 7, 8, 9, 1, 3): "blocks without a hash go to the head as a group in the order given (2 before 4): "
                                   "appendleft one at a time reverses them; use appendleft_n",
            (2, 4, 7, 8, 9, 3, 1): "cached blocks go to the tail in the order given (1 before 3)",
            (1, 3, 7, 8, 9, 2, 4): ("it is the other way round: blocks WITHOUT a hash to the head, cached ones "
                                    "to the tail"),
            (7, 8, 9): "nothing was freed: is free_blocks still the stub (...)?",
        }
        fail(f"after free_blocks([1 (cached), 2, 3 (cached), 4]) on a free queue [7, 8, 9], the queue is {got}, "
             f"expected {want}. " + hints.get(tuple(got), "Blocks without a hash go to the head as a group, in the "
                                               "order given; cached blocks go to the tail, in the order given"))
    if [x.ref_cnt for x in b] != [0, 0, 0, 0, 1, 1]:
        fail(f"after freeing blocks 1-4 once, the ref_cnts of blocks 1-6 are {[x.ref_cnt for x in b]}, expected "
             "[0, 0, 0, 0, 1, 1]")
    for blk, h in ((b[0], 101), (b[2], 103)):
        if blk.block_hash != h or pool.get_cached_block(h) is not blk:
            fail(f"free_blocks evicted block {blk.block_id} (its hash is {blk.block_hash!r}, the map gives "
                 f"{pool.get_cached_block(h)}): a freed cached block keeps its hash and its entry in "
                 "cached_block_hash_to_block until it is popped for reuse, so a later request can still hit it")
    # a block held by two requests stays held when one lets go
    pool.touch([b[4]])
    _call(pool, "free_blocks", [b[4]], "free_blocks([5]) with ref_cnt 2")
    if b[4].ref_cnt != 1 or 5 in queue(pool):
        fail(f"block 5 had ref_cnt 2; after one free it must have ref_cnt 1 and stay out of the free queue, got "
             f"ref_cnt {b[4].ref_cnt} and queue {queue(pool)}")
    _call(pool, "free_blocks", (x for x in [b[5], b[4]]), "free_blocks(a generator of [6, 5])")
    if queue(pool) != [6, 5, 2, 4, 7, 8, 9, 1, 3]:
        fail(f"after free_blocks([6, 5]) the queue is {queue(pool)}, expected [6, 5, 2, 4, 7, 8, 9, 1, 3] (and "
             "ordered_blocks may be any iterable: read it once, e.g. list(ordered_blocks))")


def check_free_blocks_bad_input(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    FreeOnly = type("FreeOnly", (Learner,), {"get_new_blocks": BlockPool.get_new_blocks})  # your free_blocks
    pool = _make_pool(FreeOnly, 6)
    b = pool.get_new_blocks(3)
    _call(pool, "free_blocks", [b[0]], "free_blocks([1])")
    if sorted(queue(pool)) != [1, 4, 5] or b[0].ref_cnt != 0:  # where block 1 goes is check_free_blocks_order's
        fail(f"after free_blocks([1]) the free queue holds blocks {sorted(queue(pool))} and block 1 has ref_cnt "
             f"{b[0].ref_cnt}, expected blocks [1, 4, 5] (in any order for this case) and ref_cnt 0"
             + (". Nothing changed: is free_blocks still the stub (...)?" if b[0].ref_cnt == 1 and sorted(queue(pool))
                == [4, 5] else ""))
    for blocks, what in (([b[0]], "free_blocks([1]) when block 1 is already free"),
                         ([b[1], b[2], b[1]], "free_blocks([2, 3, 2]) when blocks 2 and 3 have ref_cnt 1"),
                         ([b[2], b[0]], "free_blocks([3, 1]) when block 1 is free")):
        before = state(pool)
        try:
            pool.free_blocks(blocks)
        except ValueError:
            pass
        except Exception as exc:  # noqa: BLE001
            fail(f"{what} raised {type(exc).__name__}: {exc}; expected ValueError")
        else:
            fail(f"{what} returned; expected ValueError (a double free would corrupt ref_cnt and the queue)")
        why = diff(state(pool), before)
        if why:
            fail(f"{what} raised ValueError but changed the pool first: {why}. Check every block before changing any")


def check_get_new_blocks_evicts_on_reuse(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    GetOnly = type("GetOnly", (Learner,), {"free_blocks": BlockPool.free_blocks})  # your get_new_blocks
    pool = _make_pool(GetOnly, 10)
    got = _call(pool, "get_new_blocks", 9, "get_new_blocks(9)")
    if not isinstance(got, list) or [getattr(x, "block_id", x) for x in got] != list(range(1, 10)):
        shown = [getattr(x, "block_id", x) for x in got] if isinstance(got, list) else got
        fail(f"get_new_blocks(9) on a fresh pool of 10 returned {describe(shown)}, expected blocks 1..9 in order "
             "(popped from the head of the free queue)" + (". Is it still the stub?" if got is None else ""))
    if [x.ref_cnt for x in got] != [1] * 9:
        fail(f"blocks handed out must have ref_cnt 1, got {[x.ref_cnt for x in got]}")
    b = {x.block_id: x for x in got}
    for i, h in ((3, 103), (1, 101), (2, 102), (4, 103)):  # blocks 3 and 4 hold the same prefix
        cache(pool, b[i], h)
    pool.free_blocks([b[3], b[1], b[2], b[4]])  # the library's free_blocks: to the tail, in this order
    pool.free_blocks([b[5]])  # no hash: to the head
    # queue: [5, 3, 1, 2, 4]
    got = _call(pool, "get_new_blocks", 2, "get_new_blocks(2) on the free queue [5, 3 (hash 103), 1 (hash "
                                           "101), 2 (hash 102), 4 (hash 103)]")
    got_ids = [getattr(x, "block_id", x) for x in got] if isinstance(got, list) else got
    if got_ids != [5, 3]:
        fail(f"get_new_blocks(2) on the free queue [5, 3, 1, 2, 4] returned {describe(got_ids)}, expected [5, 3]: "
             "pop from the head (popleft)")
    if b[3].block_hash is not None:
        fail("block 3 was handed out but still has its hash: a cached block popped for reuse is evicted now: clear "
             "its hash (block.reset_hash()) and remove it from cached_block_hash_to_block")
    entry = pool.cached_block_hash_to_block.get(103)
    if not entry or 3 in entry or entry.get(4) is not b[4]:
        fail(f"after evicting block 3, cached_block_hash_to_block[103] is {describe(entry)}, expected {{4: block 4}}: "
             "remove only the evicted block from its hash's dict (block 4 still holds that prefix)")
    if pool.num_evictions != 1:
        fail(f"num_evictions is {pool.num_evictions} after evicting one cached block (block 3), expected 1 (block 5 "
             "had no hash: reusing it evicts nothing)")
    for i, h in ((1, 101), (2, 102), (4, 103)):
        if b[i].block_hash != h or pool.get_cached_block(h) is None:
            fail(f"block {i} is still in the free queue and must still hold its cached prefix {h!r} (evict a block "
                 f"only when it is popped), but its hash is {b[i].block_hash!r}")
    if [x.ref_cnt for x in got] != [1, 1] or queue(pool) != [1, 2, 4]:
        fail(f"after get_new_blocks(2): ref_cnts {[x.ref_cnt for x in got]} (expected [1, 1]), free queue "
             f"{queue(pool)} (expected [1, 2, 4])")

    before = state(pool)
    try:
        pool.get_new_blocks(4)
    except ValueError:
        pass
    except Exception as exc:  # noqa: BLE001
        fail(f"get_new_blocks(4) with 3 free blocks raised {type(exc).__name__}: {exc}; expected ValueError")
    else:
        fail("get_new_blocks(4) with 3 free blocks returned; expected ValueError")
    why = diff(state(pool), before)
    if why:
        fail(f"get_new_blocks(4) with 3 free blocks raised but changed the pool first: {why}")
    if _call(pool, "get_new_blocks", 0, "get_new_blocks(0)") != []:
        fail("get_new_blocks(0) must return []")
    rest = _call(pool, "get_new_blocks", 3, "get_new_blocks(3)")
    if [x.block_id for x in rest] != [1, 2, 4] or pool.cached_block_hash_to_block or pool.num_evictions != 4:
        fail(f"get_new_blocks(3) on [1, 2, 4] (all cached) must evict all three: map "
             f"{describe(pool.cached_block_hash_to_block)} (expected empty), num_evictions {pool.num_evictions} "
             "(expected 4)")


def check_eviction_with_the_manager(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    # A shared system prompt under memory pressure, run on your pool and on the library's.
    def scenario(pool_cls):
        m = KVCacheManager(24, 4)
        if pool_cls is not None:
            m.block_pool = run(pool_cls, (24,), name=pool_cls.__name__)
        system = list(range(1000, 1016))  # 4 blocks
        rng = random.Random(7)
        log = []
        live = []
        for i in range(14):
            toks = system + [rng.randrange(100) for _ in range(rng.randrange(1, 14))] if i % 3 else \
                [rng.randrange(100, 200) for _ in range(rng.randrange(5, 30))]
            r = Request(f"r{i}", toks)
            hits, n = m.get_computed_blocks(r)
            new = _attempt_on_pool(m.allocate_slots, (r, r.num_tokens - n, hits),
                                   f"allocate_slots(r{i}, {r.num_tokens - n})")
            log.append((f"r{i}", n, None if new is None else m.get_block_ids(r.request_id)))
            if new is not None:
                r.num_computed_tokens = r.num_tokens
                live.append(r)
            if len(live) > 2 or new is None:
                gone = live.pop(0)
                _attempt_on_pool(m.free, (gone,), f"free({gone.request_id})")
        return log, state(m.block_pool)

    want_log, want_state = scenario(None)
    got_log, got_state = scenario(Learner)
    for (rid, n_want, t_want), (_, n_got, t_got) in zip(want_log, got_log, strict=True):
        if (n_got, t_got) != (n_want, t_want):
            fail(f"with your pool in a KVCacheManager, request {rid} hit {n_got} cached tokens and got the block table "
                 f"{t_got}; with the library's pool: {n_want} tokens and {t_want}. The eviction order decides which "
                 "prefixes survive: check free_blocks' head/tail rule and get_new_blocks' popleft")
    why = diff(got_state, want_state)
    if why:
        fail(f"after the shared-system-prompt scenario, your pool's {why}")


def check_eviction_hidden(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    # Random operations on your pool and the library's, side by side.
    rng = random.Random(161803)
    for _ in range(25):
        n = rng.randrange(3, 20)
        mine, ref = _make_pool(Learner, n), BlockPool(n)
        held = []  # block ids, one entry per reference
        history = []
        for step in range(80):
            u = rng.random()
            if u < 0.35:
                k = rng.randrange(0, n + 1)
                history.append(f"get_new_blocks({k})")
                ok_ref = k <= ref.get_num_free_blocks()
                try:
                    got = mine.get_new_blocks(k)
                except ValueError:
                    got = None
                except Exception as exc:  # noqa: BLE001
                    fail(f"{'; '.join(history[-6:])} raised {type(exc).__name__}: {exc}")
                if ok_ref:
                    want = ref.get_new_blocks(k)
                    if got is None or [x.block_id for x in got] != [x.block_id for x in want]:
                        fail(f"after {'; '.join(history[-6:])}: returned {describe(got)}, expected "
                             f"{[x.block_id for x in want]}")
                    held += [x.block_id for x in want]
                elif got is not None:
                    fail(f"{history[-1]} with {ref.get_num_free_blocks()} free blocks must raise ValueError")
            elif u < 0.65 and held:
                pick = rng.sample(range(len(held)), rng.randrange(1, min(4, len(held)) + 1))
                ids_ = [held[i] for i in pick]
                for i in sorted(pick, reverse=True):
                    held.pop(i)
                history.append(f"free_blocks({ids_})")
                _attempt_on_pool(mine.free_blocks, ([mine.blocks[i] for i in ids_],), history[-1])
                ref.free_blocks([ref.blocks[i] for i in ids_])
            elif u < 0.8 and held:
                i = rng.choice(held)
                if ref.blocks[i].block_hash is None:
                    h = rng.choice([1, 2, 3, 4, 1000 + step])
                    history.append(f"cache block {i} as {h!r}")
                    cache(mine, mine.blocks[i], h)
                    cache(ref, ref.blocks[i], h)
            elif u < 0.9:
                h = rng.choice([1, 2, 3, 4])
                blk = ref.get_cached_block(h)
                if blk is not None:
                    history.append(f"touch the cached block {blk.block_id} ({h!r})")
                    ref.touch([blk])
                    mine.touch([mine.blocks[blk.block_id]])
                    held.append(blk.block_id)
            else:
                history.append("double free")
                free_ids = [b.block_id for b in ref.free_block_queue]
                if free_ids:
                    try:
                        mine.free_blocks([mine.blocks[rng.choice(free_ids)]])
                    except ValueError:
                        pass
                    else:
                        fail("free_blocks of a block that is already free must raise ValueError")
            why = diff(state(mine), state(ref))
            if why:
                fail(f"random operations on a pool of {n} blocks: after {'; '.join(history[-6:])}: {why}")


def check_cow_parallel_sampling(copy_on_write):
    require_function(copy_on_write, "copy_on_write")

    CoW = _cow_manager(copy_on_write)

    # n = 4: one 10-token prompt (blocks of 4: two full blocks, one holding 2 tokens), three forks.
    mine, ref = _World(CoW, 24, 4), _World(KVCacheManager, 24, 4)
    for w in (mine, ref):
        w.prefill("s0", list(range(10, 20)))
        for k in (1, 2, 3):
            w.fork("s0", f"s{k}")
    shared = mine.m.get_block_ids("s0")
    for rnd, base in enumerate((100, 200, 300)):
        for k in range(4):
            want = ref.write(f"s{k}", [base + k])
            got = mine.write(f"s{k}", [base + k])
            nth = ("first", "second", "third")[rnd]
            if got != want:  # before the reads: a wrong copy list is the cause of the reads that go wrong
                fail(f"when s{k} wrote its {nth} output token (position {10 + rnd}), the copies recorded were {got}, "
                     f"expected {want}" + (
                         ": the block it writes into is no longer shared (ref_cnt 1), so it writes in place. Still "
                         "ref_cnt > 1? Then the branches that copied before kept their reference on it: taking a "
                         "copy drops the writer's reference on the shared block (manager.block_pool.free_blocks([src]))"
                         if not want and got else
                         ": each pair is (src, dst), the shared block first, then the fresh one"
                         if got == [(d, s_) for s_, d in want] else
                         ": only the blocks the write lands in (from index num_computed_tokens // block_size) can "
                         "need a copy; the full blocks before them stay shared" if len(got) > len(want) else
                         (": a shared block that holds computed tokens must be copied: after taking its private "
                          "block, record (src.block_id, dst.block_id) in manager.pending_copies") if want and not got
                         else ""))
            check_reads(mine, f"after s{k} wrote its {nth} output token (branches s0..s3 share a 10-token prompt)")
    # the two full blocks stay shared by all four branches
    for k in range(4):
        t = mine.m.get_block_ids(f"s{k}")
        if t[:2] != shared[:2]:
            fail(f"s{k}'s table is {t}: its first two blocks should still be the shared full blocks {shared[:2]}. "
                 "Full shared blocks are never copied: nobody writes into them again")
    if [mine.m.block_pool.blocks[i].ref_cnt for i in shared[:2]] != [4, 4]:
        fail("the two full prompt blocks should have ref_cnt 4 (one per branch)")
    if len(mine.copies) != 3:
        fail(f"{len(mine.copies)} copies were made for 4 branches, expected 3 (the last writer owns the block)")
    # freeing every branch returns every block
    for k in range(4):
        mine.m.free(mine.reqs[f"s{k}"])
    usable = mine.m.num_gpu_blocks - 1
    if mine.m.get_num_free_blocks() != usable:
        held = [b.block_id for b in mine.m.block_pool.blocks[1:] if b.ref_cnt]
        fail(f"after freeing all four branches, blocks {held} are still held: copy_on_write must drop the "
             "writer's reference on the shared block (free_blocks([src])) when it takes the copy")


def check_cow_only_what_is_written(copy_on_write):
    require_function(copy_on_write, "copy_on_write")

    CoW = _cow_manager(copy_on_write)

    # n = 2: the first writer copies, the second writes in place
    mine, ref = _World(CoW, 16, 4), _World(KVCacheManager, 16, 4)
    for w in (mine, ref):
        w.prefill("p", [1, 2, 3, 4, 5, 6])
        w.fork("p", "c")
    want, got = ref.write("p", [50]), mine.write("p", [50])
    if got != want:
        fail(f"p and c share block {ref.m.get_block_ids('c')[1]} (tokens 4-5, ref_cnt 2); when p wrote token 6 there "
             f"the copies recorded were {got}, expected {want}")
    want, got = ref.write("c", [60]), mine.write("c", [60])
    if got != want:
        fail(f"after p took its copy, c is the only holder of the block (ref_cnt 1): it writes in place, with no "
             f"copy, but {got} were recorded")
    check_reads(mine, "after p and c each wrote one token")

    # a block that holds no computed token yet: a private block, but nothing to copy
    mine, ref = _World(CoW, 16, 4), _World(KVCacheManager, 16, 4)
    for w in (mine, ref):
        w.prefill("p", [1, 2, 3, 4, 5, 6, 7, 8], extra_slots=1)  # 8 tokens computed, a 3rd block already allocated
        w.fork("p", "c")
    empty = ref.m.get_block_ids("c")[2]
    want, got = ref.write("c", [70]), mine.write("c", [70])
    if got != want:
        fail(f"c shares p's 3rd block {empty} (ref_cnt 2), which holds no computed token yet (positions 8-11 are "
             f"still to be written). When c wrote token 8 the copies recorded were {got}, expected {want}: c needs a "
             "private block, but there is nothing to copy")
    if mine.m.get_block_ids("c")[2] == mine.m.get_block_ids("p")[2]:
        fail("c wrote token 8 into the block it shares with p: it needs a private block first")
    mine.write("p", [80])
    check_reads(mine, "after c and p each wrote token 8 into what was one shared, empty block")

    # a request nobody shares with: never a copy
    solo = _World(CoW, 16, 4)
    solo.prefill("s", [1, 2, 3, 4, 5])
    before = solo.m.get_block_ids("s")
    for t in (9, 10, 11, 12):
        if solo.write("s", [t]):
            fail("a request whose blocks all have ref_cnt 1 wrote a token and a copy was recorded: copy only blocks "
                 "that are shared (ref_cnt > 1)")
    if solo.m.get_block_ids("s")[:2] != before[:2]:
        fail(f"a request that shares nothing had its blocks replaced ({before} became {solo.m.get_block_ids('s')})")

    # a write that lands in two shared blocks: the partly filled one (copy) and an empty one (no copy)
    mine, ref = _World(CoW, 24, 4), _World(KVCacheManager, 24, 4)
    for w in (mine, ref):
        w.prefill("p", [1, 2, 3, 4, 5, 6], extra_slots=4)  # a table of 3 blocks: full, 2 tokens, empty
        w.fork("p", "c")
    want, got = ref.write("c", [41, 42, 43, 44, 45]), mine.write("c", [41, 42, 43, 44, 45])
    if got != want or mine.m.get_block_ids("c") != ref.m.get_block_ids("c"):
        fail(f"c shares p's 3 blocks (full, 2 tokens, empty) and writes 5 tokens (positions 6-10), which land in "
             f"the last two: copies {got} (expected {want}), c's table {mine.m.get_block_ids('c')} (expected "
             f"{ref.m.get_block_ids('c')}). Every shared block the write lands in needs a private block")
    mine.write("p", [51, 52, 53, 54, 55])
    check_reads(mine, "after c and p each wrote 5 tokens into the blocks they shared")

    # a chunk that spans the shared partial block and more
    mine, ref = _World(CoW, 24, 4), _World(KVCacheManager, 24, 4)
    for w in (mine, ref):
        w.prefill("p", [1, 2, 3, 4, 5, 6])
        w.fork("p", "c")
    want, got = ref.write("c", [21, 22, 23, 24, 25, 26, 27]), mine.write("c", [21, 22, 23, 24, 25, 26, 27])
    if got != want:
        fail(f"c wrote 7 tokens at once (positions 6-12), starting in the block it shares with p: copies {got}, "
             f"expected {want}")
    mine.write("p", [31, 32])
    check_reads(mine, "after c wrote 7 tokens and p 2 tokens, starting in a shared block")


def check_cow_hidden(copy_on_write):
    require_function(copy_on_write, "copy_on_write")

    CoW = _cow_manager(copy_on_write)

    # Random fork trees (beam-search-like), your rule and the library's side by side.
    rng = random.Random(12345)
    for trial in range(30):
        bs = rng.choice([2, 3, 4, 8])
        mine, ref = _World(CoW, 400, bs), _World(KVCacheManager, 400, bs)
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 4 * bs))]
        extra = rng.choice([0, 0, 1, bs])
        for w in (mine, ref):
            w.prefill("b0", prompt, extra_slots=extra)
        alive = ["b0"]
        for step in range(25):
            u = rng.random()
            if u < 0.3 and len(alive) < 8:
                parent = rng.choice(alive)
                child = f"b{trial}-{step}"
                for w in (mine, ref):
                    w.fork(parent, child)
                alive.append(child)
            elif u < 0.9:
                rid = rng.choice(alive)
                toks = [rng.randrange(1000) for _ in range(rng.choice([1, 1, 1, 2, bs + 1]))]
                want, got = ref.write(rid, toks), mine.write(rid, toks)
                if got != want:
                    fail(f"random fork tree (block_size {bs}), step {step}: {rid!r} wrote {len(toks)} token(s) at "
                         f"position {mine.reqs[rid].num_computed_tokens - len(toks)}; copies {got}, expected {want}")
            elif len(alive) > 1:
                rid = alive.pop(rng.randrange(len(alive)))
                for w in (mine, ref):
                    w.m.free(w.reqs[rid])
            check_reads(mine, f"random fork tree (block_size {bs}), step {step}")
            for rid in alive:
                got_t, want_t = mine.m.get_block_ids(rid), ref.m.get_block_ids(rid)
                if got_t != want_t:
                    fail(f"random fork tree (block_size {bs}), step {step}: the block table of {rid!r} is {got_t}, "
                         f"expected {want_t}. Every shared block (ref_cnt > 1) that a write lands in needs a private "
                         "block, including one that holds no computed token yet (a fresh block, without a copy)")
            if mine.m.get_num_free_blocks() != ref.m.get_num_free_blocks():
                fail(f"random fork tree, step {step}: {mine.m.get_num_free_blocks()} free blocks, expected "
                     f"{ref.m.get_num_free_blocks()}")
