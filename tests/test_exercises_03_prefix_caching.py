"""Exercise set 03 (prefix caching and copy-on-write): its checks pass the solution, fail the stub, and fail
each plausible wrong answer in a public test, with a message that names the mistake.

The test cells of ``grading/source/03_prefix_caching.ipynb`` are run here directly (exec, no kernel, no otter:
about a second), against the source's answers, against otter's stubs of them, and against answers with one
known mistake each. ``tests/test_grading.py`` grades the built notebooks end to end through ``pagedkv grade``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook, stub

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "03_prefix_caching.ipynb"
QUESTIONS = ["hash_chain", "prefix_lookup", "eviction_on_reuse", "copy_on_write"]


NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)
ITEMS, SOLUTIONS = NB.items, NB.solutions
_stub = stub
_grade = NB.grade


def test_the_source_has_every_question_with_public_and_hidden_tests() -> None:
    assert list(SOLUTIONS) == QUESTIONS
    for q in QUESTIONS:
        tests = [hidden for kind, qq, _, hidden in ITEMS if kind == "test" and qq == q]
        assert False in tests and True in tests, f"{q} needs public and hidden tests"


def test_solution_passes_every_test() -> None:
    results = _grade({})
    assert len(results) == 16  # set 03's lookup and caching are two hidden cases
    failed = [(q, msg) for q, _, ok, msg in results if not ok]
    assert not failed, failed


def test_stub_fails_every_test_with_a_message() -> None:
    results = _grade({q: _stub(src) for q, src in SOLUTIONS.items()})
    passed = [(q, hidden) for q, hidden, ok, _ in results if ok]
    assert not passed, f"the untouched stub passes {passed}"
    assert all(msg for *_, msg in results)


def test_one_question_solved_scores_only_that_question() -> None:
    for solved in QUESTIONS:
        answers = {q: (src if q == solved else _stub(src)) for q, src in SOLUTIONS.items()}
        results = _grade(answers)
        assert all(ok == (q == solved) for q, _, ok, _ in results), (solved, [(q, ok) for q, _, ok, _ in results])


# (id, question, text in the solution, replaced by, a phrase the learner must see in the first public failure)
# fmt: off
# (An answer that calls the library's own answer passes here, in-process, where the library is whole; under
# ``pagedkv grade`` it scores 0 with the stub's message: tests/test_grading_hidden.py.)
WRONG = [
    # 1. the hash chain
    ("partial_block_hashed", "hash_chain", "range(len(token_ids) // block_size)",
     "range(-(-len(token_ids) // block_size))", "a partly filled block is never hashed"),
    ("ignores_parent", "hash_chain", "parent = hash_fn((parent, block, extra_keys))",
     "parent = hash_fn((NONE_HASH, block, extra_keys))", "hashed with NONE_HASH as its parent"),
    ("first_parent_none", "hash_chain", "    parent = NONE_HASH\n", "    parent = None\n", "not None"),
    ("ignores_extra_keys", "hash_chain", "hash_fn((parent, block, extra_keys))", "hash_fn((parent, block, None))",
     "extra_keys is part of every block's key"),
    ("hard_coded", "hash_chain", "    if block_size < 1:", "    return []\n    if block_size < 1:", "expected 2"),
    # 2. lookup and caching
    ("full_hit_not_cut", "prefix_lookup", "(request.num_tokens - 1) // self.block_size",
     "request.num_tokens // self.block_size", "a full hit is cut back by one block"),
    ("always_cut", "prefix_lookup", "        num_hit_tokens = len(hits)",
     "        hits = hits[:-1]\n        num_hit_tokens = len(hits)", "expected [1, 2, 3, 4] (16 tokens)"),
    ("no_stop_at_miss", "prefix_lookup",
     "            if block is None:\n                break\n            hits.append(block)",
     "            if block is not None:\n                hits.append(block)", "stop at the first miss"),
    ("touches_in_lookup", "prefix_lookup", "        num_hit_tokens = len(hits)",
     "        self.block_pool.touch(hits)\n        num_hit_tokens = len(hits)", "a lookup only finds the blocks"),
    ("prompt_only", "prefix_lookup", "for block_hash in request.block_hashes[:max_hit_blocks]:",
     "for block_hash in __import__('pagedkv').kv_cache_utils.hash_request_tokens(self.hash_fn, self.block_size, "
     "request.prompt_token_ids)[:max_hit_blocks]:", "its outputs included"),
    ("no_stats", "prefix_lookup", "self.prefix_cache_stats.queries += request.num_tokens", "pass",
     "queries is 0"),
    ("caches_partial_block", "prefix_lookup", "num_full = num_tokens // self.block_size",
     "num_full = -(-num_tokens // self.block_size)", "a partly filled block is never cached"),
    ("caches_past_the_computed_tokens", "prefix_lookup", "num_full = num_tokens // self.block_size",
     "num_full = request.num_tokens // self.block_size", "chunked prefill"),
    ("no_num_cached_update", "prefix_lookup", "        self.num_cached_block[rid] = num_full\n", "",
     "num_cached_block['a'] is 0"),
    # 3. eviction on reuse
    ("everything_to_tail", "eviction_on_reuse",
     "if block.block_hash is None:\n                    to_head.append(block)",
     "if False:\n                    to_head.append(block)", "blocks without a hash go to the head"),
    ("everything_to_head", "eviction_on_reuse",
     "if block.block_hash is None:\n                    to_head.append(block)",
     "if True:\n                    to_head.append(block)", "cached blocks go to the tail"),
    ("cached_to_head_uncached_to_tail", "eviction_on_reuse",
     "                if block.block_hash is None:\n                    to_head.append(block)\n"
     "                else:\n                    self.free_block_queue.append(block)",
     "                if block.block_hash is not None:\n                    to_head.append(block)\n"
     "                else:\n                    self.free_block_queue.append(block)", "the other way round"),
    ("appendleft_one_by_one", "eviction_on_reuse", "self.free_block_queue.appendleft_n(to_head)",
     "[self.free_block_queue.appendleft(b) for b in to_head]", "as a group in the order given"),
    ("eager_eviction_on_free", "eviction_on_reuse",
     "                else:\n                    self.free_block_queue.append(block)",
     "                else:\n                    self.cached_block_hash_to_block.pop(block.block_hash)\n"
     "                    block.reset_hash()\n                    self.free_block_queue.append(block)",
     "keeps its hash"),
    ("no_double_free_check", "eviction_on_reuse", "raise ValueError(f\"block {block.block_id} freed",
     "pass  # (f\"block {block.block_id} freed", "expected ValueError"),
    ("pop_from_tail", "eviction_on_reuse", "blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]",
     "blocks = list(self.free_block_queue)[::-1][:num_blocks]\n"
     "        [self.free_block_queue.remove(b) for b in blocks]",
     "popped from the head"),
    ("no_eviction", "eviction_on_reuse", "            if block.block_hash is not None:\n                same_prefix",
     "            if False:\n                same_prefix", "still has its hash"),
    ("deletes_whole_hash_entry", "eviction_on_reuse",
     "                del same_prefix[block.block_id]\n                if not same_prefix:\n"
     "                    del self.cached_block_hash_to_block[block.block_hash]",
     "                del self.cached_block_hash_to_block[block.block_hash]", "remove only the evicted block"),
    ("no_eviction_count", "eviction_on_reuse", "                self.num_evictions += 1\n", "",
     "num_evictions is 0"),
    # 4. copy-on-write
    ("written_in_place", "copy_on_write", "        if src.ref_cnt > 1:", "        if False:",
     "must be copied"),
    ("keeps_reference_on_src", "copy_on_write", "            manager.block_pool.free_blocks([src])\n", "",
     "writes in place"),
    ("copies_full_shared_blocks", "copy_on_write", "    for i in range(first, last):", "    for i in range(0, last):",
     "expected [(3, 4)]"),
    ("copies_unshared_blocks", "copy_on_write", "        if src.ref_cnt > 1:", "        if src.ref_cnt >= 1:",
     "no longer shared"),
    ("copies_an_empty_block", "copy_on_write", "            if i * bs < request.num_computed_tokens:\n",
     "            if True:\n", "nothing to copy"),
    ("never_records_the_copy", "copy_on_write", "            if i * bs < request.num_computed_tokens:\n",
     "            if False:\n", "in manager.pending_copies"),
    ("only_the_first_block_written", "copy_on_write", "    for i in range(first, last):",
     "    for i in range(first, min(last, first + 1)):", "needs a private block"),
]
# fmt: on


@pytest.mark.parametrize("wid, question, old, new, phrase", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_answer_fails_a_public_test_with_a_clear_message(
    wid: str, question: str, old: str, new: str, phrase: str
) -> None:
    assert old in SOLUTIONS[question], f"{wid}: the solution no longer contains the text to break"
    results = _grade({question: SOLUTIONS[question].replace(old, new)}, only={question}, public_only=True)
    failures = [msg for q, _, ok, msg in results if not ok]
    assert failures, f"{wid}: no public test of {question} catches this mistake"
    assert phrase in failures[0], f"{wid}: the first failure does not say {phrase!r}: {failures[0]}"


def test_hash_chain_checks_compare_exactly_whatever_calls_the_function() -> None:
    """A callable that is not a function (how a check could receive the learner's hash_chain) is checked like one,
    and exactly: ``builtin_hash`` values agree between the grader's and the sandbox's processes now (both run with
    PYTHONHASHSEED=0 and no address randomisation), so other numbers are wrong numbers."""
    from pagedkv.grading.lessons import l03_prefix_caching as l03

    ns: dict = {"builtin_hash": l03.builtin_hash, "NONE_HASH": l03.NONE_HASH}
    exec(SOLUTIONS["hash_chain"], ns)

    class Proxy:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    for check in (l03.check_hash_chain_examples, l03.check_hash_chain_is_a_chain, l03.check_hash_chain_hidden):
        check(Proxy(ns["hash_chain"]))

    def other_numbers(token_ids, block_size, hash_fn=l03.builtin_hash, extra_keys=None):
        out = ns["hash_chain"](token_ids, block_size, hash_fn, extra_keys)
        return [h ^ 0x5A5A5A5A for h in out] if hash_fn is l03.builtin_hash else out

    with pytest.raises(AssertionError, match="expected 2"):
        l03.check_hash_chain_examples(Proxy(other_numbers))


# ----------------------------------------------------------------------------------------------------------------
# The checks through the grader's narrow protocol, in this process: each learner name a Learner token whose client
# sends plain data only, and runs calls and scenarios with the exercise's reference (and the set's checks)
# replaced by stubs that raise, as the sandbox's copy of the library has them.
# ----------------------------------------------------------------------------------------------------------------
LEARNER_NAMES = {"hash_chain": "hash_chain", "prefix_lookup": "PrefixCachingKVCacheManager",
                 "eviction_on_reuse": "EvictingBlockPool", "copy_on_write": "copy_on_write"}


def _references() -> dict[str, list[str]]:
    """Each question's ``reference:`` list (classes expanded), plus the set's checks, as the worker has them."""
    import json

    import yaml

    from pagedkv.grading.sandbox import expand_classes, lesson_checks

    nb = json.loads(SOURCE.read_text())
    refs: dict[str, list[str]] = {}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "raw" and src.startswith("# BEGIN QUESTION"):
            meta = yaml.safe_load(src.split("\n", 1)[1])
            refs[meta["name"]] = expand_classes(meta.get("reference") or [])
    checks = lesson_checks([src for kind, _, src, _ in ITEMS if kind == "test"])
    return {q: sorted(set(r) | set(checks)) for q, r in refs.items()}


class _Stubs:
    """The sandbox's copy of the library, emulated: each symbol's function gets the stub's body (its code object
    swapped, so that every name it is reached by raises) until the block ends."""

    def __init__(self, symbols) -> None:
        import importlib

        from pagedkv.grading.sandbox import hidden_message

        self.saved = []
        for symbol in symbols:
            parts = symbol.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for part in parts[cut:]:
                    obj = getattr(obj, part)
                break
            func = getattr(obj, "__func__", obj)
            while hasattr(func, "fn") and not hasattr(func, "__code__"):  # a @triton.jit function: its Python
                func = func.fn
            message = hidden_message(symbol, ".".join(parts[-2:]))
            scope: dict = {}
            names = func.__code__.co_freevars
            body = "".join(f"    {n} = None\n" for n in names)  # a closure as long as the function's
            src = (f"def outer():\n{body}    def stub(*a, **k):\n"
                   + "".join(f"        {n}\n" for n in names) + f"        raise RuntimeError({message!r})\n"
                   "    return stub\n")
            exec(src, scope)
            self.saved.append((func, func.__code__, scope["outer"]().__code__))

    def __enter__(self):
        for func, _, stub_code in self.saved:
            func.__code__ = stub_code
        return self

    def __exit__(self, *exc):
        for func, code, _ in self.saved:
            func.__code__ = code


class _FakeClient:
    """What ``pagedkv.grading.client.Client`` does for a test case, in this process: names, calls and scenarios
    through ``plain`` (encode and decode), with the question's references stubbed (less those a scenario ``uses``
    and the private helpers they call, as the worker's second sandbox has them)."""

    def __init__(self, ns: dict, refs: list[str]) -> None:
        self.ns, self.refs = ns, refs
        self.uses: set[frozenset] = set()

    def token(self, name: str):
        from pagedkv.grading.plain import Learner
        from pagedkv.grading.sandbox_main import Server

        return Learner(self, name, Server.describe(self.ns[name]))

    def _run(self, fn, args, kwargs, uses=()):
        from pagedkv.grading.plain import decode, encode, exception_info, rebuild_exception
        from pagedkv.grading.worker import private_helpers

        needed = set(uses) & set(self.refs)
        if needed:
            self.uses.add(frozenset(needed))
        keep = needed | private_helpers(needed, self.refs)
        args = decode(encode(list(args)), self.ns.get)
        kwargs = decode(encode(dict(kwargs)), self.ns.get)
        try:
            with _Stubs([r for r in self.refs if r not in keep]):
                result = fn(*args, **kwargs)
            return decode(encode(result))
        except Exception as exc:  # noqa: BLE001 - rebuilt as the sandbox's answer would be
            raise rebuild_exception(exception_info(exc)) from None

    def call(self, name, args, kwargs):
        return self._run(self.ns[name], args, kwargs)

    def drive(self, scenario, args, *, uses, timeout, label):
        from pagedkv.grading.plain import resolve

        assert scenario.partition(":")[2].startswith("drive_"), scenario
        return self._run(resolve(scenario), args, {}, uses)


