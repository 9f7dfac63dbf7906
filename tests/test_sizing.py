"""pagedkv.sizing against vLLM 0.26's own arithmetic: the page size, the requested memory, the block count."""

from __future__ import annotations

import ast
import functools
import math
import os
import pathlib
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import sizing
from pagedkv.sizing import (
    CPU_TOTAL_MEMORY,
    GiB,
    MemoryProfile,
    kv_page_bytes,
    max_concurrency,
    num_gpu_blocks,
    profile,
)

# --- vLLM 0.26's formula, restated -------------------------------------------------------------------------
#
# vllm/v1/worker/utils.py::request_memory:
#     requested_memory = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
# vllm/v1/worker/gpu_worker.py::determine_available_memory:
#     profile_result.non_kv_cache_memory = non_torch_increase + torch_peak_increase + weights_memory
#     available_kv_cache_memory_bytes = requested_memory - non_kv_cache_memory - cudagraph_memory_estimate_applied
# vllm/v1/core/kv_cache_utils.py::get_num_blocks (via get_kv_cache_config_from_groups, one group of all layers):
#     num_blocks = int(available_memory // page_size // num_layers); num_blocks = max(num_blocks, 0)
# vllm/v1/kv_cache_interface.py::AttentionSpec.real_page_size_bytes:
#     2 * block_size * num_kv_heads * head_size * get_dtype_size(dtype)


def vllm_num_blocks(total, util, weights, peak, non_torch, cudagraph, page_size, num_layers) -> int:
    requested_memory = math.ceil(total * util)
    non_kv_cache_memory = non_torch + peak + weights
    available_memory = requested_memory - non_kv_cache_memory - cudagraph
    num_blocks = int(available_memory // page_size // num_layers)
    return max(num_blocks, 0)


def vllm_page_size_bytes(block_size, num_kv_heads, head_size, dtype) -> int:
    return 2 * block_size * num_kv_heads * head_size * dtype.itemsize


def config(layers=4, heads=8, kv_heads=2, head_dim=None, hidden=256, dtype=None, **kw):
    return SimpleNamespace(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        vocab_size=1000,
        dtype=dtype,
        max_position_embeddings=4096,
        **kw,
    )


memory = st.integers(0, 2 * GiB)


@given(
    total=st.integers(1, 200 * GiB),
    util=st.floats(0.01, 1.0),
    weights=memory,
    peak=memory,
    non_torch=st.integers(0, GiB),
    cudagraph=st.integers(0, GiB),
    block_size=st.sampled_from([1, 8, 16, 32, 64, 128]),
    kv_heads=st.integers(1, 16),
    head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]),
    num_layers=st.integers(1, 128),
)
def test_num_gpu_blocks_agrees_with_vllm(
    total, util, weights, peak, non_torch, cudagraph, block_size, kv_heads, head_dim, dtype, num_layers
):
    page = vllm_page_size_bytes(block_size, kv_heads, head_dim, dtype)
    cfg = config(layers=num_layers, heads=kv_heads * 2, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    assert kv_page_bytes(cfg, block_size) == page
    available = math.ceil(total * util) - (non_torch + peak + weights) - cudagraph
    if available <= 0:  # vLLM: kv_cache_utils.py::_check_enough_kv_cache_memory raises
        with pytest.raises(ValueError, match="exceeds the requested"):
            num_gpu_blocks(total, util, weights, peak, non_torch, cudagraph, page, num_layers)
    else:
        got = num_gpu_blocks(total, util, weights, peak, non_torch, cudagraph, page, num_layers)
        assert type(got) is int
        assert got == vllm_num_blocks(total, util, weights, peak, non_torch, cudagraph, page, num_layers)


def test_requested_memory_is_the_float_product_rounded_up():
    # 0.92 * 80 GiB is not a whole number of bytes in floating point: vLLM takes math.ceil of the float product
    assert sizing.request_memory(80 * GiB, 0.92) == math.ceil(80 * GiB * 0.92)
    assert sizing.request_memory(1000, 0.5) == 500
    assert sizing.request_memory(3, 0.5) == 2


def test_default_utilization_is_vllms():
    assert sizing.DEFAULT_GPU_MEMORY_UTILIZATION == 0.92  # vllm/config/cache.py: gpu_memory_utilization
    import inspect

    assert inspect.signature(profile).parameters["gpu_memory_utilization"].default == 0.92


# --- against vLLM's own source, when it is unpacked on this machine ------------------------------------------

VLLM_SRC = pathlib.Path(os.environ.get("VLLM_SOURCE", "/tmp/v/vllm"))


def _vllm_function(relpath: str, name: str, namespace: dict):
    """Compile one top-level function out of vLLM's source (without importing vLLM and its dependencies)."""
    tree = ast.parse((VLLM_SRC / relpath).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    node.returns = None
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    code = compile(ast.Module(body=[node], type_ignores=[]), str(VLLM_SRC / relpath), "exec")
    exec(code, namespace)
    return namespace[name]


@functools.cache
def _vllm_sizing_functions():
    ns: dict = {"math": math, "format_gib": sizing.format_gib}
    request_memory = _vllm_function("v1/worker/utils.py", "request_memory", ns)
    _vllm_function("v1/core/kv_cache_utils.py", "may_override_num_blocks", ns)
    return request_memory, _vllm_function("v1/core/kv_cache_utils.py", "get_num_blocks", ns)


@pytest.mark.skipif(not (VLLM_SRC / "v1/core/kv_cache_utils.py").exists(), reason="vLLM 0.26's source not unpacked")
@given(
    total=st.integers(1, 200 * GiB),
    util=st.floats(0.01, 1.0),
    non_kv=memory,
    page=st.integers(1, 1 << 22),
    num_layers=st.integers(1, 128),
)
def test_against_vllms_own_get_num_blocks_and_request_memory(total, util, non_kv, page, num_layers):
    request_memory, get_num_blocks = _vllm_sizing_functions()
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks_override=None))
    snapshot = SimpleNamespace(total_memory=total, free_memory=total, device_="cuda:0")
    requested = request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=util))
    assert requested == sizing.request_memory(total, util)
    available = requested - non_kv
    if available > 0:
        expected = get_num_blocks(vllm_config, num_layers, available, page)
        assert num_gpu_blocks(total, util, non_kv, 0, 0, 0, page, num_layers) == expected


