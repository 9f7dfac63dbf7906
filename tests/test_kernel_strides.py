"""Every kernel entry point is right for any memory layout of its tensors, or refuses the layout.

Each tensor argument in turn is given the same values in other layouts -- two axes swapped in memory
(``t.transpose(i, j).contiguous().transpose(i, j)``), one axis strided by 2 (a view of a larger tensor), and
a storage offset -- and the result is checked against the float64 reference (in Triton's interpreter on CPU).
The layouts a kernel refuses are listed (``REFUSED``); everything else must give the right answer.
``paged_prefill_attention`` used to return garbage (relative error 1e19) for a query whose head_dim was
strided: the output it allocated kept the query's strides and the kernel wrote it as if packed.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedkv import kernels as pk
from pagedkv.attention import make_paged_kv, ref_paged_attention_decode, ref_paged_prefill_attention, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4  # fp32 inputs against the float64 reference


def layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The values of ``t`` in every layout the sweep tries, by name (contiguous first)."""
    out = {"contiguous": t.contiguous()}
    for i, j in itertools.combinations(range(t.dim()), 2):
        out[f"axes {i},{j} swapped"] = t.transpose(i, j).contiguous().transpose(i, j)
    for i in range(t.dim()):
        shape = list(t.shape)
        shape[i] *= 2
        big = torch.zeros(shape, dtype=t.dtype, device=t.device)
        view = big[tuple(slice(None, None, 2) if k == i else slice(None) for k in range(t.dim()))]
        view.copy_(t)
        out[f"axis {i} strided"] = view
    flat = torch.zeros(t.numel() + 3, dtype=t.dtype, device=t.device)
    off = flat[3:].view(t.shape)
    off.copy_(t)
    out["offset"] = off
    return out


def _axis_refusal(t: torch.Tensor, layout: torch.Tensor) -> bool:
    """A layout whose last axis is not packed (``stride(-1) != 1``, with more than one element there)."""
    return layout.shape[-1] > 1 and layout.stride(-1) != 1


#: Which (argument, layout) pairs are refused with a ValueError: the KV caches and a given ``out`` must be
#: packed along head_dim (the kernels write and read them with a unit stride there; copying a cache would
#: defeat the point of writing it in place).
REFUSED = {"key_cache": _axis_refusal, "value_cache": _axis_refusal, "out": _axis_refusal}


def _run_sweep(call, tensors: dict[str, torch.Tensor], check) -> int:
    """Call ``call(**tensors)`` with each tensor in each layout (the caches together); returns the calls made."""
    calls = 0
    names = [n for n in tensors if n != "value_cache"]
    for name in names:
        for label, layout in layouts(tensors[name]).items():
            args = dict(tensors)
            args[name] = layout
            if name == "key_cache":  # both caches must share strides: give both the layout
                args["value_cache"] = layouts(tensors["value_cache"])[label]
            what = f"{name} {label} {tuple(layout.stride())}"
            refused = REFUSED.get(name, lambda t, lay: False)(tensors[name], layout)
            calls += 1
            if refused:
                with pytest.raises(ValueError, match="contiguous|stride"):
                    call(**args)
                continue
            check(call(**args), args, what)
    return calls


def _check(out, ref, what):
    err = relative_error(out, ref)
    assert err < TOL, f"{what}: relative error {err:.3g}"


def _decode_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv([5, 9, 2], 2, 16, 4, device=DEVICE, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen).to(DEVICE)
    ref = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    out = torch.full_like(q, float("nan"))
    return dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, out=out), ref


@pytest.mark.parametrize(
    "version",
    # the fast tier sweeps version 3 (the cheapest in the interpreter); the others run in the full suite
    [pytest.param(v, marks=() if v == 3 else pytest.mark.slow) for v in (*pk.DECODE_VERSIONS, None)],
    ids=["v1", "v2", "v3", "v4", "dispatch"],
)
def test_decode_is_right_for_any_layout(version):
    tensors, ref = _decode_tensors()

    def call(query, key_cache, value_cache, block_tables, seq_lens, out):
        out.fill_(float("nan"))
        ret = pk.paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, version=version,
                                        num_splits=2 if version == 4 else None, out=out)
        assert ret is out
        return ret

    assert _run_sweep(call, tensors, lambda got, args, what: _check(got, ref, what)) > 20


def test_decode_allocates_a_packed_output_for_a_strided_query():
    tensors, ref = _decode_tensors(seed=1)
    q = tensors["query"].transpose(1, 2).contiguous().transpose(1, 2)  # same values, head_dim strided
    out = pk.paged_attention_decode(q, tensors["key_cache"], tensors["value_cache"], tensors["block_tables"],
                                    tensors["seq_lens"])
    _check(out, ref, "decode without out, strided query")