def _grade_through_tokens(answers: dict[str, str], only: set[str] | None = None) -> list[tuple[str, bool, bool, str]]:
    """Every test cell of the source (or of the questions ``only``), the learner's names as tokens."""
    import contextlib
    import io

    refs = _references()
    ns: dict = {"__name__": "__main__"}
    results = []
    for n, (kind, q, src, hidden) in enumerate(ITEMS):
        if kind != "test":
            code = answers.get(q, src) if kind == "solution" else src
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(Exception):
                exec(compile(code, f"<{kind} cell {n} of {q}>", "exec"), ns)
            continue
        if only and q not in only:
            continue
        client = _FakeClient(ns, refs[q])
        name = LEARNER_NAMES[q]
        cell_ns = dict(ns)
        if ns.get(name) is not None:
            cell_ns[name] = client.token(name)
        try:
            exec(compile(src, f"<test cell {n} of {q}>", "exec"), cell_ns)
        except AssertionError as exc:
            results.append((q, hidden, False, str(exc)))
        else:
            results.append((q, hidden, True, ""))
        assert len(client.uses) <= 1, f"{q}: one test case composes with {client.uses}: the worker refuses it"
    return results


def test_solution_passes_every_test_through_the_grading_protocol() -> None:
    results = _grade_through_tokens({})
    assert len(results) == 16
    failed = [(q, msg) for q, _, ok, msg in results if not ok]
    assert not failed, failed


