"""A second adversarial pass over the public API: each test pins one bug found there (it failed before its fix).

- ``paged_prefill_attention(..., validate=False)`` skipped the shape checks of ``block_tables``/``seq_lens`` (a 1-D
  or one-row table was read past its end) and trusted ``max_query_len`` (0 returned an unwritten ``out``);
- a given ``out`` overlapping the query (shifted) or the KV cache was written while being read: garbage;
- ``version=True``/``4.0`` and a string ``scale`` were accepted by the attention kernels;
- ``reshape_and_cache`` with one tensor as both caches overwrote every key with its value;
- ``gather_kv`` read block id -1 as the cache's last block and failed obscurely past the table;
- ``rank_sizing`` turned any ValueError (utilization 1.5, negative memory, weight_bits -4) into "0 blocks";
- ``model_shape`` accepted a negative/float/bool ``intermediate_size``, ``vocab_size``, ``max_position_embeddings``;
- ``check_enough_kv_cache_memory`` divided by a block size of 0 and did not tell "no memory at all" apart (vLLM does);
- ``estimate_peak_activation`` returned a negative byte count for ``num_logit_rows < 0``;
- ``pagedkv bench NAME --bad-option`` exited 1 instead of the benchmark's usage status 2.
"""

from __future__ import annotations

import pagedkv.kernels as K
import pytest
import torch

from pagedkv import sizing
from pagedkv.attention import gather_kv, make_paged_kv, ref_paged_attention_decode, ref_paged_prefill_attention
from pagedkv.sizing import parallel


def _i32(*x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.fixture(scope="module")
def paged():
    g = torch.Generator().manual_seed(0)
    kc, vc, bt, sl = make_paged_kv([5, 9], 2, 16, 4, generator=g)
    return kc, vc, bt, sl, torch.randn(7, 4, 16, generator=g), _i32(0, 3, 7)


@pytest.mark.parametrize("bad", ["one_row", "one_dim", "int64"])
def test_prefill_checks_table_shapes_without_validation(paged, bad):
    kc, vc, bt, sl, q, qsl = paged
    table = {"one_row": bt[:1], "one_dim": bt[0], "int64": bt.long()}[bad]
    with pytest.raises(ValueError, match="block_tables|batch sizes disagree"):
        K.paged_prefill_attention(q, kc, vc, table, sl, qsl, max_query_len=4, validate=False)


def test_prefill_names_a_2d_seq_lens(paged):
    kc, vc, bt, sl, q, qsl = paged
    with pytest.raises(ValueError, match="seq_lens must be a 1-D int32"):
        K.paged_prefill_attention(q, kc, vc, bt, sl[:, None], qsl)


@pytest.mark.parametrize("mql", [0, -1, 2.5, "4", 3, 8])
def test_prefill_refuses_an_impossible_max_query_len(paged, mql):
    kc, vc, bt, sl, q, qsl = paged  # 7 tokens in 2 sequences: the longest has 4..7
    with pytest.raises(ValueError, match="max_query_len must be an int in 4..7"):
        K.paged_prefill_attention(q, kc, vc, bt, sl, qsl, max_query_len=mql, validate=False)


def test_prefill_with_a_right_max_query_len_still_runs(paged):
    kc, vc, bt, sl, q, qsl = paged
    out = K.paged_prefill_attention(q, kc, vc, bt, sl, qsl, max_query_len=4, validate=False)
    ref = ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl)
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", [1, 4])
def test_decode_refuses_an_out_shifted_over_the_query(paged, version):
    kc, vc, bt, sl, _, _ = paged
    buf = torch.randn(3, 4, 16)
    before = buf.clone()
    with pytest.raises(ValueError, match="out overlaps query"):
        K.paged_attention_decode(buf[:2], kc, vc, bt, sl, out=buf[1:3], version=version)
    assert torch.equal(buf, before)


def test_out_inside_the_cache_is_refused_and_the_cache_kept(paged):
    kc, vc, bt, sl, q, qsl = paged
    kc2 = kc.clone()
    with pytest.raises(ValueError, match="out overlaps key_cache"):
        K.paged_attention_decode(q[:2], kc2, vc, bt, sl, out=kc2.view(-1)[: 2 * 4 * 16].view(2, 4, 16))
    with pytest.raises(ValueError, match="out overlaps key_cache"):
        K.paged_prefill_attention(q, kc2, vc, bt, sl, qsl, out=kc2.view(-1)[: 7 * 4 * 16].view(7, 4, 16))
    assert torch.equal(kc2, kc)


