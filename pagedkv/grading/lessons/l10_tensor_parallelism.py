"""Checks for lesson 10's exercises (``grading/source/10_tensor_parallelism.ipynb``): which KV heads a rank
holds, a rank's page size, and the pool's block count over the ranks.

Every expected value comes from :mod:`pagedkv.distributed` (``kv_head_shard``, ``kv_page_bytes_per_rank``,
``unify_num_blocks``; tested in ``tests/test_tensor_parallel.py``). Each check also computes the answers of the
plausible mistakes -- heads split without replication (ranks past the last head get heads that do not exist, or
none), replicas interleaved instead of neighbouring, ``num_kv_heads / tp`` as a float, an MLA latent split over
the ranks or counted twice as K and V, a page for every layer or of 2-byte values whatever ``dtype_bytes``, the
largest, the sum or the average of the ranks' counts instead of the smallest --
and names the mistake when the learner's answer equals one. Small known cases first, then every small
combination, then (hidden) larger ones.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

from pagedkv.distributed.layers import kv_head_shard
from pagedkv.grading.checks import STUB_NOTE, describe, expect_raises, fail, is_int, require_function, run
from pagedkv.sizing.parallel import kv_page_bytes_per_rank, unify_num_blocks

__all__ = [
    "DENSE",
    "MLA",
    "check_kv_heads_hidden",
    "check_kv_heads_published",
    "check_kv_heads_refuses_bad_splits",
    "check_kv_heads_small",
    "check_page_dense",
    "check_page_hidden",
    "check_page_mla",
    "check_pool_examples",
    "check_pool_hidden",
    "check_pool_refuses_bad_input",
    "expected_heads",
]

#: Published shapes (config.json values): Llama-3.1-70B (8 KV heads), Qwen2.5-1.5B (2 KV heads), and DeepSeek-V3
#: (MLA: one latent of kv_lora_rank + qk_rope_head_dim = 576 values per token and layer).
DENSE: dict[str, dict[str, Any]] = {
    "Llama-3.1-70B": dict(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
                          intermediate_size=28672),
    "Qwen2.5-1.5B": dict(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536,
                         intermediate_size=8960),
    # head_dim 128, although hidden_size // num_attention_heads is 64
    "Qwen3-0.6B": dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, hidden_size=1024,
                       intermediate_size=3072, head_dim=128),
}  # fmt: skip
MLA: dict[str, Any] = dict(num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                           hidden_size=7168, intermediate_size=18432, kv_lora_rank=512, qk_rope_head_dim=64)


# --- exercise 1: the KV heads of a rank ----------------------------------------------------------------------


def expected_heads(num_kv_heads: int, tp: int, rank: int) -> list[int]:
    return list(kv_head_shard(num_kv_heads, tp, rank))


def _heads_mistakes(h: int, tp: int, rank: int) -> list[tuple[list[int], str]]:
    n = max(1, h // tp)
    replicas = max(1, tp // h)
    split = list(range(rank * n, rank * n + n))
    out = [
        ([rank % h], f"each KV head is replicated on {replicas} NEIGHBOURING ranks (those holding the query heads "
                     f"that read it): rank {rank} holds head rank // (tp // num_kv_heads) = {rank // replicas}"),
        (list(range(rank * (h // tp), (rank + 1) * (h // tp))),
         f"num_kv_heads // tp is 0 here ({h} // {tp}): every rank still needs the one KV head its query heads read"),
    ]  # fmt: skip
    if tp <= h:
        out.append((list(range(rank, h, tp)), f"rank {rank} holds {n} NEIGHBOURING heads, rank * {n} .. "
                                              f"rank * {n} + {n - 1}, not one head in every {tp}: its query heads "
                                              "are neighbours, and so are the KV heads they read"))
    if split and split[-1] >= h:
        out.insert(0, (split, f"with {tp} ranks and {h} KV head(s), splitting by rank * {n} gives rank {rank} heads "
                              f"past the last one ({h - 1}): when tp exceeds the KV heads, each head is replicated on "
                              f"tp // num_kv_heads = {replicas} neighbouring ranks"))
    return out


def _check_heads(fn: Callable, h: int, tp: int, rank: int) -> None:
    call = f"kv_heads_of_rank({h}, {tp}, {rank})"
    got = run(fn, (h, tp, rank), name="kv_heads_of_rank", timeout=2)
    want = expected_heads(h, tp, rank)
    if isinstance(got, range):
        got = list(got)
    if isinstance(got, (list, tuple)) and all(is_int(x) for x in got) and list(got) == want:
        return
    message = f"{call} returned {describe(got)}, expected {want}"
    if got is None:
        fail(f"{message}. {STUB_NOTE}")
    if not isinstance(got, (list, tuple)) or not all(is_int(x) for x in got):
        fail(message + " (return a list of ints: the head indices, in increasing order)")
    hints = [why for wrong, why in _heads_mistakes(h, tp, rank) if list(got) == wrong and wrong != want]
    if not hints and sorted(got) == want:
        hints = ["the right heads: return them in increasing order"]
    fail(f"{message}. Hint: {hints[0]}" if hints else message + ".")


def check_kv_heads_published(kv_heads_of_rank: Any) -> None:
    """Llama-3.1-70B's 8 KV heads at tp 1, 2, 4, 8, and 2 KV heads at tp 4 (replicated) (1 point)."""
    require_function(kv_heads_of_rank, "kv_heads_of_rank")
    for h, tp in ((8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (2, 2)):
        for rank in range(tp):
            _check_heads(kv_heads_of_rank, h, tp, rank)


def check_kv_heads_small(kv_heads_of_rank: Any) -> None:
    """Every rank of every split with up to 16 heads and 16 ranks (1 point)."""
    require_function(kv_heads_of_rank, "kv_heads_of_rank")
    for h in (1, 2, 4, 8, 16):
        for tp in (1, 2, 4, 8, 16):
            for rank in range(tp):
                _check_heads(kv_heads_of_rank, h, tp, rank)


def check_kv_heads_refuses_bad_splits(kv_heads_of_rank: Any) -> None:
    """Splits that do not divide, and ranks outside 0..tp-1, refused with ValueError (1 point)."""
    require_function(kv_heads_of_rank, "kv_heads_of_rank")
    # the refusals count once valid splits work: several, so that an answer written for one example and raising
    # on everything else does not score here (a red-team pass: 1 point for that)
    for h, tp, rank in ((8, 2, 1), (8, 4, 3), (2, 4, 2), (4, 1, 0)):
        _check_heads(kv_heads_of_rank, h, tp, rank)
    for args, why in (((6, 4, 0), "6 KV heads do not split over 4 ranks"),
                      ((2, 3, 0), "3 ranks cannot share 2 KV heads evenly"),
                      ((4, 2, 2), "rank 2 does not exist with tp=2"),
                      ((4, 2, -1), "a negative rank"),
                      ((0, 2, 0), "a model with 0 KV heads")):  # fmt: skip
        expect_raises(ValueError, kv_heads_of_rank, args, name="kv_heads_of_rank", why=why, timeout=2)


def check_kv_heads_hidden(kv_heads_of_rank: Any) -> None:
    """Up to 128 heads and 64 ranks, every rank (hidden, 1 point)."""
    require_function(kv_heads_of_rank, "kv_heads_of_rank")
    for h in (1, 2, 4, 8, 16, 32, 64, 128):
        for tp in (1, 2, 4, 8, 16, 32, 64):
            for rank in range(tp):
                _check_heads(kv_heads_of_rank, h, tp, rank)


# --- exercise 2: a rank's page -------------------------------------------------------------------------------


def _page_mistakes(config: dict[str, Any], tp: int, block_size: int, nbytes: int) -> list[tuple[Any, str]]:
    right = _expected_page(config, tp, block_size, nbytes)
    if "kv_lora_rank" in config:
        latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        return [(v, m) for v, m in [
            (block_size * latent * nbytes // tp, "the latent is not split: every rank needs the whole latent to "
                                                 "rebuild its heads' keys and values, so it is replicated"),
            (2 * block_size * latent * nbytes, "MLA caches ONE latent per token, not a key and a value"),
            (2 * block_size * config["num_key_value_heads"] // tp * (config["hidden_size"] //
                                                                     config["num_attention_heads"]) * nbytes,
             "an MLA model (kv_lora_rank in its config) caches the latent, not num_key_value_heads heads"),
            (block_size * config["kv_lora_rank"] * nbytes, "the latent is kv_lora_rank + qk_rope_head_dim values"),
            (right * config["num_hidden_layers"], f"that is the page of all {config['num_hidden_layers']} layers: "
                                                  "return ONE layer's page (the pool divides by the layers itself)"),
            *([(right // nbytes * 2, f"multiply by dtype_bytes ({nbytes}), the bytes of one value, not by 2")]
              if nbytes != 2 else []),
        ] if v != right]  # fmt: skip
    h, heads = config["num_key_value_heads"], config["num_attention_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    d_guess = config["hidden_size"] // heads  # what a config without head_dim implies
    return [(v, m) for v, m in [
        *([(2 * block_size * max(1, h // tp) * d_guess * nbytes,
            f"this config has head_dim={d}: use it; hidden_size // num_attention_heads ({d_guess}) is only the "
            "fallback for a config without one")] if d != d_guess else []),
        (2 * block_size * (h // tp) * d * nbytes, f"{h} // {tp} is 0: a rank always holds at least one KV head"),
        (2 * block_size * h / tp * d * nbytes, "a rank holds whole heads: max(1, num_kv_heads // tp), an int"),
        (2 * block_size * h * d * nbytes, "that is the one-GPU page: each rank holds only its share of the KV heads"),
        (block_size * max(1, h // tp) * d * nbytes, "a block stores keys AND values: the factor 2"),
        (2 * block_size * max(1, heads // tp) * d * nbytes, "only the KV heads are cached, not the query heads"),
        (2 * block_size * max(1, h // tp) * (config["hidden_size"] // h) * nbytes,
         "head_dim is hidden_size // num_attention_heads (the query heads' count), not // num_key_value_heads"),
        (right * config["num_hidden_layers"], f"that is the page of all {config['num_hidden_layers']} layers: "
                                              "return ONE layer's page (the pool divides by the layers itself)"),
        *([(right // nbytes * 2, f"multiply by dtype_bytes ({nbytes}), the bytes of one value, not by 2")]
          if nbytes != 2 else []),
    ] if v != right]  # fmt: skip


def _expected_page(config: dict[str, Any], tp: int, block_size: int, nbytes: int) -> int:
    # kv_page_bytes_per_rank takes a dtype; the exercise takes bytes per value: one of 1, 2, 4
    dtype = {1: "fp8", 2: "bf16", 4: "fp32"}[nbytes]
    return kv_page_bytes_per_rank(config, tp, block_size, dtype)


def _check_page(fn: Callable, config: dict[str, Any], tp: int, block_size: int, nbytes: int, label: str) -> None:
    call = f"kv_page_bytes_per_rank({label}, tp={tp}, block_size={block_size}, dtype_bytes={nbytes})"
    want = _expected_page(config, tp, block_size, nbytes)  # first; the learner's function gets a copy
    got = run(fn, (copy.deepcopy(config), tp, block_size, nbytes), name="kv_page_bytes_per_rank", timeout=2)
    if is_int(got) and got == want:
        return
    message = f"{call} returned {describe(got)}, expected {want}"
    if got is None:
        fail(f"{message}. {STUB_NOTE}")
    hints = list(dict.fromkeys(why for wrong, why in _page_mistakes(config, tp, block_size, nbytes) if got == wrong))
    if not is_int(got) and not hints:
        fail(message + f" (expected an int, got {type(got).__name__})")
    fail(f"{message}. Hint: {'. Or: '.join(hints)}" if hints else message + ".")


def check_page_dense(kv_page_bytes_per_rank: Any) -> None:
    """Llama-3.1-70B, Qwen2.5-1.5B and Qwen3-0.6B (its own head_dim) at tp 1, 2, 4, 8 (16 when it divides),
    bf16 and fp8 (1 point)."""
    require_function(kv_page_bytes_per_rank, "kv_page_bytes_per_rank")
    for name, config in DENSE.items():
        for tp in (1, 2, 4, 8, 16):
            if config["num_attention_heads"] % tp == 0:
                for nbytes in (2, 1):
                    _check_page(kv_page_bytes_per_rank, config, tp, 16, nbytes, name)


def check_page_mla(kv_page_bytes_per_rank: Any) -> None:
    """DeepSeek-V3 (MLA) at tp 1 to 16: the latent is replicated (1 point)."""
    require_function(kv_page_bytes_per_rank, "kv_page_bytes_per_rank")
    for tp in (1, 2, 4, 8, 16):
        for block_size, nbytes in ((16, 2), (64, 1)):
            _check_page(kv_page_bytes_per_rank, MLA, tp, block_size, nbytes, "DeepSeek-V3")


def check_page_hidden(kv_page_bytes_per_rank: Any) -> None:
    """Random dense and MLA configs, explicit head_dim sometimes (hidden, 1 point)."""
    require_function(kv_page_bytes_per_rank, "kv_page_bytes_per_rank")
    rng = random.Random(1010)
    for _ in range(200):
        tp = rng.choice([1, 2, 4, 8, 16])
        kv = rng.choice([1, 2, 4, 8, 16, 32])
        heads = kv * rng.choice([1, 2, 4])
        while heads % tp:
            heads *= 2
        d = rng.choice([64, 128, 256])
        config: dict[str, Any] = dict(num_hidden_layers=rng.randrange(1, 100), num_attention_heads=heads,
                                      num_key_value_heads=kv, hidden_size=heads * d, intermediate_size=4 * heads * d)
        if rng.random() < 0.4:
            config["head_dim"] = d * 2
        if rng.random() < 0.25:
            config.update(kv_lora_rank=rng.choice([256, 512]), qk_rope_head_dim=rng.choice([32, 64]))
        _check_page(kv_page_bytes_per_rank, config, tp, rng.choice([1, 16, 32]), rng.choice([1, 2, 4]),
                    "{" + ", ".join(f"{k}={v}" for k, v in config.items()) + "}")


# --- exercise 3: the pool over the ranks ---------------------------------------------------------------------


def _check_pool(fn: Callable, available: list[int], page: int, layers: int) -> None:
    call = f"pool_num_blocks({available}, page_bytes={page}, num_layers={layers})"
    got = run(fn, (list(available), page, layers), name="pool_num_blocks", timeout=2)
    per_rank = [a // page // layers for a in available]
    want = unify_num_blocks(per_rank)
    if is_int(got) and got == want:
        return
    message = f"{call} returned {describe(got)}, expected {want} (the ranks hold {per_rank})"
    if got is None:
        fail(f"{message}. {STUB_NOTE}")
    mistakes = [
        (max(per_rank), "that is the LARGEST rank's count: a block id must exist on every rank, so the pool is the "
                        "smallest"),
        (sum(per_rank), "that is the sum over the ranks: every rank holds every block (its heads' share of it), so "
                        "the pool is one rank's count, the smallest"),
        (sum(available) // page // layers, "the ranks do not pool their memory: each holds its own share of every "
                                           "block, so the pool is the smallest rank's count"),
        (min(available) // page, "divide by the number of layers too: each layer has its own page per block"),
        (per_rank[0], "that is rank 0's count: the pool is the smallest over ALL ranks"),
        (want * len(available), f"that is the smallest count times the {len(available)} ranks: every rank holds "
                                "every block, so the pool is one rank's count"),
        (sum(available) // len(available) // page // layers, "that is the ranks' average: a block id must exist on "
                                                              "every rank, so the pool is the smallest count"),
        (min(available) // page // layers // 2, "the page already holds the keys and the values (exercise 2's "
                                                "factor 2): do not halve again"),
        (min(round(a / page / layers) for a in available), "round down (//): part of a block is no block"),
    ]  # fmt: skip
    hints = [why for wrong, why in mistakes if got == wrong and wrong != want]
    if not hints and not is_int(got):
        fail(f"{message} (expected an int: whole blocks, floor division //).")
    fail(f"{message}. Hint: {hints[0]}" if hints else message + ".")


def check_pool_examples(pool_num_blocks: Any) -> None:
    """Two and four ranks with different free memory, and equal ranks (1 point)."""
    require_function(pool_num_blocks, "pool_num_blocks")
    page = 2 * 16 * 1 * 128 * 2
    for available in ([10 * 2**30, 9 * 2**30], [5 * 2**30, 7 * 2**30], [2**33] * 4,
                      [2**33, 2**33 - 5 * page * 80, 2**33, 2**33 + 1]):
        _check_pool(pool_num_blocks, available, page, 80)


def check_pool_refuses_bad_input(pool_num_blocks: Any) -> None:
    """No ranks, a negative memory figure, a page of 0 bytes or 0 layers: refused with ValueError (1 point)."""
    require_function(pool_num_blocks, "pool_num_blocks")
    # valid calls first, the boundary included (a 1-byte page, 1 layer), so that refusing too much fails; their
    # values are the other cases' business
    for args in (([8192], 64, 2), ([8192], 1, 1), ([0], 64, 2)):
        run(pool_num_blocks, args, name="pool_num_blocks", timeout=2)
    for args, why in ((([], 64, 2), "no ranks at all"), (([4096, -1], 64, 2), "a rank with negative memory"),
                      (([4096], 0, 2), "a page of 0 bytes"), (([4096], 64, 0), "0 layers")):  # fmt: skip
        expect_raises(ValueError, pool_num_blocks, args, name="pool_num_blocks", why=why, timeout=2)


def check_pool_hidden(pool_num_blocks: Any) -> None:
    """Random ranks, pages and layer counts (hidden, 1 point)."""
    require_function(pool_num_blocks, "pool_num_blocks")
    rng = random.Random(2026)
    for _ in range(200):
        tp = rng.choice([1, 2, 4, 8])
        page = rng.choice([1024, 4096, 16384, 65536])
        layers = rng.randrange(1, 96)
        base = rng.randrange(page * layers, 80 * 2**30)
        _check_pool(pool_num_blocks, [base - rng.randrange(0, base // 3) for _ in range(tp)], page, layers)


