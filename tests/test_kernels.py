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
# groups 1 and 8 (the extremes) in the fast tier, 2 and 4 in the full suite
@pytest.mark.parametrize("group", [1, *(pytest.param(g, marks=pytest.mark.slow) for g in (2, 4)), 8])
@pytest.mark.parametrize("version", DECODE_VERSIONS)
def test_decode_versions_match_reference(version, group, head_dim, dtype):
    q, kc, vc, bt, sl, ref = _decode_case(RAGGED, 2, group, head_dim, dtype, seed=group * 1000 + head_dim)
    out = _poisoned(q)
    ret = paged_attention_decode(q, kc, vc, bt, sl, version=version, num_splits=3 if version == 4 else None,
                                 out=out)
    assert ret is out
    _check(out, ref, dtype, f"v{version} group={group} D={head_dim} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, *(pytest.param(n, marks=pytest.mark.slow) for n in (4, 5, 6)), 8])
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
    # One sequence, one KV head, 600 tokens: 1 program -> split into as many 128-token slices as there are (4).
    assert choose_num_splits(1, 1, 600) == 4
    q, kc, vc, bt, sl, ref = _decode_case([600], 1, 2, 64, torch.float32, seed=11)
    assert pk.decode_config(q, kc, bt, 600) == pk.DecodeConfig(4, 64, 4, 2, 8)  # fp32: 64-token tiles -> 8 slices
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, bt, sl, out=out)
    _check(out, ref, torch.float32, "default dispatch, split-K path")


