"""Sizing the pool: how many KV blocks fit on the device, computed the way vLLM 0.26 computes it.

vLLM 0.26 sizes its block pool once, at start-up, in three steps:

1. ``vllm/v1/worker/utils.py::request_memory``: the memory the engine may use is
   ``requested = math.ceil(total_memory * gpu_memory_utilization)`` (``CacheConfig.gpu_memory_utilization``
   defaults to 0.92, ``vllm/config/cache.py``).
2. ``vllm/v1/worker/gpu_worker.py::determine_available_memory`` runs a dummy forward pass of
   ``max_num_batched_tokens`` tokens inside ``vllm/utils/mem_utils.py::memory_profiling`` and subtracts
   everything that is not KV cache: the weights, the peak increase of torch's allocated bytes during the run
   (activations), the increase of memory that torch does not allocate since the worker's start-up snapshot
   (cuBLAS workspaces and the like; the CUDA context and NCCL's first buffers are in that snapshot already)
   and the CUDA-graph estimate the model runner's ``profile_cudagraph_memory()`` returns, applied when
   ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1`` (the default since v0.21)::

       available = requested - (non_torch + peak_activation + weights) - cudagraph

   For a dense model that estimate is **0**: 0.26 builds Model Runner V2 for it (``VllmConfig.use_v2_model_runner``,
   ``vllm/config/vllm.py``), whose ``profile_cudagraph_memory`` (``vllm/v1/worker/gpu/model_runner.py``) returns
   0, because it captures its graphs after the KV cache is allocated. Only the V1 runner, still built for MoE
   and Mamba-hybrid models, measures graphs here (``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.
   profile_cudagraph_memory``). :mod:`pagedkv.sizing.vllm_config` decides which, as 0.26 does.

3. ``vllm/v1/core/kv_cache_utils.py::get_num_blocks`` (called by ``get_kv_cache_config_from_groups``) divides
   what is left by the bytes one block takes in one layer (``FullAttentionSpec.page_size_bytes``,
   ``vllm/v1/kv_cache_interface.py``: ``2 * block_size * num_kv_heads * head_size * dtype_size``) and by the
   number of layers, each layer having its own tensor of ``num_blocks`` pages::

       num_blocks = int(available // page_size // num_layers)

``kv_cache_memory_bytes`` (``vllm/config/cache.py``) replaces step 2's subtraction with the budget it names
(``request_memory`` and the profile run still happen); ``num_gpu_blocks_override`` replaces the block count
afterwards; the lab's engine takes ``num_gpu_blocks`` for the same purpose.

:func:`profile` does the whole thing for a loaded model: on a CUDA GPU it measures, as vLLM does; on a CPU
(a laptop) it computes the same breakdown analytically, labelled as such, against a small stated budget
(:data:`CPU_TOTAL_MEMORY`), because a CPU has no device memory of its own to profile.

The exercise set asks for ``kv_page_bytes``, ``num_gpu_blocks`` and a prediction like ``analytic_profile``. Each is
computed in one function only, which the rest of the library calls (:func:`profile` calls
:func:`analytic_profile`, which calls the other two), so the grader hides an answer by stubbing that one function.

The package keeps each part where vLLM keeps it:

- :mod:`pagedkv.sizing.model`: a config's shape numbers (``vllm/config/model.py``), parameters, activations;
- :mod:`pagedkv.sizing.kv_cache_utils`: the page arithmetic (``vllm/v1/core/kv_cache_utils.py``);
- :mod:`pagedkv.sizing.mem_utils`: memory snapshots and profiling (``vllm/utils/mem_utils.py``);
- :mod:`pagedkv.sizing.gpu_worker`: the profile run and its result (``vllm/v1/worker/gpu_worker.py``);
- :mod:`pagedkv.sizing.vllm_config`: which model runner 0.26 builds, and so the CUDA-graph term
  (``vllm/config/vllm.py``: ``use_v2_model_runner``);
- :mod:`pagedkv.sizing.hybrid`: hybrid models (lesson 8): KV cache groups, page-size unification, each spec's
  ``max_memory_usage_bytes`` and the concurrency vLLM logs (``vllm/v1/core/kv_cache_utils.py``).

Everything public is re-exported here, so ``from pagedkv.sizing import profile`` works as before.
"""

from pagedkv.sizing.gpu_worker import (
    CPU_TOTAL_MEMORY,
    MemoryProfile,
    analytic_profile,
    default_cudagraph_batch_sizes,
    profile,
)
from pagedkv.sizing.hybrid import HYBRID_SHAPES, HybridSizing, hybrid_sizing
from pagedkv.sizing.kv_cache_utils import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    KV_CACHE_DTYPES,
    NoKVCacheMemoryError,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    kv_page_bytes,
    max_concurrency,
    num_gpu_blocks,
    request_memory,
    resolve_kv_cache_dtype,
)
from pagedkv.sizing.mem_utils import GiB, MemoryProfilingResult, MemorySnapshot, format_gib, memory_profiling
from pagedkv.sizing.model import (
    ModelShape,
    derived_max_model_len,
    estimate_peak_activation,
    get_and_verify_max_len,
    model_shape,
    num_parameters,
    weights_bytes,
)
from pagedkv.sizing.vllm_config import (
    DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES,
    cudagraph_memory_estimate_applied,
    is_hybrid,
    num_experts,
    use_v2_model_runner,
)

__all__ = [
    "CPU_TOTAL_MEMORY",
    "DEFAULT_GPU_MEMORY_UTILIZATION",
    "NoKVCacheMemoryError",
    "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
    "GiB",
    "HYBRID_SHAPES",
    "HybridSizing",
    "KV_CACHE_DTYPES",
    "MemoryProfile",
    "MemoryProfilingResult",
    "MemorySnapshot",
    "ModelShape",
    "analytic_profile",
    "check_enough_kv_cache_memory",
    "estimate_max_model_len",
    "cudagraph_memory_estimate_applied",
    "default_cudagraph_batch_sizes",
    "derived_max_model_len",
    "estimate_peak_activation",
    "format_gib",
    "get_and_verify_max_len",
    "hybrid_sizing",
    "is_hybrid",
    "kv_page_bytes",
    "max_concurrency",
    "memory_profiling",
    "model_shape",
    "num_gpu_blocks",
    "num_experts",
    "num_parameters",
    "weights_bytes",
    "profile",
    "request_memory",
    "resolve_kv_cache_dtype",
    "use_v2_model_runner",
]
