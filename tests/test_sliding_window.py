"""Sliding-window attention: the float64 reference, the Triton decode and prefill kernels (Triton's interpreter on a
CPU) and the engine's torch backend, on random paged caches whose out-of-window blocks are the null block.

A query at position ``p`` under a window of ``W`` sees keys ``p - W + 1 .. p`` (vLLM 0.26: FlashAttention's
``window_size = (W - 1, 0)``; transformers: ``kv_idx > q_idx - W``). vLLM frees the blocks wholly behind the
window of the step's first query (``SlidingWindowManager.get_num_skipped_tokens``: ``num_computed_tokens - W + 1``
tokens) and puts the null block in their place; here those entries point at block 0, which ``make_paged_kv``
fills with huge values, so any read of them shows.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv import kernels as pk
from pagedkv.attention import (
    attention,
    make_paged_kv,
    ref_paged_attention_decode,
    ref_paged_prefill_attention,
    relative_error,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


def null_out_of_window(block_tables: torch.Tensor, first_query_pos: list[int], window: int,
                       block_size: int) -> torch.Tensor:
    """The tables with every block wholly behind the window of each sequence's first query set to the null block
    0, as vLLM's ``remove_skipped_blocks`` leaves them: ``(first_query_pos - window + 1) // block_size`` blocks."""
    tables = block_tables.clone()
    for b, pos in enumerate(first_query_pos):
        skipped = max(0, pos - window + 1) // block_size
        tables[b, :skipped] = 0
    return tables


def decode_case(lens, window, num_kv_heads=2, group=4, head_dim=32, dtype=torch.float32, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE,
                                   generator=gen)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    return q, kc, vc, null_out_of_window(bt, [n - 1 for n in lens], window, block_size), sl, bt


def test_reference_window_sees_the_last_w_keys_and_equals_dense_attention_on_them():
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8).double(), torch.randn(12, 2, 8).double(), torch.randn(12, 2, 8).double()
    out = attention(q, k, v, 0.3, causal_offset=7, sliding_window=3)  # queries at positions 7..11
    for i in range(5):
        p = 7 + i
        want = attention(q[i : i + 1], k[p - 2 : p + 1], v[p - 2 : p + 1], 0.3)  # keys p-2, p-1, p
        torch.testing.assert_close(out[i : i + 1], want)
    # a window as long as the sequence is full causal attention; a window of 1 is the query's own value
    torch.testing.assert_close(attention(q, k, v, 0.3, 7, 12), attention(q, k, v, 0.3, 7))
    torch.testing.assert_close(attention(q, k, v, 0.3, 7, 1), v[7:].repeat_interleave(2, dim=1))
    with pytest.raises(ValueError, match="causal_offset"):
        attention(q, k, v, 0.3, sliding_window=3)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_a_bad_window_is_refused_by_every_entry_point(bad):
    q, kc, vc, bt, sl, _ = decode_case([20], 8)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for call in (lambda: ref_paged_attention_decode(q, kc, vc, bt, sl, sliding_window=bad),
                 lambda: ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl, sliding_window=bad),
                 lambda: pk.paged_attention_decode(q, kc, vc, bt, sl, sliding_window=bad),
                 lambda: pk.paged_prefill_attention(q, kc, vc, bt, sl, qsl, sliding_window=bad)):
        with pytest.raises(ValueError, match="sliding_window must be"):
            call()


def test_lesson_decode_versions_refuse_a_window():
    q, kc, vc, bt, sl, _ = decode_case([20], 8)
    for version in (1, 2):
        with pytest.raises(ValueError, match="versions"):
            pk.paged_attention_decode(q, kc, vc, bt, sl, version=version, sliding_window=8)


LENS = [1, 5, 16, 17, 40, 63, 100]


VERSIONS = [pytest.param(3, None, id="v3"), pytest.param(4, 2, id="v4-2"), pytest.param(4, 5, id="v4-5"),
            pytest.param(None, None, id="dispatch")]


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("window", [1, pytest.param(7, marks=pytest.mark.slow), 16,
                                    pytest.param(33, marks=pytest.mark.slow), 1000])
@pytest.mark.parametrize("version, num_splits", VERSIONS)
def test_decode_kernels_with_a_window_match_float64(version, num_splits, window, dtype):
    q, kc, vc, bt, sl, full_bt = decode_case(LENS, window, dtype=dtype, seed=window)
    ref = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64, sliding_window=window)
    out = torch.full_like(q, float("nan"))
    pk.paged_attention_decode(q, kc, vc, bt, sl, version=version, num_splits=num_splits, out=out,
                              sliding_window=window)
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"v{version} window {window}: relative error {err:.3g}"
    if window < max(LENS):  # the window changes the answer: the test would see a kernel that ignored it
        full = ref_paged_attention_decode(q, kc, vc, full_bt, sl, compute_dtype=torch.float64)
        assert relative_error(full, ref) > 1e-2


