"""Checks for lesson 9's exercises (``grading/source/09_serving_online.ipynb``): stop strings as the server's
output processor finds them, salted block hashes (``cache_salt``), and one streamed request's latencies as
``vllm bench serve`` defines them.

Every expected value comes from the library: :func:`pagedkv.engine.output_processor.check_stop_strings` (vLLM
0.26's ``check_stop_strings``), :func:`pagedkv.kv_cache_utils.update_block_hashes` on a salted
:class:`~pagedkv.request.Request` (vLLM's ``generate_block_hash_extra_keys``), and
:func:`pagedkv.benchmarks.serve.request_metrics` (vLLM's ``calculate_metrics``). Each check also computes the
plausible mistakes and names them when the learner's answer equals one: the earliest stop string instead of the
first in the list, the whole text searched again, only the new characters searched; the salt in every block, no
hash chain, an extra key when there is no salt; TPOT as the mean gap between chunks, TPOT over all tokens or
with the first token's time left in, the latency counted from the first chunk. Small known cases first, then
seeded random ones.
"""

from __future__ import annotations

import copy
import math
import numbers
import random
from typing import Any

from pagedkv.grading.checks import STUB_NOTE, describe, fail, is_int, require_function, run

__all__ = [
    "check_metrics_examples",
    "check_metrics_hidden",
    "check_metrics_multi_token_chunks",
    "check_salted_hashes_hidden",
    "check_salted_hashes_paired",
    "check_salted_hashes_unsalted",
    "check_stop_examples",
    "check_stop_hidden",
    "check_stop_list_order",
    "check_stop_search_window",
    "expected_metrics",
    "expected_salted_hashes",
    "expected_stop",
]