def test_stub_fails_every_test_through_the_grading_protocol() -> None:
    results = _grade_through_tokens({q: _stub(src) for q, src in SOLUTIONS.items()})
    passed = [(q, hidden) for q, hidden, ok, _ in results if ok]
    assert not passed, f"the untouched stub passes {passed}"
    assert all(msg for *_, msg in results)


def _planted(routes: dict[str, str]) -> dict[str, str]:
    by_name = {name: q for q, name in LEARNER_NAMES.items()}
    return {by_name[name]: src for name, src in routes.items()}


def test_the_librarys_answers_score_0_through_the_grading_protocol() -> None:
    """The routes ``pagedkv grade`` must refuse (tests/test_grading_hidden.py, tests/test_grading_bypasses.py, graded
    end to end there): the library's answers through super(), another name or a private helper, and a
    copy_on_write that plants a method on the manager so that the library's allocate_slots copies for it. Each
    scores 0 here too, with the references stubbed as the sandbox has them; those that reach a stub say so."""
    from test_grading_bypasses import SET03, SET03_MORE
    from test_grading_hidden import SET03_ROUTES

    for routes, told in ((SET03_ROUTES, {"hash_chain", "prefix_lookup", "eviction_on_reuse"}), (SET03, {"hash_chain"}),
                         (SET03_MORE, set())):
        answers = _planted(routes)
        results = _grade_through_tokens(answers, only=set(answers))
        passed = [(q, hidden) for q, hidden, ok, _ in results if ok]
        assert not passed, (sorted(routes), passed)
        for q in told:
            first = next(msg for qq, _, ok, msg in results if qq == q and not ok)
            assert "not available while grading" in first, (q, first)


