"""``max_num_seqs`` and ``max_num_batched_tokens`` left out: vLLM 0.26's defaults, by device, by the number of
workers on a CPU and by who asks (``EngineArgs.get_batch_defaults`` and
``_set_default_max_num_seqs_and_batched_tokens_args`` in ``vllm/engine/arg_utils.py``): the ``LLM`` class, or the
OpenAI-compatible server (``UsageContext.OPENAI_API_SERVER``, which ``vllm serve`` passes)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.engine.llm import LLM, batch_defaults, fit_batch_limits
from pagedkv.entrypoints.api_server import build_engine
from pagedkv.entrypoints.cli_args import make_arg_parser
from pagedkv.grading.lessons.l07_serving_engine import tiny_llama

CPU = torch.device("cpu")


def test_the_cpu_table_is_vllms_and_grows_with_the_workers():
    assert batch_defaults(CPU) == (4096, 256)
    assert batch_defaults(CPU, 2) == (8192, 512)  # 4096 * world_size, 256 * world_size
    assert batch_defaults(CPU, usage_context="OPENAI_API_SERVER") == (2048, 128)
    assert batch_defaults(CPU, 4, "OPENAI_API_SERVER") == (8192, 512)
    with pytest.raises(ValueError, match="usage_context must be one of"):
        batch_defaults(CPU, usage_context="llm")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            batch_defaults(CPU, bad)


@pytest.mark.parametrize(("seqs", "tokens", "want"), [
    (None, None, (256, 4096)),  # min(256 * 2048, 4096) tokens; min(256, 4096) sequences
    (2, None, (2, 128)),  # a budget of two whole sequences of 64
    (None, 8, (8, 8)),  # no more sequences than tokens
    (300, 5000, (300, 5000)),  # both given: as given
])
def test_a_figure_left_out_is_fitted_to_the_other(seqs, tokens, want):
    max_model_len = 2048 if (seqs, tokens) == (None, None) else 64
    assert fit_batch_limits(seqs, tokens, max_model_len, (4096, 256)) == want


def test_two_that_cannot_go_together_are_refused_in_vllms_words():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be greater than or equal to "
                                         r"max_num_seqs \(16\)\."):
        fit_batch_limits(16, 8, 64, (4096, 256))


def test_the_llm_class_and_the_server_take_their_own_defaults():
    model = tiny_llama()
    llm = LLM(model, num_gpu_blocks=16, block_size=8, max_model_len=64)
    assert (llm.max_num_seqs, llm.max_num_batched_tokens) == (256, 4096)
    served = LLM(model, num_gpu_blocks=16, block_size=8, max_model_len=64, usage_context="OPENAI_API_SERVER")
    assert (served.max_num_seqs, served.max_num_batched_tokens) == (128, 2048)
    with pytest.raises(ValueError, match="usage_context must be one of"):
        LLM(model, num_gpu_blocks=16, block_size=8, usage_context="server")
    engine, _ = build_engine(make_arg_parser().parse_args(["tiny", "--num-gpu-blocks", "16", "--max-model-len", "64"]))
    assert (engine.llm.max_num_seqs, engine.llm.max_num_batched_tokens) == (128, 2048)  # vllm serve's, on a CPU
    engine, _ = build_engine(make_arg_parser().parse_args(["tiny", "--num-gpu-blocks", "16", "--max-model-len", "64",
                                                           "--max-num-seqs", "4"]))
    assert (engine.llm.max_num_seqs, engine.llm.max_num_batched_tokens) == (4, 256)
