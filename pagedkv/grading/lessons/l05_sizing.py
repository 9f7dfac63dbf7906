"""Checks for lesson 5's exercises (``grading/source/05_sizing_the_pool.ipynb``): the KV page size, vLLM 0.26's
block count, and a prediction of a model's block count.

Every expected value comes from :mod:`pagedkv.sizing` (itself checked against vLLM 0.26's functions in
``tests/test_sizing.py``). Each check also computes the answers of the plausible mistakes -- the factor 2 for
K and V forgotten, query heads instead of KV heads, ``hidden_size // num_attention_heads`` instead of an explicit
``head_dim``, the total instead of the requested memory, the layers divided twice, the requested memory rounded
down -- and, when the learner's answer equals one of them, the message names it. Cases come small and known
first, then randomised (seeded) ones: GQA and MHA, ``head_dim`` different from ``hidden_size //
num_attention_heads``, FP8, utilizations whose product with the total is not a whole number of bytes. Configs
are plain dicts (what ``model.config.to_dict()`` gives), so they cross to a sandboxed learner as plain data.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

from pagedkv import sizing
from pagedkv.grading.checks import STUB_NOTE, describe, expect_raises, fail, is_int, require_function, run
from pagedkv.grading.lessons.depends import Earlier, with_earlier_answers

__all__ = [
    "PUBLISHED",
    "check_kv_page_bytes_dtypes",
    "check_kv_page_bytes_hidden",
    "check_kv_page_bytes_published",
    "check_kv_page_bytes_random",
    "check_num_gpu_blocks_errors",
    "check_num_gpu_blocks_examples",
    "check_num_gpu_blocks_hidden",
    "check_num_gpu_blocks_random",
    "check_predict_examples",
    "check_predict_hidden",
    "expected_blocks",
    "expected_page",
    "expected_prediction",
    "random_config",
    "reference_kv_page_bytes",
    "reference_num_gpu_blocks",
]

GiB = 1 << 30

#: Published shapes (their Hugging Face config.json values): Llama-3.1-8B (GQA 4:1), Llama-2-7B (MHA, no
#: num_key_value_heads given), Qwen3-0.6B (head_dim 128 while hidden_size // num_attention_heads is 64).
PUBLISHED: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                         intermediate_size=14336, vocab_size=128256, dtype="bfloat16"),
    "Llama-2-7B": dict(num_hidden_layers=32, num_attention_heads=32, hidden_size=4096, intermediate_size=11008,
                       vocab_size=32000, dtype="float16"),
    "Qwen3-0.6B": dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       hidden_size=1024, intermediate_size=3072, vocab_size=151936, dtype="bfloat16"),
}  # fmt: skip


def _short(config: dict[str, Any]) -> str:
    """A config as the message shows it: only the fields sizing reads."""
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "dtype")
    return "{" + ", ".join(f"{k}: {config[k]!r}" for k in keys if k in config) + "}"


def random_config(rng: random.Random) -> dict[str, Any]:
    """A decoder's config: GQA or MHA, sometimes an explicit head_dim different from hidden // heads, a dtype."""
    kv = rng.choice([1, 2, 4, 8, 16])
    heads = kv * rng.choice([1, 1, 2, 4, 8])
    head_dim = rng.choice([32, 64, 80, 96, 128, 256])
    explicit = rng.random() < 0.5
    hidden = heads * (rng.choice([d for d in (32, 64, 128, 256) if d != head_dim]) if explicit else head_dim)
    config: dict[str, Any] = dict(num_hidden_layers=rng.randrange(1, 97), num_attention_heads=heads,
                                  hidden_size=hidden, intermediate_size=rng.choice([2, 3, 4]) * hidden,
                                  vocab_size=rng.choice([1000, 32000, 128256]),
                                  dtype=rng.choice(["float16", "bfloat16", "float32"]))  # fmt: skip
    if kv != heads or rng.random() < 0.5:
        config["num_key_value_heads"] = kv  # MHA sometimes leaves it out
    if explicit:
        config["head_dim"] = head_dim
    elif rng.random() < 0.3:
        config["head_dim"] = None  # transformers writes null when it derives head_dim
    return config


