"""The prefix-cache benchmark runs at tiny sizes and reports what it says it measures."""

from __future__ import annotations

import pytest

from pagedkv.benchmarks import prefix_cache as bench


def test_run_benchmark_tiny_sizes() -> None:
    result = bench.run_benchmark(prompt_tokens=65, block_size=16, repeats=3, hash_blocks=8, hash_repeats=2)
    assert {(t.hash_fn, t.call) for t in result.lookups} == {
        (h, c) for h in ("builtin", "sha256") for c in ("first", "repeat")
    }
    for t in result.lookups:
        assert t.hit_blocks == 4  # (65 - 1) // 16: a full hit on 4 full blocks, nothing cut
        assert 0 < t.min_us <= t.median_us
    assert result.lookup("builtin", "first").prompt_tokens == 65
    for h in result.hashing:
        assert 0 < h.min_us_per_block <= h.us_per_block and h.num_blocks == 8
    assert result.hash_cost("sha256").block_size == 16


def test_full_hit_is_cut_back_by_one_block() -> None:
    first, repeat = bench.time_lookup("builtin", prompt_tokens=64, block_size=16, repeats=2)
    assert first.hit_blocks == repeat.hit_blocks == 3  # 64 tokens = 4 full blocks, the last one recomputed


def test_main_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--prompt-tokens", "48", "--repeats", "2", "--hash-blocks", "4", "--hash-repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "get_computed_blocks, 48-token prompt" in out
    assert "first: hash 3 blocks" in out and "repeat: look up" in out
    assert "hash_block_tokens" in out and "sha256" in out and "builtin" in out


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_tokens": 16}, r"prompt_tokens must be an int >= 17 \(more than one block"),
        ({"repeats": 0}, "repeats must be an int >= 1"),
    ],
)
def test_bad_sizes_raise(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench.time_lookup("builtin", **{"block_size": 16, **kwargs})


def test_unknown_hash_fn_raises() -> None:
    with pytest.raises(ValueError, match="unknown hash function"):
        bench.run_benchmark(prompt_tokens=32, repeats=1, hash_blocks=1, hash_repeats=1, hash_fns=("md5",))