def test_choose_num_splits_aims_at_two_programs_per_sm_without_empty_slices():
    # Issue 11: the old rule over-split at B >= 32 and under-split at B = 1, L <= 4096.
    assert choose_num_splits(1, 8, 512, num_sms=132) == 4  # 4 tiles of 128 tokens: one slice each (was 2)
    assert choose_num_splits(1, 8, 4096, num_sms=132) == 32  # 8 programs x 32 = 256, ~2 per SM (was 16)
    assert choose_num_splits(1, 8, 32768, num_sms=132) == 32
    assert choose_num_splits(8, 8, 4096, num_sms=132) == 4  # 64 programs x 4 (was 9)
    assert choose_num_splits(32, 8, 1024, num_sms=132) == 1  # 256 programs already (was 3)
    assert choose_num_splits(64, 8, 4096, num_sms=132) == 1  # (was 2)
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1  # one tile: nothing to split
    assert choose_num_splits(1, 8, 1000, num_sms=132, tile_tokens=64) == 16
    for batch in (1, 2, 3, 5, 8, 16, 33):
        for length in (1, 100, 129, 1000, 4096, 40000):
            n = choose_num_splits(batch, 8, length, num_sms=132)
            assert n & (n - 1) == 0 and n <= pk.dispatch.MAX_SPLITS and n <= -(-length // 128)
    with pytest.raises(ValueError):
        choose_num_splits(0, 8, 100)


# The configuration with the lowest CUDA-graph time at each shape of the H200 sweep
# (benchmarks/results/gpu/2026-11-30-h200/sweep_graph.json), or one within 2% of it: (version, tile, warps,
# stages, splits). 32 query heads, 8 KV heads, 132 SMs.
MEASURED_CHOICES = {
    (1, 512): (4, 128, 4, 3, 4), (1, 4096): (4, 128, 4, 3, 32), (1, 32768): (4, 128, 4, 3, 32),
    (8, 512): (4, 128, 4, 3, 4), (8, 4096): (4, 128, 4, 3, 4), (8, 32768): (4, 128, 4, 3, 4),
    (32, 1024): (3, 128, 4, 3, 1), (64, 512): (3, 64, 4, 3, 1), (64, 4096): (3, 64, 4, 3, 1),
    (64, 32768): (3, 64, 4, 3, 1), (256, 4096): (3, 64, 4, 3, 1), (256, 32768): (3, 64, 4, 3, 1),
}


@pytest.mark.parametrize("shape", list(MEASURED_CHOICES), ids=[f"B{b}-L{n}" for b, n in MEASURED_CHOICES])
def test_tuned_dispatch_picks_the_measured_configuration(shape):
    batch, length = shape
    assert tuple(pk.choose_decode_config(batch, 8, length, 132)) == MEASURED_CHOICES[shape]


def test_tuned_dispatch_by_cache_dtype():
    """fp8 caches follow the measured (16-bit) rule; fp32 caches, not measured, keep the lesson's tile and stages."""
    assert pk.choose_decode_config(8, 8, 4096, 132, 1) == pk.choose_decode_config(8, 8, 4096, 132, 2)
    assert tuple(pk.choose_decode_config(8, 8, 4096, 132, 4)) == (4, 64, 4, 2, 4)
    assert tuple(pk.choose_decode_config(64, 8, 4096, 132, 4)) == (3, 64, 4, 2, 1)
    q, kc, _, bt, _, _ = _decode_case([5], 1, 2, 16, torch.float32)
    assert pk.decode_config(q, kc, bt).tile_tokens == 64
    assert set(pk.dispatch.reachable_configs()) >= {pk.choose_decode_config(b, 8, n, 132, e) for b in (1, 8, 32, 64)
                                                    for n in (100, 4096, 40000) for e in (1, 2, 4)}


def test_measured_choices_agree_with_the_committed_sweep():
    """The table above is read from the committed measurements, not typed in: each choice is within 2% of the
    fastest configuration the sweep timed at its shape."""
    path = pk.dispatch.SWEEP_PATH
    if not path.exists():
        pytest.skip(f"{path} is not in this checkout")
    rows = json.loads(path.read_text())
    for (batch, length), cfg in MEASURED_CHOICES.items():
        here = [r for r in rows if (r["batch"], r["ctx"]) == (batch, length)]
        best = min(r["ms"] for r in here)
        mine = [r["ms"] for r in here if (int(r["ver"][1]), r["tile"], r["warps"], r["stages"], r["splits"]) == cfg]
        assert mine, f"{cfg} was not measured at B={batch} L={length}"
        assert mine[0] <= 1.02 * best, (batch, length, mine[0], best)


def _launch_config(cfg, out, q, kc, vc, bt, sl, k_scale=1.0, v_scale=1.0):
    from pagedkv.kernels.decode_v3 import launch_decode_v3
    from pagedkv.kernels.decode_v4 import launch_decode_v4

    kw = dict(tile_tokens=cfg.tile_tokens, num_warps=cfg.num_warps, num_stages=cfg.num_stages, k_scale=k_scale,
              v_scale=v_scale)
    scale = q.shape[-1] ** -0.5
    if cfg.version == 3:
        launch_decode_v3(out, q, kc, vc, bt, sl, scale, **kw)
    else:
        launch_decode_v4(out, q, kc, vc, bt, sl, scale, num_splits=cfg.num_splits, **kw)


def _one_per_version_fast(configs):
    """The fast tier runs the first configuration of each version; the rest (a few seconds each in the
    interpreter) are marked slow and run in the full suite."""
    first: dict[int, object] = {}
    return [pytest.param(c, marks=() if first.setdefault(c.version, c) is c else pytest.mark.slow) for c in configs]


@pytest.mark.parametrize("cfg", _one_per_version_fast(pk.dispatch.reachable_configs(132)),
                         ids=lambda c: f"v{c.version}-t{c.tile_tokens}-s{c.num_splits}")
def test_every_configuration_the_dispatch_can_choose_is_exact(cfg):
    """Each (version, tile, warps, stages, splits) the rule can return, against float64, on ragged lengths
    that leave some slices empty (1 token) and give others many tiles."""
    fp32_rule = (cfg.tile_tokens, cfg.num_stages) == (pk.dispatch.FP32_TILE_TOKENS, pk.dispatch.FP32_NUM_STAGES)
    cases = ((torch.float32, [1, 200, 513]),) if fp32_rule else ((torch.float16, [1, 129, 700, 2100]),)
    for dtype, lens in cases:  # each configuration in the dtype the rule picks it for
        q, kc, vc, bt, sl, ref = _decode_case(lens, 2, 4, 64, dtype, seed=cfg.num_splits + cfg.tile_tokens)
        out = _poisoned(q)
        _launch_config(cfg, out, q, kc, vc, bt, sl)
        _check(out, ref, dtype, f"{cfg} {dtype}")


def test_tiles_shrink_to_the_shared_memory_of_the_gpu():
    """A T4 (64 KiB per block) cannot hold a 128-token 16-bit tile, or a 64-token fp32 one, at head dim 128:
    Triton would refuse the launch. The tile halves until K and V fit; the H200's 227 KiB keeps every tile."""
    from pagedkv.kernels.dispatch import fit_tile_tokens, reachable_configs

    t4, h200 = 64 * 1024, 227 * 1024
    assert fit_tile_tokens(128, 128, 2, t4) == 64 and fit_tile_tokens(64, 128, 4, t4) == 32
    assert fit_tile_tokens(128, 64, 2, t4) == 128 and fit_tile_tokens(128, 128, 1, t4) == 64  # fp8 is widened
    assert fit_tile_tokens(128, 100, 2, t4) == 64  # head dim padded to 128
    assert all(fit_tile_tokens(c.tile_tokens, 128, e, h200) == c.tile_tokens for c in reachable_configs()
               for e in (1, 2, 4))
    assert fit_tile_tokens(64, 4096, 4, t4) == 16  # never below 16


def test_dispatch_plan_cache_does_not_skip_checks():
    """A call signature seen before skips the shape checks; a new bad one is still refused."""
    args = _good()
    paged_attention_decode(**args)
    paged_attention_decode(**args)
    with pytest.raises(ValueError, match="int32"):
        paged_attention_decode(**{**args, "seq_lens": args["seq_lens"].long()})
    with pytest.raises(ValueError, match="block table too short"):  # values still checked on a cached plan
        paged_attention_decode(**{**args, "seq_lens": torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)})


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


