"""The compiled CPU decode attention (``pagedkv.engine.cpu_kernel``) against the float64 reference on random
steps (any block table, shared blocks, windows, head sizes that are and are not a multiple of 16, a strided
query), its refusals, and the engine's fallback to PyTorch when the kernel is switched off or cannot be built."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import ref_paged_prefill_attention
from pagedkv.block_table import make_block_table_tensor
from pagedkv.engine import cpu_kernel
from pagedkv.engine.attention import AttentionMetadata, torch_paged_attention

needs_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the kernel is not built")


def _step(seed: int, q_lens: list[int], hkv: int, g: int, d: int, bs: int, shared: bool):
    """A step whose requests have ``q_lens`` new tokens each, their blocks shuffled over the pool (with
    ``shared``, request 0's first block is also every other request's first block); ``query`` is a strided
    view (the q part of a packed q/k tensor), as the lab's decoder passes it."""
    rng = random.Random(seed)
    lens = [rng.randint(q, q + 4 * bs) for q in q_lens]
    nblk = [-(-n // bs) for n in lens]
    ids = list(range(1, sum(nblk) + 4))
    rng.shuffle(ids)
    it = iter(ids)
    tables = [[next(it) for _ in range(n)] for n in nblk]
    if shared:
        for t in tables[1:]:
            t[0] = tables[0][0]
    gen = torch.Generator().manual_seed(seed)
    shape = (len(ids) + 1, bs, hkv, d)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    t_all = sum(q_lens)
    packed = torch.randn(t_all, hkv * g + hkv, d, generator=gen)  # [T, Hq + Hkv, D]: q then k
    query = packed[:, : hkv * g]  # [T, Hq, D], token stride (Hq + Hkv)·D
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    decodes = [b for b, q in enumerate(q_lens) if q == 1]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(t_all, dtype=torch.long), block_tables=make_block_table_tensor(tables),
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(lens), kv_caches=[(key_cache, value_cache)],
        decode_req_idx=torch.tensor(decodes, dtype=torch.long),
        prefill_reqs=[(b, qsl[b], qsl[b + 1], lens[b]) for b, q in enumerate(q_lens) if q > 1])
    return query, key_cache, value_cache, meta


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), q_lens=st.lists(st.sampled_from([1, 1, 1, 3]), min_size=1, max_size=7),
       hkv=st.integers(1, 3), g=st.integers(1, 3), d=st.sampled_from([8, 16, 24, 40, 64]),
       bs=st.sampled_from([1, 4, 16]), shared=st.booleans(), window=st.sampled_from([None, 1, 5, 20]))
def test_kernel_matches_the_float64_reference(seed, q_lens, hkv, g, d, bs, shared, window):
    query, key_cache, value_cache, meta = _step(seed, q_lens, hkv, g, d, bs, shared)
    want = ref_paged_prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, 0.3, compute_dtype=torch.float64, sliding_window=window)
    out = torch.full(query.shape, 7.0)
    cpu_kernel.decode_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, meta.decode_req_idx, out, 0.3, window)
    rows = meta.query_start_loc[meta.decode_req_idx].long()  # the decode rows' tokens
    torch.testing.assert_close(out[rows].double(), want[rows], atol=1e-5, rtol=1e-5)
    others = torch.ones(query.shape[0], dtype=torch.bool)
    others[rows] = False
    assert (out[others] == 7.0).all()  # the prefill rows untouched
    # the whole backend (the kernel for decode rows, PyTorch for prefill chunks) against the reference too
    got = torch_paged_attention(query, key_cache, value_cache, meta, 0.3, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_refuses_a_table_outside_the_pool():
    query, key_cache, value_cache, meta = _step(0, [1, 1], 2, 2, 16, 4, False)
    out = torch.zeros(query.shape)
    bad = meta.block_tables.clone()
    bad[1, 0] = key_cache.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="request 1's block table"):
        cpu_kernel.decode_attention(query, key_cache, value_cache, bad, meta.seq_lens, meta.query_start_loc,
                                    meta.decode_req_idx, out, 0.3)
    short = meta.seq_lens.clone()
    short[0] = 4 * (meta.block_tables.shape[1] + 1)  # longer than its table
    with pytest.raises(ValueError, match="request 0's block table is shorter"):
        cpu_kernel.decode_attention(query, key_cache, value_cache, meta.block_tables, short, meta.query_start_loc,
                                    meta.decode_req_idx, out, 0.3)
    assert not cpu_kernel.usable(query.double(), key_cache.double())  # float32 only


@pytest.mark.parametrize("env", [{"PAGEDKV_CPU_KERNEL": "0"}, {"CC": "/nonexistent/cc"},
                                 {"PAGEDKV_KERNEL_CACHE": "{tmp}/a-file/cache"}])  # a folder that cannot be made
def test_without_the_kernel_the_backend_falls_back(monkeypatch, tmp_path, env):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PAGEDKV_KERNEL_CACHE", str(tmp_path))  # nothing built yet in this cache
    for k, v in env.items():
        monkeypatch.setenv(k, v.format(tmp=tmp_path))
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is None and not cpu_kernel.serves("cpu", torch.float32)
        query, key_cache, value_cache, meta = _step(3, [1, 3, 1], 2, 2, 16, 4, True)
        got = torch_paged_attention(query, key_cache, value_cache, meta, 0.3)  # the gathered groups
        want = ref_paged_prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                           meta.query_start_loc, 0.3, compute_dtype=torch.float64)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    finally:
        cpu_kernel.load.cache_clear()
