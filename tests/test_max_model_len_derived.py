"""The model's length as vLLM 0.26 derives it from the config (``_get_and_verify_max_len``,
``vllm/config/model.py``): the smallest length key, RoPE scaling, LongRoPE's default, and the refusal of a longer
``max_model_len`` (unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` or the config's ``model_max_length`` allows it).
Before, the lab took ``max_position_embeddings`` alone: a Llama with linear RoPE scaling of factor 2 was held to
half the length vLLM serves it at."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.engine import LLM, SamplingParams
from pagedkv.sizing import derived_max_model_len, get_and_verify_max_len

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32, initializer_range=0.5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.mark.parametrize(("rope", "want"), [
    (None, 32),
    ({"rope_type": "linear", "factor": 2.0}, 64),
    ({"rope_type": "dynamic", "factor": 3.0}, 96),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64),  # from the original
    (LLAMA3, 32),  # its max_position_embeddings already counts the factor
])
def test_rope_scaling_scales_the_length_as_vllm_does(rope, want):
    config = LlamaConfig(**BASE, rope_scaling=rope)
    assert derived_max_model_len(config) == (want, "max_position_embeddings")
    assert get_and_verify_max_len(config, None) == get_and_verify_max_len(config, -1) == want


def test_the_smallest_length_key_wins_and_model_max_length_overrides():
    assert derived_max_model_len({"max_position_embeddings": 2048, "n_positions": 1024}) == (1024, "n_positions")
    assert derived_max_model_len({"max_position_embeddings": 2048, "model_max_length": 4096}) == \
        (4096, "model_max_length")  # Command-R's rule
    assert derived_max_model_len({"hidden_size": 8}) == (2048, None)  # vLLM's default, with its warning
    # transformers 4's name for the RoPE type; Gemma 3's length is already scaled
    assert derived_max_model_len({"max_position_embeddings": 100, "rope_scaling": {"type": "linear", "factor": 2}}) \
        == (200, "max_position_embeddings")
    assert derived_max_model_len({"model_type": "gemma3_text", "max_position_embeddings": 100,
                                  "rope_scaling": {"rope_type": "linear", "factor": 8.0}})[0] == 100


def test_longrope_starts_at_its_original_length_and_allows_the_long_one():
    config = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
              "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}
    assert get_and_verify_max_len(config, None) == 4096
    assert get_and_verify_max_len(config, 131072) == 131072


def test_a_longer_max_model_len_is_refused_unless_allowed(monkeypatch, caplog):
    config = LlamaConfig(**BASE, rope_scaling={"rope_type": "linear", "factor": 2.0})
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match=r"User-specified max_model_len \(65\) is greater than the derived "
                                         r"max_model_len \(max_position_embeddings=64.0 or model_max_length=None in "
                                         r"model's config.json\)\. To allow overriding this maximum, set the env var "
                                         r"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1\."):
        get_and_verify_max_len(config, 65)
    assert get_and_verify_max_len(config, 64) == 64
    assert get_and_verify_max_len({"max_position_embeddings": 32, "model_max_length": None}, 16) == 16
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with caplog.at_level(logging.WARNING):
        assert get_and_verify_max_len(config, 65) == 65
    assert "must be used with extreme caution" in caplog.text


def test_the_engine_serves_a_linearly_scaled_llama_past_max_position_embeddings_as_hf_does():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BASE, rope_scaling={"rope_type": "linear", "factor": 2.0})).eval()
    llm = LLM(model, num_gpu_blocks=64, block_size=8)
    assert llm.max_model_len == 64  # was 32: max_position_embeddings alone
    prompt = [int(x) for x in torch.randint(0, 128, (40,))]  # past the config's 32 positions
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert list(out.outputs[0].token_ids) == ref[0, 40:].tolist()
    with pytest.raises(ValueError, match="User-specified max_model_len"):
        LLM(model, num_gpu_blocks=64, block_size=8, max_model_len=65)
    with pytest.raises(ValueError, match=r"max_model_len must be an int in 2\.\.64 \(for this model\)"):
        LLM(model, num_gpu_blocks=64, block_size=8, max_model_len=1)


VLLM_SIDE = """
import json, sys
sys.path.extend(json.loads(sys.argv[1]))
from transformers import LlamaConfig
from vllm.config.model import _get_and_verify_max_len
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

out = []
for kwargs, max_model_len in json.loads(sys.argv[2]):
    config = LlamaConfig(**kwargs)
    arch = type("Arch", (), {"derived_max_model_len_and_key":
                             ModelArchConfigConvertorBase(config, config).derive_max_model_len_and_key()})()
    try:
        out.append(_get_and_verify_max_len(config, arch, None, max_model_len, False, None))
    except ValueError as exc:
        out.append(str(exc).split(" To allow")[0])
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parity
def test_the_length_is_vllms_own_on_a_grid_of_configs():
    """vLLM 0.26's ``_get_and_verify_max_len`` itself (its sources fetched as the parity checks fetch them; skipped
    when they cannot be), run on the same configs and requested lengths as the lab's: the same length, or the
    same refusal."""
    import json
    import os
    import subprocess
    import sys

    from pagedkv.parity import available
    from pagedkv.parity.fetch import ensure_vllm

    ok, reason = available()
    if not ok:
        pytest.skip(f"vLLM 0.26's sources are unavailable: {reason}")
    ropes = [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 3.0},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, LLAMA3]
    configs = [{**BASE, "rope_scaling": r} for r in ropes] + [{**BASE, "model_max_length": 100}]
    cases = [(c, m) for c in configs for m in (None, -1, 32, 64, 96, 97, 128)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", VLLM_CONFIGURE_LOGGING="0")
    env.pop("VLLM_ALLOW_LONG_MAX_MODEL_LEN", None)
    proc = subprocess.run([sys.executable, "-c", VLLM_SIDE, json.dumps(ensure_vllm(log=lambda _m: None).paths),
                           json.dumps(cases)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = []
    for kwargs, max_model_len in cases:
        try:
            ours.append(get_and_verify_max_len(LlamaConfig(**kwargs), max_model_len))
        except ValueError as exc:
            ours.append(str(exc).split(" To allow")[0])
    assert ours == theirs, [(c, o, t) for c, o, t in zip(cases, ours, theirs, strict=True) if o != t]
    assert len(set(map(str, theirs))) > 5  # the grid holds lengths and refusals of several kinds