# --- the page size --------------------------------------------------------------------------------------------


def test_kv_page_bytes_gqa_head_dim_and_dtypes():
    llama_8b = config(layers=32, heads=32, kv_heads=8, hidden=4096, dtype=torch.bfloat16)
    assert kv_page_bytes(llama_8b, 16) == 2 * 16 * 8 * 128 * 2  # 64 KiB per block per layer
    assert kv_page_bytes(llama_8b, 16, "fp8") == 2 * 16 * 8 * 128 * 1
    assert kv_page_bytes(llama_8b, 16, torch.float32) == 2 * 16 * 8 * 128 * 4
    mha = config(layers=32, heads=32, kv_heads=None, hidden=4096, dtype="float16")
    assert kv_page_bytes(mha, 16) == 2 * 16 * 32 * 128 * 2  # no num_key_value_heads: every head is a KV head
    qwen3 = config(layers=28, heads=16, kv_heads=8, head_dim=128, hidden=1024, dtype="bfloat16")
    assert kv_page_bytes(qwen3, 16) == 2 * 16 * 8 * 128 * 2  # head_dim 128, not 1024 // 16 = 64
    assert kv_page_bytes(config(dtype=None), 1, "auto") == 2 * 2 * 32 * 4  # no dtype in the config: float32
    for name, size in [("fp16", 2), ("bf16", 2), ("fp8", 1), ("fp8_e4m3", 1), ("float32", 4)]:
        assert kv_page_bytes(llama_8b, 1, name) == 2 * 8 * 128 * size


