"""Sizing the pool of a hybrid model: groups, page-size unification, per-spec memory, concurrency.

Lesson 5's arithmetic (``num_blocks = available // page_size // num_layers``) assumes every layer keeps
every token. A hybrid model's sliding-window layers do not, and vLLM 0.26 sizes its pool with that in mind,
in ``vllm/v1/core/kv_cache_utils.py``:

1. ``get_kv_cache_groups``: layers with the same spec are gathered; when several specs remain, their page
   sizes are unified (``unify_kv_cache_spec_page_size``: a smaller page's block size is scaled up until its
   page costs as much as the largest) and each type is cut into groups of ``group_size`` layers, the smallest
   type's layer count (``_get_kv_cache_groups_uniform_page_size``; Gemma 3 27B: 10 full + 52 sliding layers
   give one full group and six sliding groups, the last ones short: "padding layers").
2. ``get_kv_cache_config_from_groups``: ``group_size`` tensors, each shared by one layer of every group, so a
   block id names one page in each of them: ``num_blocks = available // page_size // group_size``.
3. ``_max_memory_usage_bytes_from_groups`` (the start-up check) and ``get_max_concurrency_for_kv_cache_config``
   (the log line): a request of ``max_model_len`` tokens needs ``cdiv(max_memory_usage_bytes, page_size)``
   blocks per group, where a full-attention spec's ``max_memory_usage_bytes`` covers ``max_model_len`` and a
   sliding-window spec's only ``max_admission_blocks_per_request``: ``cdiv(min(window - 1 +
   max_in_flight_tokens, max_model_len), block_size) + 1`` blocks, ``max_in_flight_tokens`` being
   ``max_concurrent_batches · max_num_batched_tokens`` (``VllmConfig.max_in_flight_tokens``).
4. ``get_kv_cache_configs`` logs ``GPU KV cache size: N tokens`` (``N = int(max_concurrency ·
   max_model_len)``) and ``Maximum concurrency for M tokens per request: X.XXx``.

``--disable-hybrid-kv-cache-manager`` (``disable_hybrid_kv_cache_manager=True`` here) turns every sliding
spec into a ``FullAttentionSpec`` (``unify_hybrid_kv_cache_specs``): the window is still applied by the
kernel, but every block is kept. Comparing the two is how many more sequences the hybrid manager fits.

Lab differences: one worker (no pipeline-parallel projection), no Mamba, MLA, EAGLE or packed layouts; a
model is read from a transformers config (``layer_types``, ``sliding_window``) the way vLLM's model classes
decide which layers slide (``vllm/model_executor/models/llama.py``: ``layer_types``, else every layer with
``cache_config.sliding_window``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pagedkv.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from pagedkv.sizing.kv_cache_utils import resolve_kv_cache_dtype
from pagedkv.sizing.mem_utils import format_gib
from pagedkv.sizing.model import _config_get, model_shape
from pagedkv.utils import cdiv, check_int

__all__ = [
    "HYBRID_SHAPES",
    "capacity_table",
    "HybridSizing",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_groups",
    "get_kv_cache_spec",
    "get_max_concurrency_for_kv_cache_config",
    "hybrid_sizing",
    "layer_to_group",
    "make_kv_cache_config",
    "max_memory_usage_bytes_from_groups",
    "unify_kv_cache_spec_page_size",
]


def _alternating(n: int, period: int) -> list[str]:
    """``period - 1`` sliding layers, then one full layer, repeated over ``n`` layers."""
    return ["full_attention" if i % period == period - 1 else "sliding_attention" for i in range(n)]


#: The shapes of the hybrid and sliding models the lesson sizes, as in their published ``config.json``
#: (text part): what the KV cache depends on, nothing else.
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    "Gemma 3 27B": {
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "hidden_size": 5376, "sliding_window": 1024, "layer_types": _alternating(62, 6),
        "max_position_embeddings": 131072, "dtype": "bfloat16",
    },
    "gpt-oss-20b": {
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_size": 2880, "sliding_window": 128, "layer_types": _alternating(24, 2),
        "max_position_embeddings": 131072, "dtype": "bfloat16",
    },
    "gpt-oss-120b": {
        "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "hidden_size": 2880, "sliding_window": 128, "layer_types": _alternating(36, 2),
        "max_position_embeddings": 131072, "dtype": "bfloat16",
    },
    "Mistral 7B v0.1": {
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 4096, "sliding_window": 4096, "max_position_embeddings": 32768, "dtype": "bfloat16",
    },
}  # fmt: skip


def layer_is_sliding(config: Any) -> list[bool]:
    """Which decoder layers use a sliding window: ``layer_types[i] == "sliding_attention"`` when the config
    lists them (Gemma 3, gpt-oss, Qwen2/3, OLMo 3), else every layer when ``sliding_window`` is set and not
    switched off by ``use_sliding_window=False`` (Mistral), else none."""
    shape = model_shape(config)
    text = _config_get(config, "text_config")
    if text is not None and _config_get(config, "num_hidden_layers") is None:
        config = text
    window = _config_get(config, "sliding_window")
    layer_types = _config_get(config, "layer_types")
    if layer_types is not None:
        if len(layer_types) != shape.num_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries for {shape.num_layers} layers")
        sliding = [t == "sliding_attention" for t in layer_types]
        if any(sliding) and window is None:
            raise ValueError("config.layer_types names sliding layers but config.sliding_window is not set")
        return sliding
    if window is None or _config_get(config, "use_sliding_window", True) is False:
        return [False] * shape.num_layers
    return [True] * shape.num_layers


def get_kv_cache_spec(
    config: Any, block_size: int = 16, kv_cache_dtype: str | torch.dtype = "auto"
) -> dict[str, KVCacheSpec]:
    """Each attention layer's spec, by layer name (``model.layers.{i}.self_attn.attn``): a
    ``SlidingWindowSpec`` for a sliding layer, a ``FullAttentionSpec`` otherwise. Mirrors what
    ``GPUModelRunner.get_kv_cache_spec`` collects from each ``Attention`` layer's ``get_kv_cache_spec``."""
    block_size = check_int(block_size, "block_size", 1)
    shape = model_shape(config)
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, shape.dtype)
    text = _config_get(config, "text_config")
    src = text if text is not None and _config_get(config, "num_hidden_layers") is None else config
    window = _config_get(src, "sliding_window")
    specs: dict[str, KVCacheSpec] = {}
    for i, sliding in enumerate(layer_is_sliding(config)):
        common = {"block_size": block_size, "num_kv_heads": shape.num_kv_heads, "head_size": shape.head_dim}
        name = f"model.layers.{i}.self_attn.attn"
        if sliding:
            specs[name] = SlidingWindowSpec(sliding_window=int(window), dtype=dtype, **common)
        else:
            specs[name] = FullAttentionSpec(dtype=dtype, **common)
    return specs


