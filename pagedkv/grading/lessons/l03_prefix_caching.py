"""Checks for lesson 3's exercises (``grading/source/03_prefix_caching.ipynb``): the hash chain, the prefix
lookup and caching of full blocks, eviction on reuse with the free queue's order, and copy-on-write.

Each ``check_*`` function is one test case of the set: the source's test cell calls it with the learner's
objects (looked up by name in the notebook; under ``pagedkv grade``, :class:`~pagedkv.grading.plain.Learner`
names of them). The learner's code runs in *scenarios* (the ``drive_*`` functions, through
:func:`pagedkv.grading.checks.drive`: one round trip each): a scenario builds the library's pool and manager
around the learner's class or function, makes every call of a workload and returns what it saw as plain data
(block ids, hits, snapshots, free queues, pending copies, read-back tokens, what raised), never a verdict. The
check then runs the same scenario on the library where it needs the library's answers, compares step by step
against vLLM's rules, and fails (``pagedkv.grading.checks.fail``) with a message that names the request, the
block and the rule.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import traceback
from pathlib import Path
from typing import Any

import pagedkv
from pagedkv import BlockPool, KVCacheManager, Request
from pagedkv.grading.checks import (
    STUB_NOTE,
    CallTimeout,
    all_came_back,
    describe,
    drive,
    fail,
    format_call,
    learner_class,
    own_frame,
    require_function,
    scenario_records,
    time_limit,
    where,
)
from pagedkv.grading.plain import encode
from pagedkv.kv_cache_utils import NONE_HASH, KVCacheBlock, builtin_hash, hash_request_tokens, sha256_hash, short_hash
from pagedkv.shadow import ShadowKVCache
from pagedkv.utils import is_int

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

#: Seconds one call of the learner's code may take inside a scenario before it counts as an infinite loop.
LIMIT = 5.0

#: This library's folder (the sandbox's copy, in the sandbox): frames in it are not the learner's.
LIBRARY = str(Path(pagedkv.__file__).resolve().parent) + os.sep

#: The library methods the checks compose with the learner's class (``drive(..., uses=...)``): the grader then
#: runs that scenario in a sandbox where they are the library's, and the part under test stays hidden. (The pool's
#: checks need no composition: the blocks they hold or put back, the scenario takes from the free queue or puts
#: there itself, each time a fixed handful.)
CACHE_BLOCKS = "pagedkv.kv_cache_manager.KVCacheManager._cache_blocks"
GET_COMPUTED_BLOCKS = "pagedkv.kv_cache_manager.KVCacheManager.get_computed_blocks"


# --------------------------------------------------------------------------------------------------------
# What the scenarios record (they run where the learner's code runs: the sandbox under grading)
# --------------------------------------------------------------------------------------------------------
class Stop(Exception):  # noqa: N818 - not an error: the scenario ends at a step that failed
    """Ends a scenario at a step where the learner's code raised or hung (already recorded)."""


class Refused(Exception):
    """The learner's code changed the scenario's harness itself (a method planted on the check's manager)."""


class LearnerFailed(Exception):
    """A step of a scenario failed: ``record`` says which call and how (:func:`raised`, a timeout)."""

    def __init__(self, record: dict) -> None:
        super().__init__(record.get("label", ""))
        self.record = record


def raised(exc: BaseException, locate: bool = True) -> dict[str, Any]:
    """A call that raised, as data: its type, the names of the types it derives from (so a check accepts a
    subclass of ``ValueError``), its message and (``locate``) the learner's line."""
    try:
        message = str(exc)
    except Exception:  # noqa: BLE001 - a learner's exception whose __str__ raises
        message = f"<{type(exc).__name__} whose str() raised>"
    return {"raised": type(exc).__name__, "kinds": [k.__name__ for k in type(exc).__mro__],
            "message": message[:2000], "where": located(exc) if locate else ""}


def located(exc: BaseException) -> str:
    """:func:`~pagedkv.grading.checks.where` when the learner's code is on the way to the raise, else ``""`` (a
    library call that failed on what a stub returned: its own line would only mislead)."""
    frame = own_frame(traceback.extract_tb(exc.__traceback__))
    if frame is None or frame.filename.startswith(LIBRARY):
        return ""
    return where(exc)


def attempt(fn: Any, args: tuple = (), label: str = "the call", expect: type | None = None) -> tuple[bool, Any]:
    """``(True, fn(*args))``, or ``(False, {"label": label, ...})`` with :func:`raised`'s fields (without the
    line for an ``expect`` exception, a refusal the check asks for), or ``"timeout"`` after :data:`LIMIT`
    seconds."""
    try:
        with time_limit(LIMIT, label):
            return True, fn(*args)
    except CallTimeout:
        return False, {"label": label, "timeout": True}
    except Exception as exc:  # noqa: BLE001 - recorded for the check to report
        return False, {"label": label, **raised(exc, locate=expect is None or not isinstance(exc, expect))}