def test_kv_page_bytes_reads_transformers_configs():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert kv_page_bytes(cfg, 16, "fp16") == 2 * 16 * 2 * 16 * 2
    assert kv_page_bytes({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}, 16, "fp16") == (
        2 * 16 * 4 * 16 * 2
    )


@pytest.mark.parametrize("bad", ["int4", "fp4", "", None, 2, torch.bool])
def test_unknown_kv_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_page_bytes(config(), 16, bad)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True])
def test_bad_block_size_is_refused(block_size):
    with pytest.raises(ValueError, match="block_size"):
        kv_page_bytes(config(), block_size)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_page_bytes(SimpleNamespace(num_attention_heads=4, hidden_size=64), 16)
    with pytest.raises(ValueError, match="multiple of"):
        kv_page_bytes(config(heads=6, kv_heads=4), 16)


# --- bad input to the arithmetic -----------------------------------------------------------------------------

GOOD = dict(total=80 * GiB, utilization=0.92, weights=16 * GiB, peak_activation=GiB, non_torch=GiB // 2,
            cudagraph=GiB // 2, page_bytes=65536, num_layers=32)  # fmt: skip


@pytest.mark.parametrize("util", [0, 0.0, -0.5, 1.0001, 2, float("nan"), True, "0.9"])
def test_utilization_outside_0_1_is_refused(util):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        num_gpu_blocks(**{**GOOD, "utilization": util})


def test_utilization_of_one_is_allowed():
    assert num_gpu_blocks(**{**GOOD, "utilization": 1.0}) > num_gpu_blocks(**GOOD)


@pytest.mark.parametrize("name", ["total", "weights", "peak_activation", "non_torch", "cudagraph"])
def test_negative_memory_is_refused(name):
    with pytest.raises(ValueError, match=name):
        num_gpu_blocks(**{**GOOD, name: -1})


@pytest.mark.parametrize("name", ["page_bytes", "num_layers"])
def test_non_positive_divisors_are_refused(name):
    with pytest.raises(ValueError, match=name):
        num_gpu_blocks(**{**GOOD, name: 0})


def test_non_kv_memory_over_the_request_says_by_how_much_and_what_to_lower():
    requested = math.ceil(80 * GiB * 0.92)
    weights = requested - GiB - GiB // 2 - GiB // 2 + 123  # 123 bytes too many
    with pytest.raises(ValueError) as err:
        num_gpu_blocks(**{**GOOD, "weights": weights})
    message = str(err.value)
    assert "exceeds the requested" in message and "(123 bytes)" in message
    assert "gpu_memory_utilization" in message and "max_num_batched_tokens" in message


def test_whole_floats_are_accepted_fractional_bytes_are_not():
    assert num_gpu_blocks(**{**GOOD, "total": 80.0 * GiB}) == num_gpu_blocks(**GOOD)
    with pytest.raises(ValueError, match="whole number"):
        num_gpu_blocks(**{**GOOD, "weights": 1.5})


def test_max_concurrency_is_blocks_over_blocks_per_request():
    # kv_cache_utils.py::get_max_concurrency_for_kv_cache_config: num_blocks / cdiv(max_model_len, block_size)
    assert max_concurrency(1000, 16, 4096) == 1000 / 256
    assert max_concurrency(1000, 16, 4097) == 1000 / 257
    with pytest.raises(ValueError):
        max_concurrency(-1, 16, 4096)


# --- profile() on a CPU: analytic ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_profile_on_cpu_is_analytic_and_small(tiny_llama):
    before = {k: v.clone() for k, v in tiny_llama.state_dict().items()}
    p = profile(tiny_llama, 2048)
    assert isinstance(p, MemoryProfile) and p.method == "analytic" and p.device == "cpu"
    assert p.total_memory == CPU_TOTAL_MEMORY
    assert p.kv_cache_memory < GiB // 2  # the engine on a laptop allocates well under 1 GiB of KV by default
    tensors = [*tiny_llama.parameters(), *tiny_llama.buffers()]  # rotary inv_freq is a non-persistent buffer
    assert p.weights_memory == sum(t.numel() * t.element_size() for t in tensors)
    assert p.page_size_bytes == kv_page_bytes(tiny_llama.config, 16, torch.float32)
    assert p.num_gpu_blocks == num_gpu_blocks(
        p.total_memory, 0.92, p.weights_memory, p.peak_activation_memory, 0, 0, p.page_size_bytes, 2
    )
    assert sum(p.breakdown().values()) == p.requested_memory
    assert all(torch.equal(before[k], v) for k, v in tiny_llama.state_dict().items())  # nothing changed
    text = str(p)
    assert "analytic" in text
    assert f"# GPU blocks: {p.num_gpu_blocks}, concurrency for 2048-token requests: " in text
    assert f"{p.max_concurrency(2048):.2f}x" in text
    assert "Available KV cache memory" in text and "Maximum concurrency for 2,048 tokens per request" in text


def test_profile_options(tiny_llama):
    base = profile(tiny_llama, 512, max_model_len=1024)
    fp8 = profile(tiny_llama, 512, max_model_len=1024, kv_cache_dtype="fp8")
    assert fp8.page_size_bytes * 4 == base.page_size_bytes  # the model runs in float32
    assert fp8.num_gpu_blocks > 3 * base.num_gpu_blocks
    big = profile(tiny_llama, 512, total_memory=4 * GiB, block_size=32, gpu_memory_utilization=0.5)
    assert big.requested_memory == 2 * GiB and big.block_size == 32
    assert base.max_concurrency(1024) == base.num_gpu_blocks / 64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"block_size": 0}, "block_size"),
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
        ({"total_memory": -5}, "total_memory"),
        ({"total_memory": 1 << 20}, "exceeds the requested"),
        ({"max_model_len": 10**9}, "max seq len"),
    ],
)
def test_profile_bad_input(tiny_llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        profile(tiny_llama, 256, **kwargs)


def test_cudagraph_batch_sizes_are_the_engines_and_checked(tiny_llama):
    """One list of capture sizes: the profile estimates the graphs the engine captures (model_runner's
    cudagraph_capture_sizes, vllm/config/vllm.py::VllmConfig._set_cudagraph_sizes's pattern)."""
    from pagedkv.engine.model_runner import cudagraph_capture_sizes

    for seqs in (1, 3, 256, 1000):
        assert sizing.default_cudagraph_batch_sizes(seqs) == tuple(cudagraph_capture_sizes(seqs))
    sizes = sizing.default_cudagraph_batch_sizes(256)
    assert sizes[:4] == (1, 2, 4, 8) and 248 in sizes and 256 in sizes and 264 not in sizes
    with pytest.raises(ValueError, match="cudagraph_batch_sizes"):
        profile(tiny_llama, 256, cuda_graphs=True, cudagraph_batch_sizes=(0, 4))


def test_profile_refuses_what_is_not_a_model():
    with pytest.raises(ValueError, match="transformers model"):
        profile(object(), 256)


def test_profile_finds_the_model_inside_an_engine(tiny_llama):
    engine = SimpleNamespace(model_runner=SimpleNamespace(model=tiny_llama))
    assert profile(engine, 256).num_gpu_blocks == profile(tiny_llama, 256).num_gpu_blocks


def test_analytic_profile_of_a_published_shape():
    # Llama-3.1-8B's config values; bf16 weights on an 80 GiB card
    llama = config(layers=32, heads=32, kv_heads=8, hidden=4096, dtype="bfloat16")
    llama.intermediate_size, llama.vocab_size, llama.max_position_embeddings = 14336, 128256, 8192
    assert sizing.num_parameters(llama) == 8_030_261_248  # the published 8.03B
    p = sizing.analytic_profile(llama, 8192, total_memory=80 * GiB, weight_bits=16)
    assert p.weights_memory == 2 * 8_030_261_248
    w4 = sizing.analytic_profile(llama, 8192, total_memory=80 * GiB, weight_bits=4)
    assert w4.num_gpu_blocks > p.num_gpu_blocks


# --- profile() on a CUDA GPU: measured (prepared; runs only where a GPU is) ------------------------------------


@pytest.mark.gpu
def test_profile_on_cuda_is_measured(tiny_llama):
    model = tiny_llama.to("cuda", torch.float16)
    try:
        # the V1 runner's estimate (MoE and Mamba-hybrid models on 0.26); a dense Llama gets Model Runner V2
        v1 = {"cuda_graphs": True, "use_v2_model_runner": False}
        p = profile(model, 4096, cudagraph_batch_sizes=(1, 2, 4, 8), **v1)
        own = profile(model, 4096, cudagraph_memory=lambda: 3 << 20, **v1)  # an engine's own capture
        assert own.cudagraph_memory == 3 << 20
        v2 = profile(model, 4096, cuda_graphs=True, cudagraph_memory=lambda: 3 << 20)
        assert v2.cudagraph_memory == 0 and any("Model Runner V2" in n for n in v2.notes)
        assert p.method == "measured" and p.device.startswith("cuda")
        assert p.total_memory == torch.cuda.mem_get_info()[1]
        assert p.peak_activation_memory > 0 and p.cudagraph_memory >= 1 << 20
        assert p.num_gpu_blocks == num_gpu_blocks(
            p.total_memory,
            0.92,
            p.weights_memory,
            p.peak_activation_memory,
            p.non_torch_memory,
            p.cudagraph_memory,
            p.page_size_bytes,
            p.num_layers,
        )
        assert "measured" in str(p)
    finally:
        tiny_llama.to("cpu", torch.float32)


# --- exercise set 05's checks (pagedkv.grading.lessons.l05_sizing) --------------------------------------------


def _answers():
    """A learner's correct answers, written plainly (not the library's)."""
    names = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}

    def kv_page_bytes(config, block_size, kv_cache_dtype="auto"):
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if isinstance(kv_cache_dtype, torch.dtype):
            dtype = kv_cache_dtype
        elif kv_cache_dtype == "auto":
            dtype = getattr(torch, config.get("dtype") or "float32")
        elif kv_cache_dtype in names:
            dtype = names[kv_cache_dtype]
        else:
            raise ValueError(kv_cache_dtype)
        return 2 * block_size * kv_heads * head_dim * dtype.itemsize

    def num_gpu_blocks(total, utilization, weights, peak_activation, non_torch, cudagraph, page_bytes, num_layers):
        if not 0 < utilization <= 1 or min(total, weights, peak_activation, non_torch, cudagraph) < 0:
            raise ValueError("bad input")
        available = math.ceil(total * utilization) - (non_torch + peak_activation + weights) - cudagraph
        if available <= 0:
            raise ValueError("nothing left")
        return available // page_bytes // num_layers

    def predict(config, weights, tokens, total, utilization=0.92, block_size=16, kv_cache_dtype="auto"):
        peak = sizing.estimate_peak_activation(config, tokens)
        page = kv_page_bytes(config, block_size, kv_cache_dtype)
        return num_gpu_blocks(total, utilization, weights, peak, 0, 0, page, config["num_hidden_layers"])

    return kv_page_bytes, num_gpu_blocks, predict


