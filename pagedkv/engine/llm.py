"""``LLM``: the offline serving engine. Prompts in, completions out, the lab's scheduler and paged cache between.

``LLM`` tokenizes and checks the prompts, turns each into ``n`` requests for the :class:`~pagedkv.engine.core.
EngineCore`, and steps the core until they have all finished::

    engine_core = EngineCore(AsyncScheduler(...), UniProcExecutor(ModelRunner(...)))
    while unfinished:
        outputs, _ = engine_core.step_fn()      # step_with_batch_queue (async scheduling) or step

The scheduler, KV cache manager and block pool are the lesson 2-4 classes, unchanged. ``async_scheduling=True``
(the default, as in vLLM 0.26 for these models) schedules step N+1 while step N runs; ``False`` gives the sync
loop, one step at a time: the same tokens either way. ``n > 1`` is ``n`` requests with the same prompt (seeds
``seed + i``), which share the prompt's full blocks through the prefix cache, as vLLM 0.26 does
(``vllm/v1/engine/parallel_sampling.py``: ``ParentRequest``). Mirrors vLLM 0.26's ``LLM``
(``vllm/entrypoints/llm.py``: ``generate``; ``OfflineInferenceMixin._run_engine`` in
``vllm/entrypoints/offline_utils.py``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.async_scheduler import AsyncScheduler
from pagedkv.engine.attention import BACKENDS, register_pagedkv_attention
from pagedkv.engine.core import EngineCore, EngineCoreOutput, EngineCoreRequest
from pagedkv.engine.exceptions import InvalidRequestError
from pagedkv.engine.executor import UniProcExecutor
from pagedkv.engine.llama import MODEL_IMPLS
from pagedkv.engine.logprobs import LogprobsLists, SampleLogprobs, prompt_logprobs_record
from pagedkv.engine.model_runner import ModelRunner, cudagraph_capture_sizes
from pagedkv.engine.output_processor import RequestState, decode_output
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampler import Sampler, make_generator
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints.chat_utils import render_chat
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request_queue import SchedulingPolicy
from pagedkv.scheduler import PREEMPTION_MODES, Scheduler
from pagedkv.sizing.hybrid import (
    describe_groups,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
    get_kv_cache_spec,
)
from pagedkv.sizing.kv_cache_utils import kv_page_bytes
from pagedkv.sizing.model import derived_max_model_len, get_and_verify_max_len
from pagedkv.utils import cdiv, check_int, is_int

#: model_type -> architecture: the models whose attention the engine knows how to replace (GQA, RoPE; the
#: q/k norms of Qwen3, Gemma 3 and OLMo 3 are the model's own code). Mistral's layers all slide; Qwen2's and
#: Qwen3's slide where ``config.layer_types`` says ``"sliding_attention"``; Gemma 3 has five sliding layers per
#: full one, OLMo 3 three. transformers passes each layer's window to the attention function.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
}
#: The default swap space (pinned host memory on a GPU): vLLM V0's default, ``EngineArgs.swap_space = 4`` GiB
#: (vLLM 0.26 has no swapping), so that a large GPU pool does not pin all of the host's memory.
SWAP_SPACE_BYTES = 4 * 2**30
#: The pool's size when ``pagedkv.sizing`` cannot profile the model (a CPU budget too small for its weights).
CPU_KV_CACHE_BYTES = 128 * 2**20


def check_architecture(config: Any) -> None:
    """``ValueError`` naming the supported architectures unless ``config`` is one of them (and uses no attention
    feature the paged attention lacks: logit soft-capping)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = getattr(config, "architectures", None) or [model_type]
        raise ValueError(
            f"unsupported architecture {', '.join(map(str, archs))} (model_type={model_type!r}): the engine serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES.values())}"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attention logit soft-capping (config.attn_logit_softcapping) is not supported: set it to "
                         "None (Gemma 3's default)")


#: vLLM 0.26's ``UsageContext`` values that choose the batch defaults (``vllm/usage/usage_lib.py``): the ``LLM``
#: class, and the OpenAI-compatible server (``pagedkv serve``, as ``vllm serve``).
USAGE_CONTEXTS = ("LLM_CLASS", "OPENAI_API_SERVER")


def _check_usage_context(usage_context: object) -> None:
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {USAGE_CONTEXTS}, got {usage_context!r}")


def batch_defaults(device: torch.device, world_size: int = 1,
                   usage_context: str = "LLM_CLASS") -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` when neither is given: vLLM 0.26's
    ``EngineArgs.get_batch_defaults`` (``vllm/engine/arg_utils.py``). The ``LLM`` class: 16,384 and 1,024 on a GPU
    of at least 70 GiB that is not an A100 (H100, H200), 8,192 and 256 on other GPUs, 4,096 and 256 per worker
    on a CPU. The server: 8,192 and 1,024, then 2,048 and 256, then 2,048 and 128 per worker on a CPU.
    ``world_size`` (the tensor-parallel ranks) multiplies the CPU's figures only, as in vLLM."""
    world_size = check_int(world_size, "world_size", 1)
    _check_usage_context(usage_context)
    server = usage_context == "OPENAI_API_SERVER"
    if device.type != "cuda":
        return (2048 if server else 4096) * world_size, (128 if server else 256) * world_size
    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower():
        return (8192, 1024) if server else (16384, 1024)
    return (2048, 256) if server else (8192, 256)


def fit_batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None, max_model_len: int,
                     defaults: tuple[int, int]) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)``: a figure left out is :func:`batch_defaults`'s ``defaults``
    fitted to the other, as vLLM 0.26's ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` fits it
    (``vllm/engine/arg_utils.py``): the token budget at most ``max_num_seqs`` whole sequences, the sequences at
    most one token each of the budget. Two that cannot go together raise ``ValueError`` with vLLM's words
    (``SchedulerConfig.verify_max_model_len``, ``vllm/config/scheduler.py``). Changes nothing."""
    default_tokens, default_seqs = defaults
    if max_num_batched_tokens is None:
        max_num_batched_tokens = min((max_num_seqs or default_seqs) * max_model_len, default_tokens)
    if max_num_seqs is None:
        max_num_seqs = min(default_seqs, max_num_batched_tokens)
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be greater than or equal to "
                         f"max_num_seqs ({max_num_seqs}).")
    return max_num_seqs, max_num_batched_tokens


#: The generation-config fields vLLM 0.26 takes as sampling defaults (``ModelConfig.get_diff_sampling_param``,
#: ``vllm/config/model.py``); ``max_new_tokens`` becomes ``max_tokens``.
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def diff_sampling_params(generation_config: Any) -> dict[str, Any]:
    """The sampling defaults a model's generation config sets, as vLLM 0.26's
    ``ModelConfig.get_diff_sampling_param`` reads them (``vllm/config/model.py``): of the fields that differ from
    transformers' own defaults (``GenerationConfig.to_diff_dict``), those in :data:`GENERATION_CONFIG_FIELDS`
    that are not None, ``max_new_tokens`` renamed ``max_tokens``. ``{}`` without a config."""
    if generation_config is None or not hasattr(generation_config, "to_diff_dict"):
        return {}
    config = generation_config.to_diff_dict()
    diff = {k: config[k] for k in GENERATION_CONFIG_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    return diff


def _one_per_prompt(values: object, name: str, label: str, kind: str, num_prompts: int) -> list[Any]:
    """``values`` as a list of one item per prompt: refuses anything but a sequence (``ValueError`` naming ``kind``)
    and a wrong length, in vLLM's words (``_params_to_seq`` and ``_priority_to_seq``, ``label`` being theirs)."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be {kind}, one per prompt; got {type(values).__name__}")
    out = list(values)
    if len(out) != num_prompts:
        raise ValueError(f"The lengths of prompts ({num_prompts}) and {label} ({len(out)}) must be the same.")
    return out


