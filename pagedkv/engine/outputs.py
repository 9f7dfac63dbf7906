"""What ``LLM.generate`` returns. Mirrors ``vllm/outputs.py`` (``RequestOutput``, ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One of a prompt's ``n`` completions: its tokens, their text (when a tokenizer exists) and why it
    stopped (``"length"``: ``max_tokens`` reached; ``"stop"``: EOS or a stop token; ``"abort"``);
    ``stop_reason`` is the stop token id that ended it (``None`` for the tokenizer's EOS or a length cap).
    ``num_preemptions`` counts how often this sequence was preempted (lab addition)."""

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | None = None
    num_preemptions: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's result, in vLLM's shape. ``num_cached_tokens`` is the prompt tokens served from the
    prefix cache when the request was first admitted (vLLM's field of that name); ``num_preemptions`` the
    preemptions of all its sequences together (lab addition)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0
    num_preemptions: int = 0