class Seen:
    """A scenario's record: named observations (``seen[key] = ...``), and ``"failed"``, the step whose call
    raised or hung, which ends the scenario (:meth:`call` raises :class:`Stop`)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def call(self, label: str, fn: Any, *args: Any) -> Any:
        ok, got = attempt(fn, args, label)
        if not ok:
            self.data["failed"] = got
            raise Stop
        return got

    def broke(self, exc: BaseException) -> None:
        """A library call of the scenario raised on what the learner's code left (a table it broke): the step
        that ends the scenario."""
        self.data["failed"] = {"label": "a step of the check", **raised(exc)}


def plain(value: Any) -> Any:
    """``value`` when it can cross as plain data (what a check compares), else ``{"$repr": how it reads}``."""
    try:
        encode(value)
    except (TypeError, ValueError, RecursionError):
        return {"$repr": describe(value)}
    return value


def num(value: Any) -> Any:
    """A number as it is (``ref_cnt``, a count; a numpy integer as its int), anything else as how it reads."""
    if is_int(value):
        return int(value)
    return value if type(value) in (int, float, bool) else {"$repr": describe(value)}


def ident(block: Any) -> Any:
    """A block as its id; ``None`` as None; anything else as how it reads."""
    if block is None:
        return None
    bid = getattr(block, "block_id", None)
    return bid if type(bid) is int else {"$repr": describe(block)}


def is_pool_block(pool: Any, block: Any) -> bool:
    try:
        return isinstance(block, KVCacheBlock) and type(block.block_id) is int and \
            0 <= block.block_id < len(pool.blocks) and pool.blocks[block.block_id] is block
    except Exception:  # noqa: BLE001 - a pool the learner's code broke
        return False


def returned(pool: Any, got: Any) -> Any:
    """What a call that should return blocks returned: their ids when they are the pool's blocks, None as None,
    else ``{"$repr": ...}`` (a list shown by its items' ids where they have one)."""
    if got is None:
        return None
    if isinstance(got, list) and all(is_pool_block(pool, b) for b in got):
        return [b.block_id for b in got]
    shown = [getattr(x, "block_id", x) for x in got] if isinstance(got, list) else got
    return {"$repr": describe(shown)}


def queue(pool: Any) -> list:
    """The free queue's block ids, head to tail; one that the learner's code made circular ends with "..."."""
    out: list[Any] = []
    limit = len(pool.blocks) + 1
    for block in pool.free_block_queue:
        if len(out) > limit:
            out.append("...")
            break
        out.append(ident(block))
    return out


def cache(pool: Any, block: Any, h: Any) -> None:
    """Enter a held block in the prefix cache under hash h (what cache_full_blocks does)."""
    block.block_hash = h
    pool.cached_block_hash_to_block.setdefault(h, {})[block.block_id] = block


def hash_of(h: Any) -> Any:
    """A block hash as plain data that can also be a dict key: as it is (an int, bytes, None, a tuple of them),
    else how it reads."""
    if h is None or type(h) in (int, bytes):
        return h
    value = plain(h)
    try:
        hash(value)
    except TypeError:
        return describe(h)
    return value


def by_key(mapping: dict) -> dict:
    """``mapping`` with its items in a fixed order (by key, or by the repr of keys that do not compare): two equal
    dicts read the same."""
    try:
        return dict(sorted(mapping.items(), key=lambda kv: kv[0]))
    except TypeError:
        return dict(sorted(mapping.items(), key=lambda kv: repr(kv[0])))


def state(pool: Any) -> Any:
    """(free queue, every block's ref_cnt, every block's hash, the map as {hash: sorted ids}, num_evictions), or
    ``{"unreadable": why}``."""
    try:
        mapping = by_key({hash_of(h): sorted(d) if all(type(k) is int for k in d) else {"$repr": describe(d)}
                          for h, d in pool.cached_block_hash_to_block.items()})
        return (queue(pool), [num(b.ref_cnt) for b in pool.blocks], [hash_of(b.block_hash) for b in pool.blocks],
                mapping, num(pool.num_evictions))
    except Exception as exc:  # noqa: BLE001 - the learner's code broke the pool: said as data
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def text(value: Any) -> str:
    """A large observation as one string, its repr (dicts already in a fixed order: :func:`by_key`): a random
    workload records one per step, which crosses as one string; a check compares the strings and reads back
    (``ast.literal_eval``) only the step where they differ."""
    return repr(value)


# --------------------------------------------------------------------------------------------------------
# How the checks read the records
# --------------------------------------------------------------------------------------------------------
class _Raw:
    """A value a scenario could only describe (``{"$repr": text}``), shown as that text in the checks' messages."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Raw) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def _plainly(value: Any) -> Any:
    """A record with each ``{"$repr": text}`` in it as a :class:`_Raw`, which messages show as its text."""
    if type(value) is dict:
        if set(value) == {"$repr"}:
            return _Raw(str(value["$repr"]))
        return {_plainly(k): _plainly(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plainly(v) for v in value)
    return value


def _drive(scenario, *args, kind: type = dict, **options) -> Any:
    """:func:`~pagedkv.grading.checks.drive`, its record ready for messages (:func:`_plainly`). The record must be
    a ``kind`` (a dict of observations, or a list of dicts): the scenario runs where the learner's code runs, and
    a record of another kind did not come from it as the check wrote it; the case fails, saying what came back
    (the checks then find every observation they compare, or fail: :func:`_at`, :func:`_incomplete`)."""
    record = _plainly(drive(scenario, *args, **options))
    label = options.get("name") or scenario.__name__
    if kind is list:
        return scenario_records(record, label)
    if not isinstance(record, kind):
        _incomplete(label, f"it came back as {describe(record, 80)}, expected a {kind.__name__} of records")
    return record


def _incomplete(what: str, detail: str) -> None:
    """Fail for a scenario's record that lacks what the check compares (see :func:`_drive`)."""
    fail(f"{what}: the scenario's record is incomplete: {detail}")


def _shown(value: Any) -> str:
    return describe(value)


def _said(record: dict, label: str | None = None, hint: str = "") -> str:
    """The failure of a step whose call raised or hung."""
    label = label or record.get("label") or "the call"
    if record.get("timeout"):
        return f"{label} did not return within {LIMIT:g} s: is there an infinite loop?"
    return f"{label} raised {record.get('raised')}: {record.get('message')}{record.get('where', '')}{hint}"


def _pool_hint(record: dict) -> str:
    return " (is one of your methods still the stub, returning None?)" if "NoneType" in str(record.get("message")) \
        else ""


def _at(seen: dict, key: str, hint: Any = None) -> Any:
    """``seen[key]``; when the scenario ended before it, the failure of the step that ended it (``hint``: a
    function of that record that adds to the message)."""
    if key not in seen:
        if not isinstance(seen.get("failed"), dict):  # no step ended it: the observation is missing
            _incomplete("the check's scenario", f"it has no {key!r}")
        _fail_with(seen["failed"], hint)
    return seen[key]


#: The longest observation :func:`_read` reads back: many times the longest a scenario of the set writes (a few
#: KB), far below what would make ``ast.literal_eval`` take much memory (about 200 bytes per character).
READ_LIMIT = 200_000


def _fail_with(record, hint=None):
    """Fail with the step that ended a scenario (``hint``: a function of it that adds to the message)."""
    if not isinstance(record, dict):
        fail("the check's scenario stopped early")
    if "refused" in record:
        fail(record["refused"])
    if record.get("out_of_blocks"):
        fail("the pool ran out of blocks (more copies than expected?)")
    fail(_said(record, hint=hint(record) if hint else ""))


def _read(observed: Any) -> Any:
    """What :func:`text` wrote, read back (as the string itself when it is not a literal)."""
    if not isinstance(observed, str):
        return observed
    if len(observed) > READ_LIMIT:  # not what a scenario of the set writes: shown by its length, never parsed
        return _Raw(f"<a text of {len(observed)} characters>")
    try:
        return _plainly(ast.literal_eval(observed))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return observed


def _raised_kind(record: Any, kind: str) -> bool:
    return isinstance(record, dict) and kind in (record.get("kinds") or ())


def diff(mine: Any, ref: Any) -> str | None:
    if not isinstance(mine, tuple) or not isinstance(ref, tuple):
        return None if mine == ref else f"state is {_shown(mine)}, expected {_shown(ref)}"
    names = ["free queue (head to tail)", "ref_cnt of blocks 0..", "block hashes", "cached_block_hash_to_block",
             "num_evictions"]
    for nm, a, b in zip(names, mine, ref, strict=True):
        if a != b:
            return f"{nm} is {describe(a, 200)}, expected {describe(b, 200)}"
    return None


# --------------------------------------------------------------------------------------------------------
# 1. hash_chain
# --------------------------------------------------------------------------------------------------------
def label(tokens, bs, fn, extra):
    return (f"hash_chain({len(tokens)} tokens {describe(list(tokens[:4]), 40)[:-1]}, ...], "
            f"{bs}, {fn.__name__}, extra_keys={extra!r})")


def shorts(hashes):
    return [short_hash(h) if isinstance(h, (int, bytes)) else describe(h, 20) for h in hashes]


def drive_hash_chains(hash_chain, calls):
    """``hash_chain(*args)`` for each ``args`` of ``calls``: ``{"value": what it returned}`` (plain), or what it
    raised (:func:`raised`), or ``{"timeout": True}``, which ends the scenario (the check stops there)."""
    out = []
    for args in calls:
        ok, got = attempt(hash_chain, tuple(args), "hash_chain")
        out.append({"value": plain(got)} if ok else got)
        if not ok and got.get("timeout"):
            break
    return out


def _chains(hash_chain, calls):
    """The learner's hash_chain on each call's arguments, in one round trip (one record per call: those after a
    call that hung repeat it)."""
    results = _drive(drive_hash_chains, hash_chain, [tuple(c) for c in calls], kind=list, name="hash_chain")
    if len(results) > len(calls) or (len(results) < len(calls) and not (results and results[-1].get("timeout"))):
        _incomplete("hash_chain", f"{len(results)} of {len(calls)} calls came back")
    return results + results[-1:] * (len(calls) - len(results))


def _variant_chain(fn, blocks, extra, first_only=False):
    """The chain of ``blocks`` (tuples of tokens), with ``extra`` in every key or (``first_only``) block 0's only."""
    out, parent = [], NONE_HASH
    for i, blk in enumerate(blocks):
        parent = fn((parent, blk, extra if i == 0 or not first_only else None))
        out.append(parent)
    return out


def _expect_chain(record, tokens, bs, fn=builtin_hash, extra=None, hint=True):
    """Compare one of :func:`drive_hash_chains`' results with the library's chain of the same tokens."""
    if "value" not in record:
        fail(_said(record, format_call("hash_chain", (tokens, bs, fn, extra))))
    got = record["value"]
    want = hash_request_tokens(fn, bs, list(tokens), extra)
    if got is None:
        fail(f"{label(tokens, bs, fn, extra)} returned None. {STUB_NOTE}")
    if isinstance(got, _Raw):
        fail(f"{label(tokens, bs, fn, extra)} returned {got}, expected a list of hashes")
    if isinstance(got, tuple):  # the hashes in a tuple: the same answer
        got = list(got)
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
        elif got and got[0] == NONE_HASH:
            msg += (". The first hash is NONE_HASH itself: append each block's hash after computing it (NONE_HASH is "
                    "block 0's parent, not a block's hash)")
        elif got == _variant_chain(fn, [tuple(tokens[i * bs:(i + 1) * bs - 1]) for i in range(n_full)], extra):
            msg += (f". Each block holds block_size = {bs} tokens, tokens[i * block_size:(i + 1) * block_size] (a "
                    "slice's end is excluded: no - 1 there)")
        elif extra is not None and got == _variant_chain(fn, blocks, extra, first_only=True):
            msg += (". extra_keys went into block 0's key only: here it is part of every block's key (a cache salt "
                    "is block 0's only, but this function's extra_keys is not a salt)")
        elif fn is not builtin_hash and got == _variant_chain(builtin_hash, blocks, extra):
            msg += f". Those are builtin_hash's hashes: hash with hash_fn, the argument (here {fn.__name__})"
    fail(msg)
    return got  # unreachable


def check_hash_chain_examples(hash_chain):
    require_function(hash_chain, "hash_chain")

    toks = list(range(100, 140))
    cases = [
        (toks, 16, builtin_hash, None),  # 2 full blocks, 8 tokens over
        (toks[:32], 16, builtin_hash, None),  # exactly 2 blocks
        (toks[:15], 16, builtin_hash, None),  # no full block: no hash
        ([], 16, builtin_hash, None),
        (toks[:16], 16, builtin_hash, None),
        (toks, 4, builtin_hash, None),
        (toks, 1, builtin_hash, None),
        (toks, 16, sha256_hash, None),
        (toks, 8, builtin_hash, ("salt", "tenant-a")),
        (tuple(toks), 16, builtin_hash, None),  # a tuple of tokens works as a list does
        *[(toks, bs, sha256_hash, None) for bs in (16, 4, 1)],
        (toks, 8, sha256_hash, ("salt", "tenant-a")),
    ]
    results = _chains(hash_chain, [*cases, (toks, 0)])
    for record, case in zip(results, cases, strict=False):
        _expect_chain(record, *case)
    zero = results[-1]
    if "value" in zero:
        fail("hash_chain(..., block_size=0) returned, expected it to raise ValueError")
    if zero.get("timeout"):
        fail(_said(zero, "hash_chain(..., block_size=0)"))
    if not _raised_kind(zero, "ValueError"):
        fail(f"hash_chain(..., block_size=0) raised {zero.get('raised')}, expected ValueError")


def check_hash_chain_is_a_chain(hash_chain):
    require_function(hash_chain, "hash_chain")

    rng = random.Random(5)
    x = [rng.randrange(32000) for _ in range(16)]
    y = [rng.randrange(32000) for _ in range(16)]
    z = [rng.randrange(32000) for _ in range(16)]
    fns = (builtin_hash, sha256_hash)
    calls = [case for fn in fns for case in ((x + z, 16, fn, None), (y + z, 16, fn, None),
                                              (x + z + [1, 2], 16, fn, None), (x + z, 16, fn, ("salt", "tenant-b")))]
    results = _chains(hash_chain, calls)
    for k, fn in enumerate(fns):
        r_xz, r_yz, r_again, r_salted = results[4 * k: 4 * k + 4]
        xz = _expect_chain(r_xz, x + z, 16, fn)
        yz = _expect_chain(r_yz, y + z, 16, fn)
        if xz[1] == yz[1]:
            fail(f"with {fn.__name__}: the second blocks of x + z and y + z got the same hash although their "
                 "prefixes differ (x vs y): a block's hash must depend on its parent's hash")
        again = _expect_chain(r_again, x + z + [1, 2], 16, fn)
        if again != xz:
            fail(f"with {fn.__name__}: x + z and x + z + 2 more tokens must give the same 2 hashes (the same full "
                 f"blocks), got {shorts(xz)} and {shorts(again)}")
        salted = _expect_chain(r_salted, x + z, 16, fn, ("salt", "tenant-b"))
        if salted[0] == xz[0] or salted[1] == xz[1]:
            fail(f"with {fn.__name__}: a different cache salt must change every block's hash: "
                 f"{shorts(xz)} without the salt, {shorts(salted)} with it")


def check_hash_chain_hidden(hash_chain):
    require_function(hash_chain, "hash_chain")

    rng = random.Random(314159)
    cases = []
    for _ in range(120):
        bs = rng.choice([1, 2, 3, 4, 8, 16, 32])
        n = rng.choice([0, bs - 1, bs, 2 * bs, 3 * bs + 1, rng.randrange(0, 300)])
        toks = [rng.randrange(50000) for _ in range(n)]
        fn = rng.choice([builtin_hash, sha256_hash])
        extra = rng.choice([None, ("salt", f"s{rng.randrange(9)}"), (("lora", rng.randrange(3)),)])
        cases.append((toks, bs, fn, extra))
    for record, case in zip(_chains(hash_chain, cases), cases, strict=True):
        _expect_chain(record, *case)


# --------------------------------------------------------------------------------------------------------
# 2. The lookup (get_computed_blocks) and caching only full blocks (_cache_blocks)
# --------------------------------------------------------------------------------------------------------
def lookup_only(cls):
    """``cls`` whose lookup is its own and whose caching is the library's ``_cache_blocks``."""
    return type("LookupOnly", (cls,), {"_cache_blocks": KVCacheManager._cache_blocks})


def cache_only(cls):
    """``cls`` whose caching is its own and whose lookup is the library's ``get_computed_blocks``."""
    return type("CacheOnly", (cls,), {"get_computed_blocks": KVCacheManager.get_computed_blocks})


def marks(m) -> tuple:
    """What a lookup must not change: each block's (ref_cnt, hash, is_null), the free queue, the tables."""
    return ([(b.ref_cnt, b.block_hash, b.is_null) for b in m.block_pool.blocks], queue(m.block_pool),
            {rid: [ident(b) for b in t] for rid, t in m.req_to_blocks.items()})


def prefix_stats(m) -> list:
    s = m.prefix_cache_stats
    return [num(s.requests), num(s.queries), num(s.hits)]


def lookup(m, r, label) -> dict[str, Any]:
    """``m.get_computed_blocks(r)`` as data: ``{"ids", "n", "changed", "stats"}`` (the hit's block ids, its token
    count, what it changed in the pool or the tables (None), the prefix-cache counters after it), or what went
    wrong: what it raised (:func:`attempt`), ``{"none": True}``, ``{"shape": ...}`` (not a pair),
    ``{"bad_blocks": ...}`` (not the pool's blocks)."""
    before = marks(m)
    ok, got = attempt(m.get_computed_blocks, (r,), label)
    if not ok:
        return got
    if got is None:
        return {"none": True}
    if not (isinstance(got, tuple) and len(got) == 2):
        return {"shape": describe(got)}
    blocks, n = got
    if isinstance(blocks, tuple):  # the blocks in a tuple: allocate_slots takes them as well as a list
        blocks = list(blocks)
    if not isinstance(blocks, list) or not all(is_pool_block(m.block_pool, b) for b in blocks):
        return {"bad_blocks": describe(blocks)}
    after = marks(m)
    changed = None
    for key, x, y in zip(("blocks", "free_queue", "block_tables"), before, after, strict=True):
        if x != y:
            detail = ""
            if key == "blocks":
                i = next(i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
                fields = [("ref_cnt", 0), ("cached", 1), ("hash", 1), ("null", 2)]
                shown = {"cached": lambda v: v is not None, "hash": lambda v: None if v is None else short_hash(v)}
                what_changed = ", ".join(f"{k} {shown.get(k, plain)(x[i][j])!r} -> {shown.get(k, plain)(y[i][j])!r}"
                                         for k, j in fields if x[i][j] != y[i][j] and
                                         shown.get(k, plain)(x[i][j]) != shown.get(k, plain)(y[i][j]))
                detail = f" (block {i}: {what_changed})"
            changed = f"{key}{detail}"
            break
    return {"ids": [b.block_id for b in blocks], "n": num(n), "changed": changed, "stats": prefix_stats(m)}


def lookup_failed(record: dict) -> bool:
    return "ids" not in record


def cache_view(m, r) -> dict[str, Any]:
    """What caching left for request r: each table entry as (block id, its hash, whether the pool's map finds
    that hash), ``num_cached_block[rid]``, whether nothing at all is cached, and r's block hashes."""
    pool = m.block_pool
    table = [(ident(b), plain(b.block_hash), b.block_hash is not None and pool.get_cached_block(b.block_hash)
              is not None) for b in m.req_to_blocks[r.request_id]]
    nothing = not m.num_cached_block and all(x.block_hash is None for x in pool.blocks)
    return {"table": table, "num_cached": num(m.num_cached_block.get(r.request_id, 0)), "nothing": nothing,
            "hashes": plain(list(r.block_hashes))}


def cached_state(m):
    """Each table entry that is cached, as {(request, index): block id}; and the map, as {hash: ids}."""
    pool = m.block_pool
    try:
        table = {(rid, i): ident(b) for rid, bl in m.req_to_blocks.items() for i, b in enumerate(bl)
                 if b.block_hash is not None}
        mapping = {hash_of(h): sorted(d) if all(type(k) is int for k in d) else {"$repr": describe(d)}
                   for h, d in pool.cached_block_hash_to_block.items() if d}
    except Exception as exc:  # noqa: BLE001 - the learner's code broke the tables: said as data
        return {"unreadable": f"{type(exc).__name__}: {exc}"}, {}
    return by_key(table), by_key(mapping)


#: check_lookup_examples' lookups on a manager that cached request "a" = tokens 0..17 (blocks of 4).
LOOKUPS = [
    ("b", list(range(18)) + [90, 91, 92]),
    ("c", list(range(16))),
    ("d", list(range(17))),
    ("e", [999] + list(range(1, 18))),
    ("f", list(range(4)) + [77, 78, 79, 80] + list(range(8, 18))),
    ("g", [5]),
]


def drive_lookup_examples(cls):
    """check_lookup_examples' scenario, the lookups by ``cls``'s get_computed_blocks and the caching by the
    library's ``_cache_blocks``: request ``a`` (18 tokens) allocated, then the lookups of :data:`LOOKUPS`; ``a``
    freed and its block 1 evicted, the lookup of ``h`` (a's tokens); a manager with ``enable_caching=False``."""
    Manager = lookup_only(cls)
    seen = Seen()
    try:
        m = seen.call(format_call(cls.__name__, (32, 4)), Manager, 32, 4)
        a = Request("a", list(range(18)))  # 4 full blocks of 4 and 2 tokens over
        seen.call("allocate_slots('a', 18)", m.allocate_slots, a, 18)
        a_ids = seen.call("get_block_ids('a')", m.get_block_ids, "a")
        seen["a_ids"] = plain(a_ids)
        for name, toks in LOOKUPS:
            seen[name] = lookup(m, Request(name, toks), f"get_computed_blocks({name})")
            if lookup_failed(seen.data[name]):
                raise Stop
        # a middle block evicted: the hit stops there
        seen.call("free(a)", m.free, a)
        pool = m.block_pool
        middle = pool.blocks[a_ids[1]]
        pool.free_block_queue.remove(middle)
        entry = pool.cached_block_hash_to_block.get(middle.block_hash, {})
        entry.pop(middle.block_id, None)
        if not entry:
            pool.cached_block_hash_to_block.pop(middle.block_hash, None)
        middle.reset_hash()
        pool.free_block_queue.appendleft(middle)
        seen["h"] = lookup(m, Request("h", list(range(18))), "get_computed_blocks(h)")
        if lookup_failed(seen.data["h"]):
            raise Stop
        off = seen.call(format_call(cls.__name__, (32, 4), {"enable_caching": False}),
                        functools.partial(Manager, enable_caching=False), 32, 4)
        seen.call("allocate_slots('x', 18)", off.allocate_slots, Request("x", list(range(18))), 18)
        seen["y"] = lookup(off, Request("y", list(range(18))), "get_computed_blocks(y)")
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def _lookup_result(record, what):
    """The (block ids, tokens) of a lookup record (:func:`lookup`), or the failure it shows."""
    call = f"get_computed_blocks({what})"
    if not isinstance(record, dict):
        _incomplete(call, f"it came back as {describe(record, 80)}")
    if "raised" in record or record.get("timeout"):
        fail(_said(record, call))
    if record.get("none"):
        fail(f"{call} returned None. {STUB_NOTE}")
    if "shape" in record:
        fail(f"{call} returned {record['shape']}, expected a tuple (blocks, num_computed_tokens)")
    if "bad_blocks" in record:
        fail(f"{call} returned {record['bad_blocks']} as its blocks: expected a list of the pool's KVCacheBlock "
             "objects (from self.block_pool.get_cached_block)")
    if not {"ids", "n", "changed", "stats"} <= set(record) or not isinstance(record["ids"], list):
        _incomplete(call, f"it came back as {describe(record, 80)}")
    if record["changed"]:
        fail(f"{call} changed the pool's {record['changed']}: a lookup only finds the blocks; allocate_slots "
             "takes them (touch)")
    if type(record["n"]) is not int:
        fail(f"{call} returned {_shown(record['n'])} as num_computed_tokens: expected an int, the tokens the blocks "
             "hold (len(blocks) * block_size)")
    return record["ids"], record["n"]


def _expect_hit(record, want_ids, want_n, what, bs, num_tokens, hint=None):
    got_ids, n = _lookup_result(record, what)
    if (got_ids, n) != (want_ids, want_n):
        msg = (f"get_computed_blocks({what}) found blocks {got_ids} ({_shown(n)} tokens), expected "
               f"{want_ids} ({want_n} tokens)")
        text = (hint(got_ids, n) if callable(hint) else hint) or _hit_hint(bs, num_tokens, got_ids, n, want_ids)
        fail(msg + (f". {text}" if text else ""))


def _hit_hint(bs, num_tokens, got_ids, n, want_ids):
    """The usual slips of a lookup, named when the result shows one (or ``None``)."""
    if got_ids == want_ids:
        return ("the blocks are right: num_computed_tokens is the tokens they hold, len(blocks) * block_size = "
                f"{len(got_ids)} * {bs}")
    if len(got_ids) * bs >= num_tokens:
        return ("the hit covers every token, but the last token must still be computed (its forward pass samples "
                "the next token): look at most at the first (num_tokens - 1) // block_size blocks")
    return None


def _fmt_stats(s):
    return f"PrefixCacheStats(requests={_shown(s[0])}, queries={_shown(s[1])}, hits={_shown(s[2])})"


def _allocate_hint(record):
    """What ``_cache_blocks``' usual slips make ``allocate_slots`` raise, named."""
    text = f"{record.get('raised')}: {record.get('message')}"
    out = ""
    if "IndexError" in text:
        out += (". Cache the blocks that are full once num_tokens tokens are computed: in a chunked prefill that "
                "is fewer than the request's tokens (and fewer than its table might suggest)")
    if "block hashes" in text:
        out += (". request.block_hashes only has the full blocks' hashes: a partly filled block is never cached, "
                "so cache num_tokens // block_size blocks")
    return out


def _allocate_said(record):
    return _said(record) + _allocate_hint(record)


def check_lookup_examples(PrefixCachingKVCacheManager):
    Learner = learner_class(PrefixCachingKVCacheManager, "PrefixCachingKVCacheManager", KVCacheManager,
                            ("get_computed_blocks", "_cache_blocks"))

    # Lookups use your get_computed_blocks; caching uses the library's _cache_blocks.
    seen = _drive(drive_lookup_examples, Learner, uses=(CACHE_BLOCKS,), name="the lookup examples")
    a_ids = _at(seen, "a_ids")
    texts = {
        "b": ("b = a's 18 tokens + 3 more (a's 4 full blocks are cached)", a_ids[:4], 16, None),
        "c": ("c = a's first 16 tokens (all 4 blocks cached)", a_ids[:3], 12,
              lambda got, n: ("every token of c is cached, but the last token must still be computed (its forward "
                              "pass samples the next token): a full hit is cut back by one block, so look at most at "
                              "the first (num_tokens - 1) // block_size blocks") if got == a_ids[:4] else None),
        "d": ("d = a's first 17 tokens", a_ids[:4], 16,
              lambda got, n: ("d's 17th token is not in a full block, so all 4 full blocks are usable: cut back only "
                              "when the hit would cover every token") if got == a_ids[:3] else None),
        "e": ("e: a's tokens with another first token", [], 0, None),
        "f": ("f: a's tokens with block 1 changed", a_ids[:1], 4, None),
        "g": ("g: a single token", [], 0, None),
    }
    for name, toks in LOOKUPS:
        what, want_ids, want_n, hint = texts[name]
        _expect_hit(_at(seen, name), want_ids, want_n, what, 4, len(toks), hint=hint)
    _expect_hit(_at(seen, "h"), a_ids[:1], 4, "h = a's tokens, after a finished and a's block 1 was evicted", 4, 18,
                hint=lambda got, n: ("block 1's hash is no longer cached: stop at the first miss. Blocks 2 and 3 "
                                     "are still cached, but without block 1's KV they are useless")
                if len(got) > 1 else None)
    y = _at(seen, "y")
    _expect_hit(y, [], 0, "y, on a manager with enable_caching=False", 4, 18)
    s = y["stats"]
    if s != [0, 0, 0]:
        fail(f"get_computed_blocks(y, on a manager with enable_caching=False) counted the lookup in "
             f"prefix_cache_stats (requests {_shown(s[0])}, queries {_shown(s[1])}, hits {_shown(s[2])}): with "
             "caching off there is no lookup, so return ([], 0) before counting anything")


#: check_lookup_outputs_and_stats' request: a 10-token prompt and 9 generated tokens.
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
OUTPUTS = [40, 41, 42, 43, 44, 45, 46, 47, 48]
#: ... and the lookups that count: (tokens, the tokens found), after a 30-token request was cached.
COUNTED = [(list(range(30)) + [5], 28), (list(range(9)), 8), ([3, 2, 1], 0), (list(range(24)), 20)]


def drive_lookup_outputs(cls):
    """check_lookup_outputs_and_stats' scenario (lookups by ``cls``, caching by the library): a request that
    computed its prompt and 8 of its 9 outputs comes back after a preemption and looks them all up (``back``);
    then the lookups of :data:`COUNTED` on another manager, each with the counters after it (``q0`` ...)."""
    Manager = lookup_only(cls)
    seen = Seen()
    try:
        m = seen.call(format_call(cls.__name__, (64, 4)), Manager, 64, 4)
        r = Request("a", PROMPT)
        seen.call("allocate_slots('a', 10)", m.allocate_slots, r, 10)
        r.num_computed_tokens = 10
        for t in OUTPUTS:
            r.append_output_token_ids(t)
            if len(r.output_token_ids) < len(OUTPUTS):
                seen.call("allocate_slots('a', 1)", m.allocate_slots, r, 1)
                r.num_computed_tokens += 1
        back = Request("a-again", PROMPT)
        back.append_output_token_ids(OUTPUTS)
        seen["back"] = lookup(m, back, "get_computed_blocks(a-again)")
        if lookup_failed(seen.data["back"]):
            raise Stop
        m2 = seen.call(format_call(cls.__name__, (64, 4)), Manager, 64, 4)
        seen.call("allocate_slots('p', 30)", m2.allocate_slots, Request("p", list(range(30))), 30)
        m2.prefix_cache_stats.requests = m2.prefix_cache_stats.queries = m2.prefix_cache_stats.hits = 0
        for k, (toks, _) in enumerate(COUNTED):
            seen[f"q{k}"] = lookup(m2, Request(f"q{k}", toks), f"get_computed_blocks(q{k})")
            if lookup_failed(seen.data[f"q{k}"]):
                raise Stop
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def check_lookup_outputs_and_stats(PrefixCachingKVCacheManager):
    Learner = learner_class(PrefixCachingKVCacheManager, "PrefixCachingKVCacheManager", KVCacheManager,
                            ("get_computed_blocks", "_cache_blocks"))

    # Lookups use your get_computed_blocks; caching uses the library's _cache_blocks.
    seen = _drive(drive_lookup_outputs, Learner, uses=(CACHE_BLOCKS,), name="the lookup of a preempted request")
    ref = _drive(drive_lookup_outputs, KVCacheManager)
    # a request computes its 10-token prompt and 9 generated tokens (the last one sampled has no KV yet);
    # it was preempted: it comes back with its prompt and outputs, and looks them up
    want_ids, want_n = ref["back"]["ids"], ref["back"]["n"]
    _expect_hit(_at(seen, "back"), want_ids, want_n, "a preempted request: 10 prompt tokens + 9 outputs", 4,
                len(PROMPT) + len(OUTPUTS),
                hint=lambda got, n: ("the lookup covers all of the request's tokens, its outputs included "
                                     "(request.all_token_ids; update_block_hashes hashes them)")
                if len(got) < len(want_ids) else None)
    got, want = seen["back"]["stats"], ref["back"]["stats"]
    if got != want:
        names = ["requests", "queries", "hits"]
        bad = [f"{nm} is {_shown(g)} (expected {w})" for nm, g, w in zip(names, got, want, strict=True) if g != w]
        fail("after the lookup of a preempted request (10 prompt tokens + 9 outputs), prefix_cache_stats: "
             f"{', '.join(bad)}. Each lookup adds 1 to requests, the request's num_tokens (its outputs included, not "
             "only its prompt) to queries and the tokens found to hits")

    # counters: requests, queries (tokens looked up) and hits (tokens found)
    want = [0, 0, 0]
    for k, (toks, hit) in enumerate(COUNTED):
        _, n = _lookup_result(_at(seen, f"q{k}"), f"q{k}: {len(toks)} tokens")
        if n != hit:
            cut = (": every token of it is cached, but the last token must still be computed, so look at most at "
                   "the first (num_tokens - 1) // block_size blocks") if n == len(toks) else ""
            fail(f"get_computed_blocks(q{k}: {len(toks)} tokens) found {_shown(n)} tokens, expected {hit}{cut}")
        want = [want[0] + 1, want[1] + len(toks), want[2] + hit]
        got = seen[f"q{k}"]["stats"]
        if got != want:
            names = ["requests", "queries", "hits"]
            bad = [f"{nm} is {_shown(g)} (expected {w})" for nm, g, w in zip(names, got, want, strict=True) if g != w]
            fail(f"after {k + 1} lookup{'s' if k else ''}, prefix_cache_stats: {', '.join(bad)}. Each lookup adds 1 "
                 "to requests, the request's num_tokens to queries and the tokens found to hits")


def drive_cache_only_full_blocks(cls):
    """check_cache_only_full_blocks' scenario (caching by ``cls``, lookups by the library): what caching left
    (:func:`cache_view`) after each allocation of request ``a`` (18 tokens, then two decode steps), ``b`` (a's
    20 tokens hit, then 11 of its own), ``d`` (a prefill in chunks of 6, 6 and 10) and ``c`` (exactly 6 blocks)."""
    Manager = cache_only(cls)
    seen = Seen()
    try:
        m = seen.call(format_call(cls.__name__, (32, 4)), Manager, 32, 4)
        a = Request("a", list(range(18)))
        seen.call("allocate_slots('a', 18)", m.allocate_slots, a, 18)
        a.num_computed_tokens = 18
        seen["a18"] = cache_view(m, a)
        # decode: block 4 fills up when token 19 gets its slot
        for tok, key in ((100, "a19"), (101, "a20")):
            a.append_output_token_ids(tok)
            seen.call(f"allocate_slots(a, 1) for token {a.num_tokens - 1}", m.allocate_slots, a, 1)
            a.num_computed_tokens += 1
            seen[key] = cache_view(m, a)
        # a request with cache hits: its own new full blocks are cached after the hits
        b = Request("b", a.all_token_ids[:20] + list(range(200, 211)))  # a's 20 tokens, then 11 of its own
        hits, n = seen.call("get_computed_blocks(b)", m.get_computed_blocks, b)
        seen.call(f"allocate_slots(b, {b.num_tokens - n}, {len(hits)} hit blocks)", m.allocate_slots, b,
                  b.num_tokens - n, hits)
        b.num_computed_tokens = b.num_tokens
        seen["b"] = cache_view(m, b)
        seen["ab5"] = (m.get_block_ids("a")[:5], m.get_block_ids("b")[:5])
        # a chunked prefill: 22 tokens computed in chunks of 6, 6 and 10
        d = Request("d", list(range(700, 722)))
        for k, chunk in enumerate((6, 6, 10)):
            start = d.num_computed_tokens
            seen.call(f"allocate_slots(d, {chunk}) (a prefill chunk: tokens {start}-{start + chunk - 1} of 22)",
                      m.allocate_slots, d, chunk)
            d.num_computed_tokens += chunk
            seen[f"d{k}"] = cache_view(m, d)
        # exactly full
        c = Request("c", list(range(500, 524)))
        seen.call("allocate_slots('c', 24)", m.allocate_slots, c, 24)
        c.num_computed_tokens = 24
        seen["c"] = cache_view(m, c)
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def expect_cached(view, want, want_full, what, rid, bs=4):
    """The first want_full blocks of the request's table (``view``: :func:`cache_view`) are cached with its
    hashes (``want``: the library's view of the same step); the rest are not. The table has the library's
    length (the blocks are the library's allocate_slots'; a shorter one compares nothing)."""
    hashes = want["hashes"]
    if not isinstance(view, dict) or not isinstance(view.get("table"), list) or \
            len(view["table"]) != len(want["table"]) or "num_cached" not in view:
        _incomplete(f"after {what}", f"the view of {rid!r}'s table came back as {describe(view, 120)}, expected "
                    f"{len(want['table'])} table entries")
    for i, (bid, h, in_map) in enumerate(view["table"]):
        if i < want_full:
            if h is None:
                fail(f"after {what}, block {_shown(bid)} (index {i} of the table of {rid!r}, tokens "
                     f"{i * bs}-{(i + 1) * bs - 1}) is full but not cached"
                     + (". Nothing is cached at all: is _cache_blocks still the stub (...), or does it count the full "
                        "blocks from something other than its num_tokens argument (allocate_slots calls it before "
                        "request.num_computed_tokens moves)?" if view["nothing"]
                        else ""))
            if i >= len(hashes) or h != hashes[i]:
                fail(f"after {what}, block {_shown(bid)} (index {i}) is cached under the wrong hash: it must be "
                     f"request.block_hashes[{i}]")
            if not in_map:
                fail(f"after {what}, block {_shown(bid)} has a hash but the pool's map does not find it: use "
                     "self.block_pool.cache_full_blocks, which does both")
        elif h is not None:
            fail(f"after {what}, block {_shown(bid)} (index {i} of the table of {rid!r}, tokens from {i * bs}) "
                 f"is cached but it is not full (only the first {want_full} are): only full blocks are "
                 "cached, a partly filled block's tokens (and KV) are not final")
    got = view["num_cached"]
    if got != want_full:
        fail(f"after {what}, num_cached_block[{rid!r}] is {_shown(got)}, expected {want_full}: once the blocks "
             "are cached, record their count (self.num_cached_block[request_id] = the number of full blocks)")


def check_cache_only_full_blocks(PrefixCachingKVCacheManager):
    Learner = learner_class(PrefixCachingKVCacheManager, "PrefixCachingKVCacheManager", KVCacheManager,
                            ("get_computed_blocks", "_cache_blocks"))

    # Caching uses your _cache_blocks; lookups use the library's get_computed_blocks.
    seen = _drive(drive_cache_only_full_blocks, Learner, uses=(GET_COMPUTED_BLOCKS,), name="the caching examples")
    ref = _drive(drive_cache_only_full_blocks, KVCacheManager)

    def view(key):
        return _at(seen, key, hint=_allocate_hint)

    expect_cached(view("a18"), ref["a18"], 4, "allocate_slots(a, 18): 4 full blocks and 2 tokens over", "a")
    expect_cached(view("a19"), ref["a19"], 4, "a's decode step for token 18 (block 4 holds 3 tokens)", "a")
    expect_cached(view("a20"), ref["a20"], 5, "a's decode step for token 19 (block 4 is now full)", "a")
    expect_cached(view("b"), ref["b"], 7,
                  "allocate_slots for b (5 hit blocks, then 11 new tokens: 2 more full blocks)", "b")
    a5, b5 = view("ab5")
    if b5 != a5 or len(a5) != 5:
        fail("b's first 5 blocks should be a's (cache hits)")
    start = 0
    for k, (chunk, full) in enumerate(((6, 1), (6, 3), (10, 5))):
        expect_cached(view(f"d{k}"), ref[f"d{k}"], full,
                      f"d's prefill chunk of tokens {start}-{start + chunk - 1} (of 22)", "d")
        start += chunk
    expect_cached(view("c"), ref["c"], 6, "allocate_slots(c, 24): exactly 6 full blocks", "c")


def drive_prefix_workload(cls, part, seed=2718):
    """check_prefix_lookup_hidden's random workloads on one manager: ``part`` 0 composes ``cls``'s lookup with the
    library's caching (each lookup recorded: :func:`lookup`), 1 ``cls``'s caching with the library's lookup
    (what is cached after each allocation: :func:`cached_state`). One record per operation: ``{"op": "new",
    "what", "lookup", "alloc"}`` (``alloc``: "ok", "none" (the pool was short) or what raised, which ends the
    scenario), ``{"op": "decode", "rid", "alloc"}``, ``{"op": "free"}``, ``{"op": "idle"}``."""
    steps: list[dict[str, Any]] = []
    try:
        prefix_workload(cls, part, seed, steps)
    except Exception as exc:  # noqa: BLE001 - a library call on what the learner's code left: said as data
        steps.append({"op": "broke", "failed": {"label": "a step of the check", **raised(exc)}})
    return steps


def prefix_workload(cls, part, seed, steps):
    """:func:`drive_prefix_workload`'s steps, appended to ``steps``."""
    Manager = (lookup_only, cache_only)[part](cls)
    rng = random.Random(seed)
    for trial in range(12):
        bs = rng.choice([2, 4, 8, 16])
        nblocks = rng.randrange(40, 160)
        caching = trial != 0
        made = format_call(cls.__name__, (nblocks, bs), {"enable_caching": caching})
        ok, m = attempt(functools.partial(Manager, enable_caching=caching), (nblocks, bs), made)
        if not ok:
            steps.append({"op": "make", "failed": m})
            return
        running = []
        prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 6 * bs))] for _ in range(4)]
        for op in range(60):
            u = rng.random()
            if u < 0.5:
                toks = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 3 * bs))]
                rid = f"t{trial}-r{op}"
                what = (f"{rid}: {len(toks)} tokens (random workload {trial}"
                        f"{'' if caching else ', a manager with enable_caching=False'}, step {op})")
                r = Request(rid, toks)
                step: dict[str, Any] = {"op": "new", "what": what, "bs": bs, "num_tokens": len(toks)}
                steps.append(step)
                if part == 0:
                    step["lookup"] = found = lookup(m, r, f"get_computed_blocks({what})")
                    if lookup_failed(found):
                        return
                    hits, n = [m.block_pool.blocks[i] for i in found["ids"]], found["n"]
                    if type(n) is not int:  # the check reports the lookup
                        return
                else:
                    ok, got = attempt(m.get_computed_blocks, (r,), f"get_computed_blocks({what})")
                    if not ok:
                        step["alloc"] = got
                        return
                    hits, n = got
                ok, new = attempt(m.allocate_slots, (r, len(toks) - n, hits), f"allocate_slots({what})")
                if not ok:
                    step["alloc"] = new
                    return
                step["alloc"] = "none" if new is None else "ok"
                if new is not None:
                    r.num_computed_tokens = len(toks)
                    running.append(r)
                if part == 1:
                    step["cached"] = text(cached_state(m))
            elif not running:
                steps.append({"op": "idle"})
            else:
                k = rng.randrange(len(running))
                if u < 0.85:  # a decode step
                    tok = rng.randrange(1000)
                    r = running[k]
                    r.append_output_token_ids(tok)
                    step = {"op": "decode", "rid": r.request_id}
                    steps.append(step)
                    ok, out = attempt(m.allocate_slots, (r, 1),
                                      f"allocate_slots({r.request_id!r}, 1) (a decode step)")
                    if not ok:
                        step["alloc"] = out
                        return
                    step["alloc"] = "none" if out is None else "ok"
                    if out is not None:
                        r.num_computed_tokens += 1
                    if part == 1:
                        step["cached"] = text(cached_state(m))
                else:
                    gone = running.pop(k)
                    steps.append({"op": "free", "rid": gone.request_id})
                    ok, out = attempt(m.free, (gone,), f"free({gone.request_id!r})")
                    if not ok:
                        steps[-1]["alloc"] = out
                        return


