"""The compiled CPU ops (``pagedkv.engine.cpu_ops``, ``pagedkv.engine.cpu_kernel``) against float64 references on
random inputs: the fused residual add + RMSNorm, SiLU-and-multiply (over the whole range of its exponential), the
rotary embedding in place, and the attention kernel on mixed steps (prefill chunks of every length around its
eight-key groups, windows, sharp softmaxes whose exponentials underflow)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_cpu_kernel import _step, needs_kernel

from pagedkv.attention import ref_paged_prefill_attention
from pagedkv.engine import cpu_kernel, cpu_ops
from pagedkv.engine.attention import torch_paged_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _randn(seed: int, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), hidden=st.integers(1, 70), seed=st.integers(0, 2**16), with_residual=st.booleans())
def test_fused_add_rms_norm_matches_float64(rows, hidden, seed, with_residual):
    x, residual, weight = _randn(seed, rows, hidden), _randn(seed + 1, rows, hidden), _randn(seed + 2, hidden)
    s = (x.double() + residual.double()) if with_residual else x.double()
    want = weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    x_in, res_in = x.clone(), residual.clone()
    out, summed = cpu_ops.fused_add_rms_norm(x_in, weight, 1e-6, res_in if with_residual else None)
    torch.testing.assert_close(out.double(), want, **TOL)
    torch.testing.assert_close(summed.double(), s, **TOL)
    if with_residual:  # the sum in the caller's residual, the norm over x: nothing allocated
        assert summed is res_in and out is x_in
    else:  # the input is the residual stream: left as it was, the norm in a new tensor
        assert summed is x_in and torch.equal(x_in, x) and out.data_ptr() != x_in.data_ptr()


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), inter=st.integers(1, 40), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 10.0, 60.0, 100.0]))
def test_silu_and_mul_matches_float64(rows, inter, seed, scale):
    """Gates from about -300 to 300: exp(-gate) under- and overflows in float32 at both ends."""
    x = _randn(seed, rows, 2 * inter, scale=scale)
    x[0, 0] = -88.5  # exp(88.5) is past the overflow guard's cut-off, not float32's
    gate, up = x.double()[:, :inter], x.double()[:, inter:]
    want = gate / (1 + torch.exp(-gate)) * up
    got = cpu_ops.silu_and_mul(x)
    torch.testing.assert_close(got.double(), want, atol=1e-30, rtol=2e-6)


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 9), heads=st.integers(1, 5), half=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_rotary_embedding_in_place_matches_float64(t, heads, half, seed):
    d = 2 * half
    packed = _randn(seed, t, heads + 2, d)  # rotate the first `heads` heads of a wider row, as q and k of a q/k/v row
    x = packed[:, :heads]
    freqs = torch.rand(t, half, generator=torch.Generator().manual_seed(seed)) * 50
    emb = torch.cat((freqs, freqs), dim=-1)  # transformers' layout
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    c, s = cos.double()[:, None, :half], sin.double()[:, None, :half]
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    untouched = packed[:, heads:].clone()
    assert cpu_ops.rotary_embedding(x, cos, sin) is x
    torch.testing.assert_close(x.double(), want, **TOL)
    assert torch.equal(packed[:, heads:], untouched)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), q_lens=st.lists(st.sampled_from([1, 1, 2, 7, 8, 9, 17]), min_size=1, max_size=5),
       hkv=st.integers(1, 3), g=st.integers(1, 3), d=st.sampled_from([8, 24, 64, 80]), bs=st.sampled_from([1, 4, 16]),
       shared=st.booleans(), window=st.sampled_from([None, 1, 5, 20]), sharp=st.sampled_from([1.0, 40.0]))
def test_attention_kernel_on_mixed_steps_matches_float64(seed, q_lens, hkv, g, d, bs, shared, window, sharp):
    """Every request of the step through the kernel: decode rows and prefill chunks (causal, after a cached
    prefix), compared row for row; ``sharp`` scales the query until most exponentials underflow to zero (scores
    of ~100, whose float32 rounding alone moves the result by ~1e-5: the tolerance grows with them)."""
    tol = TOL if sharp == 1 else {"atol": 2e-4, "rtol": 2e-4}
    query, key_cache, value_cache, meta = _step(seed, q_lens, hkv, g, d, bs, shared)
    query.mul_(sharp)
    want = ref_paged_prefill_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, 0.3, compute_dtype=torch.float64, sliding_window=window)
    out = torch.full(query.shape, 7.0)
    every = torch.arange(len(q_lens))
    cpu_kernel.decode_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                meta.query_start_loc, every, out, 0.3, window)
    torch.testing.assert_close(out.double(), want, **tol)
    got = torch_paged_attention(query, key_cache, value_cache, meta, 0.3, window)  # the backend: the same call
    assert torch.equal(got, out)
    meta.decode_kernel = False  # PyTorch's own operations, for comparison
    torch.testing.assert_close(torch_paged_attention(query, key_cache, value_cache, meta, 0.3, window).double(),
                               want, **tol)


@needs_kernel
def test_attention_kernel_refuses_more_queries_than_positions():
    query, key_cache, value_cache, meta = _step(0, [3, 1], 2, 2, 16, 4, False)
    short = meta.seq_lens.clone()
    short[0] = 2  # three query tokens, two positions
    with pytest.raises(ValueError, match="request 0"):
        cpu_kernel.decode_attention(query, key_cache, value_cache, meta.block_tables, short, meta.query_start_loc,
                                    torch.arange(2), torch.zeros(query.shape), 0.3)


@needs_kernel
def test_ops_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="last dimension contiguous"):
        cpu_ops.silu_and_mul(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.fused_add_rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        cpu_ops.fused_add_rms_norm(torch.zeros(2, 4), torch.ones(5), 1e-6)
    with pytest.raises(ValueError, match="cos/sin"):
        cpu_ops.rotary_embedding(torch.zeros(2, 1, 4), torch.zeros(3, 4), torch.zeros(3, 4))


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(t=st.integers(1, 12), hkv=st.integers(1, 3), d=st.sampled_from([4, 24, 64]), seed=st.integers(0, 2**16))
def test_cache_write_puts_each_row_at_its_slot(t, hkv, d, seed):
    """``write_kv_torch`` through ``cpu_cache.c``: K and V read from a strided view (the q/k/v product's output),
    each token's rows at its slot bit for bit, padding (-1) skipped, every other slot untouched."""
    from pagedkv.engine.attention import write_kv_torch

    packed = _randn(seed, t, 2 + 2 * hkv, d)  # [T, q + k + v heads, D]
    key, value = packed[:, 2:2 + hkv], packed[:, 2 + hkv:]
    key_cache, value_cache = _randn(seed + 1, 5, 4, hkv, d), _randn(seed + 2, 5, 4, hkv, d)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(20, generator=gen)[:t]
    slots[torch.rand(t, generator=gen) < 0.3] = -1
    want_k, want_v = key_cache.clone().view(-1, hkv, d), value_cache.clone().view(-1, hkv, d)
    keep = slots >= 0
    want_k[slots[keep]], want_v[slots[keep]] = key[keep], value[keep]
    write_kv_torch(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, hkv, d), want_k) and torch.equal(value_cache.view(-1, hkv, d), want_v)
    with pytest.raises(IndexError, match="outside the pool"):
        write_kv_torch(key, value, key_cache, value_cache, torch.full((t,), 20))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 300), seed=st.integers(0, 2**16),
       kind=st.sampled_from(["plain", "ties", "nan", "inf"]))