@pytest.mark.slow  # a fresh interpreter importing torch
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
# FP8 KV cache (e4m3, one scale per tensor)
# --------------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def _fp8_case(lens, hkv, group, d, dtype, k_scale, v_scale, seed=0):
    """A paged cache written in fp8 by reshape_and_cache; the reference reads the dequantised cache."""
    gen = torch.Generator().manual_seed(seed)
    kc16, vc16, bt, sl = make_paged_kv(lens, hkv, d, BLOCK, dtype=torch.float32, generator=gen)
    kc16, vc16 = kc16.clamp(-8, 8) * 3, vc16.clamp(-8, 8) * 5  # values of a few units, like real K/V
    slots = torch.arange(kc16.shape[0] * BLOCK)
    kc = torch.zeros(kc16.shape, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    reshape_and_cache(kc16.view(-1, hkv, d).to(dtype).to(DEVICE), vc16.view(-1, hkv, d).to(dtype).to(DEVICE),
                      kc, vc, slots.to(DEVICE), k_scale=k_scale, v_scale=v_scale)
    deq_k = kc.double() * k_scale  # what the kernels must attend over
    deq_v = vc.double() * v_scale
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(dtype=dtype, device=DEVICE)
    return q, kc, vc, bt.to(DEVICE), sl.to(DEVICE), deq_k, deq_v


@pytest.mark.skipif(DEVICE != "cpu", reason="documents Triton's interpreter")
def test_why_the_interpreter_does_not_write_fp8():
    """Triton's interpreter converts float32 -> float8e4nv wrongly, so on a CPU reshape_and_cache writes an fp8
    cache with PyTorch (same formula). If a Triton release fixes it, this test says so and the fallback can go."""

    @triton.jit
    def to_fp8(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.float8e4nv))

    x = torch.tensor([125.98, 17.0, 1e-3, 1.0])
    y = torch.empty(4, dtype=FP8)
    to_fp8[(1,)](x, y, N=4)
    assert y.float().tolist() != x.to(FP8).float().tolist(), "the interpreter now rounds fp8 right: drop the fallback"