def _is_token_list(p: object) -> bool:
    """Whether ``p`` is one prompt of token ids rather than a list of prompts: a non-empty sequence whose first
    element is a number (its elements are checked by :func:`_token_ids`)."""
    return (isinstance(p, Sequence) and not isinstance(p, (str, bytes, bytearray)) and len(p) > 0
            and isinstance(p[0], (numbers.Number, np.generic)))


def _token_ids(i: int, p: Sequence[Any] | np.ndarray) -> list[int]:
    """Prompt ``i``'s token ids as Python ints: every integer type is accepted (numpy's too), a bool or any
    other element is refused by position (``ValueError``)."""
    values = p.tolist() if isinstance(p, np.ndarray) else list(p)
    for j, t in enumerate(values):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt {i}: element {j} is {t!r} ({type(t).__name__}), not a token id: token ids "
                             "are ints (numpy integers too; bools are refused)")
    return [int(t) for t in values]


@dataclass
class _Completion:
    """One of a prompt's ``n`` completions while it is generated: the tokens so far and how it ended."""

    prompt_index: int
    index: int  # completion index within the prompt
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_state: RequestState | None = None  # with stop strings: the text so far, checked after every step
    logprobs: SampleLogprobs | None = None  # with SamplingParams.logprobs: one record a token
    prompt_logprobs: int | None = None  # SamplingParams.prompt_logprobs
    prompt_rows: Any = None  # the prompt's logprobs rows (LogprobsLists), with the first token
    include_stop_str_in_output: bool = False  # a stop token's text too
    finish_order: int = -1  # when it finished among this call's completions (0 first)