def expected_page(config: dict[str, Any], block_size: int, kv_cache_dtype: Any = "auto") -> int:
    return sizing.kv_page_bytes(config, block_size, kv_cache_dtype)


def _page_mistakes(config: dict[str, Any], block_size: int, kv_cache_dtype: Any) -> list[tuple[int, str, str]]:
    """(wrong answer, hint, which mistake) for each plausible mistake that gives a wrong answer here."""
    shape = sizing.model_shape(config)
    nbytes = sizing.resolve_kv_cache_dtype(kv_cache_dtype, shape.dtype).itemsize
    right = 2 * block_size * shape.num_kv_heads * shape.head_dim * nbytes
    out = [
        (right // 2, "that is half the answer: a block stores keys AND values, so the page is 2 x block_size x "
                     "num_kv_heads x head_dim x bytes", "half"),
        (right * shape.num_layers, "that is the page of every layer together: kv_page_bytes is ONE layer's page "
                                   "(vLLM divides by the number of layers separately)", "layers"),
        (2 * block_size * shape.num_attention_heads * shape.head_dim * nbytes,
         "you used num_attention_heads: only the KV heads are cached (num_key_value_heads; GQA shares each among "
         "several query heads)", "query heads"),
        (right * 8, "that counts bits, not bytes", "bits"),
    ]  # fmt: skip
    if shape.hidden_size % shape.num_attention_heads == 0:
        derived = shape.hidden_size // shape.num_attention_heads
        out.append((2 * block_size * shape.num_kv_heads * derived * nbytes,
                    f"you used hidden_size // num_attention_heads = {derived}: an explicit head_dim "
                    f"({shape.head_dim}) wins", "derived head_dim"))  # fmt: skip
    if kv_cache_dtype == "auto":
        out.append((2 * block_size * shape.num_kv_heads * shape.head_dim * 2,
                    f"'auto' means the config's dtype ({config.get('dtype')}), not always 2 bytes"
                    if config.get("dtype") is not None else
                    "'auto' with no dtype in the config means float32, 4 bytes (what transformers builds from such "
                    "a config), not 2", "auto"))  # fmt: skip
    if kv_cache_dtype == "fp8":
        out.append((right * 2, "fp8 stores 1 byte per value", "fp8"))
    if isinstance(kv_cache_dtype, torch.dtype):
        for wrong in (2, sizing.resolve_kv_cache_dtype("auto", shape.dtype).itemsize):
            out.append((right // nbytes * wrong, f"kv_cache_dtype is a torch.dtype here, {describe(kv_cache_dtype)}: "
                        f"its itemsize, {nbytes}, is the bytes per value", "torch dtype"))
    single = [(v, m, k) for v, m, k in out if v != right]
    # two mistakes at once: each is a factor of the right page, so their product is the answer with both
    pairs = []
    for i, (va, ma, ka) in enumerate(single):
        for vb, mb, kb in single[i + 1:]:
            both = Fraction(va, right) * Fraction(vb, right) * right
            if both.denominator == 1 and int(both) != right and int(both) not in {v for v, _, _ in single}:
                pairs.append((int(both), f"two things at once. First, {ma}. Second, {mb}", f"{ka}+{kb}"))
    return single + pairs


def _expect_int(got: Any, expected: int, call: str, mistakes: list[tuple[int, str]]) -> None:
    if is_int(got) and int(got) == expected:
        return
    message = f"{call} returned {describe(got)}, expected {expected}"
    if got is None:
        fail(f"{message}. {STUB_NOTE}")
    if not is_int(got):
        if isinstance(got, float) and got == expected:
            fail(message + f" (a {type(got).__name__}: return an int; use // rather than /)")
        fail(message + f" (expected an int, got {type(got).__name__})")
    hints = list(dict.fromkeys(why.rstrip(".") for value, why in mistakes if int(got) == value))
    if hints:
        # several mistakes can give the same number: one sentence each
        text = " Or ".join(h + ("" if h.endswith("?") else ".") for h in hints)
        fail(f"{message}. Hint: {text}")
    fail(message + ".")