def check_prefix_lookup_hidden(PrefixCachingKVCacheManager, half="both"):
    """Random workloads on your manager beside the library's: ``half`` "lookup" judges your get_computed_blocks
    (with the library's _cache_blocks), "caching" your _cache_blocks (with the library's lookup). Graded, each
    half is a test case of its own: a sandbox that holds the library's lookup for one half must not also hold its
    caching, or your methods could call them (``super()``) and pass both."""
    Learner = learner_class(PrefixCachingKVCacheManager, "PrefixCachingKVCacheManager", KVCacheManager,
                            ("get_computed_blocks", "_cache_blocks"))
    for part in {"lookup": (0,), "caching": (1,), "both": (0, 1)}[half]:
        uses = (CACHE_BLOCKS,) if part == 0 else (GET_COMPUTED_BLOCKS,)
        mine = _drive(drive_prefix_workload, Learner, part, uses=uses, kind=list, name="the random workloads")
        ref = _drive(drive_prefix_workload, KVCacheManager, part, kind=list)
        _compare_workloads(mine, ref, part)


def _compare_workloads(mine, ref, part):
    """Your manager's records (:func:`drive_prefix_workload`) against the library's, in order: every lookup and
    every cache must agree."""
    for got, want in zip(mine, ref, strict=False):
        if "failed" in got:
            fail(_said(got["failed"]))
        if got.get("op") != want.get("op"):  # the same workload on both: only a failure ends one early
            fail(f"the random workload went differently on your manager ({got.get('op')}) and on the library's "
                 f"({want.get('op')})")
        alloc = got.get("alloc")
        if want["op"] == "new":
            what = want["what"]
            if part == 0:
                got_ids, got_n = _lookup_result(got["lookup"], what)
                w = want["lookup"]
                if (got_ids, got_n) != (w["ids"], w["n"]):
                    why = _hit_hint(want["bs"], want["num_tokens"], got_ids, got_n, w["ids"])
                    fail(f"get_computed_blocks({what}) found blocks {got_ids} ({_shown(got_n)} tokens), expected "
                         f"{w['ids']} ({w['n']} tokens)" + (f". {why}" if why else ""))
                if got["lookup"]["stats"] != w["stats"]:
                    fail(f"after get_computed_blocks({what}), prefix_cache_stats is "
                         f"{_fmt_stats(got['lookup']['stats'])}, expected {_fmt_stats(w['stats'])}")
            if isinstance(alloc, dict):
                fail(_allocate_said(alloc) if part == 1 else _said(alloc))
            if alloc != want["alloc"]:
                fail(f"allocate_slots({what}) succeeded on one manager and failed on the other")
            if part == 1 and got["cached"] != want["cached"]:
                fail(f"after allocate_slots({what}), {_cached_diff(got['cached'], want['cached'])}")
        elif want["op"] == "decode":
            if isinstance(alloc, dict):
                fail(_allocate_said(alloc) if part == 1 else _said(alloc))
            if alloc != want["alloc"]:
                fail("a decode step's allocate_slots succeeded on one manager and failed on the other")
            if part == 1 and got["cached"] != want["cached"]:
                fail(f"after a decode step of {want['rid']!r}, {_cached_diff(got['cached'], want['cached'])}")
        elif want["op"] == "free" and isinstance(alloc, dict):
            fail(_said(alloc))
    all_came_back(mine, len(ref), "steps", "the random workloads")