def test_reshape_and_cache_writes_fp8_like_torch():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(5, 2, 32, generator=gen) * 40
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 447.0, 0.0])  # beyond e4m3's range: clamped to +-448, not inf/nan
    kc = torch.zeros(2, 4, 2, 32, dtype=FP8, device=DEVICE)
    vc = torch.zeros_like(kc)
    reshape_and_cache(k.to(DEVICE), (-k).to(DEVICE), kc, vc, torch.tensor([0, 3, 4, 6, 7], device=DEVICE),
                      k_scale=0.5, v_scale=2.0)
    want_k = (k / 0.5).clamp(-448, 448).to(FP8)
    want_v = (-k / 2.0).clamp(-448, 448).to(FP8)
    got_k = kc.view(-1, 2, 32)[[0, 3, 4, 6, 7]].cpu()
    got_v = vc.view(-1, 2, 32)[[0, 3, 4, 6, 7]].cpu()
    assert torch.equal(got_k.float(), want_k.float()) and torch.equal(got_v.float(), want_v.float())
    assert got_k[0, 0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("version", [3, 4, None], ids=["v3", "v4", "dispatch"])
def test_fp8_decode_is_exact_on_the_dequantised_cache(version, dtype):
    q, kc, vc, bt, sl, deq_k, deq_v = _fp8_case([1, 17, 100, 300], 2, 4, 64, dtype, 0.05, 0.02, seed=2)
    ref = ref_paged_attention_decode(q, deq_k, deq_v, bt, sl, compute_dtype=torch.float64)
    out = _poisoned(q)
    paged_attention_decode(q, kc, vc, bt, sl, version=version, out=out, k_scale=0.05, v_scale=0.02,
                           num_splits=3 if version == 4 else None)
    _check(out, ref, dtype, f"fp8 cache, version {version}, {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_prefill_is_exact_on_the_dequantised_cache(dtype):
    q, kc, vc, bt, sl, deq_k, deq_v = _fp8_case([17, 40, 33], 2, 2, 64, dtype, 0.05, 0.02, seed=3)
    q_lens = [17, 8, 1]
    qsl = torch.tensor([0, 17, 25, 26], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), q.shape[1], 64, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    ref = ref_paged_prefill_attention(q, deq_k, deq_v, bt, sl, qsl, compute_dtype=torch.float64)
    out = _poisoned(q)
    paged_prefill_attention(q, kc, vc, bt, sl, qsl, out=out, k_scale=0.05, v_scale=0.02)
    _check(out, ref, dtype, f"fp8 prefill {dtype}")


def test_fp8_refusals():
    q, kc, vc, bt, sl, _, _ = _fp8_case([5, 20], 2, 2, 16, torch.float16, 0.1, 0.1)
    for version in (1, 2):
        with pytest.raises(ValueError, match="fp8 KV cache is read by versions"):
            paged_attention_decode(q, kc, vc, bt, sl, version=version, k_scale=0.1, v_scale=0.1)
    for bad in (0.0, -1.0, float("inf"), torch.tensor(0.1), True):
        with pytest.raises(ValueError, match="k_scale"):
            paged_attention_decode(q, kc, vc, bt, sl, k_scale=bad)
    q16, kc16, vc16, bt16, sl16, _ = _decode_case([5], 1, 2, 16, torch.float16)
    with pytest.raises(ValueError, match="float8_e4m3fn cache only"):
        paged_attention_decode(q16, kc16, vc16, bt16, sl16, v_scale=0.5)
    with pytest.raises(ValueError, match="float8_e4m3fn cache only"):
        reshape_and_cache(q16[:, :1], q16[:, :1], kc16, vc16, torch.tensor([0], device=DEVICE), k_scale=2.0)


def test_fp8_needs_compute_capability_8_9(monkeypatch):
    """Triton compiles float8e4nv for Ada/Hopper and newer only: an A100 gets a clear error, not a compile trace."""
    from pagedkv.kernels import _common

    monkeypatch.setattr(_common, "_cuda_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        _common.check_fp8_supported(torch.device("cuda", 0))
    monkeypatch.setattr(_common, "_cuda_capability", lambda device: (9, 0))
    _common.check_fp8_supported(torch.device("cuda", 0))
    _common.check_fp8_supported(torch.device("cpu"))  # the interpreter reads fp8 anywhere


@pytest.mark.gpu
def test_fp8_on_gpu_close_to_the_fp16_cache():
    """On a GPU (bf16 queries): the fp8 cache's output vs the fp16 cache's, and exact on the dequantised cache."""
    gen = torch.Generator().manual_seed(0)
    kc16, vc16, bt, sl = make_paged_kv([1, 300, 1000, 4000], 8, 128, BLOCK, dtype=torch.float32, generator=gen)
    kc16, vc16 = kc16.clamp(-8, 8), vc16.clamp(-8, 8)
    k_scale = float(kc16.abs().max()) / 448
    v_scale = float(vc16.abs().max()) / 448
    kc = (kc16 / k_scale).to(FP8).cuda()
    vc = (vc16 / v_scale).to(FP8).cuda()
    q = torch.randn(4, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    bt, sl = bt.cuda(), sl.cuda()
    for version in (3, 4, None):
        out = paged_attention_decode(q, kc, vc, bt, sl, version=version, k_scale=k_scale, v_scale=v_scale)
        ref = ref_paged_attention_decode(q, kc.double() * k_scale, vc.double() * v_scale, bt, sl,
                                         compute_dtype=torch.float64)
        _check(out, ref, torch.bfloat16, f"GPU fp8 version {version}")
        full = ref_paged_attention_decode(q, kc16.cuda(), vc16.cuda(), bt, sl, compute_dtype=torch.float64)
        assert relative_error(out, full) < 0.1, "fp8 quantisation error vs the unquantised cache"


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

    result = bench.main(["--tiny", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["mode"] in ("tiny-interpreter", "tiny-gpu")
    assert set(data["meta"]) >= {"device", "when", "commit", "torch", "triton", "python"}
    assert data["read_roof"]["read_GBps"] > 0 and data["read_roof"]["read_bytes"] >= 64 << 20
    assert all(r["max_rel_err"] < TOL[torch.float16] for r in data["correctness"])
    assert {r["impl"] for r in data["decode"]} == set(bench.IMPLS)
    assert all({"eager_ms", "graph_ms", "pct_read_bw"} <= set(r) for r in data["decode"])
    assert {r["impl"] for r in data["prefill"]} == {"paged_prefill", "sdpa_causal_contiguous"}
    assert data["fp8"] and data["fp8"][0]["max_rel_err_vs_dequantised_fp64"] < TOL[torch.float16]
    assert data["host_overhead_us"]["dispatch_B64_L512_v3"] > 0
    assert (tmp_path / "bench_decode.png").exists() and (tmp_path / "bench_prefill.png").exists()
    assert result["decode"] == data["decode"]


def test_bench_arguments():
    from pagedkv.kernels import bench

    assert bench.parse_args(["--quick"]).quick and bench.parse_args([]).out is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--quick", "--full"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--dtypes", "fp64"])
    assert bench.decode_bytes(1, 16, 32, 8, 128, 2, 16) == 2 * 16 * 8 * 128 * 2 + 2 * 32 * 128 * 2 + 4 + 4
    assert bench.decode_bytes(1, 16, 32, 8, 128, 1, 16, q_elt=2) == 2 * 16 * 8 * 128 + 2 * 32 * 128 * 2 + 8
    assert bench.prefill_flops(1, 2, 1, 1) == 4 * 3


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

    bench.main(["--tiny", "--out", str(tmp_path), "--no-plot"])
    assert (tmp_path / "bench.json").exists()


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
    from pagedkv.grading.lessons import l06_paged_attention_kernel as ec

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
        (ec.check_group_decode, _group_shifted, "g * GROUP"),
    ]
    for check, answer, phrase in wrong:
        with pytest.raises(AssertionError, match=re.escape(phrase)):
            check(answer)


# --------------------------------------------------------------------------------------------------
# the device check (runs on a GPU; its plan and arguments are checked anywhere)
# --------------------------------------------------------------------------------------------------


def test_device_check_dry_run_and_arguments(capsys, tmp_path):
    from pagedkv.kernels import device_check as dc

    assert dc.main(["--dry-run", "--out", str(tmp_path / "x")]) == 0
    printed = capsys.readouterr().out
    for step in ("tests", "bench", "lesson"):
        assert f"  {step}" in printed
    assert "--quick" in printed and "06_paged_attention_kernel.ipynb" in printed and "test_kernels.py" in printed
    assert not (tmp_path / "x").exists(), "a dry run writes nothing"
    args = dc.parse_args(["--skip", "lesson", "--skip", "tests", "--budget", "120"])
    assert [name for name, _ in dc.plan(args, tmp_path)] == ["bench"] and args.budget == 120
    assert "engine-tests" not in printed, "the engine steps are opt-in"
    steps = dict(dc.plan(dc.parse_args(["--with-engine", "--skip", "bench"]), tmp_path))
    assert list(steps) == ["tests", "lesson", "engine-tests", "engine-bench"]
    assert "--gpu" in steps["engine-bench"] and str(tmp_path / "engine_gpu.json") in steps["engine-bench"]
    for bad in (["--budget", "5"], ["--skip", "everything"], ["--workers", "0"]):
        with pytest.raises(SystemExit):
            dc.parse_args(bad)


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the refusal without a GPU")
def test_device_check_refuses_without_a_gpu(tmp_path, capsys):
    from pagedkv.kernels import device_check as dc

    assert dc.main(["--out", str(tmp_path / "x")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out and not (tmp_path / "x").exists()


def test_device_check_step_timeout_is_recorded(tmp_path):
    from pagedkv.kernels import device_check as dc

    rec = dc.run_step("sleep", [sys.executable, "-c", "import time; time.sleep(30)"], 2.0, dict(os.environ))
    assert rec["status"].startswith("timed out") and rec["rc"] is None
    assert dc.run_step("x", [sys.executable, "-c", "pass"], 0.5, dict(os.environ))["status"].startswith("not run")


def _vllm_views(kc: torch.Tensor, vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same cache in vLLM 0.26's FlashAttention layout: one tensor, logical (N, Hkv, bs, 2D), NHD stride order
    (0, 2, 1, 3), split into K/V views as ``FlashAttentionImpl.forward`` does."""
    n, bs, hkv, d = kc.shape
    logical = (n, hkv, bs, 2 * d)
    order = (0, 2, 1, 3)
    kv_cache = torch.empty([logical[i] for i in order], dtype=kc.dtype, device=kc.device)
    kv_cache = kv_cache.permute(*[order.index(i) for i in range(4)])
    k_view, v_view = kv_cache.transpose(1, 2).split(d, dim=-1)
    k_view.copy_(kc)
    v_view.copy_(vc)
    return k_view, v_view


@pytest.mark.parametrize("version", [*DECODE_VERSIONS, None], ids=["v1", "v2", "v3", "v4", "dispatch"])
def test_kernels_read_vllm_layout_views(version):
    q, kc, vc, bt, sl, ref = _decode_case([1, 17, 100], 2, 2, 32, torch.float32, seed=13)
    k_view, v_view = _vllm_views(kc, vc)
    out = _poisoned(q)
    paged_attention_decode(q, k_view, v_view, bt, sl, version=version, out=out)
    _check(out, ref, torch.float32, f"version {version} on vLLM's split views")


def test_prefill_and_cache_write_on_vllm_layout_views():
    q, kc, vc, bt, sl, qsl, ref = _prefill_case([17, 40], [17, 8], 2, 2, 32, torch.float32, seed=6)
    k_view, v_view = _vllm_views(kc, vc)
    out = _poisoned(q)
    paged_prefill_attention(q, k_view, v_view, bt, sl, qsl, out=out)
    _check(out, ref, torch.float32, "prefill on vLLM's split views")
    new = torch.randn(2, 2, 32).to(DEVICE)
    reshape_and_cache(new, -new, k_view, v_view, torch.tensor([3, 40], device=DEVICE))
    assert torch.equal(k_view[0, 3], new[0]) and torch.equal(v_view[2, 8], -new[1])
    assert torch.equal(k_view[0, 4], kc[0, 4]), "a neighbouring slot was overwritten"