# copy_on_write answers whose only work of their own is choosing the blocks: the copy itself (a fresh block in the
# table, the free, pending_copies) is left to the library's allocate_slots, reached around the check's harness.
_SHARED = """    bs = manager.block_size
    table = manager.req_to_blocks[request.request_id]
    first = request.num_computed_tokens // bs
    last = min(len(table), -(-(request.num_computed_tokens + num_new_tokens) // bs))
    shared = [i for i in range(first, last) if table[i].ref_cnt > 1]
"""
COW_AROUND_THE_HARNESS = {
    # the manager's own allocate_slots, called from inside copy_on_write with a planted rule
    "reentered": "def copy_on_write(manager, request, num_new_tokens):\n" + _SHARED + """\
    manager._blocks_written = lambda *a: shared
    try:
        type(manager).__mro__[1].allocate_slots(manager, request, 0)
    finally:
        del manager._blocks_written
""",
    # the rule planted on the harness's class, for one call
    "class_patched": "def copy_on_write(manager, request, num_new_tokens):\n" + _SHARED + """\
    cls = type(manager)
    original = cls._blocks_written

    def once(self, *a):
        cls._blocks_written = original
        return shared
    cls._blocks_written = once
""",
    # the manager moved to a subclass with the rule
    "class_swapped": "def copy_on_write(manager, request, num_new_tokens):\n" + _SHARED + """\
    base = type(manager)
    manager.__class__ = type("Mine", (base,), {"_blocks_written": lambda self, *a: shared})
""",
    # the library's allocate_slots wrapped, for one call, to plant the rule after the harness looked
    "library_wrapped": "def copy_on_write(manager, request, num_new_tokens):\n" + _SHARED + """\
    from pagedkv import KVCacheManager
    original = KVCacheManager.allocate_slots

    def wrapper(self, *a, **k):
        KVCacheManager.allocate_slots = original
        self.__dict__["_blocks_written"] = lambda *x: shared
        try:
            return original(self, *a, **k)
        finally:
            del self.__dict__["_blocks_written"]
    KVCacheManager.allocate_slots = wrapper
""",
}