def test_out_may_still_be_the_query_itself(paged):
    kc, vc, bt, sl, q, qsl = paged
    ref = ref_paged_attention_decode(q[:2], kc, vc, bt, sl)
    qq = q[:2].clone()
    out = K.paged_attention_decode(qq, kc, vc, bt, sl, out=qq)
    assert out is qq
    torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-5, rtol=1e-5)
    qp = q.clone()
    K.paged_prefill_attention(qp, kc, vc, bt, sl, qsl, out=qp)
    torch.testing.assert_close(qp, ref_paged_prefill_attention(q, kc, vc, bt, sl, qsl), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [{"version": True}, {"version": 4.0}, {"scale": "0.5"}, {"scale": True}])
def test_decode_refuses_a_bool_or_float_version_and_a_string_scale(paged, kwargs):
    kc, vc, bt, sl, q, _ = paged
    with pytest.raises(ValueError, match="version must be|scale must be"):
        K.paged_attention_decode(q[:2], kc, vc, bt, sl, **kwargs)


def test_prefill_refuses_a_string_scale(paged):
    kc, vc, bt, sl, q, qsl = paged
    with pytest.raises(ValueError, match="scale must be"):
        K.paged_prefill_attention(q, kc, vc, bt, sl, qsl, scale="1")


def test_reshape_and_cache_refuses_one_tensor_as_both_caches():
    cache = torch.zeros(4, 4, 2, 16)
    k, v = torch.randn(2, 2, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match="same memory"):
        K.reshape_and_cache(k, v, cache, cache, torch.tensor([0, 5]))
    assert not cache.any()
    packed = torch.zeros(4, 4, 2, 32)  # vLLM's packed layout: K and V views of one tensor, still accepted
    K.reshape_and_cache(k, v, packed[..., :16], packed[..., 16:], torch.tensor([0, 5]))
    assert torch.equal(packed[0, 0, :, :16], k[0]) and torch.equal(packed[1, 1, :, 16:], v[1])


@pytest.mark.parametrize(("table", "seq_len", "match"), [
    ([-1, 2], 5, "block id -1"), ([1, 2], -1, "seq_len must be"), ([1, 2], 100, "seq_len must be"),
    ([1, 2], 2.5, "seq_len must be"),
])
def test_gather_kv_refuses_bad_ids_and_lengths(paged, table, seq_len, match):
    kc, vc = paged[:2]
    with pytest.raises(ValueError, match=match):
        gather_kv(kc, vc, _i32(*table), seq_len)


def test_gather_kv_still_takes_a_0d_int_tensor_length(paged):
    kc, vc, bt, sl = paged[:4]
    k, _ = gather_kv(kc, vc, bt[0], sl[0])
    assert k.shape[0] == int(sl[0])


@pytest.mark.parametrize("kwargs", [
    {"gpu_memory_utilization": 1.5}, {"total_memory": -1}, {"weight_bits": -4}, {"weight_bits": 0},
    {"weights_memory": -1}, {"non_torch_memory": -1}, {"max_model_len": 0}, {"total_memory": "80GB"},
])
def test_rank_sizing_refuses_bad_figures_instead_of_reporting_zero_blocks(kwargs):
    args = {"total_memory": 80 * 2**30, **kwargs}
    with pytest.raises(ValueError):
        parallel.rank_sizing(parallel.LLAMA_3_1_70B, 4, **args)


def test_rank_sizing_still_reports_zero_blocks_when_the_weights_do_not_fit():
    assert parallel.rank_sizing(parallel.LLAMA_3_1_70B, 1, total_memory=80 * 2**30).num_blocks == 0
    assert parallel.rank_sizing(parallel.LLAMA_3_1_70B, 4, total_memory=80 * 2**30).num_blocks > 0


@pytest.mark.parametrize("field", [{"kv_lora_rank": -600}, {"kv_lora_rank": "x"}, {"num_hidden_layers": None}])
def test_mla_sizing_refuses_bad_config_fields(field):
    config = {**parallel.DEEPSEEK_V3, **field}
    with pytest.raises(ValueError, match="config\\."):
        parallel.rank_sizing(config, 8, total_memory=80 * 2**30, weights_memory=10e9, peak_activation_memory=1e9)


_BASE = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
             intermediate_size=128, vocab_size=100, torch_dtype="float16")


@pytest.mark.parametrize("field", [
    {"intermediate_size": -5}, {"intermediate_size": 2.5}, {"intermediate_size": "abc"}, {"intermediate_size": True},
    {"vocab_size": -1}, {"vocab_size": 1.5}, {"max_position_embeddings": -1}, {"max_position_embeddings": "x"},
    {"max_position_embeddings": 2.7},
])
def test_model_shape_refuses_bad_optional_numbers(field):
    name = next(iter(field))
    with pytest.raises(ValueError, match=f"config.{name} must be an int"):
        sizing.model_shape({**_BASE, **field})


