"""The model runner: one scheduler step in, one forward pass over the paged cache, logits out.

Lesson 4's simulator stood in for this. The runner owns the KV cache tensors (two per layer,
``[num_blocks, block_size, num_kv_heads, head_dim]``, plus a CPU copy of that shape for swapped-out
blocks) and, each step:

1. performs the step's block moves on the real tensors, in order: ``blocks_to_swap_out`` (GPU → CPU),
   ``blocks_to_swap_in`` (CPU → GPU), ``blocks_to_copy`` (copy-on-write, GPU → GPU);
2. flattens every scheduled token (prefill chunks and decodes mixed) into one packed batch with
   :func:`prepare_inputs`: input ids, positions, slot mapping, block tables, sequence lengths;
3. runs transformers' own decoder (``model.base_model``) on it once, attention set to ``"pagedkv"``
   (:mod:`pagedkv.engine.attention`), the per-step metadata passed as a forward keyword argument;
4. applies the LM head to the last scheduled token of each request whose chunk reached its end, and to no
   other row (``compute_logits``), and returns those logits.

Decode-only steps on CUDA replay a CUDA graph captured for the next batch-size bucket (:class:`CUDAGraphRunner`).
Mirrors vLLM 0.26's ``GPUModelRunner`` (``vllm/v1/worker/gpu_model_runner.py``: ``_prepare_inputs``,
``execute_model``, ``capture_model``) and nano-vllm's ``ModelRunner`` (``nanovllm/engine/model_runner.py``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedkv.block_table import make_block_table_tensor
from pagedkv.engine.attention import ATTN_IMPLEMENTATION, METADATA_KWARG, AttentionMetadata, make_decode_groups
from pagedkv.kv_cache_interface import KVCacheConfig, SlidingWindowSpec
from pagedkv.sched_output import SchedulerOutput


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
    Mirrors ``GPUModelRunner._prepare_inputs`` and ``BlockTable.compute_slot_mapping``.
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
def cudagraph_capture_sizes(max_num_seqs: int, max_size: int = 512) -> list[int]:
    """The decode batch sizes to capture: ``[1, 2, 4] + range(8, 256, 8) + range(256, cap + 1, 16)`` and ``cap``,
    where ``cap = min(max_num_seqs, max_size)``. vLLM 0.26's default pattern (``VllmConfig._set_cudagraph_sizes``,
    ``vllm/config/vllm.py``, kept in ``CompilationConfig.cudagraph_capture_sizes``), whose cap is
    ``min(2 * max_num_seqs, 512, max_num_batched_tokens)``: vLLM's graphs count tokens and also serve mixed
    batches; the lab's serve decode-only steps, one token per request, so no more than ``max_num_seqs``."""
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


