"""A roofline cost model of one serving step, so throughput can be measured on a laptop.

A step's time is the larger of its compute time (FLOPs over the GPU's usable FLOP/s) and its memory time
(bytes moved over usable HBM bandwidth), plus a fixed per-step overhead and any swap traffic over PCIe:

- FLOPs: ``2 * num_params`` per token for the weight matmuls, plus attention, ``4 * num_layers * num_heads *
  head_dim`` per (query token, key) pair (QK^T and PV).
- bytes: every weight once per step (a batch shares them), plus every scheduled request's KV read once
  (its context) and its new tokens' KV written.

A decode step (one token per request) moves all the weights to produce B tokens: memory-bound, so its time
barely grows with B until the KV reads catch up; a prefill chunk of thousands of tokens is compute-bound.
That is the source card's chain: more sequences in the batch amortise the weights over more tokens.

Parameters (edit them to model another machine; every number below is a stated assumption):

- ``H100_SXM``: NVIDIA H100 SXM5 80 GB datasheet: 80 GB HBM3 (80 GiB, as vLLM's log counts it) at 3.35 TB/s, 989
  TFLOP/s dense BF16 tensor (1979 is the 2:4-sparse figure), PCIe Gen5 x16 at 64 GB/s per direction. Achievable
  fractions are our assumptions: 80 % of HBM bandwidth (typical of large streaming kernels), 50 % of peak FLOP/s
  for prefill (typical MFU), 80 % of PCIe with pinned host memory, and 1 ms of per-step overhead (scheduling,
  input preparation, kernel launches).
- ``LLAMA2_7B``: Llama-2-7B's Hugging Face config (32 layers, hidden 4096, 32 attention heads, 32 KV heads,
  head_dim 128; 6.74e9 parameters), FP16 weights and KV: 13.5 GB of weights, and
  ``2 (K, V) * 32 layers * 32 heads * 128 * 2 bytes = 512 KiB`` of KV per token (the PagedAttention paper
  quotes 800 KB for the 13B model, whose hidden size is 5120 and 40 layers).

The step cost has no vLLM counterpart (vLLM measures, it does not model); its structure is the roofline
model (Williams, Waterman and Patterson, CACM 2009) applied to a transformer step. ``num_gpu_blocks``
follows vLLM 0.26's sizing arithmetic (``gpu_memory_utilization`` 0.92 by default; see its docstring).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.utils import cdiv


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_bytes: float  # device memory, bytes
    hbm_bandwidth: float  # bytes/s, peak
    peak_flops: float  # FLOP/s, dense 16-bit tensor cores
    pcie_bandwidth: float  # bytes/s per direction, peak
    mem_efficiency: float = 0.8  # fraction of hbm_bandwidth achieved
    compute_efficiency: float = 0.5  # fraction of peak_flops achieved (MFU)
    pcie_efficiency: float = 0.8
    step_overhead_s: float = 1e-3


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # weights
    kv_dtype_bytes: int = 2  # KV cache (1 for FP8 KV)

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: ``2 * L * Hkv * D * bytes``."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes


#: ``CacheConfig.gpu_memory_utilization``'s default in vLLM 0.26 (``vllm/config/cache.py``).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92

H100_SXM = GPUSpec(
    "H100 SXM5 80GB", hbm_bytes=80 * 2**30, hbm_bandwidth=3.35e12, peak_flops=989e12, pcie_bandwidth=64e9
)
LLAMA2_7B = ModelSpec(
    "Llama-2-7B", num_params=6.74e9, num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128
)


@dataclass(frozen=True)
class StepCost:
    """One step's cost, broken down."""

    time_s: float
    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    transfer_s: float  # swap traffic over PCIe, and copy-on-write copies
    num_tokens: int

    @property
    def bound(self) -> str:
        """Which roof the step hit: ``"memory"`` or ``"compute"``."""
        return "memory" if self.memory_s >= self.compute_s else "compute"