@pytest.mark.parametrize("route", list(COW_AROUND_THE_HARNESS))
def test_copy_on_write_that_leaves_the_copy_to_the_library_scores_0(route: str) -> None:
    """The check's harness calls copy_on_write, then the library's allocate_slots with its own copy-on-write off;
    an answer that turns it back on (a rule planted on the manager, its class, or the library's method, or the
    manager's own allocate_slots called from copy_on_write) is refused in every case, both ways (real objects in a
    check cell, names through the grading protocol)."""
    from pagedkv import KVCacheManager

    answers = {"copy_on_write": COW_AROUND_THE_HARNESS[route]}
    original = KVCacheManager.allocate_slots
    try:
        only = {"copy_on_write"}
        for results in (_grade(answers, only=only), _grade_through_tokens(answers, only=only)):
            assert results and not [hidden for _, hidden, ok, _ in results if ok], (route, results)
    finally:
        KVCacheManager.allocate_slots = original


def test_run_all_goes_on_past_answers_that_raise() -> None:
    """Every demo ("Try it") cell prints what went wrong instead of stopping the notebook."""
    strict = SourceNotebook(SOURCE, tolerate_cell_errors=False)
    answers = {}
    for q, src in strict.solutions.items():
        lines = src.split("\n")
        out = []
        for line in lines:
            out.append(line)
            if line.strip() == "# BEGIN SOLUTION":
                out.append(line[: len(line) - len(line.lstrip())] + "raise RuntimeError('not yet')")
        answers[q] = "\n".join(out)
    results = strict.grade(answers)
    assert results and not any(ok for _, _, ok, _ in results)


def test_an_ordering_mistake_is_reported_by_the_ordering_case_only() -> None:
    """issue 21: free_blocks putting every block at the tail fails the order case, and the bad-input case (which
    checks the refusals) does not report an ordering error."""
    old = "                    to_head.append(block)\n"
    assert old in SOLUTIONS["eviction_on_reuse"]
    wrong = SOLUTIONS["eviction_on_reuse"].replace(old, "                    self.free_block_queue.append(block)\n")
    results = _grade({"eviction_on_reuse": wrong}, only={"eviction_on_reuse"}, public_only=True)
    failures = [msg for q, _, ok, msg in results if not ok]
    assert failures and "every block went to the tail" in failures[0], failures
    assert not [m for m in failures if "after free_blocks([1])" in m], failures