def _cached_diff(got, want):
    """How two :func:`cached_state` (as :func:`text` wrote them) differ: the cached table entries, else the map."""
    got, want = _read(got), _read(want)
    if not (isinstance(got, tuple) and isinstance(want, tuple)) or got[0] != want[0]:
        return (f"the cached blocks differ from the library's: yours {got[0] if isinstance(got, tuple) else got}, "
                f"expected {want[0]}")
    return f"the prefix cache's map (hash: block ids) is {got[1]}, expected {want[1]}"


# --------------------------------------------------------------------------------------------------------
# 3. Eviction on reuse (free_blocks, get_new_blocks)
# --------------------------------------------------------------------------------------------------------
def _learner_pool(EvictingBlockPool):
    """The learner's EvictingBlockPool: defined, a BlockPool, with its own free_blocks and get_new_blocks."""
    return learner_class(EvictingBlockPool, "EvictingBlockPool", BlockPool, ("free_blocks", "get_new_blocks"))


def drive_free_blocks_order(cls):
    """check_free_blocks_order's scenario, ``cls``'s free_blocks: blocks 1-6 held (taken from the free queue here,
    not with the pool's get_new_blocks), 1 and 3 cached, then free_blocks([1, 2, 3, 4]) (``first``: the queue,
    ref_cnts, what 1 and 3 hold); block 5 touched and freed once (``once``); free_blocks of a generator of [6, 5]
    (``generator``)."""
    seen = Seen()
    try:
        pool = seen.call(format_call(cls.__name__, (10,)), cls, 10)  # usable blocks 1..9
        b = [pool.free_block_queue.popleft() for _ in range(6)]  # blocks 1..6 held; queue [7, 8, 9]
        for x in b:
            x.ref_cnt = 1
        cache(pool, b[0], 101)
        cache(pool, b[2], 103)
        seen.call("free_blocks([1 (cached), 2, 3 (cached), 4])", pool.free_blocks, [b[0], b[1], b[2], b[3]])
        seen["first"] = {"queue": queue(pool), "ref_cnt": [num(x.ref_cnt) for x in b],
                         "kept": [(plain(blk.block_hash), describe(pool.get_cached_block(h)),
                                   pool.get_cached_block(h) is blk) for blk, h in ((b[0], 101), (b[2], 103))]}
        # a block held by two requests stays held when one lets go
        seen.call("touch([5])", pool.touch, [b[4]])
        seen.call("free_blocks([5]) with ref_cnt 2", pool.free_blocks, [b[4]])
        seen["once"] = {"ref_cnt": num(b[4].ref_cnt), "queue": queue(pool)}
        seen.call("free_blocks(a generator of [6, 5])", pool.free_blocks, (x for x in [b[5], b[4]]))
        seen["generator"] = queue(pool)
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def check_free_blocks_order(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    seen = _drive(drive_free_blocks_order, Learner, name="the free_blocks examples")
    first = _at(seen, "first", hint=_pool_hint)
    got, want = first["queue"], [2, 4, 7, 8, 9, 1, 3]
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
             f"expected {want}. " + hints.get(tuple(got) if all(type(x) is int for x in got) else (),
                                              "Blocks without a hash go to the head as a group, in the order given; "
                                              "cached blocks go to the tail, in the order given"))
    if first["ref_cnt"] != [0, 0, 0, 0, 1, 1]:
        fail(f"after freeing blocks 1-4 once, the ref_cnts of blocks 1-6 are {first['ref_cnt']}, expected "
             "[0, 0, 0, 0, 1, 1]")
    for (i, h), (got_hash, found, same) in zip(((1, 101), (3, 103)), first["kept"], strict=True):
        if got_hash != h or not same:
            fail(f"free_blocks evicted block {i} (its hash is {_shown(got_hash)}, the map gives {found}): a freed "
                 "cached block keeps its hash and its entry in cached_block_hash_to_block until it is popped for "
                 "reuse, so a later request can still hit it")
    once = _at(seen, "once", hint=_pool_hint)
    if once["ref_cnt"] != 1 or 5 in once["queue"]:
        fail(f"block 5 had ref_cnt 2; after one free it must have ref_cnt 1 and stay out of the free queue, got "
             f"ref_cnt {_shown(once['ref_cnt'])} and queue {once['queue']}")
    last = _at(seen, "generator", hint=_pool_hint)
    if last != [6, 5, 2, 4, 7, 8, 9, 1, 3]:
        fail(f"after free_blocks([6, 5]) the queue is {last}, expected [6, 5, 2, 4, 7, 8, 9, 1, 3] (and "
             "ordered_blocks may be any iterable: read it once, e.g. list(ordered_blocks))")