class CostModel:
    """The time of a step of a ``model`` served on a ``gpu`` with a paged KV cache of ``block_size``."""

    def __init__(self, gpu: GPUSpec = H100_SXM, model: ModelSpec = LLAMA2_7B, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.gpu = gpu
        self.model = model
        self.block_size = block_size

    # --- sizes -------------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        return self.model.kv_bytes_per_token * self.block_size

    def num_gpu_blocks(
        self,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        activation_bytes: float = 1.5e9,
        cudagraph_bytes: float = 0.0,
        non_torch_bytes: float = 0.3e9,
        kv_cache_memory_bytes: int | None = None,
    ) -> int:
        """How many KV blocks fit, by vLLM 0.26's arithmetic.

        ``vllm/v1/worker/utils.py::request_memory`` asks for ``ceil(total * gpu_memory_utilization)`` bytes
        (``CacheConfig.gpu_memory_utilization``, default 0.92, ``vllm/config/cache.py``);
        ``vllm/v1/worker/gpu_worker.py::Worker.determine_available_memory`` subtracts the non-KV memory it
        profiles (weights + the torch peak of a dummy forward pass + the non-torch increase: cuBLAS
        workspaces and the like) and the model runner's CUDA-graph estimate (``cudagraph_memory_estimate_applied``):
        0 by default, because the dense models this cost model describes run on Model Runner V2, whose
        ``profile_cudagraph_memory`` returns 0 (``vllm/v1/worker/gpu/model_runner.py``: its graphs are captured
        after the KV cache is allocated); pass the V1 runner's "Estimated CUDA graph memory" to model an MoE or
        Mamba-hybrid model (``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.profile_cudagraph_memory``,
        subtracted while ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1``, the default since v0.21).
        ``vllm/v1/core/kv_cache_utils.py::get_num_blocks`` divides what is left by
        the page size and the number of layers (here ``kv_bytes_per_block`` covers all layers at once, and
        the two floors give the same integer). When ``kv_cache_memory_bytes`` is given it is the KV budget
        itself and the utilization is ignored, as in vLLM. The activation and non-torch figures are this
        model's assumptions for a 7B model on one GPU, not measurements. Changes nothing; raises
        ``ValueError`` when the non-KV memory exceeds the requested memory or an argument is out of range."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if min(activation_bytes, cudagraph_bytes, non_torch_bytes) < 0:
            raise ValueError("activation_bytes, cudagraph_bytes and non_torch_bytes must be >= 0")
        if kv_cache_memory_bytes is not None:
            if kv_cache_memory_bytes < 0:
                raise ValueError(f"kv_cache_memory_bytes must be >= 0, got {kv_cache_memory_bytes}")
            available = float(kv_cache_memory_bytes)
        else:
            requested = math.ceil(self.gpu.hbm_bytes * gpu_memory_utilization)
            non_kv = self.model.weight_bytes + activation_bytes + non_torch_bytes
            available = requested - non_kv - cudagraph_bytes
            if available <= 0:
                raise ValueError(
                    f"no memory left for the KV cache: {requested / 2**30:.2f} GiB requested "
                    f"({gpu_memory_utilization} of {self.gpu.hbm_bytes / 2**30:.0f} GiB), "
                    f"{(non_kv + cudagraph_bytes) / 2**30:.2f} GiB of it is not KV"
                )
        return int(available // self.kv_bytes_per_block)

    # --- one step ----------------------------------------------------------------------------------------
    def chunks_cost(
        self, chunks: Iterable[tuple[int, int]], num_swap_blocks: int = 0, num_copy_blocks: int = 0
    ) -> StepCost:
        """The cost of a step that computes, for each ``(start, n)``, ``n`` tokens of a sequence whose first
        ``start`` tokens are already cached; plus ``num_swap_blocks`` blocks over PCIe and
        ``num_copy_blocks`` blocks copied on the GPU."""
        m, g = self.model, self.gpu
        flops = 0.0
        kv_tokens = 0
        num_tokens = 0
        attn_per_pair = 4 * m.num_layers * m.num_heads * m.head_dim
        for start, n in chunks:
            if n <= 0:
                continue
            num_tokens += n
            # query i (0-based in the chunk) attends to start + i + 1 keys
            pairs = n * start + n * (n + 1) // 2
            flops += attn_per_pair * pairs
            kv_tokens += start + 2 * n  # read the context (cached + new), write the new
        if num_tokens == 0 and num_swap_blocks == 0 and num_copy_blocks == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0)
        flops += 2 * m.num_params * num_tokens
        hbm = (m.weight_bytes if num_tokens else 0.0) + kv_tokens * m.kv_bytes_per_token
        hbm += 2 * num_copy_blocks * self.kv_bytes_per_block
        compute_s = flops / (g.peak_flops * g.compute_efficiency)
        memory_s = hbm / (g.hbm_bandwidth * g.mem_efficiency)
        transfer_s = num_swap_blocks * self.kv_bytes_per_block / (g.pcie_bandwidth * g.pcie_efficiency)
        time_s = g.step_overhead_s + max(compute_s, memory_s) + transfer_s
        return StepCost(time_s, flops, hbm, compute_s, memory_s, transfer_s, num_tokens)

    def step_cost(self, scheduler_output) -> StepCost:  # noqa: ANN001 - a SchedulerOutput
        """The cost of the step a ``SchedulerOutput`` describes."""
        out = scheduler_output
        chunks = [(out.num_computed_tokens.get(rid, 0), n) for rid, n in out.num_scheduled_tokens.items()]
        swaps = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        return self.chunks_cost(chunks, num_swap_blocks=swaps, num_copy_blocks=len(out.blocks_to_copy))

    # --- closed forms for plots ----------------------------------------------------------------------------
    def decode_step(self, batch_size: int, context_len: int) -> StepCost:
        """A pure decode step: ``batch_size`` sequences of ``context_len`` cached tokens, one new token each."""
        return self.chunks_cost([(context_len, 1)] * batch_size)

    def decode_throughput(self, batch_size: int, context_len: int) -> float:
        """Generated tokens per second of back-to-back decode steps at this batch size."""
        return batch_size / self.decode_step(batch_size, context_len).time_s

    def prefill_cost(self, num_tokens: int) -> StepCost:
        """One sequence's prefill of ``num_tokens`` tokens from scratch, alone in a step."""
        return self.chunks_cost([(0, num_tokens)])

    def recompute_seconds(self, seq_len: int) -> float:
        """What recomputing a preempted sequence's KV adds to a busy step: its prefill FLOPs at the usable
        FLOP/s (the weights are read for the batch anyway, so only the compute is extra)."""
        m, g = self.model, self.gpu
        flops = 2 * m.num_params * seq_len + 4 * m.num_layers * m.num_heads * m.head_dim * seq_len * (seq_len + 1) / 2
        return flops / (g.peak_flops * g.compute_efficiency)

    def swap_seconds(self, seq_len: int) -> float:
        """Swapping a sequence's KV out and back in: ``2 * ceil(seq_len / block_size)`` blocks over PCIe."""
        g = self.gpu
        blocks = cdiv(seq_len, self.block_size)
        return 2 * blocks * self.kv_bytes_per_block / (g.pcie_bandwidth * g.pcie_efficiency)
