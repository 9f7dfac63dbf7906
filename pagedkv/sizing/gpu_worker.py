"""The profile run: how many KV blocks fit for a loaded model, ``vllm/v1/worker/gpu_worker.py::
determine_available_memory`` in vLLM 0.26 -- measured on a CUDA GPU, computed on paper on a CPU -- and its
result, :class:`MemoryProfile`, the figures vLLM logs at start-up."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.sizing.kv_cache_utils import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    _check_utilization,
    _memory_figure,
    check_enough_kv_cache_memory,
    kv_page_bytes,
    max_concurrency,
    num_gpu_blocks,
    request_memory,
    resolve_kv_cache_dtype,
)
from pagedkv.sizing.mem_utils import GiB, MemorySnapshot, format_gib, memory_profiling
from pagedkv.sizing.model import estimate_peak_activation, model_shape, weights_bytes
from pagedkv.sizing.vllm_config import use_v2_model_runner as _use_v2_model_runner
from pagedkv.utils import check_int

__all__ = [
    "CPU_TOTAL_MEMORY",
    "MemoryProfile",
    "analytic_profile",
    "default_cudagraph_batch_sizes",
    "profile",
]

#: The "device memory" a CPU profile assumes when ``total_memory`` is not given: 512 MiB. A CPU has no
#: device memory to measure, and the KV cache lives in the same RAM as the notebook, the browser and the OS;
#: at 0.92 this leaves about 0.45 GiB of KV for a tiny model -- tens of thousands of blocks, far more than any
#: CPU lesson needs, and small enough that several kernels on an 8 GB laptop (or a busy CI box) stay within
#: memory. Pass ``total_memory`` to size for a real device instead.
CPU_TOTAL_MEMORY = 512 * (1 << 20)


@dataclass(frozen=True)
class MemoryProfile:
    """Where the device's memory goes, and how many KV blocks are left: the figures vLLM 0.26 logs at start-up.

    ``method`` is "measured" (a profile run on a CUDA GPU) or "analytic" (computed; a CPU has no device memory
    to measure). All figures in bytes. ``page_size_bytes`` is one block in one layer.
    """

    method: str
    device: str
    total_memory: int
    gpu_memory_utilization: float
    requested_memory: int
    weights_memory: int
    peak_activation_memory: int
    non_torch_memory: int
    cudagraph_memory: int
    page_size_bytes: int
    num_layers: int
    block_size: int
    kv_cache_dtype: torch.dtype
    max_num_batched_tokens: int
    max_model_len: int
    num_gpu_blocks: int
    notes: tuple[str, ...] = field(default=())

    @property
    def non_kv_cache_memory(self) -> int:
        """``non_torch + peak_activation + weights`` (``MemoryProfilingResult.non_kv_cache_memory``)."""
        return self.non_torch_memory + self.peak_activation_memory + self.weights_memory

    @property
    def available_kv_cache_memory(self) -> int:
        """``requested - non_kv - cudagraph`` (``Worker.available_kv_cache_memory_bytes``)."""
        return self.requested_memory - self.non_kv_cache_memory - self.cudagraph_memory

    @property
    def kv_cache_memory(self) -> int:
        """The bytes the cache actually takes: whole blocks in every layer (the rest of the available bytes is
        the remainder of the division, left unused)."""
        return self.num_gpu_blocks * self.page_size_bytes * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers (``page_size_bytes * num_layers / block_size``)."""
        return self.page_size_bytes * self.num_layers // self.block_size

    def max_concurrency(self, num_tokens: int | None = None) -> float:
        """Requests of ``num_tokens`` tokens (default ``max_model_len``) the pool holds at once (vLLM's
        "Maximum concurrency"; see :func:`max_concurrency`)."""
        return max_concurrency(self.num_gpu_blocks, self.block_size, num_tokens or self.max_model_len)

    def kv_cache_size_tokens(self, num_tokens: int | None = None) -> int:
        """vLLM's "GPU KV cache size" in tokens: ``int(max_concurrency * max_model_len)``
        (``kv_cache_utils.py::get_kv_cache_capacity``)."""
        num_tokens = num_tokens or self.max_model_len
        return int(self.max_concurrency(num_tokens) * num_tokens)

    def breakdown(self) -> dict[str, int]:
        """The requested memory split into its parts, in bytes, for a stacked bar (they sum to
        ``requested_memory``). The lab's own view: vLLM logs the same figures as lines (``MemoryProfilingResult``)."""
        return {
            "weights": self.weights_memory,
            "peak activations": self.peak_activation_memory,
            "non-torch": self.non_torch_memory,
            "CUDA graphs": self.cudagraph_memory,
            "KV cache": self.kv_cache_memory,
            "unused remainder": self.available_kv_cache_memory - self.kv_cache_memory,
        }

    def __str__(self) -> str:
        L = self.max_model_len
        label = "measured" if self.method == "measured" else f"analytic estimate on {self.device}, not measured"
        lines = [
            f"Memory profiling ({label}): total memory {format_gib(self.total_memory)} GiB, requested memory "
            f"{format_gib(self.requested_memory)} GiB (gpu_memory_utilization={self.gpu_memory_utilization}), "
            f"dummy batch of {self.max_num_batched_tokens:,} tokens.",
            f"Total non KV cache memory: {format_gib(self.non_kv_cache_memory)}GiB; torch peak memory increase: "
            f"{format_gib(self.peak_activation_memory)}GiB; non-torch forward increase memory: "
            f"{format_gib(self.non_torch_memory)}GiB; weights memory: {format_gib(self.weights_memory)}GiB.",
        ]
        if self.cudagraph_memory:  # the V1 runner's profile_cudagraph_memory logs it; Model Runner V2 has none
            lines.append(f"Estimated CUDA graph memory: {self.cudagraph_memory / GiB:.2f} GiB total")
        lines += [
            f"Available KV cache memory: {format_gib(self.available_kv_cache_memory)} GiB",
            f"KV cache: {self.page_size_bytes:,} bytes per block per layer ({self.block_size} tokens, "
            f"{str(self.kv_cache_dtype).removeprefix('torch.')}) x {self.num_layers} layers",
            f"GPU KV cache size: {self.kv_cache_size_tokens():,} tokens",
            f"Maximum concurrency for {L:,} tokens per request: {self.max_concurrency():.2f}x",
            f"# GPU blocks: {self.num_gpu_blocks}, concurrency for {L}-token requests: {self.max_concurrency():.2f}x",
        ]
        lines += [f"Note: {n}" for n in self.notes]
        return "\n".join(lines)



