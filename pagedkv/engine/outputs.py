"""What ``LLM.generate`` returns. Mirrors ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.logprobs import Logprob


@dataclass
class CompletionOutput:
    """One of a prompt's ``n`` completions: its tokens, their text (``""`` without a tokenizer, as vLLM) and why it
    stopped (``"length"``: ``max_tokens`` reached; ``"stop"``: EOS, a stop token or a stop string; ``"abort"``);
    ``stop_reason`` is the stop token id or stop string that ended it (``None`` for the tokenizer's EOS or a
    length cap). ``num_preemptions`` counts how often this sequence was preempted (lab addition).
    With ``SamplingParams.logprobs``: ``logprobs``, one ``{token_id: Logprob}`` dict a generated token (the sampled
    token first), and ``cumulative_logprob``, the sampled tokens' log-probabilities summed; ``None`` otherwise."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, in vLLM's shape. ``num_cached_tokens`` is the prompt tokens served from the
    prefix cache when the request was first admitted (vLLM's field of that name; with ``n > 1``, as in vLLM, the
    count of the completion that finished last); ``num_preemptions`` the
    preemptions of all its sequences together (lab addition). ``prompt_logprobs``, with
    ``SamplingParams.prompt_logprobs``: ``None`` for the first prompt token, then one ``{token_id: Logprob}`` dict a
    prompt token (that token first, then the likeliest ones at its position); ``None`` otherwise."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