def _prefill_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, bt, sl = make_paged_kv([6, 11], 2, 16, 4, device=DEVICE, generator=gen)
    qsl = torch.tensor([0, 6, 10], dtype=torch.int32, device=DEVICE)
    q = torch.randn(10, 4, 16, generator=gen).to(DEVICE)
    ref = ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl, compute_dtype=torch.float64)
    out = torch.full_like(q, float("nan"))
    return dict(query=q, key_cache=kc, value_cache=vc, block_tables=bt, seq_lens=sl, query_start_loc=qsl,
                out=out), ref


@pytest.mark.slow
def test_prefill_is_right_for_any_layout():
    tensors, ref = _prefill_tensors()

    def call(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out):
        out.fill_(float("nan"))
        return pk.paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                          out=out)

    assert _run_sweep(call, tensors, lambda got, args, what: _check(got, ref, what)) > 20


def test_prefill_allocates_a_packed_output_for_a_strided_query():
    """The report's reproduction: ``q.transpose(1, 2).contiguous().transpose(1, 2)`` gave relative error 1e19."""
    tensors, ref = _prefill_tensors(seed=2)
    for label, q in layouts(tensors["query"]).items():
        out = pk.paged_prefill_attention(q, tensors["key_cache"], tensors["value_cache"], tensors["block_tables"],
                                         tensors["seq_lens"], tensors["query_start_loc"])
        _check(out, ref, f"prefill without out, query {label}")


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32 cache", "fp8 cache"])
def test_reshape_and_cache_is_right_for_any_layout(fp8):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, hkv, d = 5, 4, 2, 16
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    k = torch.randn(6, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(6, hkv, d, generator=gen).to(DEVICE)
    slots = torch.tensor([5, 6, -1, 13, 2, 19], device=DEVICE)
    kc0 = torch.zeros(num_blocks, block_size, hkv, d, device=DEVICE).to(dtype)
    expected_k, expected_v = kc0.float().clone(), kc0.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_k[s // block_size, s % block_size] = k[t].to(dtype).float()
            expected_v[s // block_size, s % block_size] = v[t].to(dtype).float()
    tensors = dict(key=k, value=v, key_cache=kc0, value_cache=kc0.clone(), slot_mapping=slots)

    def call(key, value, key_cache, value_cache, slot_mapping):
        key_cache.zero_() if not fp8 else key_cache.copy_(kc0)
        value_cache.zero_() if not fp8 else value_cache.copy_(kc0)
        pk.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return key_cache, value_cache

    def check(got, args, what):
        kc, vc = got
        assert torch.equal(kc.float(), expected_k), f"{what}: key cache"
        assert torch.equal(vc.float(), expected_v), f"{what}: value cache"

    assert _run_sweep(call, tensors, check) > 15


def test_an_output_whose_elements_alias_each_other_is_refused():
    tensors, _ = _decode_tensors()
    aliased = torch.empty(1, 4, 16, device=DEVICE).expand(3, 4, 16)  # stride 0 along the batch
    with pytest.raises(ValueError, match="stride of 0"):
        pk.paged_attention_decode(tensors["query"], tensors["key_cache"], tensors["value_cache"],
                                  tensors["block_tables"], tensors["seq_lens"], out=aliased)
    p, _ = _prefill_tensors()
    with pytest.raises(ValueError, match="stride of 0"):
        pk.paged_prefill_attention(p["query"], p["key_cache"], p["value_cache"], p["block_tables"], p["seq_lens"],
                                   p["query_start_loc"], out=torch.empty(1, 4, 16, device=DEVICE).expand(10, 4, 16))


def test_compute_slot_mappings_is_right_for_any_layout():
    """A strided ``query_start_loc`` used to crash the interpreter and a strided ``idx_mapping`` gave wrong slots:
    the kernel read them as packed."""
    bt = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32, device=DEVICE)
    tensors = dict(block_tables=bt, idx_mapping=torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE),
                   query_start_loc=torch.tensor([0, 2, 3, 5], dtype=torch.int32, device=DEVICE),
                   positions=torch.tensor([0, 5, 1, 2, 11], device=DEVICE),
                   out=torch.full((5,), -7, dtype=torch.int64, device=DEVICE))
    want = [7 * 4 + 0, 8 * 4 + 1, 1 * 4 + 1, 4 * 4 + 2, 6 * 4 + 3]

    def call(block_tables, idx_mapping, query_start_loc, positions, out):
        out.fill_(-7)
        return pk.compute_slot_mappings(block_tables, idx_mapping, query_start_loc, positions, 4, out=out)

    def check(got, args, what):
        assert got.tolist() == want, what
        assert args["out"].tolist() == want, f"{what}: out"

    assert _run_sweep(call, tensors, check) > 15
