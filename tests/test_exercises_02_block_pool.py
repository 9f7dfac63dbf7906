"""Exercise set 02 (the block pool): its checks pass the solution, fail the stub, and fail each plausible
wrong answer with a message that names the mistake.

The test cells of ``grading/source/02_block_pool.ipynb`` are run here directly (exec, no kernel, no otter:
a few seconds), against the source's answers, against otter's stubs of them, and against answers with one
known mistake each. ``tests/test_grading.py`` grades the built notebooks end to end through ``pagedkv grade``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook, stub

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "02_block_pool.ipynb"
QUESTIONS = ["free_queue", "pool_alloc_free", "allocate_slots", "slot_mapping"]


NB = SourceNotebook(SOURCE, tolerate_cell_errors=False)
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
    assert len(results) == 14
    failed = [(q, msg) for q, _, ok, msg in results if not ok]
    assert not failed, failed


def test_stub_fails_every_test_with_a_message() -> None:
    results = _grade({q: _stub(src) for q, src in SOLUTIONS.items()})
    passed = [(q, hidden) for q, hidden, ok, _ in results if ok]
    assert not passed, f"the untouched stub passes {passed}"
    assert all(msg for *_, msg in results)


# (id, question, text in the solution, replaced by, a phrase the learner must see)
WRONG = [
    (  # issue 21: the pool's error, with the learner's own line (not a cut-off line of the library) and the hint
        "all_or_nothing_asks_the_pool_anyway",
        "allocate_slots",
        "    if num_missing > manager.block_pool.get_num_free_blocks():\n        return None\n",
        "",
        "(in allocate_slots, line 11: new_blocks = manager.block_pool.get_new_blocks(num_missing)). Hint: 3 "
        "block(s) are missing and only 2 free: all or nothing, so return None",
    ),
    (
        "popleft_takes_tail",
        "free_queue",
        ("first = self.fake_free_list_head.next_free_block\n        if first is self.fake_free_list_tail:"),
        ("first = self.fake_free_list_tail.prev_free_block\n        if first is self.fake_free_list_head:"),
        "that is the tail",
    ),
    (
        "append_at_head",
        "free_queue",
        (
            "        last = self.fake_free_list_tail.prev_free_block\n"
            "        last.next_free_block = block\n"
            "        block.prev_free_block = last\n"
            "        block.next_free_block = self.fake_free_list_tail\n"
            "        self.fake_free_list_tail.prev_free_block = block"
        ),
        (
            "        first = self.fake_free_list_head.next_free_block\n"
            "        self.fake_free_list_head.next_free_block = block\n"
            "        block.prev_free_block = self.fake_free_list_head\n"
            "        block.next_free_block = first\n"
            "        first.prev_free_block = block"
        ),
        "are head and tail swapped",
    ),
    (
        "remove_forgets_prev_link",
        "free_queue",
        "        block.next_free_block.prev_free_block = block.prev_free_block\n",
        "",
        "prev link",
    ),
    (
        "remove_keeps_links",
        "free_queue",
        ("        block.prev_free_block = block.next_free_block = None\n        self.num_free_blocks -= 1"),
        "        self.num_free_blocks -= 1",
        "still has links",
    ),
    (
        "no_count",
        "free_queue",
        "        self.num_free_blocks -= 1\n",
        "",
        "num_free_blocks is",
    ),
    (
        "appendleft_second",
        "free_queue",
        (
            "        first = self.fake_free_list_head.next_free_block\n"
            "        self.fake_free_list_head.next_free_block = block\n"
            "        block.prev_free_block = self.fake_free_list_head\n"
            "        block.next_free_block = first\n"
            "        first.prev_free_block = block"
        ),
        (
            "        if self.num_free_blocks == 0:\n"
            "            self.append(block)\n"
            "            return\n"
            "        first = self.fake_free_list_head.next_free_block\n"
            "        second = first.next_free_block\n"
            "        first.next_free_block = block\n"
            "        block.prev_free_block = first\n"
            "        block.next_free_block = second\n"
            "        second.prev_free_block = block\n"
            "        self.num_free_blocks += 1"
        ),
        "appendleft(block 3)",
    ),
    (
        "uncached_to_tail",
        "pool_alloc_free",
        "                to_head.append(block)",
        "                pool.free_block_queue.append(block)",
        "go to the head",
    ),
    (
        "appendleft_one_by_one",
        "pool_alloc_free",
        "    for block in reversed(to_head):",
        "    for block in to_head:",
        "came back in reverse",
    ),
    (
        "cached_to_head",
        "pool_alloc_free",
        ("            else:\n                pool.free_block_queue.append(block)"),
        ("            else:\n                pool.free_block_queue.appendleft(block)"),
        "cached blocks (with a hash) go to the tail",
    ),
    (
        "no_free_count_check",
        "pool_alloc_free",
        (
            "    if num_blocks > pool.get_num_free_blocks():\n"
            '        raise ValueError(f"cannot get {num_blocks} blocks: {pool.get_num_free_blocks()} are free")\n'
        ),
        "",
        "a failed call must change nothing",
    ),
    (
        "no_evict",
        "pool_alloc_free",
        "        evict_if_cached(pool, block)\n",
        "",
        "evict_if_cached",
    ),
    (
        "no_double_free_check",
        "pool_alloc_free",
        ("        if times[block.block_id] > block.ref_cnt:\n            raise"),
        ("        if False:\n            raise"),
        "expected it to raise ValueError",
    ),
    (
        "no_ref_cnt",
        "pool_alloc_free",
        "        block.ref_cnt = 1\n",
        "",
        "ref_cnt",
    ),
    (
        "floor",
        "allocate_slots",
        "num_required = -(-num_tokens // manager.block_size)",
        "num_required = num_tokens // manager.block_size",
        "round up",
    ),
    (
        "ignores_table",
        "allocate_slots",
        "num_missing = max(0, num_required - len(table))",
        "num_missing = num_required",
        "more are needed, not",
    ),
    (
        "no_free_check_raises",
        "allocate_slots",
        ("    if num_missing > manager.block_pool.get_num_free_blocks():\n        return None\n"),
        "",
        "raised ValueError",
    ),
    (
        "partial_on_failure",
        "allocate_slots",
        (
            "    if num_missing > manager.block_pool.get_num_free_blocks():\n"
            "        return None\n"
            "    new_blocks = manager.block_pool.get_new_blocks(num_missing)\n"
            "    manager.req_to_blocks[request.request_id] = table + new_blocks\n"
            "    return new_blocks"
        ),
        (
            "    manager.req_to_blocks[request.request_id] = table\n"
            "    new_blocks = []\n"
            "    for _ in range(num_missing):\n"
            "        if manager.block_pool.get_num_free_blocks() == 0:\n"
            "            return None\n"
            "        (b,) = manager.block_pool.get_new_blocks(1)\n"
            "        table.append(b)\n"
            "        new_blocks.append(b)\n"
            "    return new_blocks"
        ),
        "changed the manager first",
    ),
    (
        "hardcoded_two_blocks",
        "allocate_slots",
        ("    # BEGIN SOLUTION\n    if num_new_tokens < 0:"),
        (
            "    # BEGIN SOLUTION\n"
            "    new = manager.block_pool.get_new_blocks(2)\n"
            "    manager.req_to_blocks[request.request_id] = new\n"
            "    return new\n"
            "    if num_new_tokens < 0:"
        ),
        "expected",
    ),
    (
        "off_by_one",
        "slot_mapping",
        "block_table[p // block_size] * block_size + p % block_size)",
        "block_table[p // block_size] * block_size + p % block_size + 1)",
        "one too high",
    ),
    (
        "no_times_block_size",
        "slot_mapping",
        "block_table[p // block_size] * block_size + p % block_size)",
        "block_table[p // block_size] + p % block_size)",
        "multiply the block id",
    ),
    (
        "logical_block",
        "slot_mapping",
        "block_table[p // block_size] * block_size + p % block_size)",
        "(p // block_size) * block_size + p % block_size)",
        "logical",
    ),
    (
        "no_bounds_check",
        "slot_mapping",
        ("        if p < 0 or p >= capacity:\n            raise"),
        ("        if False:\n            raise"),
        "expected ValueError",
    ),
    (
        "hardcoded_example",
        "slot_mapping",
        ("    # BEGIN SOLUTION\n    if block_size < 1:"),
        ("    # BEGIN SOLUTION\n    return [28, 29, 30, 31, 8, 9]\n    if block_size < 1:"),
        "expected",
    ),
]


@pytest.mark.parametrize("wid, question, old, new, phrase", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_answer_fails_a_public_test_with_a_clear_message(
    wid: str, question: str, old: str, new: str, phrase: str
) -> None:
    assert old in SOLUTIONS[question], f"{wid}: the solution no longer contains the text to break"
    results = _grade({question: SOLUTIONS[question].replace(old, new)}, only={question}, public_only=True)
    failures = [msg for q, _, ok, msg in results if not ok]
    assert failures, f"{wid}: no public test of {question} catches this mistake"
    assert phrase in failures[0], f"{wid}: the first failure does not say {phrase!r}: {failures[0]}"


@pytest.mark.parametrize(
    "wid, old, new, at_least",
    [
        # a right get_new_blocks with a wrong free_blocks keeps get_new_blocks' point (and the refusals')
        ("free_reversed", "    for block in reversed(to_head):", "    for block in to_head:", 2),
        ("free_no_checks", "        if times[block.block_id] > block.ref_cnt:\n            raise",
         "        if False:\n            raise", 2),
        # a right free_blocks with a get_new_blocks that forgets to evict keeps free_blocks' points
        ("alloc_no_evict", "        evict_if_cached(pool, block)\n", "", 2),
    ],
    ids=lambda v: v if isinstance(v, str) and v.isidentifier() else None,
)
def test_pool_alloc_free_scores_the_right_half(wid: str, old: str, new: str, at_least: int) -> None:
    src = SOLUTIONS["pool_alloc_free"]
    assert old in src, wid
    results = _grade({"pool_alloc_free": src.replace(old, new)}, only={"pool_alloc_free"})
    passed = sum(ok for _, _, ok, _ in results)
    assert at_least <= passed < len(results), (wid, results)


def test_the_pool_the_queue_checks_build_is_a_block_pool() -> None:
    """The free queue's in-pool check builds its pool without ``BlockPool.__init__``, which makes the library's
    queue (hidden while the learner's queue is graded): the same attributes, and with the library's queue in it
    the same answers."""
    from pagedkv import BlockPool
    from pagedkv.grading.lessons.l02_block_pool import bare_pool
    from pagedkv.kv_cache_utils import FreeKVCacheBlockQueue

    pool, bare = BlockPool(9), bare_pool(9)
    bare.free_block_queue = FreeKVCacheBlockQueue(bare.blocks[1:])
    assert sorted(vars(bare)) == sorted(vars(pool))
    for p in (pool, bare):
        got = p.get_new_blocks(3)
        p.free_blocks(got[1:])
        p.touch([p.blocks[3]])
    assert [[b.block_id for b in p.free_block_queue] for p in (pool, bare)] == [[2, 4, 5, 6, 7, 8]] * 2
    assert [[b.ref_cnt for b in p.blocks] for p in (pool, bare)] == [[0, 1, 0, 1, 0, 0, 0, 0, 0]] * 2


def test_the_solution_is_graded_in_a_few_scenarios_given_seeds_not_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check drives the learner's code in one scenario, or two (the first random case alone, then the
    rest): a drive is one round trip to the grader's sandbox, however many calls it makes. And what a scenario
    is given, the learner's code can read (it runs in the learner's process): the random ones choose their calls
    from a seed and from the state they see, never from a script made with a model of the right answers (whose
    later calls would tell which blocks an allocation must give, or whether it must fail)."""
    import pagedkv.grading.lessons.l02_block_pool as lesson

    given: list[tuple[str, tuple]] = []
    real = lesson.drive
    monkeypatch.setattr(lesson, "drive", lambda scenario, *a, **k: given.append((scenario.__name__, a)) or
                        real(scenario, *a, **k))
    results = _grade({})
    assert all(ok for _, _, ok, _ in results)
    assert len(given) <= 25, [name for name, _ in given]
    for name, args in given:
        if name.endswith("_random") or name == "drive_queue_in_pool":
            assert all(set(case) <= {"case", "seed", "blocks", "sizes", "block_sizes", "ops", "steps"}
                       and not isinstance(case.get("ops"), list) for case in args[-1]), (name, args[-1][:1])
