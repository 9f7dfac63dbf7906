"""Shard a loaded transformers decoder (Llama, Qwen2, Mistral) for one tensor-parallel rank, in place.

Every decoder layer's attention keeps its own query heads ``rank·Hq/tp ...`` and the KV heads they read
(:func:`~pagedkv.distributed.layers.kv_head_shard`; replicated when ``tp > Hkv``), its MLP a slice of the
intermediate features; o and down become row-parallel (an all-reduce each); the embedding and the LM head split
the vocabulary. Norms and rotary embeddings stay whole on every rank. The model's config is then made to describe
the rank's shard (``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size`` per rank; the hidden
size and vocabulary stay whole), so code that sizes a KV cache from it (the model runner) allocates one rank's
``[num_blocks, block_size, kv_heads_per_rank, head_dim]``. vLLM builds the sharded model directly
(``vllm/model_executor/models/llama.py``: ``LlamaAttention`` with ``QKVParallelLinear`` and
``RowParallelLinear``, ``LlamaMLP`` with ``MergedColumnParallelLinear``).
"""

from __future__ import annotations

from torch import nn

from pagedkv.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    _check_tp,
    divide,
    kv_head_shard,
    num_kv_heads_per_rank,
)

#: The module names :func:`shard_model` expects in each decoder layer (transformers' Llama family).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _heads(config) -> tuple[int, int, int]:
    hq = config.num_attention_heads
    hkv = getattr(config, "num_key_value_heads", None) or hq
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    return hq, hkv, head_dim


def check_shardable(config, tp_size: int) -> None:
    """``ValueError`` unless ``config``'s heads and MLP split over ``tp_size`` ranks: query heads and the
    intermediate size divisible by it, KV heads divisible by it or dividing it. Checks, changes nothing."""
    _check_tp(tp_size)
    hq, hkv, _ = _heads(config)
    divide(hq, tp_size, "num_attention_heads")
    num_kv_heads_per_rank(hkv, tp_size)
    divide(config.intermediate_size, tp_size, "intermediate_size")


def shard_model(model: nn.Module, tp_size: int, rank: int) -> nn.Module:
    """Replace ``model``'s projections, embedding and LM head by rank ``rank``'s shards (in place) and return
    it. ``tp_size == 1`` shards nothing. ``ValueError`` before anything changes when the model does not split
    (:func:`check_shardable`) or its layers are not the Llama family's."""
    config = model.config
    check_shardable(config, tp_size)
    _check_tp(tp_size, rank)
    decoder = model.base_model
    for layer in decoder.layers:
        for owner, names in ((layer.self_attn, ATTENTION_PROJECTIONS), (layer.mlp, MLP_PROJECTIONS)):
            if not all(isinstance(getattr(owner, n, None), nn.Linear) for n in names):
                raise ValueError(f"tensor parallelism shards layers with {', '.join(names)} (nn.Linear each); "
                                 f"{type(owner).__name__} has other modules")
    if tp_size == 1:
        return model
    hq, hkv, head_dim = _heads(config)
    q_per_rank = hq // tp_size
    kv_heads = kv_head_shard(hkv, tp_size, rank)
    q_rows = range(rank * q_per_rank * head_dim, (rank + 1) * q_per_rank * head_dim)
    kv_rows = range(kv_heads.start * head_dim, kv_heads.stop * head_dim)
    inter = config.intermediate_size // tp_size
    mlp_rows = range(rank * inter, (rank + 1) * inter)
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj, q_rows)  # [Hq/tp · D, H]
        attn.k_proj = ColumnParallelLinear(attn.k_proj, kv_rows)  # [Hkv_rank · D, H]
        attn.v_proj = ColumnParallelLinear(attn.v_proj, kv_rows)
        attn.o_proj = RowParallelLinear(attn.o_proj, q_rows, rank)  # [H, Hq/tp · D], then all-reduce
        attn.num_key_value_groups = q_per_rank // len(kv_heads)  # transformers' eager/SDPA paths read it
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, mlp_rows)  # [I/tp, H]
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, mlp_rows)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, mlp_rows, rank)  # [H, I/tp], then all-reduce
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    embed = VocabParallelEmbedding(model.get_input_embeddings().weight.data, tp_size, rank)
    decoder.embed_tokens = embed
    model.lm_head = ParallelLMHead.tied_to(embed) if tied else ParallelLMHead(
        head.weight.data, tp_size, rank, None if head.bias is None else head.bias.data)
    config.head_dim = head_dim
    config.num_attention_heads = q_per_rank
    config.num_key_value_heads = len(kv_heads)
    config.intermediate_size = inter
    config.tensor_parallel = (tp_size, rank)  # the lab's mark: this config describes one rank's shard
    return model
