"""Tensor parallelism on ``torch.distributed`` (lesson 10): the process group, the sharded layers, and the
per-rank arithmetic of the paged cache.

Named as vLLM 0.26's ``vllm/distributed/`` (``parallel_state.py``, ``communication_op.py``) and
``vllm/model_executor/layers/`` (``linear.py``, ``vocab_parallel_embedding.py``).
"""

from pagedkv.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_head_shard,
    num_kv_heads_per_rank,
)
from pagedkv.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "kv_head_shard",
    "num_kv_heads_per_rank",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
