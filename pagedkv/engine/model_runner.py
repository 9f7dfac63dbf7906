"""The model runner: one scheduler step in, one forward pass over the paged cache, sampled tokens out.

Lesson 4's simulator stood in for this. The runner owns the KV cache tensors (two per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]``, plus a CPU copy of that shape for swapped-out
blocks), a state per request (its slot, the tokens it was admitted with, its sampling parameters), the block
tables on the device, and the last sampled token of every request on the device. Each step
(:meth:`ModelRunner.execute_model`, reached through the engine's executor):

1. updates its states from the scheduler output: finished and preempted requests are forgotten, new and resumed
   ones added with their whole block table, running ones get their new block ids appended on the device
   (:class:`~pagedkv.engine.block_table.BlockTables`);
2. performs the step's block moves on the real tensors, in order: ``blocks_to_swap_out`` (GPU → CPU),
   ``blocks_to_swap_in`` (CPU → GPU), ``blocks_to_copy`` (copy-on-write, GPU → GPU);
3. builds the packed batch on the device (:meth:`ModelRunner.prepare_inputs`): input ids (a decode's input is
   the runner's own last sample, read on the device, so the host need not know it yet), positions, slot mapping
   (a Triton kernel on CUDA, :func:`pagedkv.kernels.compute_slot_mappings`), block tables, sequence lengths;
4. runs the decoder on it once (:func:`make_decoder`): for the Llama family on a CPU the lab's own
   (:class:`~pagedkv.engine.llama.LlamaDecoder`: fused q/k/v and gate/up products over the flattened tokens, as
   vLLM's ``llama.py``), for other models transformers' own (``model.base_model``, attention set to
   ``"pagedkv"``, :mod:`pagedkv.engine.attention`); both call the same paged attention with the step's metadata;
5. applies the LM head to the last scheduled token of each request whose chunk reached its end, and to no
   other row (``compute_logits``), samples, and returns the samples without waiting for the device
   (:class:`AsyncModelRunnerOutput`).

Decode-only steps on CUDA replay a CUDA graph captured for the next batch-size bucket (:class:`CUDAGraphRunner`).
:func:`prepare_inputs` is the same flattening in plain Python lists (exercise 07); the device path is tested
against it.

Mirrors vLLM 0.26's Model Runner V2, the runner it builds for dense models (``VllmConfig.use_v2_model_runner``,
``vllm/config/vllm.py``; ``vllm/v1/worker/gpu/model_runner.py``: ``GPUModelRunner``), piece by piece:

============================  =========================================================================
lab (``pagedkv/engine/``)     vLLM 0.26 (``vllm/v1/worker/gpu/``)
============================  =========================================================================
``ModelRunner.execute_model`` ``model_runner.py``: ``execute_model`` + ``sample_tokens``
``finish/add/update_requests`` ``model_runner.py``: ``finish_requests``, ``add_requests``,
                              ``update_requests``
``CachedRequestState``        ``states.py``: ``RequestState`` (``prefill_token_ids``)
``BlockTables``               ``block_table.py``: ``BlockTables`` (``append_block_ids``,
                              ``gather_block_tables``, ``compute_slot_mappings``)
``compute_slot_mappings``     ``block_table.py``: ``_compute_slot_mappings_kernel`` (Triton)
``InputBatch``                ``input_batch.py``: ``InputBatch``
``prepare_inputs``            ``model_runner.py``: ``prepare_inputs`` (``prepare_prefill_inputs``,
                              ``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``)
``last_sampled_tokens``       ``states.py``: ``RequestState.last_sampled_tokens``
``make_decoder``              ``ModelConfig.model_impl`` (``vllm/config/model.py``): vLLM's model or Transformers'
``compute_logits``            ``model_runner.py``: logits for every request (``total_num_logits = num_reqs``)
``Sampler``                   ``sample/sampler.py``: ``Sampler`` (Gumbel noise from a seed and position)
``BadWordsState``             ``sample/bad_words.py``: ``BadWordsState`` (the lab keeps each request's last
                              outputs, not the whole token table)
``PromptLogprobsWorker``      ``sample/prompt_logprob.py``: ``PromptLogprobsWorker`` (a step with prompt rows
                              runs without a CUDA graph)
``AsyncModelRunnerOutput``    ``async_utils.py``: ``AsyncOutput``
``CUDAGraphRunner``           ``cudagraph_utils.py``: ``CudaGraphManager`` (captured after the KV cache)
============================  =========================================================================

Where the lab differs on purpose: the batch keeps the scheduling order (V2 sorts it, ``sort_batch_req_ids``);
the LM head runs on the sampled rows only; a seeded request keeps a ``torch.Generator`` (V2 draws its noise from
the seed and the position, so it needs no state); swaps and copy-on-write moves are the lab's extensions.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.block_table import make_block_table_tensor
from pagedkv.engine import cpu_kernel
from pagedkv.engine.attention import (
    ATTN_IMPLEMENTATION,
    METADATA_KWARG,
    AttentionMetadata,
    make_decode_groups,
    make_pool_decode,
    paged_attention_forward,
)
from pagedkv.engine.bad_words import BadWordsState
from pagedkv.engine.llama import MODEL_IMPLS, LlamaDecoder, unsupported_reason
from pagedkv.engine.logprobs import (
    LogprobsLists,
    LogprobsTensors,
    PromptLogprobsWorker,
    compute_topk_logprobs,
    num_logprobs,
)
from pagedkv.engine.penalties import PenaltiesState
from pagedkv.engine.sampler import apply_logit_bias, uses_logit_bias
from pagedkv.kv_cache_interface import KVCacheConfig, SlidingWindowSpec
from pagedkv.sched_output import SchedulerOutput
from pagedkv.sizing.kv_cache_utils import kv_page_bytes
from pagedkv.sizing.model import model_shape
from pagedkv.utils import cdiv


@dataclass
class ModelInputs:
    """One step's scheduled tokens, flattened: request after request, in scheduling order.

    Request ``b`` owns tokens ``query_start_loc[b]:query_start_loc[b+1]``; its K/V will fill ``seq_lens[b]``
    slots; ``logits_indices`` are the packed index of the last token of each request in ``sample_req_ids``
    (those whose chunk reaches the end of their tokens). Plain lists: what the learner builds in exercise 07.
    """

    req_ids: list[str]
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    block_tables: list[list[int]]  # [B][num_blocks_b]
    seq_lens: list[int]  # [B]
    query_start_loc: list[int]  # [B + 1]
    sample_req_ids: list[str]
    logits_indices: list[int]  # [S]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc
        return max((qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)), default=0)


def prepare_inputs(
    scheduler_output: SchedulerOutput,
    token_ids: Mapping[str, Sequence[int]],
    block_size: int,
) -> ModelInputs:
    """Flatten a step: for each scheduled request (scheduling order), its ``n`` new tokens start at position
    ``num_computed_tokens[r]``; token at position ``p`` goes to slot
    ``block_table[p // block_size] * block_size + p % block_size``. ``token_ids[r]`` are all its tokens
    (prompt and outputs). Pure: reads its arguments, changes nothing.
    The host-side flattening of vLLM 0.26's V1 runner (``vllm/v1/worker/gpu_model_runner.py``:
    ``GPUModelRunner._prepare_inputs``, ``vllm/v1/worker/block_table.py``: ``BlockTable.compute_slot_mapping``),
    which 0.26 still runs for MoE and hybrid models; for dense models it runs Model Runner V2, which does the
    same on the device (:meth:`ModelRunner.prepare_inputs`, tested against this function).
    """
    req_ids = list(scheduler_output.num_scheduled_tokens)
    partial = scheduler_output.partial_prefill_req_ids or set()
    inputs = ModelInputs(req_ids, [], [], [], [], [], [0], [], [])
    for rid in req_ids:
        n = scheduler_output.num_scheduled_tokens[rid]
        start = scheduler_output.num_computed_tokens[rid]
        table = list(scheduler_output.block_tables[rid])
        positions = range(start, start + n)
        inputs.input_ids.extend(token_ids[rid][start : start + n])
        inputs.positions.extend(positions)
        inputs.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in positions)
        inputs.block_tables.append(table)
        inputs.seq_lens.append(start + n)
        inputs.query_start_loc.append(inputs.query_start_loc[-1] + n)
        if rid not in partial:
            inputs.sample_req_ids.append(rid)
            inputs.logits_indices.append(inputs.query_start_loc[-1] - 1)
    return inputs


def _layer_index(layer_name: str) -> int:
    """``model.layers.{i}.self_attn.attn`` -> ``i`` (the names ``pagedkv.sizing.hybrid.get_kv_cache_spec`` gives)."""
    parts = layer_name.split(".")
    if len(parts) < 3 or parts[1] != "layers" or not parts[2].isdigit():
        raise ValueError(f"a KV cache layer name like 'model.layers.3.self_attn.attn', got {layer_name!r}")
    return int(parts[2])


def layer_groups_and_tensors(kv_cache_config: KVCacheConfig | None, num_layers: int) -> tuple[list[int], list[int]]:
    """For each decoder layer, its KV cache group and the index of the K/V tensor pair it reads and writes.
    Without a config: one group, a pair per layer. With one: the group that names the layer, and the
    ``KVCacheTensor`` shared by it (one layer of every group shares each tensor, vLLM's
    ``get_kv_cache_config_from_groups``). ``ValueError`` unless every layer is in exactly one group and one
    tensor."""
    if kv_cache_config is None:
        return [0] * num_layers, list(range(num_layers))
    groups: list[int | None] = [None] * num_layers
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            i = _layer_index(name)
            if not 0 <= i < num_layers or groups[i] is not None:
                raise ValueError(f"layer {name!r}: outside the model's {num_layers} layers, or in two groups")
            groups[i] = g
    tensors: list[int | None] = [None] * num_layers
    for t, tensor in enumerate(kv_cache_config.kv_cache_tensors):
        for name in tensor.shared_by:
            tensors[_layer_index(name)] = t
    if None in groups or None in tensors:
        missing = [i for i in range(num_layers) if groups[i] is None or tensors[i] is None]
        raise ValueError(f"layers {missing} are in no KV cache group or tensor of the config")
    return groups, tensors  # type: ignore[return-value]


def group_windows(kv_cache_config: KVCacheConfig | None) -> list[int | None]:
    """Each KV cache group's sliding window when its blocks are released outside it (a ``SlidingWindowSpec``),
    else ``None`` (full attention: every block kept). One ``None`` without a config."""
    if kv_cache_config is None:
        return [None]
    return [g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
            for g in kv_cache_config.kv_cache_groups]


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs: batch-size buckets
# ---------------------------------------------------------------------------------------------------------
def vllm_cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int,
                                 num_speculative_tokens: int = 0) -> list[int]:
    """The sizes vLLM 0.26 captures by default, in **tokens**: ``[1, 2, 4] + range(8, 256, 8) + range(256, cap + 1,
    16)``, plus ``max_num_batched_tokens`` when it fits, with ``cap = min(max_num_seqs * decode_query_len * 2, 512,
    max_num_batched_tokens)`` and ``decode_query_len = 1 + num_speculative_tokens``. Mirrors
    ``VllmConfig._set_cudagraph_sizes`` (``vllm/config/vllm.py``; kept in
    ``CompilationConfig.cudagraph_capture_sizes``). Under the default ``cudagraph_mode`` ``FULL_AND_PIECEWISE``
    (``vllm/config/compilation.py``) decode batches replay full graphs and mixed batches piecewise ones, so a size
    counts a step's tokens, not its requests (for 256 sequences and 8,192 tokens: 51 sizes up to 512)."""
    cap = min(max_num_seqs * (1 + num_speculative_tokens) * 2, 512, max_num_batched_tokens)
    sizes = [s for s in (1, 2, 4) if s <= cap]
    if cap >= 8:
        sizes += list(range(8, min(cap + 1, 256), 8))
    if cap >= 256:
        sizes += list(range(256, cap + 1, 16))
    if max_num_batched_tokens <= cap:
        sizes.append(max_num_batched_tokens)
    return sorted(set(sizes))


