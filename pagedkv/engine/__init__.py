"""Lesson 7: a serving engine running a real transformers model on the lab's paged KV cache.

``from pagedkv.engine import LLM, SamplingParams``. Named as vLLM 0.26's offline API (``vllm.LLM``,
``vllm.SamplingParams``, ``vllm.RequestOutput``).
"""

from pagedkv.engine.llm import LLM, SUPPORTED_ARCHITECTURES
from pagedkv.engine.outputs import CompletionOutput, RequestOutput
from pagedkv.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SUPPORTED_ARCHITECTURES", "CompletionOutput", "RequestOutput", "SamplingParams"]