def analytic_profile(
    config: Any,
    max_num_batched_tokens: int,
    *,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    total_memory: int = CPU_TOTAL_MEMORY,
    weights_memory: int | None = None,
    weight_bits: float | None = None,
    peak_activation_memory: int | None = None,
    non_torch_memory: int = 0,
    cudagraph_memory: int = 0,
    max_model_len: int | None = None,
    device: str = "cpu",
    notes: tuple[str, ...] = (),
) -> MemoryProfile:
    """vLLM's start-up breakdown computed on paper for a model ``config``, every term given or estimated.

    ``weights_memory`` defaults to :func:`num_parameters` at ``weight_bits`` bits each (default: the config's
    dtype; 4 for 4-bit quantised weights, ignoring the quantisation scales); ``peak_activation_memory`` to
    :func:`estimate_peak_activation` at ``max_num_batched_tokens``; non-torch and CUDA-graph memory to 0 (a CPU
    has neither; pass figures from a vLLM log to model a GPU). ``max_model_len`` defaults to the config's
    ``max_position_embeddings``. Then :func:`kv_page_bytes` and :func:`num_gpu_blocks` (called, not written again:
    each answer of lesson 5 has one copy), and vLLM's check that one ``max_model_len`` request fits. Returns a
    new MemoryProfile; changes nothing.
    """
    shape = model_shape(config)
    block_size = check_int(block_size, "block_size", 1)
    max_num_batched_tokens = check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, shape.dtype)
    utilization = _check_utilization(gpu_memory_utilization)
    if weights_memory is None:
        weights_memory = weights_bytes(config, weight_bits)
    if peak_activation_memory is None:
        peak_activation_memory = estimate_peak_activation(config, max_num_batched_tokens)
    if max_model_len is None:
        max_model_len = shape.max_position_embeddings or 2048
    max_model_len = check_int(max_model_len, "max_model_len", 1)
    page = kv_page_bytes(shape, block_size, kv_dtype)
    blocks = num_gpu_blocks(
        total_memory,
        utilization,
        weights_memory,
        peak_activation_memory,
        non_torch_memory,
        cudagraph_memory,
        page,
        shape.num_layers,
    )
    requested = request_memory(total_memory, utilization)
    available = requested - non_torch_memory - peak_activation_memory - weights_memory - cudagraph_memory
    check_enough_kv_cache_memory(available, page, shape.num_layers, block_size, max_model_len)
    return MemoryProfile(
        method="analytic",
        device=device,
        total_memory=int(total_memory),
        gpu_memory_utilization=utilization,
        requested_memory=requested,
        weights_memory=int(weights_memory),
        peak_activation_memory=int(peak_activation_memory),
        non_torch_memory=int(non_torch_memory),
        cudagraph_memory=int(cudagraph_memory),
        page_size_bytes=page,
        num_layers=shape.num_layers,
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_gpu_blocks=blocks,
        notes=tuple(notes),
    )