def test_argmax_is_torchs_token(rows, vocab, seed, kind):
    """The greedy sampler's compiled argmax: the lowest index of each row's maximum (ties go to the first, as
    ``torch.argmax``), a row with NaN its first NaN, -inf and +inf as numbers; exactly PyTorch's indices."""
    logits = _randn(seed, rows, vocab)
    if kind == "ties":
        logits = logits.round()  # a handful of values, each many times
    elif kind == "nan":
        logits.view(-1)[seed % logits.numel()] = float("nan")
    elif kind == "inf":
        logits[:, ::3] = float("-inf")
        logits.view(-1)[seed % logits.numel()] = float("inf")
    assert torch.equal(cpu_ops.argmax(logits), logits.max(dim=-1).indices)


@settings(max_examples=20, deadline=None)
@given(t=st.integers(1, 40), k=st.integers(1, 40), n=st.integers(1, 40), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_into_is_f_linear_bit_for_bit(t, k, n, bias, seed):
    from pagedkv.engine.llama import linear_into

    x, w = _randn(seed, t, k), _randn(seed + 1, n, k)
    b = _randn(seed + 2, n) if bias else None
    out = torch.full((t + 3, n), 7.0)[:t]  # the first rows of a larger buffer, as the workspace hands them out
    assert linear_into(x, w, b, out) is out
    assert torch.equal(out, torch.nn.functional.linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("t", [1, 127, 128, 129, 300])
def test_mlp_into_matches_float64_across_its_row_chunks(t):
    """The compiled path's MLP, 128 rows at a time through the workspace's buffers, against float64: every row,
    on both sides of each chunk's edge; the workspace hands out its buffers again on the next call."""
    from pagedkv.engine.llama import MLP_CHUNK, DecoderLayerWeights, Workspace, mlp_into

    h, i = 24, 40
    w = DecoderLayerWeights(
        input_norm=torch.ones(h), qkv_weight=torch.zeros(1, h), qkv_bias=None, o_weight=torch.zeros(h, 1),
        o_bias=None, post_norm=torch.ones(h), gate_up_weight=_randn(1, 2 * i, h, scale=0.3),
        gate_up_bias=_randn(2, 2 * i), down_weight=_randn(3, h, i, scale=0.3), down_bias=None, scaling=1.0,
        sliding_window=None)
    x = _randn(4, t, h)
    gate_up = torch.nn.functional.linear(x.double(), w.gate_up_weight.double(), w.gate_up_bias.double())
    gate, up = gate_up[:, :i], gate_up[:, i:]
    want = (gate * torch.sigmoid(gate) * up) @ w.down_weight.double().t()
    ws = Workspace()
    for _ in range(2):
        out = mlp_into(x, w, ws, ws.take("down", t, h, x))
        torch.testing.assert_close(out.double(), want, **TOL)
    assert ws.buffers["gate_up"].shape[0] == max(min(t, MLP_CHUNK), 64)  # one chunk's rows, at least 64
