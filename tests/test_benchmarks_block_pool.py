"""The block-pool benchmark runs, at tiny sizes, and its table and targets say what they should.

No speed is asserted here (timings on a shared CI machine are noise); the benchmark prints them.
"""

from __future__ import annotations

import pytest

from pagedkv.benchmarks import block_pool as bench

TINY = dict(round_time=0.001, repeats=2, progress=False)


def test_run_benchmark_covers_every_case_at_tiny_sizes() -> None:
    result = bench.run_benchmark(sizes=(8, 64), **TINY)
    expected = {(op, impl) for (op, impl) in bench.BUILDERS}
    assert {(t.op, t.impl) for t in result.timings} == expected
    assert result.sizes == [8, 64]
    for t in result.timings:
        assert t.ns_per_op > 0 and t.ns_median >= t.ns_per_op and t.ops_per_round >= 1 and t.rounds == 2
        assert t.ops_per_s == pytest.approx(1e9 / t.ns_per_op)
    # Ratios are computed from the timings, not typed in.
    t = result.get("alloc+free", bench.LINKED, 64)
    d = result.get("alloc+free", bench.DEQUE, 64)
    assert result.deque_fraction("alloc+free", bench.LINKED, 64) == pytest.approx(d.ns_per_op / t.ns_per_op)
    assert result.deque_fraction("alloc+free", bench.DEQUE, 64) == pytest.approx(1.0)
    ns = [x.ns_per_op for x in result.series("touch", bench.LIST)]
    assert result.flatness("touch", bench.LIST) == pytest.approx(max(ns) / min(ns))
    targets = result.targets()
    assert len(targets) == 2 and all(isinstance(ok, bool) for ok, _ in targets.values())


def test_format_table_names_every_container_and_the_targets() -> None:
    result = bench.run_benchmark(sizes=(16, 32), **TINY)
    table = bench.format_table(result)
    for word in ("alloc+free", "touch", "FreeKVCacheBlockQueue", "deque", "list", "BlockPool", "flatness", "targets"):
        assert word in table
    assert "32" in table and ("MET" in table or "MISS" in table)


@pytest.mark.parametrize("op, impl", sorted(k for k in bench.BUILDERS if k[1] in bench.IMPLS))
def test_timed_loops_keep_every_block(op: str, impl: str) -> None:
    """The timed loops move blocks around but never lose or duplicate one."""
    import random

    run = bench.BUILDERS[(op, impl)](50, random.Random(1))
    run(500)  # more operations than blocks: wraps around the queue many times
    container = run.container  # type: ignore[attr-defined]
    if impl == bench.LINKED:
        assert container.num_free_blocks == 50
        ids = [b.block_id for b in container.get_all_free_blocks()]
    else:
        ids = list(container)
    assert sorted(ids) == list(range(50))
    if op == "alloc+free":  # 500 pops and appends rotate the queue by 500 % 50 = 0 places
        assert ids == list(range(50))


def test_pool_loop_returns_every_block() -> None:
    import random

    run = bench.BUILDERS[("alloc+free", "BlockPool")](20, random.Random(0))
    run(100)
    pool = run.container  # type: ignore[attr-defined]
    assert pool.get_num_free_blocks() == 20 and all(b.ref_cnt == 0 for b in pool.blocks)


def test_main_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = bench.main(["--sizes", "1e1", "20", "--round-time", "0.001", "--repeats", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "FreeKVCacheBlockQueue" in out and "10" in out and "20" in out


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        bench.run_benchmark(sizes=(8,), ops=("sort",), **TINY)
    with pytest.raises(ValueError, match="unknown impl"):
        bench.run_benchmark(sizes=(8,), impls=("heap",), **TINY)
    with pytest.raises(ValueError, match="pool sizes"):
        bench.measure_series("alloc+free", bench.DEQUE, [0])
    with pytest.raises(ValueError, match=r"pool sizes\[1\] must be an int >= 1, got True"):
        bench.measure_series("alloc+free", bench.DEQUE, [8, True])
    with pytest.raises(SystemExit):
        bench.main(["--sizes", "1.5"])