def _find_hf_model(obj: Any) -> torch.nn.Module:
    """The transformers model inside ``obj``: the model itself, or an engine's ``model_runner.model`` / ``model``."""
    if isinstance(obj, torch.nn.Module):
        return obj
    for path in (("model_runner", "model"), ("model",), ("llm_engine", "model_runner", "model")):
        cur = obj
        for name in path:
            cur = getattr(cur, name, None)
        if isinstance(cur, torch.nn.Module):
            return cur
    raise ValueError(
        f"profile() needs a transformers model or an engine holding one (.model_runner.model or .model), "
        f"got {type(obj).__name__}"
    )


def _module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each tensor's storage counted once, so tied weights once):
    vLLM measures ``model_memory_usage`` as the memory loading took, which is the same for a loaded model."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _hf_dummy_run(model: torch.nn.Module, num_tokens: int, num_logit_rows: int, device: torch.device) -> None:
    """One forward pass over ``num_tokens`` tokens without a KV cache, logits for the last ``num_logit_rows``
    positions only (vLLM computes logits for one sampled position per request, never for all tokens)."""
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)  # ids: [1, T]
    with torch.inference_mode():
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        hidden = decoder(input_ids=ids, use_cache=False)[0]  # hidden: [1, T, H]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is not None:
            head(hidden[:, -num_logit_rows:]).float()  # logits: [1, rows, V], float32 as the sampler upcasts
    torch.cuda.synchronize(device)


def _check_batch_sizes(sizes: tuple[int, ...]) -> None:
    """Refuse an empty tuple of CUDA-graph batch sizes, or one holding anything but ints >= 1."""
    if not sizes:
        raise ValueError("cudagraph_batch_sizes is empty: give at least one batch size to capture")
    for b in sizes:
        check_int(b, "each of cudagraph_batch_sizes", 1)


def _hf_cudagraph_memory(model: torch.nn.Module, batch_sizes: tuple[int, ...], device: torch.device) -> int:
    """Capture decode graphs (one token per sequence, no KV cache) for ``batch_sizes``, largest first, and
    estimate the graph pool as ``gpu_model_runner.py::profile_cudagraph_memory`` does: the first capture's
    memory plus (n - 1) times the second's (at least 1 MiB each). Graphs are discarded afterwards."""
    sizes = sorted(set(batch_sizes), reverse=True)
    _check_batch_sizes(sizes)
    pool = torch.cuda.graph_pool_handle()
    samples: list[int] = []
    graphs = []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    try:
        _capture_decode_graphs(decoder, sizes[:2], pool, samples, graphs, device)
    finally:  # the graphs are only measured: free them whatever happened
        graphs.clear()
        gc.collect()
        torch.cuda.empty_cache()
    per_graph = max(samples[1] if len(samples) > 1 else 0, 1 << 20)
    return int(samples[0] + per_graph * (len(sizes) - 1))


def _capture_decode_graphs(decoder, sizes, pool, samples: list[int], graphs: list, device: torch.device) -> None:
    """Capture one decode graph per batch size in ``sizes``, recording the free memory each one took."""
    with torch.inference_mode():
        for b in sizes:
            ids = torch.zeros((b, 1), dtype=torch.long, device=device)  # ids: [B, 1]
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                decoder(input_ids=ids, use_cache=False)  # warm-up outside the graph
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            before = torch.cuda.mem_get_info(device)[0]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                decoder(input_ids=ids, use_cache=False)
            torch.cuda.synchronize(device)
            samples.append(before - torch.cuda.mem_get_info(device)[0])
            graphs.append(graph)