def test_model_shape_still_defaults_missing_optional_numbers():
    s = sizing.model_shape({k: v for k, v in _BASE.items() if k not in ("intermediate_size", "vocab_size")})
    assert (s.intermediate_size, s.vocab_size, s.max_position_embeddings) == (256, 0, None)


def test_check_enough_kv_cache_memory_refuses_bad_sizes_and_names_no_memory_as_vllm_does():
    with pytest.raises(ValueError, match="block_size must be an int"):
        sizing.check_enough_kv_cache_memory(10**9, 1000, 2, 0, 100)
    with pytest.raises(ValueError, match="max_len must be an int"):
        sizing.check_enough_kv_cache_memory(10**9, 1000, 2, 16, 0)
    with pytest.raises(ValueError, match="No available memory for the cache blocks"):
        sizing.check_enough_kv_cache_memory(0, 1000, 2, 16, 100)
    with pytest.raises(ValueError, match="larger than the available") as info:  # fits no block: no estimate
        sizing.check_enough_kv_cache_memory(1000, 1000, 2, 16, 100)
    assert "estimated maximum model length" not in str(info.value)
    with pytest.raises(ValueError, match="estimated maximum model length is 48"):
        sizing.check_enough_kv_cache_memory(6000, 1000, 2, 16, 100)
    sizing.check_enough_kv_cache_memory(14000, 1000, 2, 16, 100)


@pytest.mark.parametrize("kwargs", [{"num_logit_rows": -100}, {"num_logit_rows": 2.5}, {"dtype": "fp16"}])
def test_estimate_peak_activation_refuses_bad_rows_and_dtype(kwargs):
    with pytest.raises(ValueError, match="num_logit_rows|dtype must be"):
        sizing.estimate_peak_activation(_BASE, 16, **kwargs)


def test_bench_passes_a_benchmarks_usage_error_status_through(monkeypatch, capsys):
    from pagedkv import cli

    monkeypatch.setattr(cli.subprocess, "call", lambda argv: 2)
    assert cli.main(["bench", "kernels", "--bogus"]) == 2
    monkeypatch.setattr(cli.subprocess, "call", lambda argv: 3)
    assert cli.main(["bench", "kernels", "--bogus"]) == 3


@pytest.mark.parametrize(("change", "match"), [
    (dict(num_requests=-1), "num_requests must be an int >= 0"),  # was numpy's "negative dimensions"
    (dict(num_requests=2.5), "num_requests must be an int"),  # was "expected a sequence of integers"
    (dict(prompt_median=0), "prompt_median must be a finite number > 0"),
    (dict(output_sigma=float("nan")), "output_sigma must be a finite number >= 0"),
    (dict(max_len=4), "max_len must be an int >= 5"),  # min_prompt 4 + one output token
    (dict(seed=-1), "seed must be an int >= 0"),
    (dict(vocab_size=0), "vocab_size must be an int >= 1"),
])  # fmt: skip
def test_a_workload_that_cannot_be_drawn_is_refused_naming_its_field(change, match):
    from pagedkv.sim.workload import WorkloadSpec, make_requests

    with pytest.raises(ValueError, match=match):
        make_requests(WorkloadSpec(**change))
    assert make_requests(WorkloadSpec(num_requests=0)) == []
    assert len(make_requests(num_requests=3, max_len=5)) == 3


def test_prefill_names_seq_lens_when_the_table_has_too_few_rows():
    """Prefill's query is packed tokens: the message used to say "query has 2 sequences"."""
    kc, vc, bt, sl = make_paged_kv([5, 9], 2, 16, 4)
    q, qsl = torch.randn(14, 4, 16), _i32(0, 5, 14)
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"block_tables has 1 rows for the 2 sequences of seq_lens"):
            K.paged_prefill_attention(q, kc, vc, bt[:1], sl, qsl, validate=validate, max_query_len=9)


def test_model_shape_refuses_a_dtype_that_is_not_a_float():
    """``torch_dtype="int8"`` or ``torch.bool`` was read as the model's dtype (1-byte KV pages of integers)."""
    from pagedkv.sizing.model import model_shape

    base = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
    for bad in ("int8", torch.bool, "torch.int32"):
        with pytest.raises(ValueError, match="not a floating-point dtype"):
            model_shape({**base, "torch_dtype": bad})
    for bad in (5, True, "bogus"):
        with pytest.raises(ValueError, match="not a torch dtype"):
            model_shape({**base, "torch_dtype": bad})
    assert model_shape({**base, "torch_dtype": "torch.bfloat16"}).dtype == torch.bfloat16
    assert model_shape({**base, "dtype": torch.float16}).dtype == torch.float16
