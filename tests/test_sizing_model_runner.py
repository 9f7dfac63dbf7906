"""Which model runner vLLM 0.26 builds, and so whether a CUDA-graph term enters the KV budget
(pagedkv.sizing.vllm_config; vllm/config/vllm.py::VllmConfig.use_v2_model_runner)."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest
import transformers

from pagedkv.sim.cost import CostModel
from pagedkv.sizing import (
    DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES,
    cudagraph_memory_estimate_applied,
    is_hybrid,
    num_experts,
    profile,
    use_v2_model_runner,
)

VLLM_SRC = pathlib.Path(os.environ.get("VLLM_SOURCE", "/tmp/v/vllm"))
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 8}
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 60}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "n_routed_experts": 256}
JAMBA = {"architectures": ["JambaForCausalLM"], "layers_block_type": ["mamba", "attention"], "num_experts": 16}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention", "full_attention"]}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
GRANITE_MICRO = {"architectures": ["GraniteMoeHybridForCausalLM"], "layer_types": ["attention"] * 4}


@pytest.mark.parametrize(
    ("config", "v2"),
    [
        (LLAMA, True),  # dense: Model Runner V2
        (GEMMA3, True),  # sliding window + full attention is not "hybrid" in vLLM's sense
        (GRANITE_MICRO, True),  # a hybrid config whose layers are all attention (ModelConfig.is_hybrid)
        (MIXTRAL, False),  # MoE: the V1 runner
        (DEEPSEEK_V3, False),
        (QWEN2_MOE, True),  # MoE, but one of DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
        (JAMBA, False),  # Mamba hybrid
        (QWEN3_NEXT, False),  # linear-attention hybrid
        ({"text_config": LLAMA}, True),  # a multimodal config: its language model decides
        ({"text_config": MIXTRAL}, False),
    ],
)
def test_use_v2_model_runner_follows_vllm_026(config, v2):
    assert use_v2_model_runner(config) is v2


def test_num_experts_and_is_hybrid_read_the_names_vllm_reads():
    assert [num_experts(c) for c in (LLAMA, MIXTRAL, QWEN2_MOE, DEEPSEEK_V3)] == [0, 8, 60, 256]
    assert num_experts({"num_experts": [4, 4]}) == 4  # a list: its first entry, as get_num_experts takes it
    assert [is_hybrid(c) for c in (LLAMA, GEMMA3, GRANITE_MICRO, JAMBA, QWEN3_NEXT)] == [False] * 3 + [True] * 2


def test_a_transformers_config_is_read_too():
    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    mixtral = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    assert use_v2_model_runner(llama) and not use_v2_model_runner(mixtral)


def test_the_graph_term_is_zero_under_model_runner_v2_and_the_v1_estimate_otherwise():
    half = 1 << 29
    assert cudagraph_memory_estimate_applied(LLAMA, half) == 0  # V2: profile_cudagraph_memory() returns 0
    assert cudagraph_memory_estimate_applied(MIXTRAL, half) == half  # V1 measures it, and it is subtracted
    assert cudagraph_memory_estimate_applied(MIXTRAL, half, enforce_eager=True) == 0  # cudagraph_mode NONE
    assert cudagraph_memory_estimate_applied(MIXTRAL, half, estimate_cudagraphs=False) == 0  # the env flag at 0
    assert cudagraph_memory_estimate_applied(LLAMA, half, use_v2=False) == half  # VLLM_USE_V2_MODEL_RUNNER=0
    assert cudagraph_memory_estimate_applied(MIXTRAL, half, use_v2=True) == 0
    with pytest.raises(ValueError, match="v1_estimate"):
        cudagraph_memory_estimate_applied(MIXTRAL, -1)


def test_the_cost_models_default_graph_term_is_the_dense_models():
    """The cost model describes dense Llama models: its default graph term is what 0.26 subtracts for them."""
    cm = CostModel()
    assert cm.num_gpu_blocks() == cm.num_gpu_blocks(cudagraph_bytes=cudagraph_memory_estimate_applied(LLAMA, 1 << 29))


def test_a_cpu_profile_prints_no_graph_estimate(tiny_llama_config):
    model = transformers.LlamaForCausalLM(tiny_llama_config).eval()
    text = str(profile(model, 256))
    assert "Estimated CUDA graph memory" not in text  # only the V1 runner logs it, and only when it captured


@pytest.fixture
def tiny_llama_config():
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256,
    )


# --- against vLLM 0.26's own source (where it is unpacked) ----------------------------------------------------


def _source(relpath: str) -> ast.Module:
    return ast.parse((VLLM_SRC / relpath).read_text())


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    klass = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


needs_vllm = pytest.mark.skipif(not (VLLM_SRC / "config/vllm.py").exists(), reason="vLLM 0.26's source not unpacked")


@needs_vllm
def test_the_architectures_are_vllms():
    tree = _source("config/vllm.py")
    node = next(
        n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES"
    )
    names = {elt.value for elt in node.value.args[0].elts}
    assert names == DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES


@needs_vllm
def test_model_runner_v2_estimates_no_graph_memory_and_v1_does():
    v2 = _method(_source("v1/worker/gpu/model_runner.py"), "GPUModelRunner", "profile_cudagraph_memory")
    returns = [n for n in ast.walk(v2) if isinstance(n, ast.Return)]
    assert len(returns) == 1 and isinstance(returns[0].value, ast.Constant) and returns[0].value.value == 0
    v1 = _method(_source("v1/worker/gpu_model_runner.py"), "GPUModelRunner", "profile_cudagraph_memory")
    assert "_warmup_and_capture" in ast.unparse(v1)  # the V1 runner captures graphs to measure them
    worker = ast.unparse(_method(_source("v1/worker/gpu_worker.py"), "Worker", "determine_available_memory"))
    assert "self.model_runner.profile_cudagraph_memory()" in worker
    assert "- cudagraph_memory_estimate_applied" in worker
