"""Lesson 5's arithmetic on one tensor-parallel rank: its share of the weights, its pages, its blocks.

Under tensor parallelism every rank sizes its own pool (``gpu_worker.determine_available_memory`` runs on each
worker) from its own memory and its own shard:

- the weights: each rank holds ``1/tp`` of every sharded matrix (q, k, v, o, gate, up, down, the embedding and
  the LM head split over the vocabulary) and a whole copy of the norms, and of a KV projection whose heads are
  replicated when ``tp > num_kv_heads``;
- the page: one block in one layer holds the rank's ``num_kv_heads_per_rank = max(1, num_kv_heads // tp)``
  heads (``ModelConfig.get_num_kv_heads``), so a block costs ``1/tp`` of its one-GPU bytes until ``tp`` passes the
  KV heads, and no less after that: the heads are replicated. An MLA model (DeepSeek-V2/V3) caches one latent
  vector per token (``kv_lora_rank + qk_rope_head_dim`` values, no separate K and V: ``MLAAttentionSpec``) that
  every rank needs whole: ``get_num_kv_heads`` returns 1 for MLA, so the latent cache is replicated on every rank
  and a rank's page does not shrink with ``tp`` at all;
- then ``num_blocks = available // page // num_layers`` per rank, and the engine's pool is the minimum over the
  ranks (``kv_cache_utils.get_kv_cache_configs``: "change the num_blocks of each rank to the smallest among all
  ranks"), since one scheduler hands out block ids that must exist on every rank.

Mirrors vLLM 0.26's per-worker sizing (``vllm/v1/worker/gpu_worker.py``, ``vllm/v1/core/kv_cache_utils.py``).
Analytic, like lesson 5's :func:`~pagedkv.sizing.analytic_profile`: no GPU needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.distributed.layers import _check_tp, divide, num_kv_heads_per_rank
from pagedkv.sizing import (
    ModelShape,
    estimate_peak_activation,
    kv_page_bytes,
    max_concurrency,
    model_shape,
    num_gpu_blocks,
    resolve_kv_cache_dtype,
    weights_bytes,
)
from pagedkv.sizing.kv_cache_utils import NoKVCacheMemoryError, _check_utilization, _memory_figure, request_memory
from pagedkv.utils import check_int


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


def is_mla(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the config has a ``kv_lora_rank``. vLLM's
    ``ModelConfig.use_mla`` reads the same field (``is_deepseek_mla``)."""
    return _get(config, "kv_lora_rank") is not None


def mla_head_size(config: Any) -> int:
    """The latent vector cached per token and layer: ``kv_lora_rank + qk_rope_head_dim`` (576 for DeepSeek-V3),
    ``ModelArchConfigConvertor.get_head_size`` for an MLA model."""
    rope = _get(config, "qk_rope_head_dim")
    return (check_int(_get(config, "kv_lora_rank"), "config.kv_lora_rank", 1)
            + (0 if rope is None else check_int(rope, "config.qk_rope_head_dim", 0)))


def rank_shape(config: Any, tp_size: int) -> ModelShape:
    """The shape of one rank's shard of a dense (non-MLA) model: ``num_attention_heads / tp`` query heads,
    :func:`~pagedkv.distributed.layers.num_kv_heads_per_rank` KV heads, ``intermediate_size / tp``,
    ``ceil(vocab / tp)`` embedding rows; the hidden size and the layers whole. ``ValueError`` when the model does
    not split over ``tp_size`` ranks."""
    _check_tp(tp_size)
    s = model_shape(config)
    return dataclasses.replace(
        s,
        num_attention_heads=divide(s.num_attention_heads, tp_size, "num_attention_heads"),
        num_kv_heads=num_kv_heads_per_rank(s.num_kv_heads, tp_size),
        intermediate_size=divide(s.intermediate_size, tp_size, "intermediate_size"),
        vocab_size=-(-s.vocab_size // tp_size),
    )


def kv_page_bytes_per_rank(config: Any, tp_size: int, block_size: int = 16,
                           kv_cache_dtype: str | torch.dtype = "auto") -> int:
    """Bytes one block takes in one layer on one rank: ``2 · block_size · kv_heads_per_rank · head_dim · bytes``
    for a dense model; ``block_size · (kv_lora_rank + qk_rope_head_dim) · bytes`` for MLA, whatever ``tp``
    (``MLAAttentionSpec.real_page_size_bytes``, one latent, no K/V pair, on every rank)."""
    _check_tp(tp_size)
    block_size = check_int(block_size, "block_size", 1)
    if is_mla(config):
        dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_shape_dtype(config))
        return block_size * mla_head_size(config) * dtype.itemsize
    return kv_page_bytes(rank_shape(config, tp_size), block_size, kv_cache_dtype)


def model_shape_dtype(config: Any) -> torch.dtype:
    """The config's dtype (``torch_dtype`` / ``dtype``), float32 when it names none."""
    from pagedkv.sizing.model import _config_dtype

    return _config_dtype(config)


@dataclass(frozen=True)
class RankSizing:
    """One rank's pool at ``tp`` ranks: lesson 5's figures for its shard (bytes unless named otherwise)."""

    tp: int
    kv_heads_per_rank: int  # for MLA: 1 (the latent)
    kv_head_replicas: int  # ranks holding each KV head (1: split, tp: MLA's latent on all)
    page_bytes: int  # one block, one layer, one rank
    weights_memory: int
    peak_activation_memory: int
    requested_memory: int
    num_layers: int
    block_size: int
    num_blocks: int  # 0 when the weights and activations do not fit
    max_model_len: int

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes on this rank, all layers."""
        return self.page_bytes * self.num_layers // self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens the pool holds (every rank holds a slice of each one)."""
        return max_concurrency(self.num_blocks, self.block_size, self.max_model_len)