_KEY_ERROR = re.compile(r"raised KeyError: '([^']*)'")  # one pair of quotes, in the notebook and under the grader


_NONE_TYPE = re.compile(r"raised TypeError: .*'NoneType'")


#: The KV cache dtypes the exercise names, and the config keys a config may leave out.
_DTYPE_NAMES = ("fp16", "bf16", "fp32", "fp8")
_OPTIONAL_KEYS = ("num_key_value_heads", "head_dim", "dtype")


def _key_error_hint(key: str, config: dict[str, Any], kv_cache_dtype: Any) -> str | None:
    """Why ``KeyError: key`` was raised, as a hint: a config key that may be missing, or a dtype name that a
    table of bytes per value left out; None when the key is neither."""
    if key in _OPTIONAL_KEYS and key not in config:
        if key == "dtype":
            return ("this config has no 'dtype': with kv_cache_dtype='auto' that means float32 (4 bytes); read it "
                    "with config.get('dtype')")
        return (f"this config has no {key!r}: a config may leave out num_key_value_heads and head_dim (or set them "
                "to None); read them with config.get(...) and fall back as the exercise says")
    if isinstance(kv_cache_dtype, str) and key == kv_cache_dtype and key in _DTYPE_NAMES:
        return (f"{key!r} is one of the KV cache dtypes the exercise names ({', '.join(map(repr, _DTYPE_NAMES))}): "
                "your table of bytes per value has no entry for it")
    if kv_cache_dtype == "auto" and key == (config.get("dtype") or "float32"):
        which = "the config's dtype" if config.get("dtype") else "float32 when the config has no dtype"
        return (f"kv_cache_dtype='auto' means {which}, {key!r} here: your table of bytes per value has no entry for "
                f"it (getattr(torch, {key!r}).itemsize gives its bytes)")
    return None


def _valid_dtype_hint(kv_cache_dtype: Any) -> str | None:
    """A hint for a call that raised although ``kv_cache_dtype`` is one the exercise accepts, else None."""
    if isinstance(kv_cache_dtype, torch.dtype):
        return (f"kv_cache_dtype may be any torch.dtype: {describe(kv_cache_dtype)} takes its itemsize, "
                f"{kv_cache_dtype.itemsize} byte{'s' * (kv_cache_dtype.itemsize != 1)} per value")
    if kv_cache_dtype == "auto" or kv_cache_dtype in _DTYPE_NAMES:
        return f"{kv_cache_dtype!r} is a KV cache dtype the exercise accepts: raise ValueError only for other ones"
    return None


def _run_on_config(fn: Callable, args: tuple, name: str, timeout: float, shown: str | None = None) -> Any:
    """``run``, with a KeyError on the config explained (the key may be missing, or None, in a real config; or a
    dtype left out of a table of sizes), and the call shown as ``shown`` (the config with only the fields sizing
    reads)."""
    try:
        return run(fn, copy.deepcopy(args), name=name, timeout=timeout)  # a copy: what it changes stays there
    except AssertionError as exc:
        text = str(exc)
        cut = min((i for i in (text.find(" raised "), text.find(" did not return within ")) if i >= 0), default=-1)
        if shown is not None and cut >= 0:
            text = shown + text[cut:]
        dtype = args[-1]  # kv_cache_dtype is the last argument of both functions checked here
        m = _KEY_ERROR.search(text)
        if m is not None:
            hint = _key_error_hint(m.group(1), args[0], dtype)
            fail(f"{text}. Hint: {hint}" if hint is not None else text)
        if " raised ValueError" in text and _valid_dtype_hint(dtype) is not None:
            fail(f"{text}. Hint: {_valid_dtype_hint(dtype)}")
        nulls = [k for k in ("num_key_value_heads", "head_dim") if k in args[0] and args[0][k] is None]
        if nulls and _NONE_TYPE.search(text):
            fail(f"{text}. Hint: this config sets {' and '.join(nulls)} to None (transformers writes null when the "
                 "value is derived): config.get(key, default) returns that None, not the default; fall back when "
                 "the value is missing OR None")
        fail(text)