def cudagraph_capture_sizes(max_num_seqs: int, max_size: int = 512) -> list[int]:
    """The decode batch sizes the lab captures: vLLM's pattern (:func:`vllm_cudagraph_capture_sizes`) with
    ``cap = min(max_num_seqs, max_size)``, and ``cap`` itself. The lab differs on purpose: it captures full graphs
    of decode-only steps (one token per request), so it needs no size above ``max_num_seqs``, and mixed steps run
    eagerly; vLLM 0.26 caps at ``min(2 * max_num_seqs, 512, max_num_batched_tokens)`` tokens and replays
    piecewise graphs for mixed steps too."""
    cap = max(1, min(max_num_seqs, max_size))
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
    out = sorted({s for s in sizes if s <= cap} | {cap})
    return out


def bucket_for(batch_size: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds ``batch_size`` decodes (``None``: too big, run eagerly)."""
    for size in sorted(capture_sizes):
        if size >= batch_size:
            return size
    return None


@dataclass
class InputBatch:
    """One step's inputs on the runner's device, in batch order (the scheduling order), built by
    :meth:`ModelRunner.prepare_inputs`. ``idx_mapping[b]`` is the batch row's request slot (its row of the persistent
    :class:`~pagedkv.engine.block_table.BlockTables`); ``logits_indices`` the packed rows that are sampled, one per
    request in ``sample_req_ids`` (those whose chunk reaches the end of their tokens). The host keeps what it
    already knew (``seq_lens_host``, ``query_start_loc_host``) so that nothing here needs a device-to-host copy.
    Mirrors ``InputBatch`` (``vllm/v1/worker/gpu/input_batch.py``)."""

    req_ids: list[str]
    idx_mapping: torch.Tensor  # [B] int32
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    logits_indices: torch.Tensor  # [S] int64
    sample_req_ids: list[str]
    seq_lens_host: list[int]  # [B]
    query_start_loc_host: list[int]  # [B + 1]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_query_len(self) -> int:
        qsl = self.query_start_loc_host
        return max((qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)), default=0)

    def to_model_inputs(self, block_size: int) -> ModelInputs:
        """The same step as plain lists, what :func:`prepare_inputs` returns: each request's table cut to the
        ``ceil(seq_len / block_size)`` blocks it owns (the gathered rows are padded to the widest)."""
        tables = [row[: -(-n // block_size)] for row, n in zip(self.block_tables.tolist(), self.seq_lens_host,
                                                               strict=True)]
        return ModelInputs(
            list(self.req_ids), self.input_ids.tolist(), self.positions.tolist(), self.slot_mapping.tolist(),
            tables, list(self.seq_lens_host), list(self.query_start_loc_host), list(self.sample_req_ids),
            self.logits_indices.tolist(),
        )

    @classmethod
    def from_model_inputs(cls, inputs: ModelInputs, device: torch.device | str,
                          idx_mapping: Sequence[int] | None = None) -> InputBatch:
        """The device tensors of a step given as plain lists (the Python :func:`prepare_inputs` path)."""
        def t(x: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(list(x), dtype=dtype).to(device, non_blocking=True)

        b = len(inputs.req_ids)
        return cls(
            req_ids=list(inputs.req_ids),
            idx_mapping=t(idx_mapping if idx_mapping is not None else range(b), torch.int32),
            input_ids=t(inputs.input_ids, torch.long), positions=t(inputs.positions, torch.long),
            slot_mapping=t(inputs.slot_mapping, torch.long),
            block_tables=make_block_table_tensor(inputs.block_tables).to(device, non_blocking=True),
            seq_lens=t(inputs.seq_lens, torch.int32), query_start_loc=t(inputs.query_start_loc, torch.int32),
            logits_indices=t(inputs.logits_indices, torch.long), sample_req_ids=list(inputs.sample_req_ids),
            seq_lens_host=list(inputs.seq_lens), query_start_loc_host=list(inputs.query_start_loc),
        )


class GraphInputBuffers:
    """The static inputs of the decode graphs: one set of tensors, sized for the largest bucket, that every graph
    reads from, so a graph replays on new inputs once they are copied in (a graph is frozen: fixed addresses).

    :meth:`fill` writes a decode-only step padded to a bucket's ``size``: padding rows have input id 0 at
    position 0, slot -1 (``reshape_and_cache`` skips it), ``seq_len`` 1 and block 0 (the null block, which no
    request owns) first in their table, so they write nothing and read only the null block. A real row's table is
    written only as wide as the step's longest: the kernels read entry ``j`` of a row only for tokens below its
    ``seq_len``, so what is left beyond from earlier steps is never read, and a step copies ``B x width`` ints,
    not ``size x max_blocks`` (nano-vllm's ``prepare_decode`` copies ``[:bs, :width]`` the same way). The copies
    are device to device: the step's inputs are already there (:class:`InputBatch`).
    """

    def __init__(self, max_size: int, max_blocks: int, device: torch.device | str) -> None:
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)  # [N]
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.long, device=device)  # [N]
        self.block_tables = torch.zeros(max_size, max_blocks, dtype=torch.int32, device=device)  # [N, max_blocks]
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)  # [N]
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # [N + 1]

    def fill(self, batch: InputBatch | ModelInputs, size: int) -> None:
        """Copy a decode-only step of ``B <= size`` requests into rows ``0..B-1``, padding rows ``B..size-1``."""
        if isinstance(batch, ModelInputs):
            batch = InputBatch.from_model_inputs(batch, self.input_ids.device)
        b = len(batch.req_ids)
        if batch.max_query_len != 1 or batch.num_tokens != b:
            raise ValueError("a decode graph takes a decode-only step (one token per request)")
        if not b <= size <= self.input_ids.shape[0]:
            raise ValueError(f"cannot run {b} requests in a graph of {size} (buffers for {self.input_ids.shape[0]})")
        tables = batch.block_tables  # [B, W]
        width = tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks; the graphs hold {self.block_tables.shape[1]}")
        for buf, real, pad in ((self.input_ids, batch.input_ids, 0), (self.positions, batch.positions, 0),
                               (self.slot_mapping, batch.slot_mapping, -1), (self.seq_lens, batch.seq_lens, 1)):
            buf[:b].copy_(real, non_blocking=True)
            buf[b:size].fill_(pad)
        self.block_tables[:b, :width].copy_(tables, non_blocking=True)
        self.block_tables[b:size, 0] = 0


@contextlib.contextmanager
def attn_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Set ``model.config._attn_implementation`` to ``name`` for the duration (the model is the caller's:
    it is left as it was)."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


class TransformersDecoder:
    """transformers' own decoder (``model.base_model``) over one step's flattened tokens, the attention set to
    ``"pagedkv"`` (:mod:`pagedkv.engine.attention`) and the step's metadata passed as a forward keyword argument:
    ``forward(input_ids [T], positions [T], metadata) -> hidden [T, H]``, as :class:`~pagedkv.engine.llama.
    LlamaDecoder`. What the runner runs for a model the lab has no decoder of; vLLM's counterpart is its
    Transformers backend (``vllm/model_executor/models/transformers/``, ``model_impl="transformers"``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
        with attn_implementation(self.model, ATTN_IMPLEMENTATION):
            out = self.model.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                        **{METADATA_KWARG: metadata}).last_hidden_state  # [1, T, H]
        return out[0]

    __call__ = forward


def make_decoder(model: torch.nn.Module, model_impl: str = "auto") -> LlamaDecoder | TransformersDecoder:
    """The decoder the runner runs: ``"lab"``, the lab's own (:class:`~pagedkv.engine.llama.LlamaDecoder`; a
    ``ValueError`` naming the reason for a model it does not cover); ``"transformers"``, transformers' modules
    (:class:`TransformersDecoder`); ``"auto"``, on a CPU the lab's where it covers the model, else transformers'.
    On a GPU ``"auto"`` keeps transformers' modules (replayed by CUDA graphs, which remove their per-operation host
    cost): the fused q/k/v and gate/up matrices are copies, and the memory profile that sizes the pool
    (:mod:`pagedkv.sizing`) counts the model's parameters only. Mirrors vLLM's ``ModelConfig.model_impl``
    (``vllm/config/model.py``: ``"auto"`` tries vLLM's own implementation and falls back to the Transformers
    one)."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
    on_cpu = next(model.parameters()).device.type == "cpu"
    if model_impl == "lab" or (model_impl == "auto" and on_cpu and unsupported_reason(model) is None):
        return LlamaDecoder.from_hf(model)
    return TransformersDecoder(model)


def registered_attention() -> Callable[..., Any] | None:
    """The function transformers' ``AttentionInterface`` holds under ``"pagedkv"`` now: the library's
    :func:`~pagedkv.engine.attention.paged_attention_forward`, or one plugged in in its place (exercise 07's
    ``plugged`` registers the learner's)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get_interface(ATTN_IMPLEMENTATION, None)


class CUDAGraphRunner:
    """Decode steps captured as CUDA graphs, one per batch-size bucket, sharing one memory pool.

    A decode step's host work (Python, transformers' module calls, ~0.13 ms per attention launch measured
    on an H200) costs more than its GPU work at small batches; a graph replays the whole decoder with one
    launch. The graphs read :class:`GraphInputBuffers` and write the last hidden states into one static buffer;
    the LM head runs after the replay on the sampled rows only (the runner's ``compute_logits``), so no graph
    keeps a ``[size, vocab]`` tensor of its own. Captured largest first, so smaller graphs reuse the pool.
    Mirrors ``GPUModelRunner.capture_model`` / ``CudagraphDispatcher`` and nano-vllm's ``capture_cudagraph``.
    It holds the model, the caches and a weak reference to the runner's ``compute_logits``, not the runner: no
    reference cycle keeps the KV cache alive after the engine is dropped (CUDA frees memory only when the last
    reference goes; a cycle waits for the garbage collector, which an out-of-memory error does not run).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks: int, capture_sizes: Sequence[int],
                 compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 decoder: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor] | None = None) -> None:
        self.device = kv_caches[0][0].device
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.decoder = decoder if decoder is not None else TransformersDecoder(model)  # what the graphs record
        # a weak reference: the runner holds this object, so a strong one back would be a cycle
        self._compute_logits = weakref.WeakMethod(compute_logits)
        self.capture_sizes = sorted(capture_sizes)
        self.max_blocks = max_blocks
        n = self.capture_sizes[-1]
        self.buffers = GraphInputBuffers(n, max_blocks, self.device)
        hidden = model.config.hidden_size
        self.hidden = torch.zeros(n, hidden, dtype=next(model.parameters()).dtype, device=self.device)  # [N, H]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        buf = self.buffers
        return AttentionMetadata(
            slot_mapping=buf.slot_mapping[:size],
            block_tables=buf.block_tables[:size],
            seq_lens=buf.seq_lens[:size],
            query_start_loc=buf.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            kv_caches=self.kv_caches,
            backend="triton",
            # the tuned dispatch (kernels/dispatch.py) picks version and splits from shapes alone (validate=False
            # reads nothing from the host), so it can be captured; at batch 1-8 it is up to ~6x faster than v3
            decode_version=None,
        )

    def forward(self, size: int) -> None:
        """The decoder on the buffers' first ``size`` rows, its last hidden states into ``hidden[:size]``: what a
        graph of that size records, and what its replay does again on new buffer contents."""
        out = self.decoder(self.buffers.input_ids[:size], self.buffers.positions[:size], self._metadata(size))
        self.hidden[:size].copy_(out)  # [size, H]

    def capture(self) -> None:
        """Capture one graph per size (largest first), after a warm-up run of each (which compiles the kernels:
        nothing may compile or synchronise while a graph is being captured)."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        with torch.no_grad():
            for size in reversed(self.capture_sizes):
                self.forward(size)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.forward(size)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size] = graph
                torch.cuda.synchronize()

    def can_run(self, batch: InputBatch) -> bool:
        return batch.max_query_len == 1 and bucket_for(len(batch.req_ids), self.capture_sizes) is not None

    def run(self, batch: InputBatch) -> torch.Tensor:
        """Replay the bucket's graph on ``batch``; returns the logits of the sampled requests ``[S, V]``."""
        size = bucket_for(len(batch.req_ids), self.capture_sizes)
        assert size is not None
        self.buffers.fill(batch, size)
        self.graphs[size].replay()
        compute_logits = self._compute_logits()
        assert compute_logits is not None, "the model runner that owns these graphs is gone"
        return compute_logits(self.hidden[batch.logits_indices])


# ---------------------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------------------
@dataclass
class CachedRequestState:
    """What the runner keeps about one request between steps: its slot (row of the block tables), the tokens
    it was (re)admitted with and its sampling parameters. Decode inputs are not here: they are the runner's own
    last samples, on the device (``ModelRunner.last_sampled_tokens``). Mirrors ``RequestState``
    (``vllm/v1/worker/gpu/states.py``), whose ``prefill_token_ids`` are the same tokens."""

    req_id: str
    req_index: int
    prefill_token_ids: list[int]  # prompt, or prompt + outputs for a resumed request
    sampling_params: Any


@dataclass
class ModelRunnerOutput:
    """One step's samples, as the scheduler takes them: ``sampled_token_ids[req_id_to_index[r]]`` is ``[token]`` for
    each sampled request (``req_ids``: those whose chunk reached the end of their tokens). Mirrors
    ``ModelRunnerOutput`` (``vllm/v1/outputs.py``)."""

    req_ids: list[str] = field(default_factory=list)
    req_id_to_index: dict[str, int] = field(default_factory=dict)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: LogprobsLists | None = None  # row i: request req_ids[i]; None when no request asked for logprobs
    #: a request's whole prompt logprobs, in the step that computed its prompt's last chunk
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        """``{req_id: token}``: what :meth:`pagedkv.scheduler.Scheduler.update_from_output` takes."""
        return {rid: toks[0] for rid, toks in zip(self.req_ids, self.sampled_token_ids, strict=True) if toks}


class AsyncModelRunnerOutput:
    """A step's samples while they may still be on their way from the device: :meth:`get_output` waits for them
    (on a GPU, for the copy into pinned host memory that the forward's stream ends with). Nothing else in a step
    waits for the device, so the host can schedule and prepare the next step meanwhile. Mirrors
    ``AsyncOutput`` (``vllm/v1/worker/gpu/async_utils.py``)."""

    def __init__(self, req_ids: list[str], sampled: torch.Tensor, event: Any = None,
                 logprobs: LogprobsTensors | None = None,
                 prompt_logprobs: dict[str, LogprobsTensors] | None = None) -> None:
        self.req_ids = req_ids
        self._sampled = sampled  # [S] int64 (host memory; pinned on a GPU machine)
        self._event = event
        self._logprobs = logprobs  # host memory too
        self._prompt_logprobs = prompt_logprobs or {}

    def get_output(self) -> ModelRunnerOutput:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._sampled.tolist()
        return ModelRunnerOutput(list(self.req_ids), {r: i for i, r in enumerate(self.req_ids)},
                                 [[t] for t in tokens], None if self._logprobs is None else self._logprobs.tolists(),
                                 {r: t.tolists() for r, t in self._prompt_logprobs.items()})


@dataclass
class StepTimes:
    """Host seconds of one ``execute_model``: updating the runner's state and preparing inputs (``prepare_s``),
    then launching the forward, LM head and sampler (``forward_s``: on a CPU the compute itself; on a GPU only
    until the launches return, the device runs on). Inside ``forward_s``: the layers' attention calls
    (``attention_s``: writing the new K/V and attending, every layer; 0 when a CUDA graph replays the step) and
    the sampler (``sample_s``)."""

    prepare_s: float
    forward_s: float
    attention_s: float = 0.0
    sample_s: float = 0.0


class ModelRunner:
    """Runs a transformers causal LM over the paged KV cache, one scheduler step at a time, as vLLM 0.26's Model
    Runner V2 does (``vllm/v1/worker/gpu/model_runner.py``: ``GPUModelRunner``).

    Per step (:meth:`execute_model`): forget finished and preempted requests, add new and resumed ones, append
    new block ids to the device :class:`~pagedkv.engine.block_table.BlockTables`, move blocks (swap, copy), build
    the :class:`InputBatch` on the device (:meth:`prepare_inputs`), run the decoder once, apply the LM head to the
    sampled rows, sample, and keep the samples on the device (``last_sampled_tokens``) as the next step's decode
    inputs. ``input_prep="python"`` builds the batch with the plain :func:`prepare_inputs` instead (what the
    exercises plug into); so does replacing this module's ``prepare_inputs``. ``slot_mapping_impl``: ``"triton"``
    (:func:`pagedkv.kernels.compute_slot_mappings`; the CUDA default) or ``"torch"`` (the CPU default).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        num_cpu_blocks: int = 0,
        backend: str = "torch",
        kv_cache_dtype: torch.dtype | None = None,
        use_cuda_graph: bool = False,
        max_num_seqs: int = 256,
        sampler: Any = None,
        input_prep: str = "device",
        slot_mapping_impl: str | None = None,
        kv_cache_config: KVCacheConfig | None = None,
        model_impl: str = "auto",
    ) -> None:
        """``model_impl``: which decoder runs the model (:func:`make_decoder`: the lab's Llama decoder where it
        covers the model, else transformers' modules). ``kv_cache_config`` (lesson 8): the KV cache groups of a
        hybrid or sliding-window model; the runner then allocates one K and one V tensor per ``KVCacheTensor``
        (shared by one layer of every group: a block id names the same page in each) and gives each group's
        layers that group's block tables. ``None``: one group, every layer its own tensors, every block kept
        (lessons 2-7). The device block tables hold group 0's
        tables; the other groups' come from the scheduler output each step."""
        from pagedkv.engine.block_table import BlockTables
        from pagedkv.engine.sampler import Sampler, make_generator

        if input_prep not in INPUT_PREPS:
            raise ValueError(f"input_prep must be one of {INPUT_PREPS}, got {input_prep!r}")
        config = model.config
        self.model = model
        self.decoder = make_decoder(model, model_impl)  # forward(input_ids, positions, metadata) -> [T, H]
        self.device = next(model.parameters()).device
        self.dtype = kv_cache_dtype or next(model.parameters()).dtype
        self.block_size = block_size
        self.backend = backend
        self.input_prep = input_prep
        self.num_layers = config.num_hidden_layers
        shape_of_model = model_shape(config)  # the KV heads and head size, as lesson 5 reads a config
        self.num_kv_heads, self.head_dim = shape_of_model.num_kv_heads, shape_of_model.head_dim
        self.page_bytes = kv_page_bytes(shape_of_model, block_size, self.dtype)  # lesson 5's page: a block, a layer
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        shape = (num_gpu_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache_config = kv_cache_config
        for group in kv_cache_config.kv_cache_groups if kv_cache_config is not None else ():
            spec = group.kv_cache_spec  # the lab allocates one shape for every group's pages
            if (spec.block_size, spec.num_kv_heads, spec.head_size) != shape[1:]:
                raise ValueError(f"KV cache group {group.layer_names[:2]}...: block_size {spec.block_size}, "
                                 f"{spec.num_kv_heads} KV heads of {spec.head_size}; the runner holds {shape[1:]}")
        # layer_groups[layer]: the layer's KV cache group; tensor_of[layer]: which K/V tensor pair it uses
        self.layer_groups, tensor_of = layer_groups_and_tensors(kv_cache_config, self.num_layers)
        tensors = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(max(tensor_of) + 1)
        ]
        # kv_caches[layer] = (key_cache, value_cache), each [num_blocks, block_size, Hkv, D] (with groups, layers
        # of different groups share one pair: the same objects)
        self.kv_caches = [tensors[tensor_of[layer]] for layer in range(self.num_layers)]
        self._tensor_layers = sorted({tensor_of.index(t) for t in tensor_of})  # one layer per distinct pair
        self.group_windows = group_windows(kv_cache_config)
        cpu_shape = (num_cpu_blocks, block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.cpu_kv_caches = [
            (torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin),
             torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin))
            for _ in range(self.num_layers)
        ] if num_cpu_blocks else []
        # Request slots: with async scheduling a finished request's state goes one step after a new one may
        # arrive, so there are a few more slots than max_num_seqs.
        self.max_num_reqs = 2 * max_num_seqs + 2
        if slot_mapping_impl is None:
            slot_mapping_impl = "triton" if self.device.type == "cuda" else "torch"
        self.block_tables = BlockTables(block_size, self.max_num_reqs, self.max_blocks_per_req, self.device,
                                        slot_mapping_impl)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_slots = list(range(self.max_num_reqs - 1, -1, -1))
        self.last_sampled_tokens = torch.zeros(self.max_num_reqs, dtype=torch.long, device=self.device)  # [R]
        # unseeded requests draw from one generator with a fixed seed, so every tensor-parallel rank draws alike
        self.sampler = sampler if sampler is not None else Sampler(make_generator(0, self.device))
        # Kept from a request's arrival to its finish, across preemptions (its state is not): the seeded
        # requests' generators, every request's sampling parameters and its prompt's length (min_tokens counts
        # from it; a resumed request comes back with its outputs as its prefill)
        self.generators: dict[str, torch.Generator] = {}
        self.sampling_params: dict[str, Any] = {}
        self.prompt_lens: dict[str, int] = {}
        self.penalties = PenaltiesState(self.device)
        self.prompt_logprobs = PromptLogprobsWorker()
        self.bad_words = BadWordsState(self.device)
        self.graph_runner: CUDAGraphRunner | None = None
        self._logits: torch.Tensor | None = None  # [rows, V]: compute_logits' buffer
        if use_cuda_graph and len(self.group_windows) > 1:
            # the graphs' buffers hold one block table per request; several groups need one each (not built)
            warnings.warn("CUDA graphs are captured for one KV cache group; this model has "
                          f"{len(self.group_windows)}: decode runs eagerly", stacklevel=2)
            use_cuda_graph = False
        if use_cuda_graph:
            try:
                graph_runner = CUDAGraphRunner(self.model, self.kv_caches, block_size, self.max_blocks_per_req,
                                               cudagraph_capture_sizes(max_num_seqs), self.compute_logits,
                                               self.decoder)
                graph_runner.capture()
                self.graph_runner = graph_runner
            except Exception as exc:  # a model whose forward cannot be captured: decode runs eagerly
                # a failure inside torch.cuda.graph can leave its side stream current: back to the default one
                torch.cuda.set_stream(torch.cuda.default_stream(self.device))
                torch.cuda.synchronize(self.device)
                warnings.warn(f"CUDA-graph capture failed ({type(exc).__name__}: {exc}); decode runs eagerly",
                              stacklevel=2)
        self.last_inputs: InputBatch | None = None  # the latest step's inputs (for lessons)
        self.last_step_times: StepTimes | None = None
        self.last_logits: torch.Tensor | None = None  # [S, V]: the latest step's sampled rows (for lessons)

    def kv_cache_bytes(self) -> int:
        """Bytes of the GPU-side KV cache (all layers, K and V; a tensor shared by several layers counted once):
        lesson 5's page times the blocks, per tensor."""
        return sum(self.page_bytes * self.kv_caches[i][0].shape[0] for i in self._tensor_layers)

    # ------------------------------------------------------------------------------------------------
    # The runner's request states
    # ------------------------------------------------------------------------------------------------
    def _remove_request(self, req_id: str, finished: bool = True) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_slots.append(state.req_index)
        self.penalties.remove_request(req_id)
        self.bad_words.remove_request(req_id)
        if finished:  # a preempted request's prompt chunks so far are kept (a swapped-in one goes on from them)
            self.prompt_logprobs.remove_request(req_id)

    def _add_request(self, req_id: str, token_ids: list[int], block_ids: Sequence[int], params: Any) -> None:
        self._remove_request(req_id, finished=False)
        if not self._free_slots:
            raise RuntimeError(f"no request slot left for {req_id!r} ({self.max_num_reqs} slots)")
        index = self._free_slots.pop()
        self.requests[req_id] = CachedRequestState(req_id, index, list(token_ids), params)
        self.sampling_params[req_id] = params
        self.block_tables.append_block_ids(index, block_ids, overwrite=True)
        self.penalties.add_request(req_id, token_ids, self.prompt_lens.get(req_id, len(token_ids)), params)
        self.prompt_logprobs.add_request(req_id, params)
        self.bad_words.add_request(req_id, token_ids, self.prompt_lens.get(req_id, len(token_ids)), params)
        seed = getattr(params, "seed", None)
        if seed is not None and req_id not in self.generators:
            from pagedkv.engine.sampler import make_generator

            self.generators[req_id] = make_generator(seed, self.device)

    def finish_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the requests that finished since the last step (and their generators) and the ones preempted
        now (their state only: a resumed request is added again, with the tokens it has by then).
        Mirrors ``GPUModelRunner.finish_requests``."""
        for rid in scheduler_output.finished_req_ids:
            self._remove_request(rid)
            self.generators.pop(rid, None)
            self.sampling_params.pop(rid, None)
            self.prompt_lens.pop(rid, None)
        for rid in scheduler_output.preempted_req_ids:
            self._remove_request(rid, finished=False)

    def add_requests(self, scheduler_output: SchedulerOutput) -> None:
        """New requests (their prompt and whole block table) and resumed ones (every token so far, and their new
        table). Mirrors ``GPUModelRunner.add_requests``; Model Runner V2 receives resumed requests as new ones."""
        for new in scheduler_output.scheduled_new_reqs:
            self.prompt_lens[new.req_id] = len(new.prompt_token_ids)
            self._add_request(new.req_id, new.prompt_token_ids, new.block_ids, new.sampling_params)
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids:
                self._add_request(rid, cached.all_token_ids[rid], block_ids, self.sampling_params.get(rid))

    def update_requests(self, scheduler_output: SchedulerOutput) -> None:
        """Append each running request's new blocks to its device row. Mirrors ``GPUModelRunner.update_requests``."""
        cached = scheduler_output.scheduled_cached_reqs
        for rid, block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid not in cached.resumed_req_ids and block_ids:
                self.block_tables.append_block_ids(self.requests[rid].req_index, block_ids, overwrite=False)

    # ------------------------------------------------------------------------------------------------
    # Block moves
    # ------------------------------------------------------------------------------------------------
    def execute_block_moves(self, scheduler_output: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write, on every layer's K and V (in that order: a block freed by a
        swap-out can be the destination of a swap-in or a copy in the same step). Mirrors vLLM V0's
        ``CacheEngine.swap_out`` / ``swap_in`` / ``copy`` (``vllm/worker/cache_engine.py``)."""
        so = scheduler_output
        for pairs, src_gpu, dst_gpu in (
            (so.blocks_to_swap_out, True, False),
            (so.blocks_to_swap_in, False, True),
            (so.blocks_to_copy, True, True),
        ):
            if not pairs:
                continue
            if (not src_gpu or not dst_gpu) and not self.cpu_kv_caches:
                raise ValueError("the step swaps blocks but the runner has no CPU blocks (num_cpu_blocks=0)")
            src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
            dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
            for layer in self._tensor_layers:  # every distinct tensor once (groups share them)
                for which in (0, 1):
                    src = (self.kv_caches if src_gpu else self.cpu_kv_caches)[layer][which]
                    dst = (self.kv_caches if dst_gpu else self.cpu_kv_caches)[layer][which]
                    dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)

    # ------------------------------------------------------------------------------------------------
    # Inputs
    # ------------------------------------------------------------------------------------------------
    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> InputBatch:
        """The step's :class:`InputBatch`, in scheduling order. On the host, from the scheduler output alone:
        each request's positions ``num_computed .. num_computed + n - 1``, ``query_start_loc``, ``seq_lens``, the
        sampled rows, and the input ids of positions the runner was given (``prefill_token_ids``). On the device:
        the block tables gathered from the persistent rows, the slot mapping computed from them
        (:meth:`BlockTables.compute_slot_mappings`), and the input id of every position past the given tokens
        (a decode) read from ``last_sampled_tokens``: the token the previous step sampled, which with async
        scheduling the host does not know yet. Mirrors ``GPUModelRunner.prepare_inputs`` (Model Runner V2:
        ``prepare_prefill_inputs``, ``prepare_pos_seq_lens``, ``combine_sampled_and_draft_tokens``,
        ``BlockTables.gather_block_tables`` / ``compute_slot_mappings``)."""
        so = scheduler_output
        req_ids = list(so.num_scheduled_tokens)
        partial = so.partial_prefill_req_ids or set()
        dev = self.device
        idx, qsl, seq_lens, positions, input_ids = [], [0], [], [], []
        sample_req_ids, logits_indices, from_sample_rows, from_sample_idx = [], [], [], []
        for rid in req_ids:
            state = self.requests[rid]
            n = so.num_scheduled_tokens[rid]
            start = so.num_computed_tokens[rid]
            given = state.prefill_token_ids
            row0 = qsl[-1]
            idx.append(state.req_index)
            positions.extend(range(start, start + n))
            input_ids.extend(given[start : start + n])
            for p in range(max(start, len(given)), start + n):  # past the given tokens: the last sample
                input_ids.append(0)
                from_sample_rows.append(row0 + p - start)
                from_sample_idx.append(state.req_index)
            qsl.append(row0 + n)
            seq_lens.append(start + n)
            if rid not in partial:
                sample_req_ids.append(rid)
                logits_indices.append(qsl[-1] - 1)

        def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        idx_t, qsl_t, pos_t = t(idx, torch.int32), t(qsl, torch.int32), t(positions, torch.long)
        ids_t = t(input_ids, torch.long)
        if from_sample_rows:
            ids_t[t(from_sample_rows, torch.long)] = self.last_sampled_tokens[t(from_sample_idx, torch.long)]
        counts = [qsl[i + 1] - qsl[i] for i in range(len(req_ids))]
        token_req = torch.tensor(idx, dtype=torch.long).repeat_interleave(torch.tensor(counts)).to(dev)
        width = -(-max(seq_lens) // self.block_size)
        return InputBatch(
            req_ids=req_ids, idx_mapping=idx_t, input_ids=ids_t, positions=pos_t,
            slot_mapping=self.block_tables.compute_slot_mappings(idx_t, qsl_t, pos_t, token_req),
            block_tables=self.block_tables.gather_block_tables(idx_t, width),
            seq_lens=t(seq_lens, torch.int32), query_start_loc=qsl_t, logits_indices=t(logits_indices, torch.long),
            sample_req_ids=sample_req_ids, seq_lens_host=seq_lens, query_start_loc_host=qsl,
        )

    def prepare_inputs_python(self, scheduler_output: SchedulerOutput) -> InputBatch:
        """The same :class:`InputBatch` through the plain :func:`prepare_inputs` (this module's, so a replaced one
        too): the token lists it reads hold 0 where the runner's last sample goes, patched in on the device."""
        so = scheduler_output
        token_ids: dict[str, list[int]] = {}
        patch_rows, patch_idx = [], []
        row = 0
        for rid, n in so.num_scheduled_tokens.items():
            state = self.requests[rid]
            start = so.num_computed_tokens[rid]
            given = state.prefill_token_ids
            token_ids[rid] = list(given) + [0] * max(0, start + n - len(given))
            for p in range(max(start, len(given)), start + n):
                patch_rows.append(row + p - start)
                patch_idx.append(state.req_index)
            row += n
        inputs = prepare_inputs(so, token_ids, self.block_size)
        batch = InputBatch.from_model_inputs(inputs, self.device,
                                             [self.requests[r].req_index for r in inputs.req_ids])
        if patch_rows:
            rows = torch.tensor(patch_rows, dtype=torch.long).to(self.device)
            src = torch.tensor(patch_idx, dtype=torch.long).to(self.device)
            batch.input_ids[rows] = self.last_sampled_tokens[src]
        return batch

    def build_metadata(self, batch: InputBatch, group: int = 0,
                       scheduler_output: SchedulerOutput | None = None) -> AttentionMetadata:
        """The step's :class:`AttentionMetadata` for KV cache group ``group`` on the runner's device: group 0's
        block tables and slot mapping from the device batch, another group's from ``scheduler_output``; the torch
        backend's split of the batch from host ints. Mirrors ``FlashAttentionMetadataBuilder.build``, which vLLM
        calls once per group with that group's ``CommonAttentionMetadata``."""
        dev = self.device
        qsl = batch.query_start_loc_host
        seq_lens = batch.seq_lens_host
        b_count = len(batch.req_ids)
        tables, slot_mapping = batch.block_tables, batch.slot_mapping
        if scheduler_output is not None and group > 0:
            tables = make_block_table_tensor(
                [scheduler_output.tables_per_group(r)[group] for r in batch.req_ids]).to(dev)  # [B, W]
            slot_mapping = torch.tensor([s for r in batch.req_ids for s in scheduler_output.slots_per_group(r)[group]],
                                        dtype=torch.long, device=dev)
        window = self.group_windows[group]
        decodes = [b for b in range(b_count) if qsl[b + 1] - qsl[b] == 1]
        # the decode rows read in place from the pool where they can be (full attention, no block shared), unless
        # the compiled CPU kernel reads them (any table, any window): then neither the pool nor the groups
        kernel = self.backend == "torch" and cpu_kernel.serves(dev, self.kv_caches[0][0].dtype)
        pool = None if self.backend == "triton" or window is not None or kernel else make_pool_decode(
            decodes, seq_lens, tables if tables.device.type == "cpu" else tables.cpu(), qsl, self.block_size)
        prefills = [(b, qsl[b], qsl[b + 1], seq_lens[b]) for b in range(b_count) if qsl[b + 1] - qsl[b] > 1]
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            max_query_len=batch.max_query_len,
            max_seq_len=max(seq_lens),
            kv_caches=self.kv_caches,
            backend=self.backend,
            decode_req_idx=torch.tensor(decodes, dtype=torch.long, device=dev),
            prefill_reqs=prefills,
            kernel_req_idx=torch.arange(b_count) if kernel else None,  # the compiled kernel: every request
            pool_decode=None if pool is None else pool.to(dev),
            decode_groups=None if self.backend == "triton" or not decodes or pool is not None or kernel else [
                g.to(dev) for g in make_decode_groups(decodes, seq_lens, tables, qsl, self.block_size,
                                                      sliding_window=window)
            ],
            sliding_window=window,
        )

    def build_layer_metadata(self, inputs: InputBatch,
                             scheduler_output: SchedulerOutput) -> AttentionMetadata | dict[int, AttentionMetadata]:
        """What the step passes to attention: one :class:`AttentionMetadata`, or with several KV cache groups a
        dict from layer index to its group's (the layers of a group share one object). Mirrors
        ``GPUModelRunner._build_attention_metadata``, which returns a dict from layer name to metadata."""
        if len(self.group_windows) == 1:
            return self.build_metadata(inputs)
        per_group = [self.build_metadata(inputs, g, scheduler_output) for g in range(len(self.group_windows))]
        return {layer: per_group[g] for layer, g in enumerate(self.layer_groups)}

    def compute_logits(self, hidden: torch.Tensor, reuse_buffer: bool = True) -> torch.Tensor:
        """The LM head on the sampled positions, ``hidden [S, H]`` -> ``[S, V]``, written into one buffer kept
        across steps (a fresh ``[S, V]`` tensor every step costs a CPU thousands of page faults). The result is
        valid until the next step: copy it to keep it. ``reuse_buffer=False``: a fresh tensor (the prompt
        logprobs' rows, which must not overwrite the step's sampled logits).

        The lab applies the head to the sampled rows only: a partial prefill's row would be sampled and thrown
        away. vLLM 0.26 computes logits for every scheduled request, partial prefills included (Model Runner V2:
        ``total_num_logits = num_reqs`` in ``prepare_inputs``, and ``get_num_sampled_and_rejected`` in
        ``input_batch.py`` counts a chunked prefill's sample as none; the V1 runner: "we do so for simplicity" in
        ``gpu_model_runner.py``, then ``discard_request_mask``, rewinding a seeded request's generator). Same
        tokens either way; the lab saves the head on rows no one keeps.
        Mirrors ``LlamaForCausalLM.compute_logits`` (``vllm/model_executor/models/llama.py``)."""
        head = self.model.get_output_embeddings()
        s, v = hidden.shape[0], head.weight.shape[0]
        if not reuse_buffer:
            out = torch.mm(hidden, head.weight.t())  # [S, V]
        else:
            if self._logits is None or self._logits.shape[0] < s:
                self._logits = torch.empty(max(s, 64), v, dtype=head.weight.dtype, device=hidden.device)
            out = torch.mm(hidden, head.weight.t(), out=self._logits[:s])  # [S, V]
        if getattr(head, "bias", None) is not None:
            out += head.bias
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:  # Gemma's cap * tanh(logits / cap): LogitsProcessor(soft_cap=...) in vLLM's gemma3.py
            out.div_(cap).tanh_().mul_(cap)
        return out

    # ------------------------------------------------------------------------------------------------
    # One step
    # ------------------------------------------------------------------------------------------------
    def _sample(self, batch: InputBatch, logits: torch.Tensor) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """One token per sampled row, on the device, in Model Runner V2's order (``Sampler.__call__`` and
        ``apply_sampling_params``, ``vllm/v1/worker/gpu/sample/sampler.py``): the logit bias (allowed tokens,
        biases, the min-tokens mask: :func:`~pagedkv.engine.sampler.apply_logit_bias`, which needs each sampled
        row's position and its request's original prompt length), the penalties
        (:class:`~pagedkv.engine.penalties.PenaltiesState`, which then counts the samples), the bad words
        (:class:`~pagedkv.engine.bad_words.BadWordsState`, which then appends them), then the sampler with
        each row's parameters and generator. When a request asks for logprobs, every row's are computed from the
        raw logits (a copy kept before all that changes them in place), with the batch's largest ``logprobs``."""
        rids = batch.sample_req_ids
        params = [self.requests[r].sampling_params for r in rids]
        gens = [self.generators.get(r) for r in rids]
        wanted = [num_logprobs(p.logprobs, logits.shape[-1]) for p in params
                  if p is not None and getattr(p, "logprobs", None) is not None]
        raw = logits.clone() if wanted else None  # [S, V]: vLLM's default logprobs_mode, "raw_logprobs"
        bias = any(uses_logit_bias(p) for p in params)
        if bias or self.bad_words.words:  # each sampled row's length (its position + 1) and original prompt length
            seq_lens = dict(zip(batch.req_ids, batch.seq_lens_host, strict=True))
            lens, prompt_lens = [seq_lens[r] for r in rids], [self.prompt_lens.get(r, 0) for r in rids]
        if bias:
            apply_logit_bias(logits, params, [n - 1 for n in lens], prompt_lens)
        self.penalties.apply(logits, rids, params)
        if self.bad_words.words:  # each row's outputs before its sample
            self.bad_words.apply(logits, rids, [n - p for n, p in zip(lens, prompt_lens, strict=True)])
        sampled = self.sampler.sample(logits, params, gens)
        self.penalties.update(rids, sampled)
        self.bad_words.update(rids, sampled)
        return sampled, None if raw is None else compute_topk_logprobs(raw, sampled, max(wanted))

    def _prompt_logprob_rows(self, batch: InputBatch, so: SchedulerOutput) -> list[tuple[str, int, int, list[int],
                                                                                         bool, int]]:
        """The requests whose prompt logprobs this step computes: ``(req_id, first row, end row, the prompt tokens
        those rows predict, whether the prompt goes on in a later chunk, its prompt_logprobs)``. A prompt's last
        position is left out (its logits sample the first output token, with nothing of the prompt to predict), and
        a request resumed after its prompt was done is skipped (its prompt logprobs went out with its first
        token). A request preempted inside its prompt keeps its chunks so far: recomputed, it starts again at
        position 0 (no prefix-cache hit), and the record with it; swapped back in, it goes on from where it was (the
        lab's swap: vLLM 0.26 only recomputes). Mirrors ``PromptLogprobsWorker.compute_prompt_logprobs``'s
        selection."""
        if not self.prompt_logprobs.in_progress:  # the usual case: no request asks
            return []
        rows = []
        qsl = batch.query_start_loc_host
        for i, rid in enumerate(batch.req_ids):
            if rid not in self.prompt_logprobs.in_progress:
                continue
            state = self.requests[rid]
            prompt_len = self.prompt_lens.get(rid, len(state.prefill_token_ids))
            start, n = so.num_computed_tokens[rid], so.num_scheduled_tokens[rid]
            if start >= prompt_len or prompt_len < len(state.prefill_token_ids):
                continue
            if start == 0:  # the prompt from its start: a record begun before a recompute preemption starts again
                self.prompt_logprobs.in_progress[rid] = []
            chunked = start + n < prompt_len
            r0, r1 = qsl[i], qsl[i + 1] - (0 if chunked else 1)
            targets = state.prefill_token_ids[start + 1 : start + 1 + r1 - r0]
            rows.append((rid, r0, r1, targets, chunked, state.sampling_params.prompt_logprobs))
        return rows

    @torch.no_grad()
    def execute_model(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Run one step and sample: update the request states and device block tables, move blocks, prepare the
        inputs, one forward over every scheduled token, the LM head on the sampled rows, the sampler (then, for a
        request that asks, the prompt logprobs of its scheduled prompt rows: :class:`PromptLogprobsWorker`). The samples
        are written to ``last_sampled_tokens`` (the next step's decode inputs, on the device) and copied to the
        host without waiting: :meth:`AsyncModelRunnerOutput.get_output` waits. Mirrors
        ``GPUModelRunner.execute_model`` and ``sample_tokens`` (vLLM splits the step in two calls, so that
        structured output's grammar can be applied in between; the lab has no grammar)."""
        t0 = time.perf_counter()
        so = scheduler_output
        self.finish_requests(so)
        self.add_requests(so)
        self.update_requests(so)
        self.execute_block_moves(so)
        if so.is_empty():
            self.last_step_times = StepTimes(time.perf_counter() - t0, 0.0)
            return AsyncModelRunnerOutput([], torch.empty(0, dtype=torch.long))
        python_path = self.input_prep == "python" or prepare_inputs is not _PREPARE_INPUTS_REFERENCE
        batch = self.prepare_inputs_python(so) if python_path else self.prepare_inputs(so)
        self.last_inputs = batch
        t1 = time.perf_counter()
        timings: dict[str, float] = {}
        prompt_rows = self._prompt_logprob_rows(batch, so)
        hidden = None
        if not prompt_rows and self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.run(batch)
        else:
            meta = self.build_layer_metadata(batch, so)
            for m in meta.values() if isinstance(meta, dict) else (meta,):
                m.timings = timings  # every layer adds its attention seconds
            decoder = self.decoder
            if isinstance(decoder, LlamaDecoder) and registered_attention() is not paged_attention_forward:
                # another attention function is registered as "pagedkv" (exercise 07 plugs the learner's): the
                # step runs transformers' modules, which call it (the lab's decoder calls the library's directly)
                decoder = TransformersDecoder(self.model)
            hidden = decoder(batch.input_ids, batch.positions, meta)  # [T, H]
            logits = self.compute_logits(hidden[batch.logits_indices])  # [S, V]
        self.last_logits = logits  # valid until the next step (compute_logits' buffer)
        t2 = time.perf_counter()
        sampled, logprobs = self._sample(batch, logits)  # [S] on the device
        prompt_logprobs = {}
        for rid, r0, r1, targets, chunked, num in prompt_rows:
            assert hidden is not None  # a step with prompt rows runs no graph
            done = self.prompt_logprobs.compute(rid, functools.partial(self.compute_logits, reuse_buffer=False),
                                                hidden[r0:r1], targets, num, chunked)
            if done is not None:
                prompt_logprobs[rid] = done
        sample_s = time.perf_counter() - t2
        if batch.sample_req_ids:
            slots = torch.tensor([self.requests[r].req_index for r in batch.sample_req_ids], dtype=torch.long)
            self.last_sampled_tokens[slots.to(self.device)] = sampled
        event = None
        host = sampled
        if self.device.type == "cuda":  # a fresh pinned buffer: the previous step's may not be read yet
            host = torch.empty(sampled.shape[0], dtype=torch.long, pin_memory=True)
            host.copy_(sampled, non_blocking=True)
            logprobs = None if logprobs is None else logprobs.pinned_copy()
            prompt_logprobs = {r: t.pinned_copy() for r, t in prompt_logprobs.items()}
            event = torch.cuda.Event()
            event.record()
        self.last_step_times = StepTimes(t1 - t0, time.perf_counter() - t1, timings.get("attention_s", 0.0), sample_s)
        return AsyncModelRunnerOutput(list(batch.sample_req_ids), host, event, logprobs, prompt_logprobs)


INPUT_PREPS = ("device", "python")
_PREPARE_INPUTS_REFERENCE = prepare_inputs