@pytest.mark.parametrize("version, num_splits", VERSIONS)
def test_decode_kernels_with_a_window_in_fp16(version, num_splits):
    test_decode_kernels_with_a_window_match_float64(version, num_splits, 33, torch.float16)


@pytest.mark.parametrize("validate", [True, False])
def test_decode_without_validation_and_the_plan_cache_keep_the_window(validate):
    q, kc, vc, _, sl, full_bt = decode_case(LENS, 9, seed=3)
    for window in (9, 30, 9):  # the same shapes, different windows: no cached plan may mix them up
        bt_w = null_out_of_window(full_bt, [n - 1 for n in LENS], window, 16)
        ref = ref_paged_attention_decode(q, kc, vc, bt_w, sl, compute_dtype=torch.float64, sliding_window=window)
        out = pk.paged_attention_decode(q, kc, vc, bt_w, sl, validate=validate, sliding_window=window)
        assert relative_error(out, ref) < TOL[torch.float32]


def prefill_case(seq_lens, q_lens, window, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
                 block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE,
                                   generator=gen)
    bt = null_out_of_window(bt, [s - n for s, n in zip(seq_lens, q_lens, strict=True)], window, block_size)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return q, kc, vc, bt, sl, qsl


# (seq_len, q_len) pairs: a whole prompt, chunks that start before, at and past the window's edge, decodes
PREFILL = [(70, 70), (50, 9), (40, 33), (100, 4), (17, 1), (90, 1), (33, 16)]


@pytest.mark.parametrize("window, group, dtype", [
    *[pytest.param(w, g, torch.float32, id=f"w{w}-g{g}-fp32",
                   marks=() if (w, g) in ((1, 1), (8, 4), (500, 4)) else pytest.mark.slow)  # the rest: full suite
      for w in (1, 8, 31, 500) for g in (1, 4)],
    pytest.param(8, 4, torch.float16, id="w8-g4-fp16"),
])
def test_prefill_kernel_with_a_window_matches_float64(window, group, dtype):
    seq_lens, q_lens = zip(*PREFILL, strict=True)
    q, kc, vc, bt, sl, qsl = prefill_case(list(seq_lens), list(q_lens), window, group=group, dtype=dtype,
                                          seed=window + group)
    ref = ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl, compute_dtype=torch.float64, sliding_window=window)
    out = torch.full_like(q, float("nan"))
    pk.paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out, sliding_window=window)
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"window {window} group {group}: relative error {err:.3g}"
    out2 = pk.paged_prefill_attention(q, kc, vc, bt, sl, qsl, max_query_len=max(q_lens), validate=False,
                                      sliding_window=window)
    assert relative_error(out2, ref) < TOL[dtype]


@pytest.mark.parametrize("group_window", [False, True], ids=["mask", "group"])
@pytest.mark.parametrize("window", [1, 8, 31, 500])
@pytest.mark.parametrize("seed", range(3))
def test_engine_torch_backend_with_a_window_matches_float64(window, seed, group_window):
    """The engine's torch path (decode groups plus prefill chunks, one mixed step) on the same null-block tables:
    the window as a mask over decode groups built without it, and as a sliding-window KV cache group's (groups
    gathered from each request's window on, ``meta.sliding_window`` set)."""
    from pagedkv.engine.attention import AttentionMetadata, make_decode_groups, torch_paged_attention

    g = torch.Generator().manual_seed(seed)
    pairs = PREFILL + [(int(torch.randint(1, 120, (1,), generator=g)), 1) for _ in range(10)]
    seq_lens, q_lens = (list(x) for x in zip(*pairs, strict=True))
    q, kc, vc, bt, sl, qsl = prefill_case(seq_lens, q_lens, window, group=2, seed=seed, block_size=8)
    qsl_l = qsl.tolist()
    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=bt, seq_lens=sl, query_start_loc=qsl,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens), kv_caches=[(kc, vc)],
        decode_req_idx=torch.tensor(decodes),
        prefill_reqs=[(b, qsl_l[b], qsl_l[b + 1], seq_lens[b]) for b in range(len(pairs)) if q_lens[b] > 1],
        decode_groups=make_decode_groups(decodes, seq_lens, bt, qsl_l, 8, max_groups=3, min_group=3,
                                         sliding_window=window if group_window else None),
        sliding_window=window if group_window else None,
    )
    if group_window:  # a sliding layer's decode reads its window's blocks only, however long the request
        assert all(g.width <= -(-window // 8) + 1 for g in meta.decode_groups)
    got = torch_paged_attention(q, kc, vc, meta, 0.25, sliding_window=window)
    want = ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl, 0.25, compute_dtype=torch.float64,
                                       sliding_window=window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