#: check_free_blocks_bad_input's calls, on blocks 1-3 of which 1 is free: (positions in the table, what).
BAD_FREES = [([0], "free_blocks([1]) when block 1 is already free"),
             ([1, 2, 1], "free_blocks([2, 3, 2]) when blocks 2 and 3 have ref_cnt 1"),
             ([2, 0], "free_blocks([3, 1]) when block 1 is free")]


def drive_free_blocks_bad_input(cls):
    """check_free_blocks_bad_input's scenario, ``cls``'s free_blocks: blocks 1-3 held (taken from the free queue
    here), block 1 freed (``first``), then each call of :data:`BAD_FREES` with the pool's state before and after
    it and what it did (``"returned"``, or what it raised)."""
    seen = Seen()
    try:
        pool = seen.call(format_call(cls.__name__, (6,)), cls, 6)
        b = [pool.free_block_queue.popleft() for _ in range(3)]
        for x in b:
            x.ref_cnt = 1
        seen.call("free_blocks([1])", pool.free_blocks, [b[0]])
        seen["first"] = {"queue": queue(pool), "ref_cnt": num(b[0].ref_cnt)}
        bad = []
        for picks, what in BAD_FREES:
            before = state(pool)
            ok, got = attempt(pool.free_blocks, ([b[i] for i in picks],), what)
            if not ok and got.get("timeout"):
                seen.data["failed"] = got
                raise Stop
            bad.append({"did": "returned" if ok else got, "before": before, "after": state(pool)})
        seen["bad"] = bad
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def _sorted(values):
    return sorted(values) if all(type(v) is int for v in values) else values