def _check_page(kv_page_bytes: Callable, config: dict[str, Any], block_size: int, dtype: Any,
                ruled_out: set[str] | None = None) -> None:
    """One case. ``ruled_out`` collects the mistakes the learner's function is known not to make (it gave the
    right answer on an earlier case where that mistake gives a wrong one), so that a hint never names them."""
    call = f"kv_page_bytes({_short(config)}, {block_size}, {describe(dtype)})"
    got = _run_on_config(kv_page_bytes, (config, block_size, dtype), "kv_page_bytes", 2, shown=call)
    expected = expected_page(config, block_size, dtype)
    mistakes = _page_mistakes(config, block_size, dtype)
    ruled_out = set() if ruled_out is None else ruled_out
    if is_int(got) and int(got) == expected:
        ruled_out.update(key for _, _, key in mistakes)
    _expect_int(got, expected, call, [(v, m) for v, m, key in mistakes if not set(key.split("+")) & ruled_out])


def check_kv_page_bytes_published(kv_page_bytes: Any) -> None:
    """The three published shapes, in their own dtype and in FP8 (1 point)."""
    require_function(kv_page_bytes, "kv_page_bytes")
    ruled_out: set[str] = set()
    # Llama-2-7B once more, with num_key_value_heads written as null (missing OR None: every head is a KV head)
    for config in (*PUBLISHED.values(), {**PUBLISHED["Llama-2-7B"], "num_key_value_heads": None}):
        for block_size in (16, 1, 32):
            for dtype in ("auto", "fp8"):
                _check_page(kv_page_bytes, config, block_size, dtype, ruled_out)


def check_kv_page_bytes_random(kv_page_bytes: Any) -> None:
    """Random GQA/MHA configs with and without an explicit head_dim (1 point)."""
    require_function(kv_page_bytes, "kv_page_bytes")
    rng = random.Random(5005)
    ruled_out: set[str] = set()
    for _ in range(150):
        config = random_config(rng)
        _check_page(kv_page_bytes, config, rng.choice([1, 8, 16, 32, 64]), rng.choice(["auto", "fp16", "bf16"]),
                    ruled_out)


