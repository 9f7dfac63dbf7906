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


def test_hash_chain_checks_hold_when_the_answer_runs_in_another_process() -> None:
    """Under the sandboxed grader the learner's hash_chain is a proxy and its builtin_hash values come from
    another process (Python's hash of None and of strings differ there): those are checked for their shape, the
    sha256 chains exactly. A callable object stands in for the proxy here."""
    from pagedkv.grading.lessons import l03_prefix_caching as l03

    ns: dict = {"builtin_hash": l03.builtin_hash, "NONE_HASH": l03.NONE_HASH}
    exec(SOLUTIONS["hash_chain"], ns)

    class Proxy:
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    salt = {"n": 0}

    def other_process(token_ids, block_size, hash_fn=l03.builtin_hash, extra_keys=None):
        out = ns["hash_chain"](token_ids, block_size, hash_fn, extra_keys)
        if hash_fn is l03.builtin_hash:  # what another process's builtin hashes look like: other numbers
            salt["n"] += 1
            out = [h ^ 0x5A5A5A5A for h in out]
        return out

    for check in (l03.check_hash_chain_examples, l03.check_hash_chain_is_a_chain, l03.check_hash_chain_hidden):
        check(Proxy(other_process))
    assert salt["n"] > 0
    wrong = SOLUTIONS["hash_chain"].replace("        parent = hash_fn((parent, block, extra_keys))",
                                            "        parent = hash_fn((NONE_HASH, block, extra_keys))")
    assert wrong != SOLUTIONS["hash_chain"]
    exec(wrong, ns)
    with pytest.raises(AssertionError, match="sha256_hash|parent"):
        l03.check_hash_chain_examples(Proxy(ns["hash_chain"]))


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