# ---------------------------------------------------------------------------------------------------------
# 1. check_stop_strings
# ---------------------------------------------------------------------------------------------------------
def expected_stop(text: str, new: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    from pagedkv.engine.output_processor import check_stop_strings

    return check_stop_strings(text, new, stop, include)


def _stop_mistakes(text: str, new: int, stop: list[str], include: bool) -> list[tuple[Any, str]]:
    out: list[tuple[Any, str]] = []
    # the earliest match by position rather than the first stop string in the list
    found = [(text.find(s, max(0, len(text) - new - len(s) + 1)), s) for s in stop] if new else []
    found = [(i, s) for i, s in found if i >= 0]
    if found:
        i, s = min(found)
        end = i + len(s)
        out.append(((s, -1 if include and end >= len(text) else (end if include else i)),
                    "that is the stop string that occurs earliest; vLLM takes the first stop string of the list "
                    "that matches"))
    # the last match rather than the first (rfind)
    for s in stop:
        i = text.rfind(s, max(0, len(text) - new - len(s) + 1)) if new else -1
        if i >= 0:
            end = i + len(s)
            out.append(((s, -1 if include and end >= len(text) else (end if include else i)),
                        "that is the stop string's last occurrence; the text is cut at its first one (str.find, "
                        "not rfind)"))  # fmt: skip
            break
    # the whole text searched
    for s in stop:
        i = text.find(s)
        if i >= 0 and new:
            end = i + len(s)
            out.append(((s, -1 if include and end >= len(text) else (end if include else i)),
                        "that match ends before the new characters: text before them was searched already, so "
                        "start the search at len(text) - new_char_count - len(stop_str) + 1"))
            break
    # only the new characters searched
    tail = text[len(text) - new:] if new else ""
    only_tail = None
    for s in stop:
        i = tail.find(s)
        if i >= 0:
            i += len(text) - new
            end = i + len(s)
            only_tail = (s, -1 if include and end >= len(text) else (end if include else i))
            break
    out.append((only_tail, "a stop string can start in the old text and end in the new characters: search from "
                           "len(text) - new_char_count - len(stop_str) + 1, not from the first new character"))
    return out


def _expect_stop(fn: Any, args: tuple) -> None:
    want = expected_stop(*args)  # first, and the learner gets copies: nothing it changes reaches the expected
    got = run(fn, copy.deepcopy(args), name="check_stop_strings", timeout=2)
    if isinstance(got, list):
        got = tuple(got)
    if got == want and (want is None or (isinstance(got[1], int) and not isinstance(got[1], bool))):
        return
    call = "check_stop_strings(" + ", ".join(describe(a) for a in args) + ")"
    message = f"{call} returned {describe(got)}, expected {describe(want)}"
    if got is None and want is not None:
        # The stub's answer too, so no mistake's hint (it would point a learner who has not started at a bug they
        # do not have): where the match is, which is what an answer that missed it needs, then both readings.
        text, new, _, _ = args
        at = text.find(want[0], max(0, len(text) - new - len(want[0]) + 1))
        where = ", in the old text," if at < len(text) - new else ""
        written = ("its search starts too late: a stop string may begin in the old text" if where
                   else "does every path end in a `return`?")
        fail(f"{message}: {want[0]!r} starts at index {at}{where} and ends in the last {new} character(s), the new "
             f"ones, so it must be found. If the function is still the stub (...), write it; if it is written, "
             f"{written}")
    hints = [why for value, why in _stop_mistakes(*args) if value == got and value != want]
    if want is not None and got is not None and isinstance(got, tuple) and len(got) == 2 and got[0] == want[0]:
        if want[1] == -1:
            hints.append("with include_in_output, when the stop string ends the text there is nothing to cut: "
                         "the offset is -1")
        elif args[3] and got[1] == want[1] - len(want[0]):
            hints.append("with include_in_output the text keeps the stop string: the offset is its end")
        elif args[3] and isinstance(got[1], int) and got[1] == want[1] - 1 and len(want[0]) > 1:
            hints.append("one short: the stop string's end is its start plus len(stop_str), the index just past its "
                         "last character")  # fmt: skip
        elif not args[3] and got[1] == want[1] + len(want[0]):
            hints.append("without include_in_output the text is cut before the stop string: the offset is its "
                         "start")
    fail(message + (". Hint: " + " Or: ".join(dict.fromkeys(hints)) if hints else ""))


def check_stop_examples(check_stop_strings: Any) -> None:
    require_function(check_stop_strings, "check_stop_strings")
    for args in [("hello world", 5, ["wor"], False), ("hello world", 5, ["wor"], True),
                 ("hello world", 3, ["world"], True), ("hello world", 3, ["xyz"], False),
                 ("hello", 0, ["he"], False), ("hello", 5, [], False)]:
        _expect_stop(check_stop_strings, args)


def check_stop_list_order(check_stop_strings: Any) -> None:
    require_function(check_stop_strings, "check_stop_strings")
    for args in [("one two", 7, ["two", "one"], False), ("a.b!c", 5, ["!", "."], True)]:
        _expect_stop(check_stop_strings, args)


def check_stop_search_window(check_stop_strings: Any) -> None:
    require_function(check_stop_strings, "check_stop_strings")
    for args in [("abcdef", 1, ["def"], False), ("stop here, stop", 2, ["here"], False),
                 ("xx</s>yy</s>", 3, ["</s>"], True), ("aaab", 1, ["aab"], False)]:
        _expect_stop(check_stop_strings, args)


def check_stop_hidden(check_stop_strings: Any) -> None:
    require_function(check_stop_strings, "check_stop_strings")
    rng = random.Random(9091)
    for _ in range(300):
        text = "".join(rng.choice("ab c.") for _ in range(rng.randrange(0, 14)))
        new = rng.randrange(0, len(text) + 1)
        stop = ["".join(rng.choice("ab c.") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 3))]
        _expect_stop(check_stop_strings, (text, new, stop, rng.random() < 0.5))


# ---------------------------------------------------------------------------------------------------------
# 2. salted_block_hashes
# ---------------------------------------------------------------------------------------------------------
def expected_salted_hashes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    from pagedkv.kv_cache_utils import sha256_hash, update_block_hashes
    from pagedkv.request import Request

    req = Request("r", token_ids, cache_salt=cache_salt)
    update_block_hashes(req, block_size, sha256_hash)
    return list(req.block_hashes)


def _chain(token_ids: list[int], block_size: int, keys: Any, chained: bool = True) -> list[bytes]:
    """Hash chains built the wrong ways: ``keys(i)`` gives block i's extra keys."""
    from pagedkv.kv_cache_utils import hash_block_tokens, sha256_hash

    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        parent = out[-1] if out and chained else None
        out.append(hash_block_tokens(sha256_hash, parent, token_ids[i * block_size:(i + 1) * block_size], keys(i)))
    return out


