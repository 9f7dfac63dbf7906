"""The sharded layers of Megatron-style tensor parallelism, built from a full model's layers.

A matrix multiply ``y = x W^T`` splits two ways across ``tp`` ranks:

- **column-parallel** (:class:`ColumnParallelLinear`): each rank holds some *output* features (rows of ``W``)
  and computes its slice of ``y`` from the whole ``x``: no communication. q, k, v, gate and up are split this
  way, so each rank holds whole attention heads and a slice of the MLP's intermediate features;
- **row-parallel** (:class:`RowParallelLinear`): each rank holds some *input* features (columns of ``W``),
  multiplies its slice of ``x`` and gets a partial sum of the whole ``y``: one all-reduce adds them. o and down
  are split this way, right after a column-parallel layer whose output slice is exactly their input slice.

So one decoder layer costs two all-reduces (after attention, after the MLP), and each rank's attention runs on
its own heads: its KV cache holds :func:`num_kv_heads_per_rank` heads. The embedding and the LM head split the
vocabulary (:class:`VocabParallelEmbedding`, :class:`ParallelLMHead`). Mirrors vLLM 0.26's
``vllm/model_executor/layers/linear.py`` (``ColumnParallelLinear``, ``RowParallelLinear``,
``QKVParallelLinear``) and ``vocab_parallel_embedding.py`` (``VocabParallelEmbedding``, ``ParallelLMHead``).
The lab slices a loaded model's weights; vLLM's ``weight_loader`` reads each rank's slice from the checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from pagedkv.distributed.parallel_state import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from pagedkv.utils import check_int


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """``numerator // denominator``, which must be exact (``ValueError`` naming ``what`` otherwise). Mirrors
    ``vllm/distributed/utils.py::divide``."""
    if denominator <= 0 or numerator % denominator:
        raise ValueError(f"{what or numerator} ({numerator}) is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


def _check_tp(tp_size: int, rank: int | None = None) -> None:
    check_int(tp_size, "tensor_parallel_size", 1)
    if rank is not None:
        check_int(rank, "rank", 0, tp_size - 1)


def num_kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: ``max(1, total_num_kv_heads // tp_size)``. When ``tp_size`` exceeds the KV
    heads every rank still needs one (its query heads read it), so each KV head is *replicated* on
    ``tp_size // total_num_kv_heads`` ranks. ``ValueError`` when the heads do not split evenly (vLLM's
    ``QKVParallelLinear`` asserts the same with ``divide``). Mirrors ``ModelConfig.get_num_kv_heads``
    (``vllm/config/model.py``)."""
    _check_tp(tp_size)
    check_int(total_num_kv_heads, "num_kv_heads", 1)
    if tp_size >= total_num_kv_heads:
        divide(tp_size, total_num_kv_heads, "tensor_parallel_size")  # each head on the same number of ranks
        return 1
    return divide(total_num_kv_heads, tp_size, "num_key_value_heads")


def kv_head_shard(total_num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank ``rank`` holds. Split evenly when there are at least as many heads as ranks; otherwise
    head ``rank // (tp_size // total_num_kv_heads)``, replicated on that many neighbouring ranks (which hold the
    query heads that read it). Mirrors ``QKVParallelLinear.weight_loader``'s
    ``shard_id = tp_rank // num_kv_head_replicas``."""
    _check_tp(tp_size, rank)
    n = num_kv_heads_per_rank(total_num_kv_heads, tp_size)
    if tp_size >= total_num_kv_heads:
        head = rank // (tp_size // total_num_kv_heads)
        return range(head, head + 1)
    return range(rank * n, (rank + 1) * n)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone().contiguous(), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """A linear layer holding the output features ``rows`` of a full one: ``y[..., rows] = x W[rows]^T + b[rows]``.
    The input is whole on every rank, the output stays split (``gather_output=False``, how vLLM's Llama uses it):
    no communication. Mirrors ``ColumnParallelLinear``."""

    def __init__(self, linear: nn.Linear, rows: range) -> None:
        super().__init__()
        if rows.step != 1 or not 0 <= rows.start < rows.stop <= linear.out_features:
            raise ValueError(f"rows {rows} are not a slice of the {linear.out_features} output features")
        self.rows = rows
        self.in_features, self.out_features = linear.in_features, len(rows)
        self.weight = _param(linear.weight[rows.start:rows.stop])  # [out_shard, in]
        self.bias = _param(None if linear.bias is None else linear.bias[rows.start:rows.stop])  # [out_shard]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out_shard]
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, rows={self.rows.start}:{self.rows.stop}, bias={self.bias is not None}"


