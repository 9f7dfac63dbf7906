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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedkv.engine.attention import ATTN_IMPLEMENTATION, METADATA_KWARG, AttentionMetadata, make_decode_groups
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


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs: batch-size buckets
# ---------------------------------------------------------------------------------------------------------
def cudagraph_capture_sizes(max_num_seqs: int, max_size: int = 512) -> list[int]:
    """The decode batch sizes to capture: ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)`` up to
    ``min(max_num_seqs, max_size)``, plus that cap itself. vLLM 0.26's default pattern
    (``CompilationConfig.cudagraph_capture_sizes``, ``vllm/config/compilation.py``)."""
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


def pad_decode_inputs(inputs: ModelInputs, size: int, max_blocks: int) -> ModelInputs:
    """A decode-only step padded to ``size`` requests for a graph of that size: padding requests have input
    id 0 at position 0, slot -1 (``reshape_and_cache`` skips it), ``seq_len`` 1 and an all-null block table
    (block 0, which no request owns), so they write nothing and read only the null block. Pure."""
    b = len(inputs.req_ids)
    if inputs.max_query_len != 1 or inputs.num_tokens != b:
        raise ValueError("pad_decode_inputs takes a decode-only step (one token per request)")
    if size < b:
        raise ValueError(f"cannot pad {b} requests down to {size}")
    pad = size - b
    tables = [t + [0] * (max_blocks - len(t)) for t in inputs.block_tables] + [[0] * max_blocks] * pad
    return ModelInputs(
        req_ids=list(inputs.req_ids),
        input_ids=inputs.input_ids + [0] * pad,
        positions=inputs.positions + [0] * pad,
        slot_mapping=inputs.slot_mapping + [-1] * pad,
        block_tables=tables,
        seq_lens=inputs.seq_lens + [1] * pad,
        query_start_loc=list(range(size + 1)),
        sample_req_ids=list(inputs.sample_req_ids),
        logits_indices=list(inputs.logits_indices),
    )


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
    on an H200) costs more than its GPU work at small batches; a graph replays the whole forward with one
    launch. Static input buffers are filled before each replay; a batch is padded to its bucket
    (:func:`pad_decode_inputs`). Captured largest first, so smaller graphs reuse the pool.
    Mirrors ``GPUModelRunner.capture_model`` / ``CudagraphDispatcher`` and nano-vllm's ``capture_cudagraph``.
    """

    def __init__(self, runner: ModelRunner, capture_sizes: Sequence[int]) -> None:
        if runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner = runner
        self.capture_sizes = sorted(capture_sizes)
        self.max_blocks = runner.max_blocks_per_req
        n, dev = self.capture_sizes[-1], runner.device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.runner.block_size,
            kv_caches=self.runner.kv_caches,
            backend="triton",
            # the tuned dispatch (kernels/dispatch.py) picks version and splits from shapes alone (validate=False
            # reads nothing from the host), so it can be captured; at batch 1-8 it is up to ~6x faster than v3
            decode_version=None,
        )

    def capture(self) -> None:
        """Capture one graph per size (largest first), after a warm-up run of each."""
        model = self.runner.model
        with torch.no_grad(), attn_implementation(model, ATTN_IMPLEMENTATION):
            for size in reversed(self.capture_sizes):
                meta = self._metadata(size)
                kwargs = {METADATA_KWARG: meta}
                ids, pos = self.input_ids[:size][None], self.positions[:size][None]
                model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)  # warm-up: compiles kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits[0]  # [size, V]
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size] = graph
                self.outputs[size] = out
                torch.cuda.synchronize()

    def can_run(self, inputs: ModelInputs) -> bool:
        return inputs.max_query_len == 1 and bucket_for(len(inputs.req_ids), self.capture_sizes) is not None

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Replay the bucket's graph on ``inputs``; returns the logits of the real requests ``[B, V]``."""
        b = len(inputs.req_ids)
        size = bucket_for(b, self.capture_sizes)
        assert size is not None
        padded = pad_decode_inputs(inputs, size, self.max_blocks)
        dev = self.runner.device
        self.input_ids[:size].copy_(torch.tensor(padded.input_ids), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(padded.positions), non_blocking=True)
        self.slot_mapping[:size].copy_(torch.tensor(padded.slot_mapping), non_blocking=True)
        self.block_tables[:size].copy_(torch.tensor(padded.block_tables, dtype=torch.int32), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(padded.seq_lens, dtype=torch.int32), non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][torch.tensor(inputs.logits_indices, device=dev)]


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
    ) -> None:
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
        # kv_caches[layer] = (key_cache, value_cache), each [num_blocks, block_size, Hkv, D]
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.num_layers)
        ]
        cpu_shape = (num_cpu_blocks, block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.cpu_kv_caches = [
            (torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin),
             torch.zeros(cpu_shape, dtype=self.dtype, pin_memory=pin))
            for _ in range(self.num_layers)
        ] if num_cpu_blocks else []
        self.graph_runner: CUDAGraphRunner | None = None
        if use_cuda_graph:
            try:
                graph_runner = CUDAGraphRunner(self, cudagraph_capture_sizes(max_num_seqs))
                graph_runner.capture()
                self.graph_runner = graph_runner
            except Exception as exc:  # a model whose forward cannot be captured: decode runs eagerly
                warnings.warn(f"CUDA-graph capture failed ({type(exc).__name__}: {exc}); decode runs eagerly",
                              stacklevel=2)
        self.last_inputs: ModelInputs | None = None  # the latest step's flattened inputs (for lessons)
        self._logits: torch.Tensor | None = None  # [rows, V]: compute_logits' buffer

    def kv_cache_bytes(self) -> int:
        """Bytes of the GPU-side KV cache (all layers, K and V)."""
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

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
            for layer in range(self.num_layers):
                for which in (0, 1):
                    src = (self.kv_caches if src_gpu else self.cpu_kv_caches)[layer][which]
                    dst = (self.kv_caches if dst_gpu else self.cpu_kv_caches)[layer][which]
                    dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)

    def build_metadata(self, inputs: ModelInputs) -> AttentionMetadata:
        """The step's :class:`AttentionMetadata` on the runner's device. Mirrors
        ``FlashAttentionMetadataBuilder.build``."""
        dev = self.device
        width = max(len(t) for t in inputs.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in inputs.block_tables], dtype=torch.int32)  # [B, W]
        qsl = inputs.query_start_loc
        decodes = [b for b in range(len(inputs.req_ids)) if qsl[b + 1] - qsl[b] == 1]
        prefills = [(b, qsl[b], qsl[b + 1], inputs.seq_lens[b]) for b in range(len(inputs.req_ids))
                    if qsl[b + 1] - qsl[b] > 1]
        return AttentionMetadata(
            slot_mapping=torch.tensor(inputs.slot_mapping, dtype=torch.long, device=dev),
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
                g.to(dev) for g in make_decode_groups(decodes, inputs.seq_lens, tables, qsl, self.block_size)
            ],
        )

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
        meta = self.build_metadata(inputs)
        ids = torch.tensor(inputs.input_ids, dtype=torch.long, device=self.device)[None]  # [1, T]
        pos = torch.tensor(inputs.positions, dtype=torch.long, device=self.device)[None]  # [1, T]
        keep = torch.tensor(inputs.logits_indices, dtype=torch.long, device=self.device)  # [S]
        with attn_implementation(self.model, ATTN_IMPLEMENTATION):
            hidden = self.model.base_model(
                input_ids=ids, position_ids=pos, use_cache=False, **{METADATA_KWARG: meta}
            ).last_hidden_state  # [1, T, H]
        return inputs.sample_req_ids, self.compute_logits(hidden[0, keep])  # [S, V]