def _expect_hashes(fn: Any, args: tuple) -> list[bytes]:
    tokens, bs, salt = args
    want = expected_salted_hashes(*args)
    got = run(fn, copy.deepcopy(args), name="salted_block_hashes", timeout=5)
    if isinstance(got, tuple):
        got = list(got)
    if got == want:
        return got
    call = f"salted_block_hashes({describe(tokens, 60)}, {bs}, {salt!r})"
    if got is None:
        fail(f"{call} returned None. {STUB_NOTE}")
    if not isinstance(got, list):
        fail(f"{call} returned {describe(got)}: return a list with one hash per full block")
    if len(got) != len(want):
        fail(f"{call} returned {len(got)} hashes, expected {len(want)}: one per FULL block of {bs} tokens "
             f"({len(tokens)} tokens); a partial last block is never hashed")
    mistakes = [
        (_chain(tokens, bs, lambda i: (salt,) if salt is not None else None),
         "the salt is in every block's extra keys; vLLM puts it in the first block's only (the chain carries it on)"),
        (_chain(tokens, bs, lambda i: (salt,) if i == 0 and salt is not None else None, chained=False),
         "each block is hashed without its parent: pass the previous block's hash as parent_block_hash"),
        (_chain(tokens, bs, lambda i: (salt,) if i == 0 else None),
         "with no salt, extra_keys must be None, not (None,): an unsalted request must hash as before salting "
         "existed"),
        (_chain(tokens, bs, lambda i: None),
         "the salt is missing: block 0's extra_keys is (cache_salt,) when there is a salt"),
        (_chain(tokens, bs, lambda i: salt if i == 0 and salt is not None else None),
         "extra_keys is a tuple: block 0's is (cache_salt,), not the bare string"),
    ]
    hints = [why for value, why in mistakes if value == got]
    if not all(isinstance(h, bytes) for h in got):
        hints.append("the hashes are the bytes sha256_hash gives: pass sha256_hash as hash_block_tokens' hash_fn "
                     "(Python's hash() gives an int)")  # fmt: skip
    first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    def short(h: Any) -> str:
        return h.hex()[:12] + "..." if isinstance(h, bytes) else describe(h, 40)

    fail(f"{call}: hash {first} differs from the expected chain (got {short(got[first])}, expected "
         f"{short(want[first])})" + (". Hint: " + " Or: ".join(hints) if hints else ""))
    return got  # unreachable


def check_salted_hashes_unsalted(salted_block_hashes: Any) -> None:
    require_function(salted_block_hashes, "salted_block_hashes")
    _expect_hashes(salted_block_hashes, (list(range(40)), 16, None))
    _expect_hashes(salted_block_hashes, (list(range(7)), 4, None))
    _expect_hashes(salted_block_hashes, ([5] * 15, 16, None))


def check_salted_hashes_paired(salted_block_hashes: Any) -> None:
    """The paired test: one salt reuses, two salts share nothing."""
    require_function(salted_block_hashes, "salted_block_hashes")
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
    a = _expect_hashes(salted_block_hashes, (tokens, 4, "tenant-a"))
    b = _expect_hashes(salted_block_hashes, (tokens, 4, "tenant-b"))
    again = run(salted_block_hashes, (tokens, 4, "tenant-a"), name="salted_block_hashes", timeout=5)
    if list(again) != a:
        fail("salted_block_hashes gave two different chains for the same tokens and salt: the same tenant must "
             "find its own prefix")
    shared = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x == y]
    if shared:
        fail(f"blocks {shared} hash the same under 'tenant-a' and 'tenant-b': another tenant could hit them")


def check_salted_hashes_hidden(salted_block_hashes: Any) -> None:
    require_function(salted_block_hashes, "salted_block_hashes")
    rng = random.Random(4657)
    for _ in range(60):
        bs = rng.choice([1, 2, 4, 16])
        tokens = [rng.randrange(0, 1000) for _ in range(rng.randrange(1, 5 * bs + 3))]
        salt = rng.choice([None, "s", "tenant-" + str(rng.randrange(100)), "Z3V2bmV3aGxza3ZubGFoZ3Zud3V3ZWZ2"])
        _expect_hashes(salted_block_hashes, (tokens, bs, salt))


# ---------------------------------------------------------------------------------------------------------
# 3. request_metrics
# ---------------------------------------------------------------------------------------------------------
KEYS = ("ttft", "itl", "latency", "tpot", "output_len")