class GraphInputBuffers:
    """The static inputs of the decode graphs: one set of tensors, sized for the largest bucket, that every graph
    reads from, so a graph replays on new inputs once they are copied in (a graph is frozen: fixed addresses).

    :meth:`fill` writes a decode-only step padded to a bucket's ``size``: padding rows have input id 0 at
    position 0, slot -1 (``reshape_and_cache`` skips it), ``seq_len`` 1 and block 0 (the null block, which no
    request owns) first in their table, so they write nothing and read only the null block. A real row's table is
    written only as wide as the step's longest: the kernels read entry ``j`` of a row only for tokens below its
    ``seq_len``, so what is left beyond from earlier steps is never read, and a step copies ``B x width`` ints,
    not ``size x max_blocks`` (nano-vllm's ``prepare_decode`` copies ``[:bs, :width]`` the same way).
    """

    def __init__(self, max_size: int, max_blocks: int, device: torch.device | str) -> None:
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)  # [N]
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)  # [N]
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.long, device=device)  # [N]
        self.block_tables = torch.zeros(max_size, max_blocks, dtype=torch.int32, device=device)  # [N, max_blocks]
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)  # [N]
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)  # [N + 1]

    def fill(self, inputs: ModelInputs, size: int) -> None:
        """Copy a decode-only step of ``B <= size`` requests into rows ``0..B-1``, padding rows ``B..size-1``."""
        b = len(inputs.req_ids)
        if inputs.max_query_len != 1 or inputs.num_tokens != b:
            raise ValueError("a decode graph takes a decode-only step (one token per request)")
        if not b <= size <= self.input_ids.shape[0]:
            raise ValueError(f"cannot run {b} requests in a graph of {size} (buffers for {self.input_ids.shape[0]})")
        tables = make_block_table_tensor(inputs.block_tables)  # [B, W]
        width = tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"a block table of {width} blocks; the graphs hold {self.block_tables.shape[1]}")
        for buf, real, pad in ((self.input_ids, inputs.input_ids, 0), (self.positions, inputs.positions, 0),
                               (self.slot_mapping, inputs.slot_mapping, -1), (self.seq_lens, inputs.seq_lens, 1)):
            buf[:b].copy_(torch.tensor(real, dtype=buf.dtype), non_blocking=True)
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
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.device = kv_caches[0][0].device
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
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
        kwargs = {METADATA_KWARG: self._metadata(size)}
        ids, pos = self.buffers.input_ids[:size][None], self.buffers.positions[:size][None]  # [1, size]
        out = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).last_hidden_state
        self.hidden[:size].copy_(out[0])  # [size, H]

    def capture(self) -> None:
        """Capture one graph per size (largest first), after a warm-up run of each (which compiles the kernels:
        nothing may compile or synchronise while a graph is being captured)."""
        if self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        with torch.no_grad(), attn_implementation(self.model, ATTN_IMPLEMENTATION):
            for size in reversed(self.capture_sizes):
                self.forward(size)  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.forward(size)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size] = graph
                torch.cuda.synchronize()

    def can_run(self, inputs: ModelInputs) -> bool:
        return inputs.max_query_len == 1 and bucket_for(len(inputs.req_ids), self.capture_sizes) is not None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Replay the bucket's graph on ``inputs``; returns the logits of the sampled requests ``[S, V]``."""
        size = bucket_for(len(inputs.req_ids), self.capture_sizes)
        assert size is not None
        self.buffers.fill(inputs, size)
        self.graphs[size].replay()
        keep = torch.tensor(inputs.logits_indices, dtype=torch.long, device=self.device)  # [S]
        compute_logits = self._compute_logits()
        assert compute_logits is not None, "the model runner that owns these graphs is gone"
        return compute_logits(self.hidden[keep])


