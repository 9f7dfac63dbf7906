"""Triton kernels vs the float64 reference (in Triton's interpreter on CPU; natively on a GPU if present).

Every output buffer is filled with NaN before the kernel runs, so an element the kernel never writes
fails the comparison (``relative_error`` returns inf for any NaN). Errors are ``max|out - ref| / max|ref|``
against a float64 reference: under 1e-4 for fp32 inputs, under 3e-3 for fp16.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from pagedkv import kernels as pk  # = pagedkv.kernels (this spelling sorts the same for every isort config)
from pagedkv.attention import (
    gather_kv,
    make_paged_kv,
    ref_paged_attention_decode,
    ref_paged_prefill_attention,
    relative_error,
)

DECODE_VERSIONS = pk.DECODE_VERSIONS
choose_num_splits = pk.choose_num_splits
paged_attention_decode = pk.paged_attention_decode
paged_prefill_attention = pk.paged_prefill_attention
reshape_and_cache = pk.reshape_and_cache
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BLOCK = 16
# Ragged lengths for block size 16: one token, exact multiples, multiples +- 1, and a longer one.
RAGGED = [1, 16, 15, 17, 32, 33, 100]


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def _decode_case(lens, num_kv_heads, group, head_dim, dtype, block_size=BLOCK, seed=0, max_blocks=None):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv(lens, num_kv_heads, head_dim, block_size, dtype=dtype, device=DEVICE,
                                   generator=gen, max_blocks=max_blocks)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    ref = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    return q, kc, vc, bt, sl, ref


def _check(out, ref, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: output has NaN (an element was never written)"
    err = relative_error(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]:g}"


# --------------------------------------------------------------------------------------------------
# decode: every version, GQA group sizes, head dims, dtypes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_versions_match_reference(version, group, head_dim, dtype):
    q, kc, vc, bt, sl, ref = _decode_case(RAGGED, 2, group, head_dim, dtype, seed=group * 1000 + head_dim)
    out = _poisoned(q)
    ret = paged_attention_decode(q, kc, vc, bt, sl, version=version, num_splits=3 if version == 4 else None,
                                 out=out)
    assert ret is out
    _check(out, ref, dtype, f"v{version} group={group} D={head_dim} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 5, 6, 8])
def test_split_k_every_split_count(num_splits, dtype):
    # 64-token tiles: lengths 1 .. 320 give 1 .. 5 tiles, so some slices are empty at every split count >= 2.
    lens = [1, 64, 65, 200, 320]
    q, kc, vc, bt, sl, ref = _decode_case(lens, 2, 4, 64, dtype, seed=num_splits)
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, bt, sl, version=4, num_splits=num_splits, out=out)
    _check(out, ref, dtype, f"split-K with {num_splits} splits")


@pytest.mark.parametrize("block_size", [1, 8, 12, 32])
@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_other_block_sizes(version, block_size):
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 70]
    q, kc, vc, bt, sl, ref = _decode_case(lens, 2, 2, 64, torch.float32, block_size=block_size, seed=block_size)
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, bt, sl, version=version, num_splits=2 if version == 4 else None, out=out)
    _check(out, ref, torch.float32, f"v{version} block_size={block_size}")


@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_head_dim_not_a_power_of_two_and_custom_scale(version):
    q, kc, vc, bt, sl, _ = _decode_case([5, 40], 1, 3, 80, torch.float32, seed=7)
    ref = ref_paged_attention_decode(q, kc, vc, bt, sl, scale=0.3, compute_dtype=torch.float64)
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, bt, sl, scale=0.3, version=version, out=out)
    _check(out, ref, torch.float32, f"v{version} head_dim=80 scale=0.3")


@pytest.mark.parametrize("seed", range(4))
def test_decode_random_batches_default_dispatch(seed):
    """Random ragged batches, random group, wide stale block tables; the default (best) version."""
    gen = torch.Generator().manual_seed(100 + seed)
    batch = int(torch.randint(1, 6, (1,), generator=gen))
    lens = torch.randint(1, 150, (batch,), generator=gen).tolist()
    group = [1, 2, 4, 8][seed]
    dtype = [torch.float32, torch.float16][seed % 2]
    q, kc, vc, bt, sl, ref = _decode_case(lens, 2, group, 64, dtype, seed=seed, max_blocks=12)
    out = paged_attention_decode(q, kc, vc, bt, sl)
    _check(out, ref, dtype, f"default dispatch lens={lens} group={group}")


def test_default_dispatch_uses_split_k_for_one_long_sequence():
    # One sequence, one KV head, 600 tokens: 1 program without splitting -> the heuristic asks for 2 slices.
    assert choose_num_splits(1, 1, 600) == 2
    q, kc, vc, bt, sl, ref = _decode_case([600], 1, 2, 64, torch.float32, seed=11)
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, bt, sl, out=out)
    _check(out, ref, torch.float32, "default dispatch, split-K path")


def test_choose_num_splits_fills_the_gpu_without_tiny_slices():
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 64  # 8 programs: split to the cap
    assert choose_num_splits(8, 8, 4096, num_sms=132) == 9  # 64 programs -> ceil(528 / 64)
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 2
    assert choose_num_splits(256, 8, 4096, num_sms=132) == 1  # 2048 programs already fill 132 SMs
    assert choose_num_splits(1, 8, 512, num_sms=132) == 2  # slices of >= 256 tokens only
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 100)


def test_query_not_contiguous():
    q, kc, vc, bt, sl, ref = _decode_case([20, 3], 2, 2, 64, torch.float32, seed=5)
    wide = torch.zeros(2, 4, 128, device=DEVICE)
    wide[:, :, :64] = q
    view = wide[:, :, :64]  # strided rows
    out = paged_attention_decode(view, kc, vc, bt, sl, version=2)
    _check(out, ref, torch.float32, "strided query")


def test_empty_batch_returns_empty():
    kc = torch.zeros(4, 16, 2, 64, device=DEVICE)
    q = torch.zeros(0, 4, 64, device=DEVICE)
    bt = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    sl = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert paged_attention_decode(q, kc, kc.clone(), bt, sl).shape == (0, 4, 64)


# --------------------------------------------------------------------------------------------------
# strided integer inputs (issue 9 §2): views are read by value, never as if packed
# --------------------------------------------------------------------------------------------------

HIDDEN = 10**6  # what sits between a strided view's elements: a wrong read is out of range, and loud


def _strided_1d(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t``, as a ``[::2]`` view whose hidden elements are HIDDEN."""
    wide = torch.full((2 * t.shape[0],), HIDDEN, dtype=t.dtype, device=t.device)
    wide[::2] = t
    view = wide[::2]
    assert torch.equal(view, t) and view.stride(0) == 2
    return view