def check_kv_page_bytes_dtypes(kv_page_bytes: Any) -> None:
    """Every dtype name, torch dtypes, 'auto' on a config without a dtype (float32), and an unknown dtype refused
    (1 point)."""
    require_function(kv_page_bytes, "kv_page_bytes")
    config = PUBLISHED["Llama-3.1-8B"]
    ruled_out: set[str] = set()
    for dtype in ("fp16", "bf16", "fp32", "fp8", torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        _check_page(kv_page_bytes, config, 16, dtype, ruled_out)
    no_dtype = {k: v for k, v in config.items() if k != "dtype"}
    for without in (no_dtype, {**no_dtype, "dtype": None}):  # left out, or written as null
        _check_page(kv_page_bytes, without, 16, "auto", ruled_out)
    for bad in ("int4", "fp4", "e4m3"):
        expect_raises(ValueError, kv_page_bytes, (dict(config), 16, bad), name=f"kv_page_bytes({_short(config)}, "
                      f"16, {bad!r})", why=f"{bad!r} is not a KV cache dtype", timeout=2)  # fmt: skip


def check_kv_page_bytes_hidden(kv_page_bytes: Any) -> None:
    """More random configs (another seed), every dtype, block sizes up to 256 (hidden, 1 point)."""
    require_function(kv_page_bytes, "kv_page_bytes")
    rng = random.Random(8128)
    ruled_out: set[str] = set()
    for _ in range(300):
        config = random_config(rng)
        dtype = rng.choice(["auto", "fp16", "bf16", "fp32", "fp8", torch.float16, torch.float8_e4m3fn])
        _check_page(kv_page_bytes, config, rng.choice([1, 2, 16, 128, 256]), dtype, ruled_out)


# --- num_gpu_blocks ------------------------------------------------------------------------------------------


def expected_blocks(*args: int | float) -> int:
    return sizing.num_gpu_blocks(*args)


def _blocks_mistakes(total, util, weights, act, non_torch, cudagraph, page, layers) -> list[tuple[int, str]]:
    requested = math.ceil(total * util)
    non_kv = weights + act + non_torch + cudagraph
    available = requested - non_kv
    out = [
        ((total - non_kv) // page // layers,
         "you subtracted from the total memory: vLLM subtracts from the REQUESTED memory, ceil(total x "
         "utilization)"),
        (available // page // layers // layers, "you divided by the number of layers twice"),
        (available // page, "divide by the number of layers too: page_bytes is one layer's page, and every layer "
                            "stores its own copy of each block"),
        ((math.floor(total * util) - non_kv) // page // layers,
         "round the requested memory UP: vLLM takes math.ceil(total * utilization)"),
        (available // (2 * page) // layers, "page_bytes already counts keys and values: do not multiply by 2 again"),
        ((requested - non_kv + cudagraph) // page // layers, "subtract the CUDA-graph memory too"),
        ((requested - non_kv + non_torch) // page // layers, "subtract the non-torch memory too"),
        ((requested - non_kv + act) // page // layers, "subtract the peak activation memory too"),
        (round(available / page / layers), "use floor division (//): a partial block cannot be allocated"),
    ]  # fmt: skip
    right = available // page // layers
    return [(v, m) for v, m in out if v != right]


def _check_blocks(num_gpu_blocks: Callable, args: tuple) -> None:
    names = ("total", "utilization", "weights", "peak_activation", "non_torch", "cudagraph", "page_bytes",
             "num_layers")  # fmt: skip
    call = "num_gpu_blocks(" + ", ".join(f"{n}={a!r}" for n, a in zip(names, args, strict=True)) + ")"
    try:
        got = run(num_gpu_blocks, args, name="num_gpu_blocks", timeout=2)
    except AssertionError as exc:
        text = str(exc)
        if " raised ValueError" not in text:
            raise
        text = call + text[text.find(" raised "):]
        if args[1] == 1:
            fail(f"{text}. Hint: utilization 1.0 is allowed: the range is (0, 1], 1 included")
        fail(f"{text}. Hint: this call is valid (utilization in (0, 1], no negative figure, memory left for the "
             f"cache: {math.ceil(args[0] * args[1]) - sum(args[2:6])} bytes): it should return a block count")
    _expect_int(got, expected_blocks(*args), call, _blocks_mistakes(*args))


#: Known cases: an 80 GiB GPU serving Llama-3.1-8B in bf16 (page 65,536 bytes, 32 layers), a 24 GiB one, and
#: a small budget where 0.92 x total is not a whole number of bytes.
_EXAMPLES = [
    (80 * GiB, 0.92, 16_060_522_496, 2 * GiB, GiB // 2, GiB // 4, 65536, 32),
    (24 * GiB, 0.92, 16_060_522_496, GiB, 300 << 20, 200 << 20, 65536, 32),
    (1_000_003, 0.9, 10_000, 20_000, 3_000, 0, 1024, 4),
    (1_000_003, 0.9, 80_803, 0, 0, 0, 1024, 4),  # ceil(900_002.7) - 80_803 = 200 blocks of 4 x 1024 exactly
    (512 << 20, 0.92, 558_400, 5_767_168, 0, 0, 4096, 2),
]


def check_num_gpu_blocks_examples(num_gpu_blocks: Any) -> None:
    """Worked cases (1 point)."""
    require_function(num_gpu_blocks, "num_gpu_blocks")
    for args in _EXAMPLES:
        _check_blocks(num_gpu_blocks, args)


def _random_blocks_args(rng: random.Random) -> tuple:
    total = rng.choice([rng.randrange(1 << 20, 200 * GiB), rng.choice([24, 40, 80, 141]) * GiB])
    util = rng.choice([0.5, 0.8, 0.9, 0.92, 0.95, 1.0, round(rng.uniform(0.3, 1.0), 3)])
    requested = math.ceil(total * util)
    budget = rng.randrange(0, requested // 2 + 1)
    parts = sorted(rng.randrange(0, budget + 1) for _ in range(3))
    weights, act, non_torch = parts[0], parts[1] - parts[0], parts[2] - parts[1]
    cudagraph = rng.randrange(0, max(1, (requested - parts[2]) // 4))
    config = random_config(rng)
    page = expected_page(config, rng.choice([1, 16, 32]), rng.choice(["auto", "fp8"]))
    layers = config["num_hidden_layers"]
    if rng.random() < 0.3 and total * util != requested:
        # land exactly on a block boundary, where rounding the requested memory down loses a block
        k = rng.randrange(1, max(2, (requested - act - non_torch - cudagraph) // (page * layers)))
        weights = max(0, requested - act - non_torch - cudagraph - k * page * layers)
    return (total, util, weights, act, non_torch, cudagraph, page, layers)


def check_num_gpu_blocks_random(num_gpu_blocks: Any) -> None:
    """Random figures, exact integer agreement with vLLM 0.26's arithmetic (1 point)."""
    require_function(num_gpu_blocks, "num_gpu_blocks")
    rng = random.Random(2605)
    for _ in range(300):
        _check_blocks(num_gpu_blocks, _random_blocks_args(rng))


def check_num_gpu_blocks_errors(num_gpu_blocks: Any) -> None:
    """Utilization outside (0, 1], negative figures, and non-KV memory over the request refused (1 point)."""
    require_function(num_gpu_blocks, "num_gpu_blocks")
    try:  # several valid calls: an answer written for the notebook's example alone scores nothing here
        for args in _EXAMPLES[:3]:
            _check_blocks(num_gpu_blocks, args)
    except AssertionError as exc:
        fail(f"the refusals are checked once valid calls work, and this one does not yet: {exc}")
    good = list(_EXAMPLES[0])
    for util in (0, 0.0, -0.1, 1.01, 1.5):
        args = tuple(good[:1] + [util] + good[2:])
        expect_raises(ValueError, num_gpu_blocks, args, name="num_gpu_blocks",
                      why=f"gpu_memory_utilization {util} is outside (0, 1]", timeout=2)  # fmt: skip
    for i, name in enumerate(("weights", "peak_activation", "non_torch", "cudagraph"), start=2):
        args = tuple(good[:i] + [-1] + good[i + 1 :])
        expect_raises(ValueError, num_gpu_blocks, args, name="num_gpu_blocks", why=f"{name} is negative", timeout=2)
    requested = math.ceil(80 * GiB * 0.92)
    over = (80 * GiB, 0.92, requested, 1, 0, 0, 65536, 32)  # 1 byte over: nothing left for the cache
    expect_raises(ValueError, num_gpu_blocks, over, name="num_gpu_blocks",
                  why="the non-KV memory exceeds the requested memory", timeout=2)  # fmt: skip
    exact = (80 * GiB, 0.92, requested - 1, 1, 0, 0, 65536, 32)  # exactly the request: 0 bytes left, vLLM refuses
    expect_raises(ValueError, num_gpu_blocks, exact, name="num_gpu_blocks",
                  why="nothing is left for the KV cache (vLLM refuses available <= 0)", timeout=2)  # fmt: skip


def check_num_gpu_blocks_hidden(num_gpu_blocks: Any) -> None:
    """More random figures, another seed (hidden, 1 point)."""
    require_function(num_gpu_blocks, "num_gpu_blocks")
    rng = random.Random(9091)
    for _ in range(500):
        _check_blocks(num_gpu_blocks, _random_blocks_args(rng))


# --- predict_num_gpu_blocks ----------------------------------------------------------------------------------


def reference_kv_page_bytes(config: dict[str, Any], block_size: int, kv_cache_dtype: Any = "auto") -> int:
    """Exercise 1's answer, what exercise 3's checks put in place of the learner's ``kv_page_bytes``."""
    return sizing.kv_page_bytes(config, block_size, kv_cache_dtype)


def reference_num_gpu_blocks(total: int, utilization: float, weights: int, peak_activation: int, non_torch: int,
                             cudagraph: int, page_bytes: int, num_layers: int) -> int:  # fmt: skip
    """Exercise 2's answer, what exercise 3's checks put in place of the learner's ``num_gpu_blocks``."""
    return sizing.num_gpu_blocks(total, utilization, weights, peak_activation, non_torch, cudagraph, page_bytes,
                                 num_layers)  # fmt: skip


def _uses_exercises_1_and_2(check: Callable[..., None]) -> Callable[..., None]:
    """A check of ``predict_num_gpu_blocks`` run with exercises 1 and 2's answers in place of the learner's
    ``kv_page_bytes`` and ``num_gpu_blocks`` (:mod:`pagedkv.grading.lessons.depends`): a missing x2 in the page
    costs points in exercise 1 only."""
    earlier = [Earlier("kv_page_bytes", 1, reference_kv_page_bytes, lambda fn: check_kv_page_bytes_published(fn)),
               Earlier("num_gpu_blocks", 2, reference_num_gpu_blocks,
                       lambda fn: check_num_gpu_blocks_examples(fn))]  # fmt: skip

    @functools.wraps(check)
    def judged(fn: Any, *args: Any, env: Any = None, **kwargs: Any) -> None:
        with_earlier_answers(fn, earlier, lambda: check(fn, *args, **kwargs), what="predict_num_gpu_blocks",
                             env=env)

    return judged


def expected_prediction(config, weights_bytes, max_num_batched_tokens, total_memory, utilization, block_size,
                        kv_cache_dtype) -> int:  # fmt: skip
    """What vLLM's arithmetic gives on a CPU profile: estimated activations, no non-torch or CUDA-graph memory."""
    peak = sizing.estimate_peak_activation(config, max_num_batched_tokens)
    page = sizing.kv_page_bytes(config, block_size, kv_cache_dtype)
    return sizing.num_gpu_blocks(total_memory, utilization, weights_bytes, peak, 0, 0, page,
                                 config["num_hidden_layers"])  # fmt: skip


def _check_prediction(predict: Callable, args: tuple) -> None:
    config, weights, tokens, total, util, block_size, dtype = args
    call = (f"predict_num_gpu_blocks({_short(config)}, weights_bytes={weights}, max_num_batched_tokens={tokens}, "
            f"total_memory={total}, gpu_memory_utilization={util}, block_size={block_size}, "
            f"kv_cache_dtype={describe(dtype)})")  # fmt: skip
    got = _run_on_config(predict, (config, weights, tokens, total, util, block_size, dtype),
                         "predict_num_gpu_blocks", 5, shown=call)  # fmt: skip
    expected = expected_prediction(*args)
    peak = sizing.estimate_peak_activation(config, tokens)
    page = expected_page(config, block_size, dtype)
    layers = config["num_hidden_layers"]
    def blocks(**change: Any) -> int | None:
        a = dict(util=util, weights=weights, peak=peak, page=page, page_args=(block_size, dtype))
        a.update(change)
        try:
            pg = a["page"] if "page_args" not in change else expected_page(config, *a["page_args"])
            return sizing.num_gpu_blocks(total, a["util"], a["weights"], a["peak"], 0, 0, pg, layers)
        except ValueError:
            return None

    mistakes = [
        # an argument not passed on: checked first, since it can look like another mistake (fp8 ignored also
        # doubles the page)
        (blocks(page_args=(16, dtype)), f"that is the count for blocks of 16 tokens: pass block_size "
                                        f"({block_size}) on to kv_page_bytes"),
        (blocks(page_args=(block_size, "auto")), f"that is the count with kv_cache_dtype='auto': pass "
                                                 f"kv_cache_dtype ({describe(dtype)}) on to kv_page_bytes"),
        (blocks(util=0.92), f"that is the count at utilization 0.92: pass gpu_memory_utilization ({util}) on"),
        (blocks(page=page // 2), "twice the blocks: does your page size leave out the factor 2 for keys and "
                                 "values?"),
        (blocks(peak=0), "subtract the peak activations too (estimate_peak_activation(config, "
                         "max_num_batched_tokens))"),
        *[(blocks(peak=sizing.estimate_peak_activation(config, n)),
           f"that is the count with the activations of a batch of {n} tokens: pass max_num_batched_tokens "
           f"({tokens}) on to estimate_peak_activation") for n in (4096, block_size) if n != tokens],
        *_blocks_mistakes(total, util, weights, peak, 0, 0, page, layers),
    ]  # fmt: skip
    seen: set[int] = set()
    unique = []
    for v, m in mistakes:  # one hint per wrong count that two rules give for the same reason
        if v is None or v == expected or (v in seen and "activation" in m):
            continue
        seen.add(v)
        unique.append((v, m))
    _expect_int(got, expected, call, unique)


def _lesson7_config() -> dict[str, Any]:
    return dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                intermediate_size=128, vocab_size=512, dtype="float32")  # fmt: skip


@_uses_exercises_1_and_2
def check_predict_examples(predict_num_gpu_blocks: Any) -> None:
    """The tiny CPU model against a 512 MiB budget, Llama-3.1-8B on 80 GiB and 24 GiB GPUs (1 point)."""
    require_function(predict_num_gpu_blocks, "predict_num_gpu_blocks")
    llama = PUBLISHED["Llama-3.1-8B"]
    cases = [
        (_lesson7_config(), 558_400, 2048, 512 << 20, 0.92, 16, "auto"),
        (llama, 16_060_522_496, 8192, 80 * GiB, 0.92, 16, "auto"),
        (llama, 16_060_522_496, 8192, 24 * GiB, 0.92, 16, "fp8"),
        (PUBLISHED["Qwen3-0.6B"], 1_503_264_768, 4096, 24 * GiB, 0.9, 32, "auto"),
    ]
    for args in cases:
        _check_prediction(predict_num_gpu_blocks, args)


@_uses_exercises_1_and_2
def check_predict_hidden(predict_num_gpu_blocks: Any) -> None:
    """Random configs, budgets and dtypes (hidden, 1 point)."""
    require_function(predict_num_gpu_blocks, "predict_num_gpu_blocks")
    rng = random.Random(31337)
    done = 0
    while done < 60:
        config = random_config(rng)
        tokens = rng.choice([256, 1024, 2048, 8192])
        weights = rng.randrange(0, 4 * GiB)
        total = rng.choice([512 << 20, 8 * GiB, 24 * GiB, 80 * GiB])
        args = (config, weights, tokens, total, rng.choice([0.5, 0.9, 0.92]), rng.choice([8, 16, 32]),
                rng.choice(["auto", "fp8", "bf16"]))  # fmt: skip
        try:
            expected_prediction(*args)
        except ValueError:
            continue  # nothing left for the cache: not a case for this check
        _check_prediction(predict_num_gpu_blocks, args)
        done += 1