def unify_kv_cache_spec_page_size(kv_cache_spec: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give every layer the largest page size by scaling up the block size of layers with smaller pages (a
    page half as large gets twice the tokens per block). ``NotImplementedError`` when a page size does not
    divide the largest (vLLM pads such pages only for backends that index by block stride). Mirrors
    ``unify_kv_cache_spec_page_size``."""
    page_sizes = {s.page_size_bytes for s in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return kv_cache_spec
    max_page = max(page_sizes)
    out: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_spec.items():
        if spec.page_size_bytes == max_page:
            out[name] = spec
        elif max_page % spec.page_size_bytes == 0:
            out[name] = replace(spec, block_size=spec.block_size * (max_page // spec.page_size_bytes))
        else:
            raise NotImplementedError(
                f"layer {name}: page size {spec.page_size_bytes} does not divide the largest, {max_page}"
            )
    return out


def _to_full(spec: KVCacheSpec) -> KVCacheSpec:
    """``unify_hybrid_kv_cache_specs``: a sliding layer becomes full attention that remembers its window."""
    if isinstance(spec, SlidingWindowSpec):
        return FullAttentionSpec(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_size,
            dtype=spec.dtype, sliding_window=spec.sliding_window, page_size_padded=spec.page_size_padded,
        )  # fmt: skip
    return spec


def _same_spec_key(spec: KVCacheSpec) -> Any:
    """Specs that merge into one group: a ``FullAttentionSpec`` with and without a window is one type
    (``is_kv_cache_spec_uniform``)."""
    if isinstance(spec, FullAttentionSpec):
        return replace(spec, sliding_window=None)
    return spec


@dataclass
class GroupingResult:
    """The groups, and the padding vLLM warns about ("Add N padding layers, may waste at most P% ...")."""

    groups: list[KVCacheGroupSpec]
    warnings: list[str] = field(default_factory=list)


def get_kv_cache_groups(
    kv_cache_spec: dict[str, KVCacheSpec], disable_hybrid_kv_cache_manager: bool = False
) -> GroupingResult:
    """Split the layers into KV cache groups of one spec and (with several specs) ``group_size`` layers.

    One spec (or only full attention, some with windows): one group of every layer. Otherwise page sizes are
    unified and each spec's layers are dealt round-robin (``layers[i::num_groups]``) into
    ``cdiv(len, group_size)`` groups, ``group_size`` being the smallest spec's layer count (or the largest,
    when that is under 1.5 times the smallest). Mirrors ``get_kv_cache_groups`` and
    ``_get_kv_cache_groups_uniform_page_size``."""
    specs = dict(kv_cache_spec)
    if disable_hybrid_kv_cache_manager and any(isinstance(s, FullAttentionSpec) for s in specs.values()):
        specs = {name: _to_full(s) for name, s in specs.items()}
    keys = {_same_spec_key(s) for s in specs.values()}
    if len(keys) == 1:
        first = next(iter(specs.values()))
        windows = {s.sliding_window for s in specs.values() if isinstance(s, FullAttentionSpec) and s.sliding_window}
        merged = (
            replace(first, sliding_window=windows.pop()) if windows and isinstance(first, FullAttentionSpec) else first
        )
        return GroupingResult([KVCacheGroupSpec(list(specs), merged)])
    specs = unify_kv_cache_spec_page_size(specs)
    same_type: dict[KVCacheSpec, list[str]] = defaultdict(list)
    for name, spec in specs.items():
        same_type[spec].append(name)
    sizes = [len(v) for v in same_type.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups: list[KVCacheGroupSpec] = []
    warnings: list[str] = []
    for spec, layers in same_type.items():
        padding = group_size - len(layers) % group_size
        if padding != group_size:
            warnings.append(
                f"Add {padding} padding layers, may waste at most {padding / len(layers) * 100:.2f}% KV cache memory"
            )
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroupSpec(layers[i::num_groups], spec))
    return GroupingResult(groups, warnings)


def _uniform_page_size(groups: list[KVCacheGroupSpec]) -> int:
    sizes = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"the groups' page sizes differ: {sorted(sizes)}")
    return sizes.pop()


def get_kv_cache_config_from_groups(groups: list[KVCacheGroupSpec], available_memory: int) -> KVCacheConfig:
    """``group_size`` tensors of ``page_size · num_blocks`` bytes, tensor ``i`` shared by layer ``i`` of every
    group; ``num_blocks = available_memory // page_size // group_size``. Mirrors
    ``get_kv_cache_config_from_groups`` (its general case) and ``get_num_blocks``."""
    group_size = max(len(g.layer_names) for g in groups)
    num_blocks = max(0, int(available_memory // _uniform_page_size(groups) // group_size))
    return _config_with_tensors(groups, max(num_blocks, 1))


def _config_with_tensors(groups: list[KVCacheGroupSpec], num_blocks: int) -> KVCacheConfig:
    """``num_blocks`` blocks, and ``group_size`` tensors, tensor ``i`` shared by layer ``i`` of every group."""
    page_size = _uniform_page_size(groups)
    group_size = max(len(g.layer_names) for g in groups)
    tensors = [
        KVCacheTensor(page_size * num_blocks, [g.layer_names[i] for g in groups if i < len(g.layer_names)])
        for i in range(group_size)
    ]
    return KVCacheConfig(num_blocks, tensors, groups)


def max_memory_usage_bytes_from_groups(
    groups: list[KVCacheGroupSpec], max_model_len: int, max_in_flight_tokens: int
) -> int:
    """Bytes one request of ``max_model_len`` tokens can hold: ``group_size · page_size · Σ_groups
    cdiv(spec.max_memory_usage_bytes, page_size)``. What the start-up check compares with the available
    memory. Mirrors ``_max_memory_usage_bytes_from_groups``."""
    group_size = max(len(g.layer_names) for g in groups)
    page_size = _uniform_page_size(groups)
    blocks = sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_in_flight_tokens), page_size) for g in groups
    )
    return group_size * page_size * blocks


def get_max_concurrency_for_kv_cache_config(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int
) -> float:
    """Requests of ``max_model_len`` tokens the pool holds at once: ``num_blocks / cdiv(group_size ·
    Σ max_memory_usage_bytes, page_size · group_size)`` (the null block counted, as vLLM does). Mirrors
    ``get_max_concurrency_for_kv_cache_config``."""
    groups = kv_cache_config.kv_cache_groups
    n = max(len(g.layer_names) for g in groups)
    per_request = n * sum(g.kv_cache_spec.max_memory_usage_bytes(max_model_len, max_in_flight_tokens) for g in groups)
    per_block = groups[0].kv_cache_spec.page_size_bytes * n
    return kv_cache_config.num_blocks / cdiv(per_request, per_block)


@dataclass
class HybridSizing:
    """What vLLM 0.26 decides at start-up for one model and memory budget (:func:`hybrid_sizing`). The pool's
    block count is ``kv_cache_config.num_blocks``, under vLLM's name (``KVCacheConfig.num_blocks``,
    ``vllm/v1/kv_cache_interface.py``), with no second name here."""

    kv_cache_config: KVCacheConfig
    group_size: int
    page_size_bytes: int
    blocks_per_request: list[int]  # per group, for one request of max_model_len tokens
    max_concurrency: float
    num_tokens: int  # "GPU KV cache size: N tokens"
    log_lines: list[str]


def hybrid_sizing(
    config: Any,
    available_memory: int,
    *,
    max_model_len: int | None = None,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    max_num_batched_tokens: int = 8192,
    max_concurrent_batches: int = 2,
    disable_hybrid_kv_cache_manager: bool = False,
    every_layer_full: bool = False,
) -> HybridSizing:
    """Group a model's layers, size its pool from ``available_memory`` bytes of KV cache, and compute what
    vLLM 0.26 logs: ``get_kv_cache_groups``, ``check_enough_kv_cache_memory`` (``ValueError`` when one
    request of ``max_model_len`` does not fit), ``get_kv_cache_config_from_groups`` and
    ``get_kv_cache_capacity``. The defaults are ``vllm serve``'s on a GPU of 70 GiB or more (``arg_utils.py``:
    ``max_num_batched_tokens`` 8192; async scheduling with one pipeline stage: ``max_concurrent_batches`` 2,
    ``VllmConfig.max_concurrent_batches``, ``pp_size + 1`` on Model Runner V2 -- what a sliding-window model that
    is not MoE runs, Gemma 3 -- and 2 on the V1 runner, which MoE models such as gpt-oss run);
    ``max_model_len`` defaults to ``max_position_embeddings``.

    ``every_layer_full`` (the lab's what-if, no vLLM flag) sizes the same shape as if no layer had a window:
    the baseline of "how many more sequences fit". For a model with full and sliding layers it is what
    ``disable_hybrid_kv_cache_manager`` gives; for an all-sliding model (Mistral) that flag changes nothing,
    and vLLM's ``disable_sliding_window`` would also cap ``max_model_len`` to the window."""
    shape = model_shape(config)
    max_model_len = check_int(max_model_len or shape.max_position_embeddings, "max_model_len", 1)
    in_flight = check_int(max_concurrent_batches, "max_concurrent_batches", 1) * check_int(
        max_num_batched_tokens, "max_num_batched_tokens", 1
    )
    specs = get_kv_cache_spec(config, block_size, kv_cache_dtype)
    if every_layer_full:
        specs = {name: _to_full(s) for name, s in specs.items()}
    grouping = get_kv_cache_groups(specs, disable_hybrid_kv_cache_manager)
    groups = grouping.groups
    needed = max_memory_usage_bytes_from_groups(groups, max_model_len, in_flight)
    if needed > available_memory:
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), "
            f"{format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({format_gib(available_memory)} GiB)."
        )
    kv_config = get_kv_cache_config_from_groups(groups, available_memory)
    concurrency = get_max_concurrency_for_kv_cache_config(kv_config, max_model_len, in_flight)
    page = _uniform_page_size(groups)
    per_group = [cdiv(g.kv_cache_spec.max_memory_usage_bytes(max_model_len, in_flight), page) for g in groups]
    num_tokens = int(concurrency * max_model_len)
    lines = [f"WARNING {w}" for w in grouping.warnings] + [
        f"INFO GPU KV cache size: {num_tokens:,} tokens",
        f"INFO Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x",
    ]
    return HybridSizing(
        kv_cache_config=kv_config,
        group_size=max(len(g.layer_names) for g in groups),
        page_size_bytes=page,
        blocks_per_request=per_group,
        max_concurrency=concurrency,
        num_tokens=num_tokens,
        log_lines=lines,
    )