def _strided_rows(t: torch.Tensor) -> torch.Tensor:
    wide = torch.full((2 * t.shape[0], t.shape[1]), HIDDEN, dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


def _strided_cols(t: torch.Tensor) -> torch.Tensor:
    wide = torch.full((t.shape[0], 2 * t.shape[1]), HIDDEN, dtype=t.dtype, device=t.device)
    wide[:, ::2] = t
    view = wide[:, ::2]
    assert view.stride(-1) == 2
    return view


STRIDED = {"seq_lens[::2]": ("seq_lens", _strided_1d), "block_tables rows [::2]": ("block_tables", _strided_rows),
           "block_tables cols [:, ::2]": ("block_tables", _strided_cols)}


@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unvalidated"])
@pytest.mark.parametrize("which", list(STRIDED))
@pytest.mark.parametrize("version", [*DECODE_VERSIONS, None], ids=["v1", "v2", "v3", "v4", "dispatch"])
def test_decode_reads_strided_integer_inputs_by_value(version, which, validate):
    q, kc, vc, bt, sl, ref = _decode_case([10, 12, 6, 70], 2, 2, 32, torch.float32, seed=21)
    args = {"seq_lens": sl, "block_tables": bt}
    name, make = STRIDED[which]
    args[name] = make(args[name])
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, args["block_tables"], args["seq_lens"], version=version, out=out,
                           num_splits=2 if version == 4 else None, validate=validate)
    _check(out, ref, torch.float32, f"version {version} with {which}")


def test_issue_9_seq_lens_example():
    """The report's reproduction: ``tensor([10, 12, 6, 12])[::2]`` is lengths 10 and 6, not 10 and 12."""
    q, kc, vc, bt, _, _ = _decode_case([10, 6], 1, 2, 16, torch.float32, seed=3, max_blocks=1)
    sl = torch.tensor([10, 12, 6, 12], dtype=torch.int32, device=DEVICE)[::2]
    ref = ref_paged_attention_decode(q, kc, vc, bt, sl.contiguous(), compute_dtype=torch.float64)
    for version in DECODE_VERSIONS:
        _check(paged_attention_decode(q, kc, vc, bt, sl, version=version), ref, torch.float32, f"v{version}")