def _checks(prefix: str):
    from pagedkv.grading.lessons import l05_sizing

    return [getattr(l05_sizing, n) for n in l05_sizing.__all__ if n.startswith(prefix)]


def _named(*names: str):
    from pagedkv.grading.lessons import l05_sizing

    return [getattr(l05_sizing, f"check_{n}") for n in names]


def _fails(check, fn, *phrases: str) -> str:
    with pytest.raises(AssertionError) as err:
        check(fn)
    message = str(err.value)
    for phrase in phrases:
        assert phrase in message, f"{check.__name__}: {phrase!r} not in {message!r}"
    return message


def test_l05_checks_pass_a_correct_answer():
    kv_page_bytes_, num_gpu_blocks_, predict = _answers()
    for check in _checks("check_kv_page_bytes"):
        check(kv_page_bytes_)
    for check in _checks("check_num_gpu_blocks"):
        check(num_gpu_blocks_)
    for check in _checks("check_predict"):
        check(predict)


def _stub(*args, **kwargs): ...


@pytest.mark.parametrize("prefix", ["check_kv_page_bytes", "check_num_gpu_blocks", "check_predict"])
def test_l05_checks_fail_the_stub_and_hard_coded_answers(prefix):
    for check in _checks(prefix):
        _fails(check, _stub, "stub")
        _fails(check, lambda *a, **k: 65536, "expected")
        _fails(check, lambda *a, **k: 28616, "expected")