def rank_sizing(
    config: Any,
    tp_size: int,
    *,
    total_memory: int,
    gpu_memory_utilization: float = 0.92,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    max_num_batched_tokens: int = 8192,
    max_model_len: int | None = None,
    weights_memory: int | None = None,
    weight_bits: float | None = None,
    peak_activation_memory: int | None = None,
    non_torch_memory: int = 0,
) -> RankSizing:
    """One rank's share of a ``total_memory`` GPU at ``tp_size`` ranks, computed.

    ``weights_memory`` (bytes on one rank) defaults to the parameters of :func:`rank_shape` at ``weight_bits``
    each (default: the config's dtype); pass it for a model :func:`~pagedkv.sizing.num_parameters` does not count
    (MLA and mixture-of-experts models, such as DeepSeek-V3). ``peak_activation_memory`` defaults to
    :func:`~pagedkv.sizing.estimate_peak_activation` of the rank's shard. Then ``num_gpu_blocks``' arithmetic;
    ``num_blocks`` is 0 when nothing is left (at ``tp=1`` a 70B model's weights exceed an 80 GiB GPU).
    Pure: changes nothing."""
    _check_tp(tp_size)
    mla = is_mla(config)
    full = None if mla else model_shape(config)
    shard = None if mla else rank_shape(config, tp_size)
    num_layers = check_int(_get(config, "num_hidden_layers"), "config.num_hidden_layers", 1)
    if max_model_len is None:
        max_pos = _get(config, "max_position_embeddings")
        max_model_len = 2048 if max_pos is None else max_pos
    max_model_len = check_int(max_model_len, "max_model_len", 1)
    page = kv_page_bytes_per_rank(config, tp_size, block_size, kv_cache_dtype)
    # Every figure checked here, so that only "nothing is left for the cache" gives num_blocks = 0 below (a bad
    # utilization or a negative figure is an error, not a model that does not fit).
    total_memory = _memory_figure(total_memory, "total_memory")
    gpu_memory_utilization = _check_utilization(gpu_memory_utilization)
    non_torch_memory = _memory_figure(non_torch_memory, "non_torch_memory")
    if weights_memory is not None:
        weights_memory = _memory_figure(weights_memory, "weights_memory")
    if peak_activation_memory is not None:
        peak_activation_memory = _memory_figure(peak_activation_memory, "peak_activation_memory")
    if weights_memory is None:
        if mla:
            raise ValueError("pass weights_memory for an MLA model (num_parameters counts Llama-style layers only)")
        weights_memory = weights_bytes(shard, weight_bits)
    if peak_activation_memory is None:
        if mla:
            raise ValueError("pass peak_activation_memory for an MLA model")
        peak_activation_memory = estimate_peak_activation(shard, max_num_batched_tokens)
    requested = request_memory(total_memory, gpu_memory_utilization)  # reported in the row
    try:
        blocks = num_gpu_blocks(total_memory, gpu_memory_utilization, weights_memory, peak_activation_memory,
                                non_torch_memory, 0, page, num_layers)
    except NoKVCacheMemoryError:
        blocks = 0  # the weights do not fit this split: a row of the table, not an error
    kv_heads = 1 if mla else shard.num_kv_heads
    replicas = tp_size if mla else max(1, tp_size // full.num_kv_heads)
    return RankSizing(tp_size, kv_heads, replicas, page, int(weights_memory), int(peak_activation_memory),
                      requested, num_layers, block_size, blocks, max_model_len)


def unify_num_blocks(per_rank_blocks: Sequence[int]) -> int:
    """The pool's block count: the smallest any rank can hold (every block id the scheduler hands out must
    exist on every rank). Mirrors the last step of ``get_kv_cache_configs`` (``vllm/v1/core/kv_cache_utils.py``,
    which once lived in ``unify_kv_cache_configs``). ``ValueError`` on an empty list or a count below 0."""
    iterable = not isinstance(per_rank_blocks, (str, bytes)) and isinstance(per_rank_blocks, Iterable)
    counts = list(per_rank_blocks) if iterable else []
    if not counts:
        raise ValueError(f"give each rank's block count (ints >= 0), got {per_rank_blocks!r}")
    for c in counts:
        check_int(c, "each rank's block count", 0)
    return min(counts)


#: Configs of the lesson's examples, from their published ``config.json`` (only the fields sizing reads).
LLAMA_3_1_70B: dict[str, Any] = dict(
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
    intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072, torch_dtype="bfloat16",
    tie_word_embeddings=False,
)
QWEN2_5_1_5B: dict[str, Any] = dict(  # 2 KV heads: replicated at tp 4
    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, hidden_size=1536,
    intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, torch_dtype="bfloat16",
    tie_word_embeddings=True,
)
DEEPSEEK_V3: dict[str, Any] = dict(  # MLA: one 576-wide latent per token and layer
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, hidden_size=7168,
    intermediate_size=18432, vocab_size=129280, max_position_embeddings=163840, torch_dtype="bfloat16",
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536,
)