@pytest.mark.parametrize("which", ["seq_lens", "query_start_loc", "block_tables rows", "block_tables cols"])
def test_prefill_reads_strided_integer_inputs_by_value(which):
    q, kc, vc, bt, sl, qsl, ref = _prefill_case([17, 40, 33], [17, 8, 5], 2, 2, 32, torch.float32, seed=5)
    args = {"block_tables": bt, "seq_lens": sl, "query_start_loc": qsl}
    key = which.split()[0]
    make = {"seq_lens": _strided_1d, "query_start_loc": _strided_1d, "block_tables rows": _strided_rows,
            "block_tables cols": _strided_cols}[which]
    args[key] = make(args[key])
    for validate in (True, False):
        out = _poisoned(q)
        paged_prefill_attention(q, kc, vc, args["block_tables"], args["seq_lens"], args["query_start_loc"],
                                out=out, validate=validate, max_query_len=17)
        _check(out, ref, torch.float32, f"prefill with strided {which}, validate={validate}")


@pytest.mark.parametrize("validate", [True, False])
def test_reshape_and_cache_reads_a_strided_slot_mapping_by_value(validate):
    """The report's reproduction: ``tensor([5, 9, 6, 9, 7, 9])[::2]`` is slots 5, 6, 7 (not 5, 6, 9)."""
    kc = torch.zeros(3, 4, 1, 16, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.arange(1, 4, dtype=torch.float32, device=DEVICE)[:, None, None].expand(3, 1, 16).contiguous()
    slots = torch.tensor([5, 9, 6, 9, 7, 9], device=DEVICE)[::2]
    reshape_and_cache(k, -k, kc, vc, slots, validate=validate)
    flat = kc.view(-1, 16)[:, 0].tolist()
    assert flat[5:8] == [1.0, 2.0, 3.0] and flat[9] == 0.0
    assert (vc.view(-1, 16)[5:8, 0] == -k[:, 0, 0]).all()
    # Hidden elements far out of range must never be read (they would be an out-of-bounds write).
    kc.zero_()
    reshape_and_cache(k, k, kc, vc, _strided_1d(torch.tensor([0, 1, 11], device=DEVICE)), validate=validate)
    assert kc.view(-1, 16)[[0, 1, 11], 0].tolist() == [1.0, 2.0, 3.0]


# --------------------------------------------------------------------------------------------------
# bad inputs: a clear ValueError, nothing written
# --------------------------------------------------------------------------------------------------


def _good():
    gen = torch.Generator().manual_seed(0)
    kc, vc, bt, sl = make_paged_kv([5, 20], 2, 16, 8, generator=gen, device=DEVICE)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    return dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl)