class LLM:
    """An offline engine serving a transformers model of :data:`SUPPORTED_ARCHITECTURES` on the lab's paged KV cache.

    ``model``: a Hugging Face id, a local ``save_pretrained`` folder, or a loaded model (used as is; the
    engine never changes its attention setting outside its own forward calls). ``num_gpu_blocks=None``
    sizes the pool with lesson 5's ``pagedkv.sizing.profile`` (a small analytic budget on a CPU).
    ``attn_backend``: ``"torch"`` (any device; the CPU default) or ``"triton"`` (the lab's kernels; CUDA
    only; the CUDA default, decode steps in CUDA graphs unless ``enforce_eager``). ``num_cpu_blocks``: the
    swap space for ``preemption_mode="swap"`` (default: as many blocks as the GPU pool, at most 4 GiB of them).
    ``scheduling_policy`` (vLLM's ``--scheduling-policy``): ``"fcfs"``, or ``"priority"``, lesson 4's queue ordered
    by each request's ``priority`` (``generate(..., priority=[...])``) then arrival.
    ``max_model_len`` (default: the model's length as vLLM 0.26 derives it from the config,
    :func:`pagedkv.sizing.get_and_verify_max_len`: ``max_position_embeddings`` times a RoPE scaling factor, ...;
    a longer one refused as vLLM refuses it): ``-1`` fits it to the pool, the longest request the pool holds up to
    that default, as vLLM 0.26's auto-fit (``--max-model-len auto``).
    Two defaults differ from vLLM 0.26's on purpose: ``dtype=None`` keeps the checkpoint's own dtype, float32
    included, so that greedy tokens can match transformers' exactly (vLLM's ``"auto"`` casts a float32 config
    to the platform's first dtype, ``_resolve_auto_dtype`` in ``vllm/config/model.py``); and ``block_size`` is 16
    on a CPU too, the lessons' size (vLLM's CPU platform takes 128 unless told,
    ``CpuPlatform.check_and_update_config`` in ``vllm/platforms/cpu.py``).
    ``max_num_seqs``/``max_num_batched_tokens`` default to vLLM 0.26's (:func:`batch_defaults`: by device, by
    ``tensor_parallel_size`` on a CPU, and by ``usage_context``, ``"LLM_CLASS"`` or ``"OPENAI_API_SERVER"``, which
    ``pagedkv serve`` passes as vLLM's server passes ``UsageContext.OPENAI_API_SERVER``), one left out fitted to
    the other as vLLM fits it (:func:`fit_batch_limits`). ``generation_config`` (vLLM's ``--generation-config``):
    ``"auto"`` takes ``generate``'s default sampling from the model's generation config, ``"vllm"`` ignores it
    (:meth:`get_default_sampling_params`). ``max_logprobs`` (vLLM's, default 20; ``-1``: the vocabulary): the most
    ``SamplingParams.logprobs`` a request may ask for.
    ``async_scheduling`` (default ``True``, vLLM 0.26's for these models): an ``AsyncScheduler`` and
    ``EngineCore.step_with_batch_queue``; ``False``: the plain ``Scheduler`` and ``EngineCore.step``.
    ``model_impl`` (vLLM's ``--model-impl``): ``"auto"`` runs the lab's own decoder for the Llama family on a
    CPU (:mod:`pagedkv.engine.llama`) and transformers' modules for the rest and on a GPU; ``"lab"`` or
    ``"transformers"`` force one (the one-process engine; tensor-parallel ranks run transformers' sharded modules).
    Parts: ``scheduler``, ``kv_cache_manager``, ``runner`` (the ``ModelRunner``), ``model_executor``
    (``UniProcExecutor``), ``engine_core``. Mirrors ``vllm.LLM``.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        *,
        block_size: int = 16,
        num_gpu_blocks: int | None = None,
        gpu_memory_utilization: float = 0.92,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        scheduling_policy: str = "fcfs",
        attn_backend: str | None = None,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        num_cpu_blocks: int | None = None,
        enforce_eager: bool = False,
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        kv_cache_memory_bytes: int | Sequence[int] | None = None,
        async_scheduling: bool = True,
        model_impl: str = "auto",
        usage_context: str = "LLM_CLASS",
        generation_config: str = "auto",
        max_logprobs: int = 20,
    ) -> None:
        block_size, seed = check_int(block_size, "block_size", 1), check_int(seed, "seed", 0)
        self.max_logprobs = check_int(max_logprobs, "max_logprobs", -1)  # vLLM's ModelConfig field (-1: no limit)
        tensor_parallel_size = check_int(tensor_parallel_size, "tensor_parallel_size", 1)  # True is not 1 here
        if max_num_seqs is not None:
            max_num_seqs = check_int(max_num_seqs, "max_num_seqs", 1)
        if max_num_batched_tokens is not None:
            max_num_batched_tokens = check_int(max_num_batched_tokens, "max_num_batched_tokens", 1)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if scheduling_policy not in {p.value for p in SchedulingPolicy}:  # vLLM's SchedulerConfig.policy
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
        if attn_backend is not None and attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS} or None, got {attn_backend!r}")
        _check_usage_context(usage_context)  # before the model loads (batch_defaults checks it again after)
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' (the model's sampling defaults) or 'vllm' (vLLM's "
                             f"neutral ones), got {generation_config!r}")
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        dev = torch.device(device) if device is not None else None
        if attn_backend == "triton" and not (torch.cuda.is_available() and (dev is None or dev.type == "cuda")):
            raise ValueError(
                "attn_backend='triton' needs a CUDA GPU (the lab's kernels run natively there; on a CPU use "
                "attn_backend='torch', which reads the same paged cache)"
            )
        if isinstance(dtype, str) and dtype != "auto":
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"dtype must be a torch dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
            dtype = getattr(torch, dtype)
        torch_dtype = None if dtype == "auto" else dtype

        register_pagedkv_attention()
        self.model, self.tokenizer = self._load(model, torch_dtype, dev, tokenizer)
        config = self.model.config
        self.device = next(self.model.parameters()).device
        self.attn_backend = attn_backend or ("triton" if self.device.type == "cuda" else "torch")
        if self.attn_backend == "triton" and self.device.type != "cuda":
            raise ValueError("attn_backend='triton' needs the model on a CUDA device")

        # -1: vLLM 0.26's auto-fit (ModelConfig.max_model_len; `--max-model-len auto`): the model's length for the
        # batch defaults and the pool's sizing, then the longest that the pool holds (_auto_fit_max_model_len)
        auto_fit = is_int(max_model_len) and max_model_len == -1
        if max_model_len is not None and not auto_fit and not (is_int(max_model_len) and max_model_len >= 2):
            check_int(max_model_len, "max_model_len", 2, int(derived_max_model_len(config)[0]), why="for this model")
        max_model_len = get_and_verify_max_len(config, None if auto_fit else max_model_len)
        self.max_model_len = max_model_len
        max_num_seqs, max_num_batched_tokens = fit_batch_limits(
            max_num_seqs, max_num_batched_tokens, max_model_len,
            batch_defaults(self.device, tensor_parallel_size, usage_context))
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.generation_config = generation_config
        self.default_sampling_params: dict[str, Any] | None = None  # read on first use, as vLLM's LLM
        self.memory_profile = None
        # lesson 8: one KV cache group per attention type (None: one full-attention group, lessons 2-7's manager;
        # also under tensor parallelism, where a sliding layer's window is only a mask and every block is kept)
        self.kv_cache_groups = self._kv_cache_groups() if tensor_parallel_size == 1 else None
        self.kv_cache_config = None
        per_rank = tensor_parallel_size > 1 and isinstance(kv_cache_memory_bytes, (list, tuple))  # the lab's extension
        if kv_cache_memory_bytes is not None and not is_int(kv_cache_memory_bytes) and not per_rank:
            raise ValueError(f"kv_cache_memory_bytes must be an int number of bytes (or None), "
                             f"got {kv_cache_memory_bytes!r}")
        if num_gpu_blocks is None and is_int(kv_cache_memory_bytes) and tensor_parallel_size == 1:
            # vLLM's kv_cache_memory_bytes is the budget get_num_blocks divides; check_enough_kv_cache_memory
            # (vllm/v1/core/kv_cache_utils.py) refuses one that cannot hold a single max_model_len request
            if kv_cache_memory_bytes <= 0:
                raise ValueError(f"No available memory for the cache blocks: kv_cache_memory_bytes is "
                                 f"{kv_cache_memory_bytes}; give a positive number of bytes")
            needed = cdiv(max_model_len, block_size) * self._block_bytes()
            if self.kv_cache_groups is None and kv_cache_memory_bytes < needed and not auto_fit:
                fits = kv_cache_memory_bytes // self._block_bytes() * block_size
                raise ValueError(
                    f"To serve at least one request with the model's max seq len ({max_model_len}), {needed:,} "
                    f"bytes of KV cache are needed, more than kv_cache_memory_bytes ({kv_cache_memory_bytes:,}). "
                    + (f"Based on it, the estimated maximum model length is {fits}. " if fits > 0 else "")
                    + "Raise kv_cache_memory_bytes or lower max_model_len.")
            num_gpu_blocks = max(2, kv_cache_memory_bytes // self._block_bytes())  # vLLM's kv_cache_memory_bytes
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {async_scheduling!r}")
        self.async_scheduling = async_scheduling
        self.executor = None
        try:
            self.executor = self._start_executor(tensor_parallel_size) if tensor_parallel_size != 1 else None
            if self.executor is not None and num_gpu_blocks is None:  # lesson 10: each rank's count, the minimum
                num_gpu_blocks = self.executor.determine_num_blocks(block_size, kv_cache_memory_bytes,
                                                                    gpu_memory_utilization)
            if num_gpu_blocks is None:
                num_gpu_blocks = self._size_pool(
                    gpu_memory_utilization, self.attn_backend == "triton" and not enforce_eager, not auto_fit)
            else:
                num_gpu_blocks = check_int(num_gpu_blocks, "num_gpu_blocks", 2, why="block 0 is the null block")
            self.num_gpu_blocks = num_gpu_blocks
            if auto_fit:
                max_model_len = self._auto_fit_max_model_len(num_gpu_blocks)
            if num_cpu_blocks is None:  # swap space: as many blocks as the pool, at most SWAP_SPACE_BYTES of them
                num_cpu_blocks = min(num_gpu_blocks, max(1, SWAP_SPACE_BYTES // self._block_bytes())) \
                    if preemption_mode == "swap" else 0
            if self.kv_cache_groups is None:
                self.kv_cache_manager = KVCacheManager(num_gpu_blocks, block_size,
                                                       enable_caching=enable_prefix_caching)
            else:  # every group's pages in the same pool: block b is page b of each shared tensor
                self.kv_cache_config = get_kv_cache_config_from_groups(self.kv_cache_groups,
                                                                       num_gpu_blocks * self._block_bytes())
                self.kv_cache_manager = KVCacheManager(self.kv_cache_config, enable_caching=enable_prefix_caching,
                                                       max_model_len=max_model_len)
            # vLLM 0.26: SchedulerConfig.get_scheduler_cls() gives AsyncScheduler when async_scheduling is on
            scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
            self.scheduler = scheduler_cls(
                self.kv_cache_manager, max_num_seqs, max_num_batched_tokens, policy=scheduling_policy,
                preemption_mode=preemption_mode, num_cpu_blocks=num_cpu_blocks,
            )
            if self.executor is not None:  # lesson 10: every rank allocates its shard of the same pool
                self.executor.initialize_cache(num_gpu_blocks, num_cpu_blocks, block_size, max_model_len,
                                               self.attn_backend, max_num_seqs, seed)
            self.runner = self.executor or ModelRunner(
                self.model, num_gpu_blocks=num_gpu_blocks, block_size=block_size, max_model_len=max_model_len,
                num_cpu_blocks=num_cpu_blocks, backend=self.attn_backend,
                use_cuda_graph=self.attn_backend == "triton" and not enforce_eager, max_num_seqs=max_num_seqs,
                sampler=Sampler(make_generator(seed, self.device)),
                kv_cache_config=self.kv_cache_config, model_impl=model_impl,
            )
        except BaseException:
            self.shutdown()  # no worker outlives a failed start
            raise
        # the tensor-parallel executor (lesson 10) or the one runner in this process
        self.model_executor = self.executor or UniProcExecutor(self.runner, async_scheduling=async_scheduling)
        self.eos_token_ids = self._eos_token_ids()
        self.engine_core = EngineCore(
            self.scheduler, self.model_executor, eos_token_ids=self.eos_token_ids,
            tokenizer_eos_token_id=getattr(self.tokenizer, "eos_token_id", None), async_scheduling=async_scheduling,
        )
        self._next_id = 0

    # ------------------------------------------------------------------------------------------------
    # Set-up
    # ------------------------------------------------------------------------------------------------
    def _start_executor(self, tensor_parallel_size: int):
        """Lesson 10: ``tensor_parallel_size`` worker processes, each holding its shard of the model and of the
        KV cache (:class:`~pagedkv.engine.multiproc_executor.MultiprocExecutor`); ``ValueError`` before any
        starts when the model does not split that way."""
        from pagedkv.distributed.shard import check_shardable
        from pagedkv.engine.multiproc_executor import MultiprocExecutor

        check_shardable(self.model.config, tensor_parallel_size)
        return MultiprocExecutor(self.model, tensor_parallel_size, self.device.type)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; also done when the engine is collected or the
        process exits). Mirrors ``LLM.shutdown`` / ``EngineCore.shutdown``."""
        if self.executor is not None:
            self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @staticmethod
    def _load(model: Any, dtype: torch.dtype | None, device: torch.device | None, tokenizer: Any):
        """The model (checked to be a supported architecture before any weight is loaded) and a tokenizer
        (``None`` when there is none)."""
        if isinstance(model, torch.nn.Module):
            if not hasattr(model, "config"):
                raise ValueError("model must be a transformers model (with a .config), an id or a path")
            check_architecture(model.config)
            if dtype is not None or device is not None:
                model = model.to(device=device, dtype=dtype)
            return model.eval(), tokenizer
        if not isinstance(model, str):
            raise ValueError(f"model must be a Hugging Face id, a local path or a loaded model, got {type(model)}")
        if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
            raise ValueError(f"model {model!r}: no such folder (a Hugging Face id, such as 'Qwen/Qwen3-0.6B', "
                             "does not start with '/', '.' or '~')")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        check_architecture(AutoConfig.from_pretrained(model))
        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=dtype or "auto")
        if device is not None:
            loaded = loaded.to(device)
        elif torch.cuda.is_available():
            loaded = loaded.to("cuda")
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(model)
            except (OSError, ValueError):
                tokenizer = None
        return loaded.eval(), tokenizer

    def _eos_token_ids(self) -> frozenset[int]:
        ids: Any = None
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            ids = gen.eos_token_id
        if ids is None:
            ids = getattr(self.model.config, "eos_token_id", None)
        if ids is None:
            return frozenset()
        return frozenset([int(ids)] if is_int(ids) else ids)

    def _kv_cache_groups(self) -> list[KVCacheGroupSpec] | None:
        """The model's KV cache groups as vLLM 0.26 forms them (``pagedkv.sizing.hybrid.get_kv_cache_groups``:
        one per attention type, the layers of a type dealt into groups of ``group_size``), or ``None`` when
        there is one full-attention group (every layer keeps every block: the flat lesson 2-7 manager). An
        all-sliding model (Mistral) has one sliding-window group; Gemma 3's 5 : 1 layers make six groups of
        one layer, OLMo 3's 3 : 1 four (``group_size`` is the smaller type's layer count)."""
        specs = get_kv_cache_spec(self.model.config, self.block_size, next(self.model.parameters()).dtype)
        groups = get_kv_cache_groups(specs).groups
        if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            return None
        return groups

    def _block_bytes(self) -> int:
        """Bytes of one KV block (K and V, in the model's dtype): over all layers, or with KV cache groups one
        page in each of the ``group_size`` shared tensors (``get_kv_cache_config_from_groups``)."""
        if self.kv_cache_groups is not None:
            group_size = max(len(g.layer_names) for g in self.kv_cache_groups)
            return self.kv_cache_groups[0].kv_cache_spec.page_size_bytes * group_size
        config = self.model.config  # lesson 5's page (one layer), in every layer
        return kv_page_bytes(config, self.block_size, next(self.model.parameters()).dtype) * config.num_hidden_layers

    def _size_pool(self, gpu_memory_utilization: float, use_cuda_graph: bool, check_len: bool = True) -> int:
        """Blocks for the pool, from lesson 5's ``pagedkv.sizing.profile`` (vLLM 0.26's
        ``determine_available_memory`` then ``get_num_blocks``): measured on a CUDA GPU, computed ("analytic",
        against a small CPU budget) on a CPU. Prints its start-up lines, ending with
        ``# GPU blocks: N, concurrency for L-token requests: X``. Where the module is missing, or a CPU profile
        leaves no room (weights larger than the CPU budget), a pool of at most ``CPU_KV_CACHE_BYTES``.
        ``check_len=False`` (auto-fit) leaves out the check that one ``max_model_len`` request fits."""
        dtype = next(self.model.parameters()).dtype
        block_bytes = self._block_bytes()
        try:
            from pagedkv.sizing import profile  # lesson 5
        except ImportError:
            profile = None
        if profile is not None:
            try:
                self.memory_profile = profile(
                    self.model, self.max_num_batched_tokens, block_size=self.block_size, kv_cache_dtype=dtype,
                    gpu_memory_utilization=gpu_memory_utilization, device=self.device,
                    max_model_len=self.max_model_len if check_len else None, max_num_seqs=self.max_num_seqs,
                    cuda_graphs=use_cuda_graph,
                    cudagraph_batch_sizes=tuple(cudagraph_capture_sizes(self.max_num_seqs)),  # the ones captured
                )
            except ValueError:
                if self.device.type == "cuda":
                    raise
            else:
                print(str(self.memory_profile))
                if self.kv_cache_groups is None:
                    return int(self.memory_profile.num_gpu_blocks)
                # the same bytes, in blocks of one page per shared tensor (get_kv_cache_config_from_groups)
                blocks = max(2, self.memory_profile.available_kv_cache_memory // block_bytes)
                for line in describe_groups(self.kv_cache_groups):
                    print(f"KV cache {line}")
                print(f"# GPU blocks with {len(self.kv_cache_groups)} KV cache groups: {blocks}")
                return blocks
        blocks = max(2, CPU_KV_CACHE_BYTES // block_bytes)
        concurrency = (blocks - 1) * self.block_size / self.max_model_len
        print(f"KV cache: {CPU_KV_CACHE_BYTES / 2**20:.0f} MiB on {self.device} (no memory profile for this model)")
        print(f"# GPU blocks: {blocks}, concurrency for {self.max_model_len}-token requests: {concurrency:.2f}x")
        return blocks

    def _auto_fit_max_model_len(self, num_gpu_blocks: int) -> int:
        """``max_model_len=-1``: the longest request, at most the model's own length, whose KV cache the pool of
        ``num_gpu_blocks`` holds (one full-attention group: ``num_gpu_blocks * block_size`` tokens, the null block
        counted as vLLM counts it; a hybrid model: its groups' ``max_memory_usage_bytes_from_groups`` with
        ``max_in_flight_tokens`` of 2 batches under async scheduling, 1 without). Sets and returns
        ``self.max_model_len``, and prints vLLM's line. Mirrors ``_auto_fit_max_model_len``
        (``vllm/v1/core/kv_cache_utils.py``), which runs before the pool's other checks, so an auto-fitted length
        always passes them."""
        from pagedkv.sizing import estimate_max_model_len, format_gib
        from pagedkv.sizing.hybrid import max_memory_usage_bytes_from_groups

        block_bytes = self._block_bytes()
        available = num_gpu_blocks * block_bytes
        if self.kv_cache_groups is None:
            def usage(n: int) -> int:
                return cdiv(n, self.block_size) * block_bytes
        else:
            in_flight = (2 if self.async_scheduling else 1) * self.max_num_batched_tokens  # max_in_flight_tokens

            def usage(n: int) -> int:
                return max_memory_usage_bytes_from_groups(self.kv_cache_groups, n, in_flight)
        original = self.max_model_len
        fitted = estimate_max_model_len(usage, available, original)
        if fitted <= 0:
            raise ValueError("Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single "
                             "token. Try increasing `gpu_memory_utilization`.")
        if fitted >= original:
            print(f"Auto-fit max_model_len: full model context length {original} fits in available GPU memory")
        else:
            print(f"Auto-fit max_model_len: reduced from {original} to {fitted} to fit in available GPU memory "
                  f"({format_gib(available)} GiB available for KV cache)")
        self.max_model_len = fitted  # at most the original: the search starts there
        return fitted

    # ------------------------------------------------------------------------------------------------
    # Requests
    # ------------------------------------------------------------------------------------------------
    def _tokenize(self, prompts: Any) -> tuple[list[list[int]], list[str | None]]:
        """Each prompt's token ids and text. A prompt is a string, a list of token ids, or vLLM's dict forms
        ``{"prompt": text}`` (``TextPrompt``) and ``{"prompt_token_ids": ids}`` (``TokensPrompt``, its text
        optionally beside the ids as ``"prompt"``: not tokenized again, only shown in the output)."""
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, (str, Mapping)) or _is_token_list(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
            raise ValueError("prompts must be a string, a list of token ids, a {'prompt_token_ids': ...} or "
                             "{'prompt': ...} dict, or a list of those")
        ids: list[list[int]] = []
        texts: list[str | None] = []
        vocab = self.model.config.vocab_size
        for i, p in enumerate(prompts):
            text = None
            if isinstance(p, Mapping):
                if set(p) in ({"prompt_token_ids"}, {"prompt_token_ids", "prompt"}) and \
                        isinstance(p.get("prompt", ""), str):
                    text = p.get("prompt")  # a TokensPrompt's text, what the output's prompt shows (LLM.chat)
                    p = p["prompt_token_ids"]
                elif set(p) == {"prompt"} and isinstance(p["prompt"], str):
                    p = p["prompt"]
                else:
                    raise ValueError(f"prompt {i}: a dict prompt is {{'prompt_token_ids': ids}} (its text as "
                                     f"'prompt' beside them, optional) or {{'prompt': text}}; got keys "
                                     f"{sorted(map(str, p))}")
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; this model has none: pass token ids")
                tokens = list(self.tokenizer(p)["input_ids"])
                texts.append(p)
            elif _is_token_list(p) or isinstance(p, np.ndarray) or (isinstance(p, (list, tuple)) and not p):
                tokens = _token_ids(i, p)  # an empty list too: refused below as empty, not as "not a list"
                texts.append(text)
            else:
                raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
            # vLLM 0.26's words (InputProcessor._validate_prompt_len and _validate_model_input), after the index
            if not tokens:
                raise ValueError(f"prompt {i}: The decoder prompt cannot be empty")
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:  # the largest id, as vLLM names it; a negative one (which vLLM lets through) when none is
                raise ValueError(f"prompt {i}: Token id {max(bad) if max(bad) >= vocab else min(bad)} is out of "
                                 f"vocabulary (the model's ids are 0..{vocab - 1})")
            ids.append(tokens)
        return ids, texts

    def _check_fits(self, i: int, prompt_len: int, max_tokens: int) -> None:
        # vLLM 0.26's words (InputProcessor._validate_prompt_len, vllm/v1/engine/input_processor.py), after the
        # prompt's index in the call
        if prompt_len > self.max_model_len:
            raise ValueError(
                f"prompt {i}: The decoder prompt (length {prompt_len}) is longer than the maximum model length of "
                f"{self.max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        if prompt_len == self.max_model_len:
            raise ValueError(
                f"prompt {i}: The decoder prompt (length {prompt_len}) plus the number of requested output tokens "
                f"(at least 1) is longer than the maximum model length of {self.max_model_len}. Make sure that "
                "`max_model_len` is no smaller than the number of text tokens (prompt + requested output tokens)."
            )
        # with KV cache groups, a sliding-window group holds at most its window's worth (the scheduler's rule)
        need = (cdiv(prompt_len + max_tokens, self.block_size) if self.kv_cache_config is None
                else self.kv_cache_manager.max_num_blocks_for(prompt_len + max_tokens))
        if need > self.num_gpu_blocks - 1:
            raise ValueError(
                f"the KV pool is too small for prompt {i}: {prompt_len} prompt tokens + {max_tokens} new tokens need "
                f"{need} blocks of {self.block_size}, the pool has {self.num_gpu_blocks - 1} usable blocks; "
                f"use num_gpu_blocks >= {need + 1} (block 0 is the null block) or a smaller max_tokens"
            )

    def verify_sampling_params(self, params: SamplingParams) -> None:
        """``params.verify`` against this engine's model (its vocabulary) and ``max_logprobs``: vLLM's checks of a
        request's sampling parameters that need the model (``SamplingParams.verify``, called by vLLM's
        ``InputProcessor.process_inputs``), and the bad words' token ids from the tokenizer
        (``update_from_tokenizer``; vLLM ignores ``bad_words`` without a tokenizer, the lab refuses them, and
        those whose ids are past the model's vocabulary, which vLLM's kernel would write past its row)."""
        vocab = self.model.config.vocab_size
        params.verify(vocab, self.max_logprobs)
        if params.bad_words:  # vLLM's InputProcessor: SamplingParams.update_from_tokenizer
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words need a tokenizer; this model has none: use logit_bias",
                                          "bad_words")
            params.update_from_tokenizer(self.tokenizer, vocab)

    def get_default_sampling_params(self) -> SamplingParams:
        """The :class:`SamplingParams` ``generate`` uses when given none: vLLM's neutral defaults, overridden by
        the sampling fields of the model's generation config (``generation_config.json``: ``repetition_penalty``,
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``max_new_tokens`` as ``max_tokens``) unless the engine
        was made with ``generation_config="vllm"`` (:meth:`get_diff_sampling_param` reads the config once). Mirrors
        ``LLM.get_default_sampling_params`` (``vllm/entrypoints/llm.py``)."""
        return SamplingParams(**self.get_diff_sampling_param())

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The sampling fields the model's generation config sets (:func:`diff_sampling_params`; ``{}`` with
        ``generation_config="vllm"``), read on first use and kept in ``self.default_sampling_params``; the server
        fills a request's omitted fields from it. Mirrors ``ModelConfig.get_diff_sampling_param``
        (``vllm/config/model.py``), which vLLM's ``LLM`` and serving classes keep the same way."""
        if self.default_sampling_params is None:
            source = None if self.generation_config == "vllm" else getattr(self.model, "generation_config", None)
            self.default_sampling_params = diff_sampling_params(source)
        return self.default_sampling_params

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (``None`` for a model given without one). Mirrors ``LLM.get_tokenizer``
        (``vllm/entrypoints/llm.py``)."""
        return self.tokenizer

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate the replies to one conversation (a list of ``{"role", "content"}`` messages) or to a list of
        them, one :class:`RequestOutput` each. Each conversation is rendered to text by the tokenizer's chat
        template (or ``chat_template``), with ``add_generation_prompt``, ``continue_final_message``, ``tools`` and
        ``chat_template_kwargs`` passed to it, then tokenized without special tokens (the template writes its
        own, a BOS among them) and generated as :meth:`generate` does; the output's ``prompt`` is the rendered
        text. Every conversation is rendered before anything is queued (``ValueError``, the engine unchanged).
        Mirrors ``LLM.chat`` (``vllm/entrypoints/llm.py``; the rendering, ``HfRenderer.render_messages`` in
        ``vllm/renderers/hf.py``, tokenized with ``add_special_tokens=False`` as
        ``BaseRenderer.default_chat_tok_params`` in ``vllm/renderers/base.py`` says:
        :func:`pagedkv.entrypoints.chat_utils.render_chat`, as ``pagedkv serve`` renders). Content given as
        OpenAI's list of parts is its text parts joined by newlines; an image or other media part is refused."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs a tokenizer with a chat template; this model has none: use generate "
                             "with token ids")
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                             "dicts) or a list of conversations")
        one = all(isinstance(m, Mapping) for m in messages)  # vLLM's conversation_to_seq
        prompts = []
        for i, conversation in enumerate([messages] if one else messages):
            text, ids = render_chat(self.tokenizer, conversation, chat_template=chat_template,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs,
                                    where="messages" if one else f"conversation {i}")
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (strings need a tokenizer; token-id lists always work).
        ``sampling_params``: one for all prompts or one per prompt. Returns one :class:`RequestOutput` per
        prompt, in prompt order, each with ``n`` completions. Every input is checked before anything is queued
        (``ValueError``, the engine unchanged); if generation is interrupted its requests are aborted, so the
        engine stays usable. ``priority``: one int per prompt, lower first, for ``scheduling_policy="priority"``
        (under ``"fcfs"`` it is ignored, as in vLLM). ``use_tqdm``: a bool, or (as vLLM's) a function that makes the
        progress bar. Mirrors ``LLM.generate`` (``vllm/entrypoints/llm.py``)."""
        if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
            raise ValueError(f"use_tqdm must be a bool or a function that makes a tqdm bar, got {use_tqdm!r}")
        prompt_ids, texts = self._tokenize(prompts)
        if priority is None:  # vLLM's _priority_to_seq
            priorities = [0] * len(prompt_ids)
        else:
            priorities = _one_per_prompt(priority, "priority", "priority", "a list of ints", len(prompt_ids))
            for i, value in enumerate(priorities):
                if not is_int(value):
                    raise ValueError(f"priority[{i}] must be an int, got {value!r}")
            priorities = [int(v) for v in priorities]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_ids)
        else:
            params_list = _one_per_prompt(sampling_params, "sampling_params", "params",
                                          "a SamplingParams or a list of them", len(prompt_ids))
            for i, params in enumerate(params_list):
                if not isinstance(params, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(params).__name__}")
        # checked again now, so a field changed after construction is refused; the engine keeps its own copies
        params_list = [p.verified() for p in params_list]
        if self.tokenizer is None and any(p.stop for p in params_list):
            raise ValueError("stop strings need a tokenizer; this model has none: use stop_token_ids")
        for params in params_list:
            self.verify_sampling_params(params)
        clamped = []
        for i, (ids, params) in enumerate(zip(prompt_ids, params_list, strict=True)):
            # vLLM 0.26 lets the request run and ends it at max_model_len (check_stop: FINISHED_LENGTH_CAPPED,
            # "length"); capping max_tokens ends it at the same token with the same reason
            room = self.max_model_len - len(ids)  # max_tokens None: all of it (vLLM's InputProcessor)
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            self._check_fits(i, len(ids), max_tokens)
            clamped.append(max_tokens)

        completions: dict[str, _Completion] = {}
        core = self.engine_core
        core.tokenizer_eos_token_id = getattr(self.tokenizer, "eos_token_id", None)  # the tokenizer may change
        requests = []
        for i, (ids, params, max_tokens) in enumerate(zip(prompt_ids, params_list, clamped, strict=True)):
            base = f"{self._next_id + i}"
            for j in range(params.n):  # vLLM's ParentRequest: n requests, seeds seed + j
                child = params.for_child(j) if params.n > 1 else params
                rid = base if j == 0 else f"{base}-{j}"
                child = child.with_max_tokens(max_tokens)
                requests.append(EngineCoreRequest(rid, list(ids), child, priority=priorities[i]))
                completions[rid] = _Completion(i, j, include_stop_str_in_output=child.include_stop_str_in_output,
                                               prompt_logprobs=child.prompt_logprobs)
                if child.logprobs is not None:
                    completions[rid].logprobs = SampleLogprobs(child.logprobs, self.tokenizer)
                if child.stop:  # the API side's stop-string check, as AsyncLLM's (output_processor.RequestState)
                    completions[rid].stop_state = RequestState(rid, j, list(ids), child, list(child.stop),
                                                               child.include_stop_str_in_output, self.tokenizer)
        self._next_id += len(prompt_ids)
        from tqdm.auto import tqdm

        if callable(use_tqdm):  # vLLM's: a function that makes the bar (functools.partial(tqdm, leave=False))
            bar = use_tqdm(total=len(prompt_ids), desc="Processed prompts", dynamic_ncols=True)
        else:
            bar = tqdm(total=len(prompt_ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        left = {i: p.n for i, p in enumerate(params_list)}
        unfinished = set(completions)
        idle = 0
        stopped_by_string = False
        try:
            for request in requests:
                core.add_request(request)
            while unfinished:
                outputs, executed = core.step_fn()
                for out in outputs.outputs if outputs is not None else ():
                    if out.request_id in unfinished:
                        self._record(completions[out.request_id], out)
                        if self._stop_string_seen(completions[out.request_id], out):
                            core.abort_requests([out.request_id])  # between steps: its blocks return now
                            stopped_by_string = True
                        if completions[out.request_id].finish_reason is not None:
                            unfinished.discard(out.request_id)
                            completions[out.request_id].finish_order = len(completions) - len(unfinished)
                            left[completions[out.request_id].prompt_index] -= 1
                            if left[completions[out.request_id].prompt_index] == 0:
                                bar.update(1)
                idle = 0 if executed or (outputs is not None and outputs.outputs) else idle + 1
                if idle > 100:  # nothing scheduled for 100 steps: a scheduler bug, not a wait
                    raise RuntimeError(f"the scheduler scheduled nothing for {idle} steps with {len(unfinished)} "
                                       "sequences unfinished")
        except BaseException:
            self.abort(list(unfinished))  # free their blocks, keep the engine usable
            raise
        finally:
            bar.close()
        if stopped_by_string:
            self.abort([])  # a step launched before a stop string was seen: drained, so the engine is idle
        return self._outputs(completions, prompt_ids, texts)

    @staticmethod
    def _stop_string_seen(completion: _Completion, out: EngineCoreOutput) -> bool:
        """Check a completion's stop strings after its new tokens; when one shows, the completion finishes
        ``"stop"`` with the string as ``stop_reason`` and its text cut there (a stop string found in the last
        token outranks ``"length"``, as vLLM's detokenizer does). True when the engine must abort it (it was still
        running). Mirrors ``OutputProcessor.process_outputs`` (``vllm/v1/engine/output_processor.py``)."""
        state = completion.stop_state
        if state is None or state.finished:
            return False
        state.add_tokens(out.new_token_ids, out.finish_reason, out.stop_reason, 0.0)
        if not state.finished or state.stop_reason not in state.stop:
            return False
        completion.finish_reason, completion.stop_reason = state.finish_reason, state.stop_reason
        return not out.finished

    def abort(self, request_ids: list[str]) -> None:
        """Abort these requests and drain the steps still in flight, so the engine is idle and usable again."""
        core = self.engine_core
        core.abort_requests(request_ids)
        while core.batch_queue:  # the discarded steps' samples: read, and thrown away by update_from_output
            future, so = core.batch_queue.pop()
            try:
                output = future.result()
            except Exception:  # noqa: BLE001 - the executor failed (a dead worker): its error is already raised
                continue
            core._update_from_output(so, output)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix (each cached block's hash; the blocks stay free), so the next requests
        compute every token again: what a benchmark does between runs, or a server after a weight update. Between
        two ``generate`` calls no request holds blocks and it returns ``True``; ``reset_running_requests`` preempts
        any that do first (``False`` without it, nothing changed). Mirrors ``LLM.reset_prefix_cache``
        (``vllm/entrypoints/llm.py``; vLLM's ``reset_connector`` has no counterpart here)."""
        if not isinstance(reset_running_requests, bool):
            raise ValueError(f"reset_running_requests must be a bool, got {reset_running_requests!r}")
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    @staticmethod
    def _record(completion: _Completion, out: EngineCoreOutput) -> None:
        completion.token_ids.extend(out.new_token_ids)
        if completion.logprobs is not None and out.new_logprobs is not None:
            completion.logprobs.update(*out.new_logprobs)
        if out.new_prompt_logprobs_tensors is not None:
            completion.prompt_rows = out.new_prompt_logprobs_tensors
        completion.num_cached_tokens = out.num_cached_tokens
        completion.num_preemptions = out.num_preemptions
        if out.finished:
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason

    @property
    def stats(self) -> dict[str, float]:
        """The engine core's counters: ``steps``, ``forward_tokens``, and host seconds spent scheduling
        (``schedule_s``), preparing inputs (``prepare_s``), in the forward and sampler (``forward_s``; of it, every
        layer's attention call ``attention_s`` and the sampler ``sample_s``) and updating (``update_s``)."""
        return self.engine_core.stats

    def _outputs(
        self, completions: dict[str, _Completion], prompt_ids: list[list[int]], texts: list[str | None]
    ) -> list[RequestOutput]:
        outputs = [
            RequestOutput(request_id=str(self._next_id - len(prompt_ids) + i), prompt=texts[i],
                          prompt_token_ids=prompt_ids[i])
            for i in range(len(prompt_ids))
        ]
        for c in sorted(completions.values(), key=lambda c: (c.prompt_index, c.index)):
            out = outputs[c.prompt_index]
            text = ""  # no tokenizer: vLLM's IncrementalDetokenizer base class gives "" (vllm/v1/engine/detokenizer.py)
            if c.stop_state is not None and c.stop_state.stop_reason in c.stop_state.stop:
                text = c.stop_state.text  # cut at its stop string
            elif self.tokenizer is not None:
                text = decode_output(self.tokenizer, c.token_ids, c.finish_reason, c.include_stop_str_in_output,
                                     prompt_ids[c.prompt_index])
            lp = c.logprobs
            out.outputs.append(CompletionOutput(c.index, text, list(c.token_ids), c.finish_reason, c.stop_reason,
                                                c.num_preemptions, None if lp is None else lp.cumulative_logprob,
                                                None if lp is None else lp.logprobs))
            out.num_preemptions += c.num_preemptions
            if c.prompt_logprobs is not None and out.prompt_logprobs is None:  # n > 1: the first completion's
                rows = c.prompt_rows if c.prompt_rows is not None else LogprobsLists([], [], [])
                out.prompt_logprobs = prompt_logprobs_record(c.prompt_logprobs, rows, prompt_ids[c.prompt_index],
                                                             self.tokenizer)
        # vLLM makes an n > 1 request's output when its last child finishes, with that child's num_cached_tokens
        # (`vllm/v1/engine/output_processor.py`: `RequestState.make_request_output`;
        # `vllm/v1/engine/parallel_sampling.py`: `ParentRequest.get_outputs`)
        for c in sorted(completions.values(), key=lambda c: c.finish_order):
            outputs[c.prompt_index].num_cached_tokens = c.num_cached_tokens
        return outputs

    def __repr__(self) -> str:
        return (
            f"LLM({type(self.model).__name__}, backend={self.attn_backend}, blocks={self.num_gpu_blocks}x"
            f"{self.block_size}, device={self.device})"
        )

