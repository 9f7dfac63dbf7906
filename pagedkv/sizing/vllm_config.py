"""Which model runner vLLM 0.26 builds for a model, and so whether a CUDA-graph term enters the KV budget.

vLLM 0.26 has two GPU model runners, and they treat CUDA-graph memory differently at start-up:

- **Model Runner V2** (``vllm/v1/worker/gpu/model_runner.py``, ``GPUModelRunner``), the default for every
  dense generate model: ``VllmConfig.use_v2_model_runner`` (``vllm/config/vllm.py``) is true when
  ``_is_default_v2_model_runner_model`` holds (a generate model, not ``is_hybrid``, not attention-free, and
  not MoE unless its architecture is in ``DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES``), Triton is present and no
  feature V2 lacks is asked for (``_get_v2_model_runner_unsupported_features``). Its
  ``profile_cudagraph_memory()`` returns 0, so ``Worker.determine_available_memory``
  (``vllm/v1/worker/gpu_worker.py``) subtracts no graph memory: the graphs are captured later, in
  ``compile_or_warm_up_model`` -> ``capture_model``, after ``initialize_from_config`` has allocated the KV
  cache, and take their memory from what ``gpu_memory_utilization`` leaves outside the request.
- **The V1 runner** (``vllm/v1/worker/gpu_model_runner.py``, ``GPUModelRunner``), still built for MoE and
  Mamba-hybrid models: its ``profile_cudagraph_memory()`` captures the first two graphs of each
  ``cudagraph_mode`` against a minimal KV cache and estimates ``max(first capture) + sum((n - 1) x second
  capture)`` (at least 1 MiB a graph); ``determine_available_memory`` subtracts it when
  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` is 1 (the default since v0.21;
  ``cudagraph_memory_estimate_applied``). With ``enforce_eager`` the ``cudagraph_mode`` is ``NONE`` and
  nothing is estimated.

Lab differences: the lab reads these facts from a transformers config (vLLM reads ``is_hybrid`` from the model
class's ``IsHybrid`` interface; the lab takes a ``layers_block_type`` or ``layer_types`` entry that is not an
attention layer as the sign of one), and ignores the ``VLLM_USE_V2_MODEL_RUNNER`` variable, Triton's absence and
the unsupported features (pass ``use_v2_model_runner=`` to choose).
"""

from __future__ import annotations

from typing import Any

from pagedkv.sizing.model import _config_get
from pagedkv.utils import check_int

__all__ = [
    "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES",
    "cudagraph_memory_estimate_applied",
    "is_hybrid",
    "num_experts",
    "use_v2_model_runner",
]

#: MoE architectures that get Model Runner V2 all the same (``vllm/config/vllm.py``, the same name).
DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "GraniteMoeForCausalLM",
        "InklingForCausalLM",
        "InklingForConditionalGeneration",
        "LongcatFlashNgramForCausalLM",
        "Qwen2MoeForCausalLM",
    }
)

# the layer kinds that are attention (every other kind a config names -- "mamba", "linear_attention", ... --
# makes the model a hybrid in vLLM's sense: ``ModelConfig.is_hybrid``)
_ATTENTION_LAYER_TYPES = frozenset({"attention", "full_attention", "sliding_attention", "chunked_attention"})

# ``vllm/transformers_utils/model_arch_config_convertor.py``, ``get_num_experts``: the names tried, in order
_NUM_EXPERT_NAMES = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")


def _text_config(config: Any) -> Any:
    text = _config_get(config, "text_config")
    return text if text is not None and _config_get(config, "num_hidden_layers") is None else config


def num_experts(config: Any) -> int:
    """The experts of a config's MoE layers, 0 for a dense model: the first of ``num_experts``,
    ``moe_num_experts``, ``n_routed_experts``, ``num_local_experts`` that is set (a list: its first entry), as
    ``get_num_experts`` reads them (``model_arch_config_convertor.py``). Changes nothing."""
    config = _text_config(config)
    for name in _NUM_EXPERT_NAMES:
        value = _config_get(config, name)
        if value:
            return int(value[0] if isinstance(value, (list, tuple)) else value)
    return 0


def is_hybrid(config: Any) -> bool:
    """Whether the model mixes attention with other token mixers (Mamba, linear attention): vLLM's
    ``ModelConfig.is_hybrid`` (``vllm/config/model.py``), which is false when every listed layer is attention.
    A sliding-window model (Gemma 3, Mistral with a window) is not hybrid in this sense. Changes nothing."""
    config = _text_config(config)
    for name in ("layers_block_type", "layer_types"):
        kinds = _config_get(config, name)
        if kinds and any(str(k) not in _ATTENTION_LAYER_TYPES for k in kinds):
            return True
    return False


def use_v2_model_runner(config: Any) -> bool:
    """Whether vLLM 0.26 builds Model Runner V2 for a generate model of this config:
    ``VllmConfig._is_default_v2_model_runner_model`` (``vllm/config/vllm.py``) -- not hybrid, and not MoE unless
    its architecture is one of :data:`DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`. Changes nothing."""
    if is_hybrid(config):
        return False
    architectures = _config_get(_text_config(config), "architectures") or _config_get(config, "architectures") or ()
    return any(a in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES for a in architectures) or num_experts(config) == 0


def cudagraph_memory_estimate_applied(
    config: Any,
    v1_estimate: int,
    *,
    enforce_eager: bool = False,
    estimate_cudagraphs: bool = True,
    use_v2: bool | None = None,
) -> int:
    """The CUDA-graph bytes ``Worker.determine_available_memory`` subtracts from the KV budget
    (``cudagraph_memory_estimate_applied``, ``vllm/v1/worker/gpu_worker.py``).

    0 under Model Runner V2 (``use_v2``, default :func:`use_v2_model_runner` of ``config``), whose
    ``profile_cudagraph_memory()`` returns 0; 0 with ``enforce_eager`` (``cudagraph_mode`` ``NONE``: nothing
    is profiled); 0 when ``estimate_cudagraphs`` is false (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``: the
    V1 runner still measures and logs it, then vLLM warns and does not subtract it); otherwise
    ``v1_estimate``, what the V1 runner's ``profile_cudagraph_memory`` measured (its log line "Estimated CUDA
    graph memory: X GiB total"). Raises ``ValueError`` for a negative estimate; changes nothing."""
    v1_estimate = check_int(v1_estimate, "v1_estimate", 0)
    if use_v2 is None:
        use_v2 = use_v2_model_runner(config)
    if use_v2 or enforce_eager or not estimate_cudagraphs:
        return 0
    return v1_estimate
