"""Lesson 1's library: fragmentation arithmetic (pagedkv.fragmentation) and the first-fit allocator
(pagedkv.contiguous). Example-based tests for the source card's numbers, hypothesis for the properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.contiguous import (
    FirstFitAllocator,
    Hole,
    TraceRequest,
    make_trace,
    simulate_first_fit,
    simulate_paged,
)
from pagedkv.fragmentation import (
    block_size_sweep,
    block_table_entries,
    blocks_needed,
    contiguous_capacity,
    contiguous_internal_waste,
    contiguous_waste_percent,
    paged_admission,
    paged_internal_waste,
    paged_reserved_slots,
    sample_request_lengths,
    waste_percent,
)

SEED_LENS = [40, 128, 300, 64, 210, 96, 180, 48, 150, 80, 60, 420, 33, 256, 90, 110]

# No per-example deadline: CI machines are shared and a slow example is not a wrong one.
relaxed = settings(deadline=None)

lengths = st.lists(st.integers(0, 5000), max_size=60)
block_sizes = st.integers(1, 300)
pools = st.integers(0, 2000)


# ------------------------------------------------------------------------------------------ the card's example
def test_seed_card_example_4_vs_13_vs_14():
    assert contiguous_capacity(128, 512, 16) == 4
    assert paged_admission(SEED_LENS, 128, 16, "fcfs") == list(range(13))
    assert paged_admission(SEED_LENS, 128, 16, "skip") == list(range(13)) + [14]
    assert paged_admission(SEED_LENS, 128, 16) == list(range(13))  # fcfs is the default


def test_seed_card_loop_verbatim_gives_14():
    used = paged = 0
    for n in SEED_LENS:
        need = math.ceil(n / 16)
        if used + need <= 128:
            used += need
            paged += 1
    assert paged == 14 == len(paged_admission(SEED_LENS, 128, 16, "skip"))


def test_why_fcfs_stops_at_13():
    need = [blocks_needed(n, 16) for n in SEED_LENS]
    assert 128 - sum(need[:13]) == 10 and need[13] == 16 and need[14] == 6 and need[15] == 7


# ------------------------------------------------------------------------------------------ blocks_needed
@pytest.mark.parametrize(
    ("n", "b", "want"),
    [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (40, 16, 3), (512, 16, 32), (5, 1, 5), (1, 256, 1)],
)
def test_blocks_needed_examples(n, b, want):
    assert blocks_needed(n, b) == want
    assert type(blocks_needed(n, b)) is int


@relaxed
@given(st.integers(0, 10**12), st.integers(1, 10**6))
def test_blocks_needed_is_the_smallest_cover(n, b):
    k = blocks_needed(n, b)
    assert k * b >= n and (k - 1) * b < n or (k == 0 and n == 0)


def test_blocks_needed_accepts_numpy_integers():
    assert blocks_needed(np.int64(40), np.int32(16)) == 3


@pytest.mark.parametrize(
    ("args", "match"),
    [((-1, 16), "num_tokens must be an int >= 0, got -1"), ((10, 0), "block_size must be an int >= 1, got 0"),
     ((10, -2), "block_size"), ((2.5, 16), "num_tokens must be an int"), ((10, True), "block_size .* got True"),
     (("10", 16), "num_tokens must be an int")],
)
def test_blocks_needed_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        blocks_needed(*args)


# ------------------------------------------------------------------------------------------ contiguous_capacity
@relaxed
@given(pools, st.integers(1, 5000), block_sizes)
def test_contiguous_capacity_is_pool_over_reservation(pool, max_len, b):
    cap = contiguous_capacity(pool, max_len, b)
    per_seq = blocks_needed(max_len, b)
    assert cap * per_seq <= pool < (cap + 1) * per_seq


@pytest.mark.parametrize(
    ("args", "match"),
    [((-1, 512, 16), "pool_blocks"), ((128, 0, 16), "max_len"), ((128, 512, 0), "block_size")],
)
def test_contiguous_capacity_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        contiguous_capacity(*args)


# ------------------------------------------------------------------------------------------ paged_admission
@relaxed
@given(lengths, pools, block_sizes)
def test_admission_properties(lens, pool, b):
    fcfs = paged_admission(lens, pool, b, "fcfs")
    skip = paged_admission(lens, pool, b, "skip")
    need = [blocks_needed(n, b) for n in lens]
    # fcfs admits a prefix, and stops exactly where the next one does not fit
    assert fcfs == list(range(len(fcfs)))
    assert sum(need[i] for i in fcfs) <= pool
    if len(fcfs) < len(lens):
        assert sum(need[: len(fcfs) + 1]) > pool
    # skip admits in order, never more than the pool, and everything it passed over did not fit then
    assert skip == sorted(skip) and sum(need[i] for i in skip) <= pool
    used = 0
    for i, k in enumerate(need):
        if i in skip:
            used += k
        else:
            assert used + k > pool
    # skip extends fcfs's prefix: it never admits fewer
    assert skip[: len(fcfs)] == fcfs and len(skip) >= len(fcfs)


@relaxed
@given(lengths, pools, block_sizes)
def test_admission_does_not_modify_its_input(lens, pool, b):
    before = list(lens)
    paged_admission(lens, pool, b, "skip")
    assert lens == before


def test_admission_edges():
    assert paged_admission([], 0, 16, "fcfs") == []
    assert paged_admission([0, 5, 0], 0, 16, "fcfs") == [0]
    assert paged_admission([0, 5, 0], 0, 16, "skip") == [0, 2]
    assert paged_admission((16, 16), 2, 16) == [0, 1]
    assert paged_admission(np.array([16, 17]), 2, 16) == [0]


@pytest.mark.parametrize(
    ("args", "match"),
    [(([40], 128, 16, "lifo"), "policy"), (([40, -1], 128, 16, "skip"), r"lens\[1\] must be an int >= 0"),
     (([40], -1, 16, "fcfs"), "pool_blocks"), (([40], 128, 0, "fcfs"), "block_size"), (("abc", 8, 16), "lens")],
)
def test_admission_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        paged_admission(*args)


def test_admission_checks_every_length_before_admitting():
    # the bad length comes after fcfs would already have stopped: still an error
    with pytest.raises(ValueError, match=r"lens\[2\]"):
        paged_admission([100, 100, -3], 1, 16, "fcfs")


# ------------------------------------------------------------------------------------------ internal waste
@relaxed
@given(st.integers(0, 10**6), block_sizes)
def test_paged_waste_is_less_than_one_block(n, b):
    waste = paged_internal_waste(n, b)
    assert 0 <= waste < b
    assert paged_reserved_slots(n, b) == n + waste
    assert waste == 0 or n % b != 0


@relaxed
@given(lengths, block_sizes)
def test_waste_percent_matches_its_definition(lens, b):
    reserved = sum(paged_reserved_slots(n, b) for n in lens)
    got = waste_percent(lens, b)
    if reserved == 0:
        assert got == 0.0
    else:
        assert got == pytest.approx(100 * (reserved - sum(lens)) / reserved)
        assert 0.0 <= got < 100.0


def test_waste_examples():
    assert waste_percent([40], 16) == pytest.approx(100 * 8 / 48)
    assert waste_percent([16, 32], 16) == 0.0 and waste_percent([], 16) == 0.0 and waste_percent([0], 16) == 0.0
    assert contiguous_internal_waste(40, 512) == 472
    assert contiguous_waste_percent(SEED_LENS, 512) == pytest.approx(100 * (16 * 512 - sum(SEED_LENS)) / (16 * 512))
    with pytest.raises(ValueError, match="exceeds max_len"):
        contiguous_internal_waste(600, 512)
    assert block_table_entries(SEED_LENS, 16) == 147


def test_block_size_sweep_trade_off():
    lens = sample_request_lengths(2000, seed=0)
    rows = block_size_sweep(lens, [1, 2, 4, 8, 16, 32, 64, 128, 256])
    waste = [r.waste_percent for r in rows]
    entries = [r.mean_entries for r in rows]
    assert waste[0] == 0.0 and waste == sorted(waste)  # bigger blocks waste more
    assert entries == sorted(entries, reverse=True)  # and need fewer table entries
    assert rows[4].block_size == 16 and rows[4].waste_percent < 3.0
    assert rows[0].max_entries == max(lens)
    with pytest.raises(ValueError, match="empty"):
        block_size_sweep([], [16])


def test_sample_request_lengths_is_seeded_and_clipped():
    a = sample_request_lengths(500, seed=4, max_len=512)
    assert a == sample_request_lengths(500, seed=4, max_len=512)
    assert a != sample_request_lengths(500, seed=5, max_len=512)
    assert min(a) >= 1 and max(a) <= 512 and all(type(x) is int for x in a)
    big = sample_request_lengths(20_000, seed=0, median=300, sigma=0.9, max_len=10**6)
    assert 280 < float(np.median(big)) < 320


# ------------------------------------------------------------------------------------------ first fit
def test_first_fit_refuses_with_enough_free_memory():
    ff = FirstFitAllocator(100)
    assert [ff.allocate(k, s) for k, s in [("A", 30), ("B", 20), ("C", 30), ("D", 20)]] == [0, 30, 50, 80]
    ff.free("B")
    ff.free("D")
    assert ff.holes() == [Hole(30, 20), Hole(80, 20)]
    assert ff.num_free_slots == 40 and ff.largest_hole == 20
    assert ff.allocate("E", 30) is None
    assert "E" not in ff.allocations and ff.num_free_slots == 40  # a refusal changes nothing
    assert ff.allocate("F", 20) == 30  # first fit: the lowest hole that is large enough
    ff.check_invariants()


def test_first_fit_merges_neighbouring_holes():
    ff = FirstFitAllocator(90)
    for k in "ABC":
        ff.allocate(k, 30)
    ff.free("A")
    ff.free("C")
    ff.free("B")  # merges with both neighbours
    assert ff.holes() == [Hole(0, 90)]
    ff.check_invariants()


def test_first_fit_rejects_bad_input():
    ff = FirstFitAllocator(10)
    ff.allocate("A", 5)
    with pytest.raises(ValueError, match="already holds"):
        ff.allocate("A", 1)
    with pytest.raises(ValueError, match="size"):
        ff.allocate("B", 0)
    with pytest.raises(ValueError, match="holds no slots"):
        ff.free("B")
    with pytest.raises(ValueError, match="num_slots"):
        FirstFitAllocator(-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=80), st.integers(0, 300))
def test_first_fit_invariants_under_random_operations(ops, num_slots):
    ff = FirstFitAllocator(num_slots)
    live: list[int] = []
    for k, (alloc, size) in enumerate(ops):
        if alloc or not live:
            fits_somewhere = ff.largest_hole >= size
            start = ff.allocate(k, size)
            assert (start is not None) == fits_somewhere
            if start is not None:
                live.append(k)
        else:
            ff.free(live.pop(len(live) // 2))
        ff.check_invariants()
        assert ff.num_free_slots + sum(r.size for r in ff.allocations.values()) == num_slots


def test_trace_replay_first_fit_vs_paged():
    trace = make_trace(800, seed=3, mean_gap=1.0, mean_duration=25)
    assert trace == make_trace(800, seed=3, mean_gap=1.0, mean_duration=25)
    ev_ff = simulate_first_fit(trace, 16_384)
    ev_pg = simulate_paged(trace, 1024, 16)
    assert len(ev_ff) == len(ev_pg) == 800
    assert any(e.external_fragmentation for e in ev_ff)  # first fit refuses with enough memory free
    assert not any(e.external_fragmentation for e in ev_pg)  # paging never does
    for e in ev_ff:
        assert e.admitted == (e.size <= e.largest_hole)


def test_trace_replay_frees_before_admitting_at_the_same_step():
    trace = [TraceRequest(0, 0, 5, 10), TraceRequest(1, 5, 5, 10)]
    events = simulate_first_fit(trace, 10)
    assert [e.admitted for e in events] == [True, True]
    assert events[1].free_before == 10 and events[1].live == 1