def check_free_blocks_bad_input(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    seen = _drive(drive_free_blocks_bad_input, Learner, name="the free_blocks refusals")
    first = _at(seen, "first", hint=_pool_hint)
    held = _sorted(first["queue"])
    if held != [1, 4, 5] or first["ref_cnt"] != 0:  # where block 1 goes is check_free_blocks_order's
        fail(f"after free_blocks([1]) the free queue holds blocks {held} and block 1 has ref_cnt "
             f"{_shown(first['ref_cnt'])}, expected blocks [1, 4, 5] (in any order for this case) and ref_cnt 0"
             + (". Nothing changed: is free_blocks still the stub (...)?" if first["ref_cnt"] == 1 and held == [4, 5]
                else ""))
    bad = _at(seen, "bad")
    if not isinstance(bad, list) or len(bad) != len(BAD_FREES) or \
            not all(type(x) is dict and {"did", "before", "after"} <= set(x) for x in bad):
        _incomplete("the free_blocks refusals", f"they came back as {describe(bad, 80)}, expected {len(BAD_FREES)}")
    for (_, what), step in zip(BAD_FREES, bad, strict=True):
        did = step["did"]
        if did == "returned":
            fail(f"{what} returned; expected ValueError (a double free would corrupt ref_cnt and the queue)")
        if not _raised_kind(did, "ValueError"):
            fail(f"{what} raised {did.get('raised')}: {did.get('message')}; expected ValueError")
        why = diff(step["after"], step["before"])
        if why:
            fail(f"{what} raised ValueError but changed the pool first: {why}. Check every block before changing any")


#: check_get_new_blocks_evicts_on_reuse's second call, on the queue the first one and the library's free left.
TWO_OF_FIVE = "get_new_blocks(2) on the free queue [5, 3 (hash 103), 1 (hash 101), 2 (hash 102), 4 (hash 103)]"


def drive_get_new_blocks(cls):
    """check_get_new_blocks_evicts_on_reuse's scenario, ``cls``'s get_new_blocks: get_new_blocks(9) on a fresh
    pool (``nine``); blocks 3, 1, 2, 4 cached (3 and 4 the same prefix) and put back at the tail of the free queue,
    then 5 at its head (here, not with the pool's free_blocks); :data:`TWO_OF_FIVE` (``two``: what it returned,
    what it evicted, what stayed); get_new_blocks(4) with 3 free (``four``); get_new_blocks(0) (``zero``);
    get_new_blocks(3) (``rest``)."""
    seen = Seen()
    try:
        pool = seen.call(format_call(cls.__name__, (10,)), cls, 10)
        got = seen.call("get_new_blocks(9)", pool.get_new_blocks, 9)
        seen["nine"] = {"ids": returned(pool, got),
                        "ref_cnt": [num(x.ref_cnt) for x in got] if isinstance(got, list) and
                        all(is_pool_block(pool, x) for x in got) else None}
        if seen.data["nine"]["ids"] != list(range(1, 10)):
            raise Stop
        b = {x.block_id: x for x in got}
        for i, h in ((3, 103), (1, 101), (2, 102), (4, 103)):  # blocks 3 and 4 hold the same prefix
            cache(pool, b[i], h)
        for i in (3, 1, 2, 4):  # free again, cached: to the tail, in this order
            b[i].ref_cnt = 0
            pool.free_block_queue.append(b[i])
        b[5].ref_cnt = 0  # free again, no hash: to the head
        pool.free_block_queue.appendleft(b[5])
        # queue: [5, 3, 1, 2, 4]
        got = seen.call(TWO_OF_FIVE, pool.get_new_blocks, 2)
        entry = pool.cached_block_hash_to_block.get(103)
        seen["two"] = {
            "ids": returned(pool, got),
            "hash_3": plain(b[3].block_hash),
            "entry_103": {"text": describe(entry), "keys": sorted(entry) if isinstance(entry, dict) and
                          all(type(k) is int for k in entry) else None,
                          "four_is_4": isinstance(entry, dict) and entry.get(4) is b[4]},
            "evictions": num(pool.num_evictions),
            "kept": [(i, h, plain(b[i].block_hash), pool.get_cached_block(h) is not None)
                     for i, h in ((1, 101), (2, 102), (4, 103))],
            "ref_cnt": [num(x.ref_cnt) for x in got] if isinstance(got, list) and
            all(is_pool_block(pool, x) for x in got) else None,
            "queue": queue(pool),
        }
        before = state(pool)
        ok, four = attempt(pool.get_new_blocks, (4,), "get_new_blocks(4) with 3 free blocks")
        if not ok and four.get("timeout"):
            seen.data["failed"] = four
            raise Stop
        seen["four"] = {"did": returned(pool, four) if ok else four, "returned": ok, "before": before,
                        "after": state(pool)}
        if ok:
            raise Stop
        zero = seen.call("get_new_blocks(0)", pool.get_new_blocks, 0)
        seen["zero"] = returned(pool, zero)
        rest = seen.call("get_new_blocks(3)", pool.get_new_blocks, 3)
        seen["rest"] = {"ids": returned(pool, rest), "map": describe(pool.cached_block_hash_to_block),
                        "map_empty": not pool.cached_block_hash_to_block, "evictions": num(pool.num_evictions)}
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def check_get_new_blocks_evicts_on_reuse(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    seen = _drive(drive_get_new_blocks, Learner, name="the get_new_blocks examples")
    nine = _at(seen, "nine", hint=_pool_hint)
    if nine["ids"] != list(range(1, 10)):
        shown = nine["ids"]
        fail(f"get_new_blocks(9) on a fresh pool of 10 returned {_shown(shown)}, expected blocks 1..9 in order "
             "(popped from the head of the free queue)" + (". Is it still the stub?" if shown is None else ""))
    if nine["ref_cnt"] != [1] * 9:
        fail(f"blocks handed out must have ref_cnt 1, got {nine['ref_cnt']}")
    two = _at(seen, "two", hint=_pool_hint)
    if two["ids"] != [5, 3]:
        fail(f"get_new_blocks(2) on the free queue [5, 3, 1, 2, 4] returned {_shown(two['ids'])}, expected [5, 3]: "
             "pop from the head (popleft)")
    if two["hash_3"] is not None:
        fail("block 3 was handed out but still has its hash: a cached block popped for reuse is evicted now: clear "
             "its hash (block.reset_hash()) and remove it from cached_block_hash_to_block")
    entry = two["entry_103"]
    if not entry["keys"] or 3 in entry["keys"] or not entry["four_is_4"]:
        fail(f"after evicting block 3, cached_block_hash_to_block[103] is {entry['text']}, expected {{4: block 4}}: "
             "remove only the evicted block from its hash's dict (block 4 still holds that prefix)")
    if two["evictions"] != 1:
        fail(f"num_evictions is {_shown(two['evictions'])} after evicting one cached block (block 3), expected 1 "
             "(block 5 had no hash: reusing it evicts nothing)")
    for i, h, got_hash, found in two["kept"]:
        if got_hash != h or not found:
            fail(f"block {i} is still in the free queue and must still hold its cached prefix {h!r} (evict a block "
                 f"only when it is popped), but its hash is {_shown(got_hash)}")
    if two["ref_cnt"] != [1, 1] or two["queue"] != [1, 2, 4]:
        fail(f"after get_new_blocks(2): ref_cnts {two['ref_cnt']} (expected [1, 1]), free queue "
             f"{two['queue']} (expected [1, 2, 4])")

    four = _at(seen, "four")
    if four["returned"]:
        fail("get_new_blocks(4) with 3 free blocks returned; expected ValueError")
    if not _raised_kind(four["did"], "ValueError"):
        fail(f"get_new_blocks(4) with 3 free blocks raised {four['did'].get('raised')}: {four['did'].get('message')}; "
             "expected ValueError")
    why = diff(four["after"], four["before"])
    if why:
        did = four["did"]
        fail(f"get_new_blocks(4) with 3 free blocks raised {did.get('raised')} ({did.get('message')}"
             f"{did.get('where')}) but changed the pool first: {why}. Check that enough blocks are free before "
             "popping any")
    if _at(seen, "zero", hint=_pool_hint) != []:
        fail("get_new_blocks(0) must return []")
    rest = _at(seen, "rest", hint=_pool_hint)
    if rest["ids"] != [1, 2, 4] or not rest["map_empty"] or rest["evictions"] != 4:
        fail(f"get_new_blocks(3) on [1, 2, 4] (all cached) must evict all three: map {rest['map']} (expected "
             f"empty), num_evictions {_shown(rest['evictions'])} (expected 4)")


def drive_eviction_with_manager(pool_cls):
    """check_eviction_with_the_manager's scenario: a shared system prompt under memory pressure, in a
    KVCacheManager of 24 blocks of 4 whose pool is a ``pool_cls``. ``log``: each request's (id, tokens hit, block
    table or None when the pool was short); ``state``: the pool's at the end (:func:`state`)."""
    seen = Seen()
    try:
        m = KVCacheManager(24, 4)
        m.block_pool = seen.call(format_call(pool_cls.__name__, (24,)), pool_cls, 24)
        system = list(range(1000, 1016))  # 4 blocks
        rng = random.Random(7)
        log = []
        seen["log"] = log
        live = []
        for i in range(14):
            toks = system + [rng.randrange(100) for _ in range(rng.randrange(1, 14))] if i % 3 else \
                [rng.randrange(100, 200) for _ in range(rng.randrange(5, 30))]
            r = Request(f"r{i}", toks)
            hits, n = seen.call(f"get_computed_blocks(r{i})", m.get_computed_blocks, r)
            new = seen.call(f"allocate_slots(r{i}, {r.num_tokens - n})", m.allocate_slots, r, r.num_tokens - n, hits)
            log.append((f"r{i}", n, None if new is None else m.get_block_ids(r.request_id)))
            if new is not None:
                r.num_computed_tokens = r.num_tokens
                live.append(r)
            if len(live) > 2 or new is None:
                gone = live.pop(0)
                seen.call(f"free({gone.request_id})", m.free, gone)
        seen["state"] = state(m.block_pool)
    except Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - said as data
        seen.broke(exc)
    return seen.data


def check_eviction_with_the_manager(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    # A shared system prompt under memory pressure, run on your pool and on the library's.
    mine = _drive(drive_eviction_with_manager, Learner, name="the shared-system-prompt scenario")
    ref = _drive(drive_eviction_with_manager, BlockPool)
    if "failed" in mine:
        _at(mine, "state", hint=_pool_hint)
    log = _at(mine, "log")
    if not isinstance(log, list) or len(log) != len(ref["log"]) or \
            not all(isinstance(x, (list, tuple)) and len(x) == 3 for x in log):
        _incomplete("the shared-system-prompt scenario", f"its log came back as {describe(log, 80)}, expected "
                    f"{len(ref['log'])} requests")
    _at(mine, "state")
    for (rid, n_want, t_want), (_, n_got, t_got) in zip(ref["log"], log, strict=True):
        if (n_got, t_got) != (n_want, t_want):
            fail(f"with your pool in a KVCacheManager, request {rid} hit {n_got} cached tokens and got the block table "
                 f"{t_got}; with the library's pool: {n_want} tokens and {t_want}. The eviction order decides which "
                 "prefixes survive: check free_blocks' head/tail rule and get_new_blocks' popleft")
    why = diff(mine["state"], ref["state"])
    if why:
        fail(f"after the shared-system-prompt scenario, your pool's {why}")


def drive_eviction_hidden(cls, seed=161803):
    """check_eviction_hidden's scenario: random operations on ``cls``'s pool (get_new_blocks, free_blocks, caching
    a held block, touching a cached one, freeing a free block). One record per trial (``n`` blocks, or the
    ``failed`` construction) with one per step: the operation (``op``, None when the step did nothing, ``k`` and
    ``free`` for get_new_blocks), what the pool's method did (``did``: returned block ids, ``"returned"``, or what
    it raised; a raise other than ``ValueError`` or a timeout ends the scenario) and the pool's state after it."""
    rng = random.Random(seed)
    trials: list[dict[str, Any]] = []
    for _ in range(25):
        n = rng.randrange(3, 20)
        ok, pool = attempt(cls, (n,), format_call(cls.__name__, (n,)))
        if not ok:
            trials.append({"n": n, "failed": pool})
            return trials
        held: list[int] = []  # block ids, one entry per reference
        steps: list[dict[str, Any]] = []
        trials.append({"n": n, "steps": steps})
        for step in range(80):
            u = rng.random()
            rec: dict[str, Any] = {"op": None}
            steps.append(rec)
            try:
                if u < 0.35:
                    k = rng.randrange(0, n + 1)
                    rec.update(op=f"get_new_blocks({k})", k=k, free=num(pool.get_num_free_blocks()))
                    ok, got = attempt(pool.get_new_blocks, (k,), rec["op"], ValueError)
                    rec["did"] = returned(pool, got) if ok else got
                    if ok and isinstance(rec["did"], list):
                        held += rec["did"]
                    if not ok and not _raised_kind(got, "ValueError"):
                        return trials
                elif u < 0.65 and held:
                    pick = rng.sample(range(len(held)), rng.randrange(1, min(4, len(held)) + 1))
                    ids_ = [held[i] for i in pick]
                    for i in sorted(pick, reverse=True):
                        held.pop(i)
                    rec["op"] = f"free_blocks({ids_})"
                    ok, got = attempt(pool.free_blocks, ([pool.blocks[i] for i in ids_],), rec["op"])
                    if not ok:
                        rec["did"] = got
                        return trials
                elif u < 0.8 and held:
                    i = rng.choice(held)
                    if pool.blocks[i].block_hash is None:
                        h = rng.choice([1, 2, 3, 4, 1000 + step])
                        rec["op"] = f"cache block {i} as {h!r}"
                        cache(pool, pool.blocks[i], h)
                elif u < 0.9:
                    h = rng.choice([1, 2, 3, 4])
                    blk = pool.get_cached_block(h)
                    if blk is not None:
                        rec["op"] = f"touch the cached block {blk.block_id} ({h!r})"
                        pool.touch([blk])
                        held.append(blk.block_id)
                else:
                    rec["op"] = "double free"
                    free_ids = [i for i in queue(pool) if type(i) is int]
                    if free_ids:
                        ok, got = attempt(pool.free_blocks, ([pool.blocks[rng.choice(free_ids)]],), "double free",
                                          ValueError)
                        rec["did"] = "returned" if ok else got
                        if not ok and got.get("timeout"):
                            return trials
            except Exception as exc:  # noqa: BLE001 - a library call on what the learner's code left
                rec["did"] = {"label": "a step of the check", **raised(exc)}
                return trials
            rec["state"] = text(state(pool))
    return trials


def check_eviction_hidden(EvictingBlockPool):
    Learner = _learner_pool(EvictingBlockPool)

    # Random operations on your pool and the library's, side by side.
    mine = _drive(drive_eviction_hidden, Learner, kind=list, name="the random pool operations")
    ref = _drive(drive_eviction_hidden, BlockPool, kind=list)
    for got_trial, want_trial in zip(mine, ref, strict=False):
        if "failed" in got_trial:
            fail(_said(got_trial["failed"]))
        n = want_trial["n"]
        history: list[str] = []
        steps = scenario_records(got_trial.get("steps"), "the random pool operations", at_most=len(want_trial["steps"]),
                                 unit="steps")
        for got, want in zip(steps, want_trial["steps"], strict=False):
            if want["op"] is not None:
                history.append(want["op"])
            recent = "; ".join(history[-6:])
            did, expected = got.get("did"), want.get("did")
            if isinstance(did, dict) and did.get("label") == "a step of the check":
                fail(f"random operations on a pool of {n} blocks: after {recent}: {_said(did)}")
            if "k" in want:  # get_new_blocks(k)
                if isinstance(did, dict) and not _raised_kind(did, "ValueError"):
                    fail(_said(did, recent) if did.get("timeout") else
                         f"{recent} raised {did.get('raised')}: {did.get('message')}{did.get('where', '')}")
                if isinstance(expected, list):
                    if did != expected:
                        shown = None if isinstance(did, dict) and "raised" in did else did
                        fail(f"after {recent}: returned {_shown(shown)}, expected {expected}")
                elif did is not None and not (isinstance(did, dict) and "raised" in did):
                    fail(f"{history[-1]} with {want['free']} free blocks must raise ValueError")
            elif want["op"] == "double free" and expected is not None:
                if did == "returned":
                    fail("free_blocks of a block that is already free must raise ValueError")
                if isinstance(did, dict) and did.get("timeout"):
                    fail(_said(did))
                if not _raised_kind(did, "ValueError"):
                    fail(f"free_blocks of a block that is already free raised {did.get('raised')}: "
                         f"{did.get('message')}, expected ValueError" if isinstance(did, dict) else
                         f"random operations on a pool of {n} blocks: after {recent}: your pool had no free block")
            elif isinstance(did, dict):  # free_blocks
                fail(_said(did, history[-1], _pool_hint(did)))
            if got.get("state") != want["state"]:
                why = diff(_read(got.get("state")), _read(want["state"]))
                if why:
                    fail(f"random operations on a pool of {n} blocks: after {recent}: {why}")
        if len(steps) < len(want_trial["steps"]):
            fail(f"random operations on a pool of {n} blocks stopped early, after {'; '.join(history[-6:])}")
    all_came_back(mine, len(ref), "trials", "the random pool operations")


# --------------------------------------------------------------------------------------------------------
# 4. copy_on_write
# --------------------------------------------------------------------------------------------------------
def cow_manager(copy_on_write):
    """A KVCacheManager whose allocate_slots first calls ``copy_on_write(manager, request, num_new_tokens)`` for a
    running request, with the library's own copy-on-write switched off.

    The copies must be copy_on_write's own changes to the tables and the pool. A method it plants on the manager
    (which the library's allocate_slots would then call, to make the copy for it), a change to the manager's
    class, a call of the manager's own methods that change tables (its allocate_slots makes copies), or a table
    entry that allocate_slots replaces after copy_on_write returned: each is refused (:class:`Refused`)."""
    inside: list[bool] = []

    def _blocks_written(self, request, blocks, num_new_tokens):
        return []  # the library's own rule: disabled here

    def _record(self, event=None, request_id=None):
        if inside:  # the manager's own allocate_slots (or free, fork) ran inside copy_on_write
            inside.append(True)
        return KVCacheManager._record(self, event, request_id)

    def allocate_slots(self, request, num_new_tokens, new_computed_blocks=None):
        rid = request.request_id
        before = None
        if rid in self.req_to_blocks and not new_computed_blocks:
            inside[:] = [True]
            try:
                ok, got = attempt(copy_on_write, (self, request, num_new_tokens),
                                  f"copy_on_write(manager, {rid!r}, {num_new_tokens})")
            finally:
                reentered = len(inside) > 1
                inside.clear()
            if not ok:
                raise LearnerFailed(got)
            # the copy must be the learner's: a method planted on the manager would hand it to the library's
            planted = sorted(n for n in vars(self) if callable(getattr(type(self), n, None)))
            for name in planted:
                vars(self).pop(name)
            if planted:
                raise Refused(f"copy_on_write set {', '.join(planted)} on the manager: change its block tables and "
                              "the pool's blocks, not its methods")
            if type(self) is not manager or any(vars(manager).get(k) is not v for k, v in own.items()):
                raise Refused("copy_on_write changed the manager's class: change its block tables and the pool's "
                              "blocks, not its methods")
            if reentered:
                raise Refused("copy_on_write called the manager's own allocate_slots (or another of its methods "
                              "that change the tables), which makes the copies for it: make them yourself, with "
                              "manager.block_pool and manager.req_to_blocks")
            before = list(self.req_to_blocks.get(rid, []))
        out = KVCacheManager.allocate_slots(self, request, num_new_tokens, new_computed_blocks)
        if before is not None:
            after = self.req_to_blocks.get(rid, [])
            if len(after) < len(before) or any(x is not y for x, y in zip(before, after, strict=False)):
                raise Refused("allocate_slots replaced blocks of the table after copy_on_write returned, although "
                              "the library's copy-on-write is switched off here: something copy_on_write changed "
                              "made the library copy for it. Make the copies in copy_on_write itself")
        return out

    own = {"_blocks_written": _blocks_written, "_record": _record, "allocate_slots": allocate_slots}
    manager = type("CoWKVCacheManager", (KVCacheManager,), dict(own))
    return manager


class World:
    """A manager and its shadow cache, where each slot holds the token written there. The manager calls the
    learner's ``copy_on_write`` (:func:`cow_manager`), or, given None, is the library's own."""

    def __init__(self, copy_on_write, num_blocks, bs):
        cls = KVCacheManager if copy_on_write is None else cow_manager(copy_on_write)
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
        """rid appends tokens and computes them (their KV is written at their slots); the copies recorded."""
        r = self.reqs[rid]
        start = r.num_computed_tokens
        r.append_output_token_ids(tokens)
        label = f"allocate_slots({rid!r}, {len(tokens)})"
        try:
            out = self.m.allocate_slots(r, len(tokens))
        except (LearnerFailed, Refused):
            raise
        except Exception as exc:  # noqa: BLE001 - the library's allocate_slots, on what copy_on_write left
            raise LearnerFailed({"label": label, **raised(exc)}) from None
        if out is None:
            raise LearnerFailed({"label": label, "out_of_blocks": True})
        pairs = self.m.get_pending_copies()
        self.copies += pairs
        try:
            self.shadow.copy_blocks(pairs)
            self.shadow.write(self.m.get_slot_mapping(rid, start, start + len(tokens)), tokens)
        except Exception as exc:  # noqa: BLE001 - copies that name no block
            raise LearnerFailed({"label": f"copying the blocks of manager.pending_copies {describe(pairs)}",
                                 **raised(exc)}) from None
        r.num_computed_tokens += len(tokens)
        return plain(pairs)

    def read(self, rid):
        r = self.reqs[rid]
        return self.shadow.read(self.m.get_block_ids(rid), r.num_computed_tokens)

    def view(self):
        """What the checks compare after a step: each request's table (block ids) and what it reads back from the
        shadow cache along it (its computed tokens), and the number of free blocks."""
        tables, reads = {}, {}
        for rid, blocks in self.m.req_to_blocks.items():
            tables[rid] = [ident(b) for b in blocks]
            try:
                reads[rid] = self.read(rid)
            except Exception as exc:  # noqa: BLE001 - a table the learner's code broke
                reads[rid] = {"$repr": f"unreadable ({type(exc).__name__}: {exc})"}
        return {"tables": by_key(tables), "reads": by_key(reads), "free": num(self.m.get_num_free_blocks())}


def cow_failure(exc: BaseException) -> dict[str, Any]:
    """The step of a copy-on-write scenario that ended it, as data."""
    if isinstance(exc, LearnerFailed):
        return exc.record
    if isinstance(exc, Refused):
        return {"refused": str(exc)}
    return {"label": "a step of the check", **raised(exc)}


def check_reads(view, want, bs, what):
    """Each request reads back its own tokens (``want``: the library's view of the same step; every request of
    it must be in ``view``)."""
    reads = view.get("reads") if isinstance(view, dict) else None
    if not isinstance(reads, dict) or not set(want["reads"]) <= set(reads) or \
            not isinstance(view.get("tables"), dict) or not set(want["tables"]) <= set(view["tables"]):
        _incomplete(what, f"the requests' reads came back as {describe(view, 120)}, expected one per request "
                    f"{sorted(want['reads'])}")
    for rid, own in want["reads"].items():
        got = reads[rid]
        if got == own:
            continue
        if not isinstance(got, list):
            fail(f"{what}: the table of {rid!r} cannot be read back: {_shown(got)}")
        pos = next((i for i, (g, x) in enumerate(zip(got, own, strict=False)) if g != x), min(len(got), len(own)))
        if pos >= len(got) or pos >= len(own):
            fail(f"{what}: {rid!r} reads back {len(got)} tokens, expected {len(own)}")
        table = view["tables"][rid]
        block = table[pos // bs] if pos // bs < len(table) else None
        holders = [o for o, t in view["tables"].items() if block in t]
        fail(f"{what}: {rid!r} reads back token {got[pos]} at position {pos}, but its own token there is "
             f"{own[pos]} (block {block}, now held by {holders}). A branch wrote into a block it shared "
             "(ref_cnt > 1) in place, or a copy was lost: the writer must get a private copy first, put it in "
             "its table in place of the shared block, and record the copy in manager.pending_copies")


def _cow_missing_hint(view, rid, want, position, bs):
    """Why a write that should have recorded the copies ``want`` recorded none (``view``: :meth:`World.view` after
    it): the writer still holds the shared block (no private block taken), or it took one and recorded no copy."""
    src = want[0][0]
    table = view.get("tables", {}).get(rid) if isinstance(view, dict) else None
    if isinstance(table, list) and src in table:
        return (f": {rid}'s table still holds block {src}, which other branches share (ref_cnt > 1), so it wrote in "
                f"place. A shared block that the write lands in must be copied first: the write starts at position "
                f"{position}, in table index {position} // {bs} = {position // bs}, and every shared block from index "
                "num_computed_tokens // block_size up to the block of the last position written needs a private block "
                "(and a copy when it holds computed tokens). Is copy_on_write still the stub?")
    return (": a shared block that holds computed tokens must be copied: after taking its private block, record "
            "(src.block_id, dst.block_id) in manager.pending_copies")


def drive_cow_parallel_sampling(copy_on_write):
    """check_cow_parallel_sampling's scenario: one 10-token prompt (blocks of 4), forked three times; the four
    branches write an output token each, three rounds (``writes``: the copies recorded and :meth:`World.view`
    after each); the tables and the prompt blocks' ref_cnt after that; the free blocks once all are freed."""
    seen = Seen()
    try:
        w = World(copy_on_write, 24, 4)
        w.prefill("s0", list(range(10, 20)))
        for k in (1, 2, 3):
            w.fork("s0", f"s{k}")
        shared = w.m.get_block_ids("s0")
        seen["shared"] = shared
        writes: list[dict[str, Any]] = []
        seen["writes"] = writes
        for base in (100, 200, 300):
            for k in range(4):
                pairs = w.write(f"s{k}", [base + k])
                writes.append({"pairs": pairs, **w.view()})
        seen["tables"] = {f"s{k}": w.m.get_block_ids(f"s{k}") for k in range(4)}
        seen["prompt_ref_cnt"] = [num(w.m.block_pool.blocks[i].ref_cnt) for i in shared[:2]]
        seen["copies"] = len(w.copies)
        for k in range(4):
            w.m.free(w.reqs[f"s{k}"])
        seen["end"] = {"free": num(w.m.get_num_free_blocks()), "usable": w.m.num_gpu_blocks - 1,
                       "held": [b.block_id for b in w.m.block_pool.blocks[1:] if b.ref_cnt]}
    except Exception as exc:  # noqa: BLE001 - said as data
        seen["failed"] = cow_failure(exc)
    return seen.data


def check_cow_parallel_sampling(copy_on_write):
    require_function(copy_on_write, "copy_on_write")

    # n = 4: one 10-token prompt (blocks of 4: two full blocks, one holding 2 tokens), three forks.
    mine = _drive(drive_cow_parallel_sampling, copy_on_write, name="the parallel-sampling scenario")
    ref = _drive(drive_cow_parallel_sampling, None)
    _at(mine, "shared")
    shared = ref["shared"]  # the library's prefill made it: the same on both
    writes = mine.get("writes", [])
    if not isinstance(writes, list) or not all(type(x) is dict and "pairs" in x for x in writes):
        _incomplete("the parallel-sampling scenario", f"its writes came back as {describe(writes, 80)}")
    i = 0
    for rnd in range(3):
        for k in range(4):
            if i >= len(writes):
                _fail_with(mine.get("failed"))
            got, want = writes[i]["pairs"], ref["writes"][i]["pairs"]
            nth = ("first", "second", "third")[rnd]
            if got != want:  # before the reads: a wrong copy list is the cause of the reads that go wrong
                fail(f"when s{k} wrote its {nth} output token (position {10 + rnd}), the copies recorded were {got}, "
                     f"expected {want}" + (
                         ": the block it writes into is no longer shared (ref_cnt 1), so it writes in place. Still "
                         "ref_cnt > 1? Then the branches that copied before kept their reference on it: taking a "
                         "copy drops the writer's reference on the shared block (manager.block_pool.free_blocks([src]))"
                         if not want and got else
                         ": each pair is (src, dst), the shared block first, then the fresh one"
                         if isinstance(got, list) and got == [(d, s_) for s_, d in want] else
                         ": only the blocks the write lands in (from index num_computed_tokens // block_size) can "
                         "need a copy; the full blocks before them stay shared"
                         if isinstance(got, list) and len(got) > len(want) else
                         _cow_missing_hint(writes[i], f"s{k}", want, 10 + rnd, 4) if want and not got
                         else ""))
            check_reads(writes[i], ref["writes"][i], 4,
                        f"after s{k} wrote its {nth} output token (branches s0..s3 share a 10-token prompt)")
            i += 1
    # the two full blocks stay shared by all four branches
    tables = _at(mine, "tables")
    if not isinstance(tables, dict) or set(tables) != set(ref["tables"]):
        _incomplete("the parallel-sampling scenario", f"its tables came back as {describe(tables, 80)}")
    for k in range(4):
        t = tables[f"s{k}"]
        if t[:2] != shared[:2]:
            fail(f"s{k}'s table is {t}: its first two blocks should still be the shared full blocks {shared[:2]}. "
                 "Full shared blocks are never copied: nobody writes into them again")
    if _at(mine, "prompt_ref_cnt") != [4, 4]:
        fail("the two full prompt blocks should have ref_cnt 4 (one per branch)")
    if _at(mine, "copies") != 3:
        fail(f"{mine['copies']} copies were made for 4 branches, expected 3 (the last writer owns the block)")
    # freeing every branch returns every block
    end = _at(mine, "end")
    if not isinstance(end, dict) or not {"free", "held"} <= set(end):
        _incomplete("the parallel-sampling scenario", f"its end came back as {describe(end, 80)}")
    if end["free"] != ref["end"]["usable"]:
        fail(f"after freeing all four branches, blocks {end['held']} are still held: copy_on_write must drop the "
             "writer's reference on the shared block (free_blocks([src])) when it takes the copy")


def drive_cow_only_what_is_written(copy_on_write):
    """check_cow_only_what_is_written's five scenarios, in order: (1) p and c share a partly filled block and
    each write one token; (2) c writes into a shared block that holds no computed token yet; (3) a request that
    shares nothing writes four tokens; (4) a write that lands in two shared blocks (one partly filled, one
    empty); (5) a 7-token chunk that starts in a shared block. The copies each write recorded, the tables, and
    :meth:`World.view` at the end of each."""
    seen = Seen()
    try:
        w = World(copy_on_write, 16, 4)
        w.prefill("p", [1, 2, 3, 4, 5, 6])
        w.fork("p", "c")
        seen["1.c_table"] = w.m.get_block_ids("c")
        seen["1.p"] = w.write("p", [50])
        seen["1.c"] = w.write("c", [60])
        seen["1.end"] = w.view()

        w = World(copy_on_write, 16, 4)
        w.prefill("p", [1, 2, 3, 4, 5, 6, 7, 8], extra_slots=1)  # 8 tokens computed, a 3rd block already allocated
        w.fork("p", "c")
        seen["2.c_table"] = w.m.get_block_ids("c")
        seen["2.c"] = w.write("c", [70])
        seen["2.tables"] = (w.m.get_block_ids("c"), w.m.get_block_ids("p"))
        w.write("p", [80])
        seen["2.end"] = w.view()

        w = World(copy_on_write, 16, 4)
        w.prefill("s", [1, 2, 3, 4, 5])
        seen["3.before"] = w.m.get_block_ids("s")
        solo: list[Any] = []
        seen["3.pairs"] = solo
        for t in (9, 10, 11, 12):
            solo.append(w.write("s", [t]))
        seen["3.after"] = w.m.get_block_ids("s")

        w = World(copy_on_write, 24, 4)
        w.prefill("p", [1, 2, 3, 4, 5, 6], extra_slots=4)  # a table of 3 blocks: full, 2 tokens, empty
        w.fork("p", "c")
        seen["4.c"] = {"pairs": w.write("c", [41, 42, 43, 44, 45]), "table": w.m.get_block_ids("c")}
        w.write("p", [51, 52, 53, 54, 55])
        seen["4.end"] = w.view()

        w = World(copy_on_write, 24, 4)
        w.prefill("p", [1, 2, 3, 4, 5, 6])
        w.fork("p", "c")
        seen["5.c"] = w.write("c", [21, 22, 23, 24, 25, 26, 27])
        w.write("p", [31, 32])
        seen["5.end"] = w.view()
    except Exception as exc:  # noqa: BLE001 - said as data
        seen["failed"] = cow_failure(exc)
    return seen.data


def check_cow_only_what_is_written(copy_on_write):
    require_function(copy_on_write, "copy_on_write")

    mine = _drive(drive_cow_only_what_is_written, copy_on_write, name="the copy-on-write examples")
    ref = _drive(drive_cow_only_what_is_written, None)

    # n = 2: the first writer copies, the second writes in place
    want, got = ref["1.p"], _at(mine, "1.p")
    if got != want:
        fail(f"p and c share block {ref['1.c_table'][1]} (tokens 4-5, ref_cnt 2); when p wrote token 6 there "
             f"the copies recorded were {got}, expected {want}"
             + (_cow_missing_hint(mine.get("1.end"), "p", want, 6, 4) if want and not got else ""))
    want, got = ref["1.c"], _at(mine, "1.c")
    if got != want:
        fail(f"after p took its copy, c is the only holder of the block (ref_cnt 1): it writes in place, with no "
             f"copy, but {got} were recorded")
    check_reads(_at(mine, "1.end"), ref["1.end"], 4, "after p and c each wrote one token")

    # a block that holds no computed token yet: a private block, but nothing to copy
    empty = ref["2.c_table"][2]
    want, got = ref["2.c"], _at(mine, "2.c")
    if got != want:
        fail(f"c shares p's 3rd block {empty} (ref_cnt 2), which holds no computed token yet (positions 8-11 are "
             f"still to be written). When c wrote token 8 the copies recorded were {got}, expected {want}: c needs a "
             "private block, but there is nothing to copy")
    c_table, p_table = _at(mine, "2.tables")
    if c_table[2] == p_table[2]:
        fail("c wrote token 8 into the block it shares with p: it needs a private block first")
    check_reads(_at(mine, "2.end"), ref["2.end"], 4,
                "after c and p each wrote token 8 into what was one shared, empty block")

    # a request nobody shares with: never a copy
    before = _at(mine, "3.before")
    solo = mine.get("3.pairs", [])
    for k in range(4):
        if k >= len(solo):
            _fail_with(mine.get("failed"))
        if solo[k]:
            fail("a request whose blocks all have ref_cnt 1 wrote a token and a copy was recorded: copy only blocks "
                 "that are shared (ref_cnt > 1)")
    after = _at(mine, "3.after")
    if after[:2] != before[:2]:
        fail(f"a request that shares nothing had its blocks replaced ({before} became {after})")

    # a write that lands in two shared blocks: the partly filled one (copy) and an empty one (no copy)
    want, got = ref["4.c"], _at(mine, "4.c")
    if got != want:
        fail(f"c shares p's 3 blocks (full, 2 tokens, empty) and writes 5 tokens (positions 6-10), which land in "
             f"the last two: copies {got['pairs']} (expected {want['pairs']}), c's table {got['table']} (expected "
             f"{want['table']}). Every shared block the write lands in needs a private block")
    check_reads(_at(mine, "4.end"), ref["4.end"], 4, "after c and p each wrote 5 tokens into the blocks they shared")

    # a chunk that spans the shared partial block and more
    want, got = ref["5.c"], _at(mine, "5.c")
    if got != want:
        fail(f"c wrote 7 tokens at once (positions 6-12), starting in the block it shares with p: copies {got}, "
             f"expected {want}")
    check_reads(_at(mine, "5.end"), ref["5.end"], 4,
                "after c wrote 7 tokens and p 2 tokens, starting in a shared block")


def drive_cow_hidden(copy_on_write, seed=12345):
    """check_cow_hidden's scenario: random fork trees (beam-search-like), 30 of 25 steps each (a fork, a write of
    1, 2 or block_size + 1 tokens, or a branch freed). One record per tree (``bs``, ``steps``), each step with
    its operation (``op``; a write's ``rid``, ``n`` tokens, ``start`` position and the copies recorded), the live
    branches and :meth:`World.view` after it; a step that fails ends the scenario with ``{"failed": ...}``."""
    rng = random.Random(seed)
    trials: list[dict[str, Any]] = []
    try:
        for trial in range(30):
            bs = rng.choice([2, 3, 4, 8])
            w = World(copy_on_write, 400, bs)
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 4 * bs))]
            extra = rng.choice([0, 0, 1, bs])
            w.prefill("b0", prompt, extra_slots=extra)
            alive = ["b0"]
            steps: list[dict[str, Any]] = []
            trials.append({"bs": bs, "steps": steps})
            for step in range(25):
                u = rng.random()
                rec: dict[str, Any] = {"op": "none"}
                steps.append(rec)
                if u < 0.3 and len(alive) < 8:
                    parent = rng.choice(alive)
                    child = f"b{trial}-{step}"
                    rec["op"] = "fork"
                    w.fork(parent, child)
                    alive.append(child)
                elif u < 0.9:
                    rid = rng.choice(alive)
                    toks = [rng.randrange(1000) for _ in range(rng.choice([1, 1, 1, 2, bs + 1]))]
                    rec.update(op="write", rid=rid, n=len(toks), start=w.reqs[rid].num_computed_tokens)
                    rec["pairs"] = w.write(rid, toks)
                elif len(alive) > 1:
                    rid = alive.pop(rng.randrange(len(alive)))
                    rec["op"] = "free"
                    w.m.free(w.reqs[rid])
                rec.update(view=text(w.view()), alive=list(alive))
    except Exception as exc:  # noqa: BLE001 - said as data
        trials.append({"failed": cow_failure(exc)})
    return trials


def check_cow_hidden(copy_on_write):
    require_function(copy_on_write, "copy_on_write")

    # Random fork trees (beam-search-like), your rule and the library's side by side.
    mine = _drive(drive_cow_hidden, copy_on_write, kind=list, name="the random fork trees")
    ref = _drive(drive_cow_hidden, None, kind=list)
    failed = next((t["failed"] for t in mine if "failed" in t), None)
    for trial, want_trial in enumerate(ref):
        if trial >= len(mine) or "failed" in mine[trial]:
            _fail_with(failed)
        bs = want_trial["bs"]
        got_steps = mine[trial]["steps"]
        for step, want in enumerate(want_trial["steps"]):
            got = got_steps[step] if step < len(got_steps) else {}
            if want["op"] == "write" and "pairs" not in got:  # the write failed
                _fail_with(failed)
            if want["op"] == "write" and got["pairs"] != want["pairs"]:
                fail(f"random fork tree (block_size {bs}), step {step}: {want['rid']!r} wrote {want['n']} token(s) at "
                     f"position {want['start']}; copies {got['pairs']}, expected {want['pairs']}")
            if "view" not in got:
                _fail_with(failed)
            if got["view"] == want["view"]:
                continue
            got_view, want_view = _read(got["view"]), _read(want["view"])
            if not isinstance(got_view, dict):
                fail(f"random fork tree (block_size {bs}), step {step}: the manager cannot be read: {got_view}")
            what = f"random fork tree (block_size {bs}), step {step}"
            check_reads(got_view, want_view, bs, what)
            for rid in want["alive"]:
                got_t, want_t = got_view["tables"].get(rid), want_view["tables"][rid]
                if got_t != want_t:
                    fail(f"{what}: the block table of {rid!r} is {got_t}, expected {want_t}. Every shared block "
                         "(ref_cnt > 1) that a write lands in needs a private block, including one that holds no "
                         "computed token yet (a fresh block, without a copy)")
            if got_view["free"] != want_view["free"]:
                fail(f"random fork tree, step {step}: {_shown(got_view['free'])} free blocks, expected "
                     f"{want_view['free']}")