BAD_DECODE = {
    "query 2-D": (lambda a: a.update(query=a["query"][0]), "query must be"),
    "Hq not a multiple of Hkv": (lambda a: a.update(query=a["query"][:, :3].contiguous()), "multiple of num_kv_heads"),
    "head dim mismatch": (lambda a: a.update(query=a["query"][..., :8].contiguous()), "head_dim"),
    "dtype mismatch": (lambda a: a.update(query=a["query"].half()), "must match"),
    "int query": (lambda a: a.update(query=a["query"].long()), "dtype"),
    "value shape": (lambda a: a.update(value_cache=a["value_cache"][:3]), "value_cache shape"),
    "cache 3-D": (lambda a: a.update(key_cache=a["key_cache"][0], value_cache=a["value_cache"][0]),
                  "key_cache must be"),
    "block table int64": (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
    "seq_lens int64": (lambda a: a.update(seq_lens=a["seq_lens"].long()), "int32"),
    "batch mismatch": (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "batch sizes disagree"),
    "block table too short": (lambda a: a.update(seq_lens=torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)),
                              "block table too short"),
    "zero length": (lambda a: a.update(seq_lens=torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)),
                    "at least 1"),
    "block id out of range": (lambda a: a["block_tables"].__setitem__((1, 0), 999), "outside the cache"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_decode_rejects_bad_inputs(case):
    args = _good()
    mutate, message = BAD_DECODE[case]
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention_decode(**args)


def test_decode_rejects_bad_options():
    args = _good()
    with pytest.raises(ValueError, match="version"):
        paged_attention_decode(**args, version=5)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(**args, version=2, num_splits=2)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(**args, version=4, num_splits=0)
    with pytest.raises(ValueError, match="scale"):
        paged_attention_decode(**args, scale=-1.0)
    out = torch.empty(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_decode(**args, out=out)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the interpreter's refusals")
def test_interpreter_refuses_bfloat16():
    args = _good()
    for k in ("query", "key_cache", "value_cache"):
        args[k] = args[k].bfloat16()
    with pytest.raises(ValueError, match="bfloat16"):
        paged_attention_decode(**args)


def test_import_turns_on_the_interpreter_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, torch, pagedkv.kernels; print(torch.cuda.is_available(), os.environ.get('TRITON_INTERPRET'))"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    cuda, flag = res.stdout.split()
    assert flag == ("None" if cuda == "True" else "1")


# --------------------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reshape_and_cache_writes_slots_and_skips_minus_one(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 6, 4, 2, 64
    kc = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype=dtype, device=DEVICE)
    vc = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype=dtype, device=DEVICE)
    before_k, before_v = kc.clone(), vc.clone()
    slots = [5, -1, 0, 23, 9, -1, 12]
    k = torch.randn(len(slots), hkv, d, generator=gen).to(dtype=dtype, device=DEVICE)
    v = torch.randn(len(slots), hkv, d, generator=gen).to(dtype=dtype, device=DEVICE)
    reshape_and_cache(k, v, kc, vc, torch.tensor(slots, dtype=slot_dtype, device=DEVICE))
    want_k = before_k.view(-1, hkv, d).clone()
    want_v = before_v.view(-1, hkv, d).clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want_k[s], want_v[s] = k[t], v[t]
    assert torch.equal(kc.view(-1, hkv, d), want_k), "key cache: wrong slots written (or a -1 slot written)"
    assert torch.equal(vc.view(-1, hkv, d), want_v)