def expected_metrics(start: float, times: list[float], tokens: list[int]) -> dict[str, Any]:
    from pagedkv.benchmarks.serve import request_metrics

    return request_metrics(start, times, tokens)


def _close(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(b, list):
        if not isinstance(a, (list, tuple)) or len(a) != len(b):
            return False
        return all(_close(x, y) for x, y in zip(a, b, strict=True))
    # numbers.Real: numpy's scalars too (np.int64 is no int), which the text's "in seconds" allows
    return isinstance(a, numbers.Real) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-9,
                                                                                    abs_tol=1e-12)


def _expect_metrics(fn: Any, args: tuple) -> None:
    start, times, tokens = args
    want = expected_metrics(*args)
    got = run(fn, copy.deepcopy(args), name="request_metrics", timeout=2)
    call = f"request_metrics({start!r}, {describe(times, 60)}, {describe(tokens, 40)})"
    if got is None:
        fail(f"{call} returned None. {STUB_NOTE}")
    if not isinstance(got, dict) or any(k not in got for k in KEYS):
        fail(f"{call} returned {describe(got)}: return a dict with the keys {list(KEYS)}")
    for key in ("ttft", "itl", "latency", "output_len", "tpot"):  # TPOT last: it is computed from the others
        if _close(got[key], want[key]):
            continue
        hint = ""
        n = sum(tokens)
        itl = want["itl"]
        if key == "tpot" and want["tpot"] is not None:
            if itl and _close(got[key], sum(itl) / len(itl)):
                hint = (" Hint: that is the mean gap between chunks; a chunk can carry several tokens, so TPOT is "
                        "(latency - ttft) / (output_len - 1)")
            elif _close(got[key], (want["latency"] - want["ttft"]) / n):
                hint = " Hint: the first token is not a decode step: divide by output_len - 1"
            elif _close(got[key], want["latency"] / (n - 1)):
                hint = " Hint: the time to the first token is not a decode step's: take ttft out of the latency"
        elif key == "tpot":
            hint = " Hint: with a single output token there is no time per output token: None"
        elif key in ("ttft", "latency") and _close(got[key], want[key] * 1000):
            hint = " Hint: that is in milliseconds; the times are in seconds, and so is every metric"
        elif key == "latency" and _close(got[key], times[-1] - times[0]):
            hint = " Hint: latency runs from when the request was sent (start), not from the first chunk"
        elif key == "itl" and isinstance(got[key], list) and len(got[key]) == len(times):
            hint = " Hint: ITL is the gap between consecutive chunks: one fewer than the chunks (the first is TTFT)"
        elif key == "output_len" and _close(got[key], len(times)):
            hint = " Hint: output_len counts tokens, and a chunk can carry several"
        elif key == "itl" and not isinstance(got[key], (list, tuple)):
            hint = f" Hint: ITL is a list of floats, not a {type(got[key]).__name__} (vllm bench serve's is a list)"
        fail(f"{call}[{key!r}] is {describe(got[key])}, expected {describe(want[key])}.{hint}")
    if not is_int(got["output_len"]):
        fail(f"{call}['output_len'] is {describe(got['output_len'])}, expected {want['output_len']}: a number of "
             "tokens is an int (the sum of the chunks' token counts)")


def check_metrics_examples(request_metrics: Any) -> None:
    require_function(request_metrics, "request_metrics")
    _expect_metrics(request_metrics, (10.0, [10.5, 10.6, 10.8], [1, 1, 1]))
    _expect_metrics(request_metrics, (0.0, [0.25], [1]))


def check_metrics_multi_token_chunks(request_metrics: Any) -> None:
    require_function(request_metrics, "request_metrics")
    _expect_metrics(request_metrics, (1.0, [1.2, 1.5, 1.6], [1, 3, 2]))
    _expect_metrics(request_metrics, (5.0, [5.5], [4]))


def check_metrics_hidden(request_metrics: Any) -> None:
    require_function(request_metrics, "request_metrics")
    rng = random.Random(3119)
    for _ in range(200):
        start = rng.uniform(0, 100)
        t = start
        times, tokens = [], []
        for _ in range(rng.randrange(1, 12)):
            t += rng.expovariate(20.0)
            times.append(t)
            tokens.append(rng.choice([1, 1, 1, 2, 5]))
        _expect_metrics(request_metrics, (start, times, tokens))