def test_l05_kv_page_bytes_mistakes_are_named():
    right, _, _ = _answers()

    def without_kv_heads(c, b, d="auto"):
        return right({**c, "num_key_value_heads": None}, b, d)

    def derived_head_dim(c, b, d="auto"):
        return right({**c, "head_dim": None}, b, d)

    published, random_, dtypes, hidden = _named("kv_page_bytes_published", "kv_page_bytes_random",
                                                 "kv_page_bytes_dtypes", "kv_page_bytes_hidden")  # fmt: skip
    for check in (published, random_, hidden):
        _fails(check, lambda c, b, d="auto": right(c, b, d) // 2, "keys AND values")  # forgot the 2
    _fails(published, without_kv_heads, "num_attention_heads")
    _fails(published, derived_head_dim, "explicit head_dim (128) wins")
    _fails(random_, derived_head_dim, "explicit head_dim")
    _fails(published, lambda c, b, d="auto": right(c, b, d) * c["num_hidden_layers"], "ONE layer")
    _fails(published, lambda c, b, d="auto": right(c, b, "fp16" if d == "fp8" else d), "1 byte")

    def silent(c, b, d="auto"):
        try:
            return right(c, b, d)
        except ValueError:
            return 0

    _fails(dtypes, silent, "not a KV cache dtype")


def test_l05_num_gpu_blocks_mistakes_are_named():
    _, right, _ = _answers()

    def from_total(total, u, w, a, n, c, p, layers):
        right(total, u, w, a, n, c, p, layers)
        return (total - w - a - n - c) // p // layers

    def layers_twice(total, u, w, a, n, c, p, layers):
        return right(total, u, w, a, n, c, p, layers) // layers

    def rounded_down(total, u, w, a, n, c, p, layers):
        right(total, u, w, a, n, c, p, layers)
        return (int(total * u) - w - a - n - c) // p // layers

    def no_cudagraph(total, u, w, a, n, c, p, layers):
        return right(total, u, w, a, n, 0, p, layers)

    def never_raises(total, u, w, a, n, c, p, layers):
        return max(0, (math.ceil(total * u) - w - a - n - c) // p // layers)

    examples, random_, errors, hidden = _named("num_gpu_blocks_examples", "num_gpu_blocks_random",
                                               "num_gpu_blocks_errors", "num_gpu_blocks_hidden")  # fmt: skip
    for fn, phrase in [(from_total, "REQUESTED"), (layers_twice, "layers twice"), (rounded_down, "round the requested"),
                       (no_cudagraph, "CUDA-graph")]:  # fmt: skip
        for check in (examples, random_, hidden):
            _fails(check, fn, phrase)
    _fails(errors, never_raises, "raise ValueError")


def test_l05_predict_mistakes_are_named():
    page, blocks, _ = _answers()

    def forgot_2(config, weights, tokens, total, u=0.92, b=16, d="auto"):
        peak = sizing.estimate_peak_activation(config, tokens)
        return blocks(total, u, weights, peak, 0, 0, page(config, b, d) // 2, config["num_hidden_layers"])

    def no_activations(config, weights, tokens, total, u=0.92, b=16, d="auto"):
        return blocks(total, u, weights, 0, 0, 0, page(config, b, d), config["num_hidden_layers"])

    examples, hidden = _named("predict_examples", "predict_hidden")
    for check in (examples, hidden):
        _fails(check, forgot_2, "factor 2")
    _fails(examples, no_activations, "peak activations")