def test_reshape_and_cache_rejects_bad_inputs():
    kc = torch.zeros(3, 4, 2, 8, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.ones(2, 2, 8, device=DEVICE)
    ok = torch.tensor([0, 1], device=DEVICE)
    cases = [
        ((k, k, kc, vc, torch.tensor([0, 12], device=DEVICE)), "outside"),
        ((k, k, kc, vc, torch.tensor([0, -2], device=DEVICE)), "outside"),
        ((k, k, kc, vc, torch.tensor([3, 3], device=DEVICE)), "same slot"),
        ((k, k, kc, vc, torch.tensor([0], device=DEVICE)), "slot_mapping must be"),
        ((k, k, kc, vc, ok.float()), "int32 or int64"),
        ((k.half(), k.half(), kc, vc, ok), "must match"),
        ((k[:, :1], k[:, :1], kc, vc, ok), "num_kv_heads"),
        ((k, k[:1], kc, vc, ok), "key and value"),
        ((k, k, kc, vc[:2], ok), "value_cache shape"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            reshape_and_cache(*args)
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0, "a refused call wrote to the cache"


def test_cache_then_decode_equals_dense_attention():
    """Paging does not change the output: scatter K/V into shuffled blocks, decode, compare with dense SDPA."""
    gen = torch.Generator().manual_seed(9)
    lens, hkv, group, d, bs = [7, 40, 16], 2, 4, 64, 16
    num_blocks = 12
    kc = torch.zeros(num_blocks, bs, hkv, d, device=DEVICE)
    vc = torch.zeros_like(kc)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), 3, dtype=torch.int32)
    dense_k, dense_v, slots = [], [], []
    for b, n in enumerate(lens):
        need = -(-n // bs)
        ids = [free.pop() for _ in range(need)]
        tables[b, :need] = torch.tensor(ids)
        slots += [ids[t // bs] * bs + t % bs for t in range(n)]
        dense_k.append(torch.randn(n, hkv, d, generator=gen))
        dense_v.append(torch.randn(n, hkv, d, generator=gen))
    reshape_and_cache(torch.cat(dense_k).to(DEVICE), torch.cat(dense_v).to(DEVICE), kc, vc,
                      torch.tensor(slots, device=DEVICE))
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = paged_attention_decode(q, kc, vc, tables.to(DEVICE), sl)
    for b in range(len(lens)):
        k = dense_k[b].to(DEVICE).repeat_interleave(group, 1).transpose(0, 1)
        v = dense_v[b].to(DEVICE).repeat_interleave(group, 1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[b][:, None], k, v)[:, 0]
        assert (out[b] - want).abs().max() < 1e-5


# --------------------------------------------------------------------------------------------------
# paged prefill (chunked prefill with a cached prefix)
# --------------------------------------------------------------------------------------------------


def _prefill_case(lens, q_lens, hkv, group, d, dtype, seed=0, block_size=BLOCK):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv(lens, hkv, d, block_size, dtype=dtype, device=DEVICE, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(dtype=dtype, device=DEVICE)
    ref = ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl, compute_dtype=torch.float64)
    return q, kc, vc, bt, sl, qsl, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_prefill_matches_reference(group, dtype):
    # Whole prompts (q_len == seq_len), chunks after a cached prefix, a decode-like row, an idle sequence.
    lens = [17, 40, 33, 70, 9]
    q_lens = [17, 8, 1, 45, 0]
    q, kc, vc, bt, sl, qsl, ref = _prefill_case(lens, q_lens, 2, group, 64, dtype, seed=group)
    out = _poisoned(q)
    paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out)
    _check(out, ref, dtype, f"prefill group={group} {dtype}")


def test_prefill_head_dim_128_and_odd_block_size():
    q, kc, vc, bt, sl, qsl, ref = _prefill_case([30, 12], [30, 5], 1, 3, 128, torch.float32, seed=4, block_size=12)
    out = _poisoned(q)
    paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out)
    _check(out, ref, torch.float32, "prefill D=128 block_size=12 group=3")


def test_prefill_with_one_new_token_is_decode():
    q, kc, vc, bt, sl, ref = _decode_case([3, 50], 2, 4, 64, torch.float32, seed=8)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    a = paged_prefill_attention(q, kc, vc, bt, sl, qsl)
    _check(a, ref, torch.float32, "prefill with q_len 1")


def test_prefill_rejects_bad_inputs():
    q, kc, vc, bt, sl, qsl, _ = _prefill_case([10, 20], [4, 6], 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="query_start_loc must start at 0"):
        paged_prefill_attention(q, kc, vc, bt, sl, torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="never decrease"):
        paged_prefill_attention(q, kc, vc, bt, sl, torch.tensor([0, 11, 10], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        paged_prefill_attention(q, kc, vc, bt, sl, qsl.long())
    with pytest.raises(ValueError, match="new tokens"):
        paged_prefill_attention(q, kc, vc, bt, torch.tensor([3, 20], dtype=torch.int32, device=DEVICE), qsl)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_prefill_attention(q[:, :3].contiguous(), kc, vc, bt, sl, qsl)


# --------------------------------------------------------------------------------------------------
# the benchmark script, tiny mode (what CI runs), and a native GPU run
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_runs_in_tiny_mode(tmp_path):
    from pagedkv.kernels import bench

    rows = bench.main(["--tiny", "--out", str(tmp_path), "--no-plot"])
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    assert data["mode"] in ("tiny-interpreter", "tiny-gpu")
    assert rows and all(r["max_rel_err"] < TOL[torch.float16] for r in data["correctness"])
    assert {r["impl"] for r in data["timings"]} >= {"v1", "v2", "v3", "v4", "sdpa_contiguous", "gather_sdpa"}


@pytest.mark.gpu
def test_native_gpu_all_dtypes(tmp_path):
    """On a CUDA GPU: compiled kernels (not the interpreter) in bf16/fp16/fp32, and the quick benchmark."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("0", "")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for version in DECODE_VERSIONS:
            q, kc, vc, bt, sl, ref = _decode_case([1, 17, 300, 1000], 8, 4, 128, dtype, seed=version)
            out = _poisoned(q)
            paged_attention_decode(q, kc, vc, bt, sl, version=version, out=out)
            _check(out, ref, dtype, f"GPU v{version} {dtype}")
        q, kc, vc, bt, sl, qsl, ref = _prefill_case([100, 300], [60, 300], 8, 4, 128, dtype)
        out = _poisoned(q)
        paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out)
        _check(out, ref, dtype, f"GPU prefill {dtype}")
    from pagedkv.kernels import bench

    bench.main(["--quick", "--out", str(tmp_path), "--no-plot"])
    assert (tmp_path / "bench_decode.json").exists()


def test_gather_kv_roundtrip_matches_kernel_view():
    """The reference's gather and the cache layout agree: token t of seq b is at [table[t//bs], t%bs]."""
    gen = torch.Generator().manual_seed(12)
    kc, vc, bt, sl = make_paged_kv([21], 1, 4, 8, generator=gen)
    k, _ = gather_kv(kc, vc, bt[0], 21)
    assert torch.equal(k[20], kc[int(bt[0, 2]), 4])


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one():
    """The interpreter accepts code a GPU compiler refuses; compile every kernel for sm_90 to be sure."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run([sys.executable, "-m", "pagedkv.kernels.compile_check", "--quick"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "0 failed" in res.stdout


# --------------------------------------------------------------------------------------------------
# lesson 6's exercise checks: right answers pass, the typical wrong ones fail with a message that says why
# --------------------------------------------------------------------------------------------------

@triton.jit
def _offsets_body(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh,
                  BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, INT64: tl.constexpr, LE: tl.constexpr):
    physical = tl.load(table_row_ptr + j)
    if INT64:
        physical = physical.to(tl.int64)
    slot = tl.arange(0, BLOCK_SIZE)
    offsets = physical * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + tl.arange(0, HEAD_DIM)[None, :]
    if LE:
        mask = j * BLOCK_SIZE + slot <= seq_len
    else:
        mask = j * BLOCK_SIZE + slot < seq_len
    return offsets, mask


@triton.jit
def _offsets_right(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    return _offsets_body(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh, BLOCK_SIZE, HEAD_DIM,
                         True, False)


@triton.jit
def _offsets_int32(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    return _offsets_body(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh, BLOCK_SIZE, HEAD_DIM,
                         False, False)


@triton.jit
def _offsets_le(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh,
                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    return _offsets_body(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh, BLOCK_SIZE, HEAD_DIM,
                         True, True)


@triton.jit
def _v1_body(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
             stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
             GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, RESCALE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        offsets, mask = _offsets_right(block_tables_ptr + b * stride_bt, j, seq_len, h // GROUP,
                                       stride_kb, stride_kt, stride_kh, BLOCK_SIZE, HEAD_DIM)
        k = tl.load(k_cache_ptr + offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offsets, mask=mask[:, None], other=0.0).to(tl.float32)
        s = tl.where(mask, tl.sum(k * q[None, :], axis=1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        if not RESCALE:
            alpha = 1.0
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(out_ptr + b * stride_qb + h * stride_qh + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))


@triton.jit
def _v1_right(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
              stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
              GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    _v1_body(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale, stride_qb,
             stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, GROUP, BLOCK_SIZE, HEAD_DIM, True)


@triton.jit
def _v1_no_rescale(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                   GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    _v1_body(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale, stride_qb,
             stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, GROUP, BLOCK_SIZE, HEAD_DIM, False)


@triton.jit
def _group_body(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                HEAD_DIM: tl.constexpr, FIRST_HEAD_TIMES_GROUP: tl.constexpr):
    r = tl.arange(0, BLOCK_G)
    if FIRST_HEAD_TIMES_GROUP:
        heads = kv_head * GROUP + r
    else:
        heads = kv_head + r
    row_mask = r < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + tl.arange(0, HEAD_DIM)[None, :],
                mask=row_mask[:, None], other=0.0)
    return q, heads, row_mask


@triton.jit
def _group_right(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    return _group_body(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM, True)


@triton.jit
def _group_shifted(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    return _group_body(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM, False)


@pytest.mark.skipif(DEVICE != "cpu", reason="the exercise checks run in the interpreter on CPU tensors")
def test_exercise_checks_pass_right_answers_and_explain_wrong_ones():
    from pagedkv.kernels import exercise_checks as ec

    ec.check_kv_block_offsets_probe(_offsets_right)
    ec.check_kv_block_offsets_gather(_offsets_right, block_sizes=(8,))
    ec.check_decode_v1(_v1_right, group=2)
    ec.check_query_group_probe(_group_right, groups=(1, 4))
    ec.check_group_decode(_group_right, groups=(2,))
    wrong = [
        (ec.check_kv_block_offsets_probe, _offsets_int32, "wrapped around int32"),
        (ec.check_kv_block_offsets_probe, _offsets_le, "use `<`, not `<=`"),
        (ec.check_decode_v1, _v1_no_rescale, "exp2(m_i - m_new)"),
        (ec.check_query_group_probe, _group_shifted, "g * GROUP"),
        (ec.check_group_decode, _group_shifted, "relative error"),
    ]
    for check, answer, phrase in wrong:
        with pytest.raises(AssertionError, match=re.escape(phrase)):
            check(answer)