# ---------------------------------------------------------------------------------------------------------
# The runner
# ---------------------------------------------------------------------------------------------------------
class ModelRunner:
    """Runs a transformers causal LM over the paged KV cache, one scheduler step at a time."""

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
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """``kv_cache_config`` (lesson 8): the KV cache groups of a hybrid or sliding-window model; the runner then
        allocates one K and one V tensor per ``KVCacheTensor`` (shared by one layer of every group: a block id
        names the same page in each) and gives each group's layers that group's block tables. ``None``: one
        group, every layer its own tensors, every block kept (lessons 2-7)."""
        config = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = kv_cache_dtype or next(model.parameters()).dtype
        self.block_size = block_size
        self.backend = backend
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_blocks_per_req = -(-max_model_len // block_size)
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
                                               cudagraph_capture_sizes(max_num_seqs), self.compute_logits)
                graph_runner.capture()
                self.graph_runner = graph_runner
            except Exception as exc:  # a model whose forward cannot be captured: decode runs eagerly
                # a failure inside torch.cuda.graph can leave its side stream current: back to the default one
                torch.cuda.set_stream(torch.cuda.default_stream(self.device))
                torch.cuda.synchronize(self.device)
                warnings.warn(f"CUDA-graph capture failed ({type(exc).__name__}: {exc}); decode runs eagerly",
                              stacklevel=2)
        self.last_inputs: ModelInputs | None = None  # the latest step's flattened inputs (for lessons)

    def kv_cache_bytes(self) -> int:
        """Bytes of the GPU-side KV cache (all layers, K and V; a tensor shared by several layers counted once)."""
        return sum(self.kv_caches[i][0].numel() * self.kv_caches[i][0].element_size() * 2 for i in self._tensor_layers)

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

    def build_metadata(self, inputs: ModelInputs, group: int = 0,
                       scheduler_output: SchedulerOutput | None = None) -> AttentionMetadata:
        """The step's :class:`AttentionMetadata` for KV cache group ``group`` on the runner's device: the
        group's block tables and slot mapping (``scheduler_output``'s, for a group other than the one
        ``inputs`` holds), the step's lengths. Mirrors ``FlashAttentionMetadataBuilder.build``, which vLLM
        calls once per group with that group's ``CommonAttentionMetadata``."""
        dev = self.device
        block_tables, slot_mapping = inputs.block_tables, inputs.slot_mapping
        if scheduler_output is not None and len(self.group_windows) > 1:
            block_tables = [scheduler_output.tables_per_group(r)[group] for r in inputs.req_ids]
            slot_mapping = [s for r in inputs.req_ids for s in scheduler_output.slots_per_group(r)[group]]
        window = self.group_windows[group]
        tables = make_block_table_tensor(block_tables)  # [B, W]
        qsl = inputs.query_start_loc
        decodes = [b for b in range(len(inputs.req_ids)) if qsl[b + 1] - qsl[b] == 1]
        prefills = [(b, qsl[b], qsl[b + 1], inputs.seq_lens[b]) for b in range(len(inputs.req_ids))
                    if qsl[b + 1] - qsl[b] > 1]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(inputs.seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=inputs.max_query_len,
            max_seq_len=max(inputs.seq_lens),
            kv_caches=self.kv_caches,
            backend=self.backend,
            decode_req_idx=torch.tensor(decodes, dtype=torch.long, device=dev),
            prefill_reqs=prefills,
            decode_groups=None if self.backend == "triton" or not decodes else [
                g.to(dev) for g in make_decode_groups(decodes, inputs.seq_lens, tables, qsl, self.block_size,
                                                      sliding_window=window)
            ],
            sliding_window=window,
        )

    def build_layer_metadata(self, inputs: ModelInputs,
                             scheduler_output: SchedulerOutput) -> AttentionMetadata | dict[int, AttentionMetadata]:
        """What the step passes to attention: one :class:`AttentionMetadata`, or with several KV cache groups a
        dict from layer index to its group's (the layers of a group share one object). Mirrors
        ``GPUModelRunner._build_attention_metadata``, which returns a dict from layer name to metadata."""
        if len(self.group_windows) == 1:
            return self.build_metadata(inputs)
        per_group = [self.build_metadata(inputs, g, scheduler_output) for g in range(len(self.group_windows))]
        return {layer: per_group[g] for layer, g in enumerate(self.layer_groups)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on the sampled positions, ``hidden [S, H]`` -> ``[S, V]``, written into one buffer kept
        across steps (a fresh ``[S, V]`` tensor every step costs a CPU thousands of page faults). The result is
        valid until the next step: copy it to keep it. Mirrors ``LlamaForCausalLM.compute_logits``
        (``vllm/model_executor/models/llama.py``), which applies ``LogitsProcessor``
        (``vllm/model_executor/layers/logits_processor.py``) to the sampled rows only."""
        head = self.model.get_output_embeddings()
        s, v = hidden.shape[0], head.weight.shape[0]
        if self._logits is None or self._logits.shape[0] < s:
            self._logits = torch.empty(max(s, 64), v, dtype=head.weight.dtype, device=hidden.device)
        out = torch.mm(hidden, head.weight.t(), out=self._logits[:s])  # [S, V]
        if getattr(head, "bias", None) is not None:
            out += head.bias
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:  # Gemma's cap * tanh(logits / cap): LogitsProcessor(soft_cap=...) in vLLM's gemma3.py
            out.div_(cap).tanh_().mul_(cap)
        return out

    @torch.no_grad()
    def execute_model(
        self, scheduler_output: SchedulerOutput, token_ids: Mapping[str, Sequence[int]]
    ) -> tuple[list[str], torch.Tensor]:
        """Run one step: block moves, then one forward over every scheduled token. Returns
        ``(sample_req_ids, logits [S, V])``: the logits after the last scheduled token of each request whose
        chunk reached the end of its tokens (partial prefills get none), valid until the next step (they live in
        :meth:`compute_logits`' buffer). Mirrors ``GPUModelRunner.execute_model``.
        """
        self.execute_block_moves(scheduler_output)
        if scheduler_output.is_empty():
            return [], torch.empty(0, 0)
        inputs = prepare_inputs(scheduler_output, token_ids, self.block_size)
        self.last_inputs = inputs
        if self.graph_runner is not None and self.graph_runner.can_run(inputs):
            return inputs.sample_req_ids, self.graph_runner.run(inputs)
        meta = self.build_layer_metadata(inputs, scheduler_output)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)[None]  # [1, T]
        pos = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)[None]  # [1, T]
        keep = torch.tensor(inputs.logits_indices, dtype=torch.long, device=self.device)  # [S]
        with attn_implementation(self.model, ATTN_IMPLEMENTATION):
            hidden = self.model.base_model(
                input_ids=ids, position_ids=pos, use_cache=False, **{METADATA_KWARG: meta}
            ).last_hidden_state  # [1, T, H]
        return inputs.sample_req_ids, self.compute_logits(hidden[0, keep])  # [S, V]
