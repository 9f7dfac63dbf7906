"""The PyTorch reference in pagedkv.attention: the yardstick every kernel test uses, so test it first."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import (
    attention,
    gather_kv,
    make_paged_kv,
    ref_paged_attention_decode,
    ref_paged_prefill_attention,
    relative_error,
)


def _sdpa(q, k, v, scale, causal=False):
    """torch's own attention on [H, L, D] tensors (GQA expanded by hand)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal)


def test_gather_kv_reads_each_token_from_its_block():
    gen = torch.Generator().manual_seed(0)
    kc, vc, bt, sl = make_paged_kv([37, 5], num_kv_heads=2, head_dim=4, block_size=8, generator=gen)
    k, v = gather_kv(kc, vc, bt[0], 37)
    assert k.shape == (37, 2, 4)
    for t in range(37):
        blk = int(bt[0, t // 8])
        assert torch.equal(k[t], kc[blk, t % 8]) and torch.equal(v[t], vc[blk, t % 8])


def test_make_paged_kv_scatters_distinct_blocks_and_poisons_the_rest():
    gen = torch.Generator().manual_seed(1)
    kc, vc, bt, sl = make_paged_kv([16, 17, 1], num_kv_heads=1, head_dim=2, block_size=16, generator=gen)
    used = [bt[0, :1], bt[1, :2], bt[2, :1]]
    ids = torch.cat(used).tolist()
    assert len(ids) == len(set(ids)) == 4 and 0 not in ids
    assert sl.dtype == torch.int32 and bt.dtype == torch.int32 and sl.tolist() == [16, 17, 1]
    # Slot 1 of sequence 1's second block is past its end: poisoned with a huge value.
    assert kc[int(bt[1, 1]), 1].abs().min() >= 1e4
    with pytest.raises(ValueError, match="max_blocks"):
        make_paged_kv([40], 1, 2, 16, max_blocks=2)
    with pytest.raises(ValueError, match="empty"):
        make_paged_kv([], 1, 2, 16)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_reference_matches_sdpa_on_dense_kv(group):
    gen = torch.Generator().manual_seed(group)
    hkv, d, lens = 2, 16, [1, 9, 33]
    kc, vc, bt, sl = make_paged_kv(lens, hkv, d, 8, generator=gen)
    q = torch.randn(len(lens), hkv * group, d, generator=gen)
    out = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    assert out.dtype == torch.float64
    for b, n in enumerate(lens):
        k, v = gather_kv(kc, vc, bt[b], n)
        k = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [Hq, n, D]
        v = v.double().repeat_interleave(group, 1).transpose(0, 1)
        want = _sdpa(q[b].double()[:, None, :], k, v, d**-0.5)[:, 0]
        assert torch.allclose(out[b], want, atol=1e-12)


def test_prefill_reference_matches_causal_sdpa_and_decode():
    gen = torch.Generator().manual_seed(3)
    hkv, group, d = 2, 2, 16
    lens = [20, 7]
    kc, vc, bt, sl = make_paged_kv(lens, hkv, d, 4, generator=gen)
    # Sequence 0: 6 new tokens after a 14-token prefix; sequence 1: a whole 7-token prompt.
    qsl = torch.tensor([0, 6, 13], dtype=torch.int32)
    q = torch.randn(13, hkv * group, d, generator=gen)
    out = ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl, compute_dtype=torch.float64)
    k, v = gather_kv(kc, vc, bt[1], 7)
    k = k.double().repeat_interleave(group, 1).transpose(0, 1)
    v = v.double().repeat_interleave(group, 1).transpose(0, 1)
    want = _sdpa(q[6:13].double().transpose(0, 1), k, v, d**-0.5, causal=True).transpose(0, 1)
    assert torch.allclose(out[6:13], want, atol=1e-12)
    # The last new token of sequence 0 sees all 20 tokens: that is decode at seq_len 20.
    dec = ref_paged_attention_decode(q[5:6], kc, vc, bt[:1], sl[:1], compute_dtype=torch.float64)
    assert torch.allclose(out[5], dec[0], atol=1e-12)
    # Its first new token (position 14) sees 15 tokens.
    dec = ref_paged_attention_decode(q[0:1], kc, vc, bt[:1], torch.tensor([15], dtype=torch.int32),
                                     compute_dtype=torch.float64)
    assert torch.allclose(out[0], dec[0], atol=1e-12)


def test_reference_returns_compute_dtype_and_default_scale():
    gen = torch.Generator().manual_seed(4)
    kc, vc, bt, sl = make_paged_kv([5], 1, 16, 4, dtype=torch.float16, generator=gen)
    q = torch.randn(1, 2, 16, generator=gen).half()
    assert ref_paged_attention_decode(q, kc, vc, bt, sl).dtype == torch.float32
    a = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    b = ref_paged_attention_decode(q, kc, vc, bt, sl, scale=0.25, compute_dtype=torch.float64)
    assert torch.equal(a, b)  # 1/sqrt(16) = 0.25


def test_relative_error_flags_nan_and_measures_max_abs():
    ref = torch.tensor([1.0, -2.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.tensor([1.0, -2.0, 4.5]), ref) == pytest.approx(0.125)
    assert relative_error(torch.tensor([1.0, float("nan"), 4.0]), ref) == math.inf


def test_attention_causal_offset_masks_the_future():
    q = torch.randn(3, 1, 4)
    k = torch.randn(5, 1, 4)
    v = torch.zeros(5, 1, 4)
    v[4] = 1.0  # only the last token carries signal
    out = attention(q, k, v, 0.5, causal_offset=2)  # queries at positions 2, 3, 4
    assert torch.all(out[:2] == 0) and torch.all(out[2] > 0)


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 3, 4, 16]),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_paging_does_not_change_the_output(lens, block_size, group, seed):
    """Moving blocks around the pool (and rewriting the tables to match) leaves the output bit-identical."""
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv(lens, 2, 8, block_size, generator=gen)
    q = torch.randn(len(lens), 2 * group, 8, generator=gen)
    out = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    perm = torch.randperm(kc.shape[0], generator=gen)  # new physical home of every block
    kc2 = torch.empty_like(kc)
    vc2 = torch.empty_like(vc)
    kc2[perm], vc2[perm] = kc, vc
    bt2 = perm[bt.long()].to(torch.int32)
    out2 = ref_paged_attention_decode(q, kc2, vc2, bt2, sl, compute_dtype=torch.float64)
    assert torch.equal(out, out2)


def test_reference_reads_vllm_packed_layout_views():
    """vLLM 0.26's FlashAttention cache: one tensor, logical (num_blocks, Hkv, block_size, 2 * D), NHD stride order
    (0, 2, 1, 3), split into K/V views by ``kv_cache.transpose(1, 2).split(D, dim=-1)``: the same attention."""
    gen = torch.Generator().manual_seed(7)
    kc, vc, bt, sl = make_paged_kv([5, 33], 2, 8, 16, generator=gen)
    q = torch.randn(2, 4, 8, generator=gen)
    logical = (kc.shape[0], 2, 16, 16)
    order = (0, 2, 1, 3)
    kv_cache = torch.empty([logical[i] for i in order]).permute(*[order.index(i) for i in range(4)])
    assert tuple(kv_cache.shape) == logical
    k_view, v_view = kv_cache.transpose(1, 2).split(8, dim=-1)
    k_view.copy_(kc)
    v_view.copy_(vc)
    assert k_view.stride() == (16 * 2 * 16, 2 * 16, 16, 1)  # head stride 2 * D: K and V side by side
    want = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    assert torch.equal(ref_paged_attention_decode(q, k_view, v_view, bt, sl, compute_dtype=torch.float64), want)