class RowParallelLinear(nn.Module):
    """A linear layer holding the input features ``cols`` of a full one. Each rank multiplies its slice of the
    input (``input_is_parallel``: the previous column-parallel layer's output) and gets a *partial* sum of the
    whole output; :meth:`forward` all-reduces the partial sums. The bias is added once, by rank 0 before the
    all-reduce (vLLM: ``bias_ = None if self.tp_rank > 0``). Mirrors ``RowParallelLinear``."""

    def __init__(self, linear: nn.Linear, cols: range, rank: int) -> None:
        super().__init__()
        if cols.step != 1 or not 0 <= cols.start < cols.stop <= linear.in_features:
            raise ValueError(f"cols {cols} are not a slice of the {linear.in_features} input features")
        self.cols, self.rank = cols, rank
        self.in_features, self.out_features = len(cols), linear.out_features
        self.weight = _param(linear.weight[:, cols.start:cols.stop])  # [out, in_shard]
        self.bias = _param(linear.bias if rank == 0 else None)  # [out] on rank 0 only

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output (before the all-reduce): ``x_shard W[:, cols]^T`` (+ b on rank 0)."""
        return F.linear(x, self.weight, self.bias)  # x: [..., in_shard] -> [..., out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.forward_partial(x))

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"cols={self.cols.start}:{self.cols.stop}, out_features={self.out_features}, bias={bias}"


def vocab_range(vocab_size: int, tp_size: int, rank: int) -> range:
    """The token ids rank ``rank`` holds: contiguous ranges of ``ceil(vocab_size / tp_size)`` ids, the last
    possibly shorter (empty ranks padded). vLLM first pads the whole vocabulary to a multiple of 64
    (``pad_vocab_size``, ``DEFAULT_VOCAB_PADDING_SIZE``) and splits that into equal shares
    (``VocabParallelEmbedding.__init__``, ``vllm/model_executor/layers/vocab_parallel_embedding.py``); the lab pads
    only to equal shares, which the all-gather needs."""
    _check_tp(tp_size, rank)
    per = -(-vocab_size // tp_size)
    return range(min(rank * per, vocab_size), min((rank + 1) * per, vocab_size))


class VocabParallelEmbedding(nn.Module):
    """An embedding table holding the rows of its rank's token ids (:func:`vocab_range`), padded with zero rows
    to ``ceil(V / tp)``. A token held elsewhere looks up a zero vector here; the all-reduce then gives every rank
    each token's one real row (a sum of it and zeros: exact). Mirrors ``VocabParallelEmbedding``."""

    def __init__(self, weight: torch.Tensor, tp_size: int, rank: int) -> None:
        super().__init__()
        vocab, hidden = weight.shape  # weight: [V, H]
        self.org_vocab_size, self.tp_size = vocab, tp_size
        self.shard = vocab_range(vocab, tp_size, rank)
        per = -(-vocab // tp_size)
        rows = torch.zeros(per, hidden, dtype=weight.dtype, device=weight.device)  # [ceil(V/tp), H]
        rows[: len(self.shard)] = weight[self.shard.start:self.shard.stop]
        self.weight = nn.Parameter(rows, requires_grad=False)

    def forward_partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows for the ids it holds, zeros for the others: ``[..., H]``."""
        lo, hi = self.shard.start, self.shard.stop
        mine = (input_ids >= lo) & (input_ids < hi)
        out = F.embedding(torch.where(mine, input_ids - lo, 0), self.weight)
        return out.masked_fill(~mine[..., None], 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(self.forward_partial(input_ids))


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head split over the vocabulary like :class:`VocabParallelEmbedding` (the same shard when the
    embeddings are tied). :meth:`compute_logits` multiplies the sampled rows only and all-gathers the vocabulary
    slices, so every rank holds the full ``[S, V]`` logits. Mirrors ``ParallelLMHead`` and
    ``LogitsProcessor._gather_logits`` (``vllm/model_executor/layers/logits_processor.py``)."""

    def __init__(self, weight: torch.Tensor, tp_size: int, rank: int, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, tp_size, rank)
        self.bias = None
        if bias is not None:
            b = torch.zeros(self.weight.shape[0], dtype=bias.dtype, device=bias.device)
            b[: len(self.shard)] = bias[self.shard.start:self.shard.stop]
            self.bias = nn.Parameter(b, requires_grad=False)

    @classmethod
    def tied_to(cls, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """A head sharing ``embedding``'s shard (``tie_word_embeddings``)."""
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.org_vocab_size, head.tp_size, head.shard = embedding.org_vocab_size, embedding.tp_size, embedding.shard
        head.weight = embedding.weight
        head.bias = None
        return head

    def compute_logits_partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [S, H]`` times this rank's vocabulary rows: ``[S, ceil(V/tp)]``."""
        return F.linear(hidden, self.weight, self.bias)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full logits ``[S, V]`` on every rank: the partial slices all-gathered, the padding dropped."""
        return tensor_model_parallel_all_gather(self.compute_logits_partial(hidden), dim=-1)[:, : self.org_vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
