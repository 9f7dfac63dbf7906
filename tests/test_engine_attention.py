"""The torch backend's PyTorch decode read in place from the pool (``PoolDecode``) against the float64 reference,
and the cases where it steps aside for the gathered groups (a shared block, blocks spread over the pool, no
decode). Where the compiled CPU kernel is built it serves the engine instead; these paths remain its fallback."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import ref_paged_prefill_attention
from pagedkv.block_table import make_block_table_tensor
from pagedkv.engine.attention import AttentionMetadata, make_pool_decode, torch_paged_attention


def _step(seed: int, num_reqs: int, hkv: int, g: int, bs: int, spare: int):
    """A decode-only step of ``num_reqs`` requests whose blocks are shuffled over a pool with ``spare`` free
    blocks, and its metadata with the in-place decode."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 5 * bs) for _ in range(num_reqs)]
    nblk = [-(-n // bs) for n in lens]
    spare = min(spare, sum(nblk))  # at most as many free blocks as used ones: in place (max_spread 2)
    ids = list(range(1, sum(nblk) + spare + 1))
    rng.shuffle(ids)
    tables, it = [], iter(ids)
    for n in nblk:
        tables.append([next(it) for _ in range(n)])
    gen = torch.Generator().manual_seed(seed)
    d = 8
    shape = (len(ids) + 1, bs, hkv, d)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(num_reqs, hkv * g, d, generator=gen)
    bt = make_block_table_tensor(tables)
    qsl = list(range(num_reqs + 1))
    pool = make_pool_decode(list(range(num_reqs)), lens, bt, qsl, bs)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_reqs, dtype=torch.long), block_tables=bt,
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=1, max_seq_len=max(lens), kv_caches=[(key_cache, value_cache)],
        decode_req_idx=torch.arange(num_reqs), pool_decode=pool, decode_kernel=False)  # PyTorch's decode paths
    return query, key_cache, value_cache, meta


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), num_reqs=st.integers(1, 9), hkv=st.integers(1, 3), g=st.integers(1, 3),
       bs=st.sampled_from([1, 4, 16]), spare=st.integers(0, 6))
def test_in_place_decode_matches_the_reference(seed, num_reqs, hkv, g, bs, spare):
    query, key_cache, value_cache, meta = _step(seed, num_reqs, hkv, g, bs, spare)
    assert meta.pool_decode is not None
    got = torch_paged_attention(query, key_cache, value_cache, meta, 0.3)
    want = ref_paged_prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, 0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    meta.pool_decode = None  # the gathered groups give the same
    torch.testing.assert_close(torch_paged_attention(query, key_cache, value_cache, meta, 0.3), got,
                               atol=1e-6, rtol=1e-5)


def test_in_place_decode_steps_aside():
    bt = make_block_table_tensor([[3, 4], [5, 4]])  # block 4 in both rows: a shared prefix
    assert make_pool_decode([0, 1], [20, 20], bt, [0, 1, 2], 16) is None
    bt = make_block_table_tensor([[1], [90]])  # two blocks, 90 apart: the range would be mostly others' blocks
    assert make_pool_decode([0, 1], [5, 5], bt, [0, 1, 2], 16) is None
    assert make_pool_decode([], [5], bt, [0, 5], 16) is None  # no decode row
    pool = make_pool_decode([1], [9, 20], make_block_table_tensor([[1], [7, 8]]), [0, 9, 10], 16)
    assert (pool.lo, pool.hi, pool.width) == (7, 9, 2) and pool.tokens.tolist() == [9]
    assert pool.owner.tolist() == [0, 0] and pool.col.tolist() == [0, 1]
    assert torch.isinf(pool.mask[0, 0, 20:]).all() and not pool.mask[0, 0, :20].any()