def capacity_table(
    available_memory: int,
    max_model_lens: tuple[int, ...] = (4096, 32768, 131072),
    shapes: dict[str, dict[str, Any]] | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """For each model of ``shapes`` (default :data:`HYBRID_SHAPES`) and each context length it supports: the
    KV cache groups, the blocks, the concurrency vLLM 0.26 logs, the same with every layer full attention, and
    the gain (how many times more sequences fit). ``kwargs`` go to :func:`hybrid_sizing` (block size,
    batching). A length whose single request does not fit is left out."""
    rows = []
    for name, cfg in (HYBRID_SHAPES if shapes is None else shapes).items():
        for m in max_model_lens:
            if m > cfg.get("max_position_embeddings", m):
                continue
            try:
                h = hybrid_sizing(cfg, available_memory, max_model_len=m, **kwargs)
                f = hybrid_sizing(cfg, available_memory, max_model_len=m, every_layer_full=True, **kwargs)
            except ValueError:
                continue
            rows.append({
                "model": name,
                "max_model_len": m,
                "groups": len(h.kv_cache_config.kv_cache_groups),
                "group_size": h.group_size,
                "num_blocks": h.kv_cache_config.num_blocks,
                "concurrency": h.max_concurrency,
                "concurrency_all_full": f.max_concurrency,
                "gain": h.max_concurrency / f.max_concurrency,
                "log_lines": h.log_lines,
            })  # fmt: skip
    return rows


def make_kv_cache_config(
    config: Any,
    num_blocks: int,
    *,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    disable_hybrid_kv_cache_manager: bool = False,
) -> KVCacheConfig:
    """A ``KVCacheConfig`` of ``num_blocks`` blocks for a transformers ``config``, grouped as vLLM 0.26 groups
    it (``get_kv_cache_spec`` then ``get_kv_cache_groups``): what an engine gives ``KVCacheManager(kv_cache_config,
    max_model_len=...)`` when it chose ``num_blocks`` itself (vLLM's ``num_gpu_blocks_override``). Layer ``i``
    is named ``model.layers.{i}.self_attn.attn``; :func:`layer_to_group` says which group holds it. One group
    for a model of one attention type. Different page sizes are unified by scaling block sizes, which the
    lab's manager refuses (``ValueError``): give such a model one head size, or
    ``disable_hybrid_kv_cache_manager``."""
    grouping = get_kv_cache_groups(
        get_kv_cache_spec(config, block_size, kv_cache_dtype), disable_hybrid_kv_cache_manager
    )
    return _config_with_tensors(grouping.groups, check_int(num_blocks, "num_blocks", 1))


def layer_to_group(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    """Layer name → the index of its KV cache group (the block table its attention reads)."""
    return {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}


def describe_groups(groups: list[KVCacheGroupSpec]) -> list[str]:
    """One line per group: its type, window, block size and layer count (for a lesson's table)."""
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = f"sliding window {spec.sliding_window}" if isinstance(spec, SlidingWindowSpec) else "full attention"
        assert isinstance(spec, AttentionSpec)
        out.append(f"group {i}: {kind}, block_size {spec.block_size}, {len(g.layer_names)} layers")
    return out