def default_cudagraph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes the engine captures for ``max_num_seqs`` (``pagedkv.engine.model_runner.
    cudagraph_capture_sizes``, the one list of them; vLLM 0.26's ``VllmConfig._set_cudagraph_sizes``): what the
    CUDA-graph estimate captures unless told otherwise. Imported when needed, so sizing loads no engine."""
    from pagedkv.engine.model_runner import cudagraph_capture_sizes

    return tuple(cudagraph_capture_sizes(max_num_seqs))


def profile(
    model_or_llm: Any,
    max_num_batched_tokens: int,
    *,
    block_size: int = 16,
    kv_cache_dtype: str | torch.dtype = "auto",
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    device: str | torch.device | None = None,
    total_memory: int | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    cuda_graphs: bool = False,
    cudagraph_batch_sizes: tuple[int, ...] | None = None,
    dummy_run: Callable[[int], None] | None = None,
    cudagraph_memory: Callable[[], int] | None = None,
    use_v2_model_runner: bool | None = None,
) -> MemoryProfile:
    """Size the KV pool for a loaded model (or an engine holding one): vLLM 0.26's
    ``gpu_worker.py::determine_available_memory`` followed by ``kv_cache_utils.py::get_num_blocks``.

    On a CUDA device: snapshot, then inside :func:`memory_profiling` a dummy batch of ``max_num_batched_tokens``
    tokens (``dummy_run(num_tokens)`` when the engine gives one, else one forward of the transformers model
    with logits for ``min(max_num_seqs, tokens)`` rows), the torch peak taken before any CUDA-graph capture.
    CUDA graphs enter the budget as vLLM 0.26's runners decide (:mod:`pagedkv.sizing.vllm_config`): under Model
    Runner V2 -- ``use_v2_model_runner``, by default what 0.26 picks for the config: every dense model --
    never (``vllm/v1/worker/gpu/model_runner.py``: ``profile_cudagraph_memory`` returns 0; the graphs are
    captured after the KV cache is allocated); under the V1 runner (MoE and Mamba-hybrid models, or
    ``use_v2_model_runner=False``), with ``cuda_graphs``, the graph pool is measured by capturing decode graphs
    of ``cudagraph_batch_sizes`` (default: the engine's, :func:`default_cudagraph_batch_sizes` of
    ``max_num_seqs``), or by ``cudagraph_memory()`` (an engine's own capture returning bytes), as
    ``gpu_model_runner.py::GPUModelRunner.profile_cudagraph_memory`` does, and subtracted.
    ``total_memory`` defaults to ``mem_get_info``'s total. The
    lab profiles a model that is already loaded, so its baseline is the moment profiling starts (vLLM's is the
    worker's start, before loading) and the weights are the bytes of the parameters and buffers.

    On a CPU: the same breakdown computed (:func:`analytic_profile`): weights counted from the model's
    tensors, activations estimated, no non-torch or CUDA-graph memory, against ``total_memory`` (default
    :data:`CPU_TOTAL_MEMORY`, 512 MiB), and labelled "analytic".

    Changes nothing in the model or the engine (the dummy run writes no KV cache). Raises ``ValueError``,
    before running anything, for a bad utilization, block size, dtype or token count, and when the non-KV
    memory leaves nothing for the cache or one ``max_model_len`` request does not fit.
    """
    utilization = _check_utilization(gpu_memory_utilization)
    block_size = check_int(block_size, "block_size", 1)
    max_num_batched_tokens = check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
    max_num_seqs = check_int(max_num_seqs, "max_num_seqs", 1)
    if cuda_graphs and cudagraph_memory is None:
        if cudagraph_batch_sizes is None:
            cudagraph_batch_sizes = default_cudagraph_batch_sizes(max_num_seqs)
        _check_batch_sizes(tuple(cudagraph_batch_sizes))
    if total_memory is not None:
        total_memory = _memory_figure(total_memory, "total_memory")
        if total_memory == 0:
            raise ValueError("total_memory must be > 0 bytes")
    model = _find_hf_model(model_or_llm)
    config = model.config
    if use_v2_model_runner is None:
        use_v2_model_runner = _use_v2_model_runner(config)
    model_dtype = _model_dtype(model)
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device(device)
    weights = _module_bytes(model)

    if device.type != "cuda":
        shape = model_shape(config)
        rows = min(max_num_seqs, max_num_batched_tokens)
        activations = estimate_peak_activation(config, max_num_batched_tokens, model_dtype, rows)
        return analytic_profile(
            dataclasses.replace(shape, dtype=model_dtype),  # "auto" means the dtype the model runs in
            max_num_batched_tokens,
            block_size=block_size,
            kv_cache_dtype=kv_dtype,
            gpu_memory_utilization=utilization,
            total_memory=CPU_TOTAL_MEMORY if total_memory is None else total_memory,
            weights_memory=weights,
            peak_activation_memory=activations,
            max_model_len=max_model_len,
            device=str(device),
            notes=(
                "a CPU has no device memory to profile: weights are the model's tensors, activations an estimate, "
                "non-torch and CUDA-graph memory 0, and the total a stated budget (pass total_memory to change it)",
            ),
        )
    return _profile_cuda(
        model,
        config,
        device,
        max_num_batched_tokens,
        block_size,
        kv_dtype,
        utilization,
        total_memory,
        max_model_len,
        max_num_seqs,
        cuda_graphs and not use_v2_model_runner,
        cudagraph_batch_sizes,
        dummy_run,
        cudagraph_memory,
        weights,
        "CUDA graphs off: no graph memory estimated"
        if not cuda_graphs
        else "Model Runner V2: profile_cudagraph_memory() returns 0; its CUDA graphs are captured after the KV "
        "cache is allocated, outside this budget",
    )


def _profile_cuda(
    model: torch.nn.Module,
    config: Any,
    device: torch.device,
    num_tokens: int,
    block_size: int,
    kv_dtype: torch.dtype,
    utilization: float,
    total_memory: int | None,
    max_model_len: int | None,
    max_num_seqs: int,
    cuda_graphs: bool,
    cudagraph_batch_sizes: tuple[int, ...] | None,
    dummy_run: Callable[[int], None] | None,
    cudagraph_memory: Callable[[], int] | None,
    weights: int,
    no_graph_note: str,
) -> MemoryProfile:
    """The measured path of :func:`profile` (needs CUDA); ``cuda_graphs``: estimate the graph pool as the V1
    runner does (else ``no_graph_note`` says why not)."""
    shape = model_shape(config)
    gc.collect()  # an engine the notebook dropped still holds its KV cache until collected: free it first
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    baseline = MemorySnapshot.measure(device)
    total = baseline.total_memory if total_memory is None else total_memory
    requested = request_memory(total, utilization)
    # vLLM's request_memory refuses to start when free memory at start-up is below the request. vLLM profiles in
    # a fresh process; the lab profiles a model already loaded, so its stand-in for "free at start-up" is free
    # now plus this model's weights. Anything else this process holds (another engine's KV cache) is not free.
    startup_free = baseline.free_memory + weights
    if total_memory is None and startup_free < requested:
        raise ValueError(
            f"Free memory on device {device} ({format_gib(startup_free)}/{format_gib(total)} GiB) on startup is "
            f"less than desired GPU memory utilization ({utilization}, {format_gib(requested)} GiB). Decrease GPU "
            "memory utilization or reduce GPU memory used by other processes, or by other engines in this one "
            f"(`del` them; this process holds {format_gib(max(0, baseline.torch_memory - weights))} GiB besides the "
            "model's weights)."
        )
    run = dummy_run or (lambda n: _hf_dummy_run(model, n, min(max_num_seqs, n), device))
    cudagraph = 0
    with memory_profiling(baseline, device, weights_memory=weights) as result:
        run(num_tokens)
        torch.cuda.synchronize(device)
        profile_torch_peak = torch.cuda.memory_stats(device).get("allocated_bytes.all.peak", 0)
        if cuda_graphs:
            measure = cudagraph_memory or (lambda: _hf_cudagraph_memory(model, tuple(cudagraph_batch_sizes), device))
            cudagraph = int(measure())
    # the pre-capture torch peak, so graph capture is not counted twice (as determine_available_memory does)
    result.torch_peak_increase = profile_torch_peak - result.before_profile.torch_peak
    notes = [f"profile run took {result.profile_time:.2f} s"]
    if not cuda_graphs:
        notes.append(no_graph_note)
    measured = analytic_profile(
        shape,
        num_tokens,
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        gpu_memory_utilization=utilization,
        total_memory=total,
        weights_memory=weights,
        peak_activation_memory=max(result.torch_peak_increase, 0),
        non_torch_memory=max(result.non_torch_increase, 0),
        cudagraph_memory=cudagraph,
        max_model_len=max_model_len,
        device=f"{device} ({torch.cuda.get_device_name(device)})",
        notes=tuple(notes),
    )
    return dataclasses.replace(measured, method="measured")
