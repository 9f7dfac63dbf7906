"""The OpenAI-compatible wire format: request and response bodies, as pydantic models.

Field names, defaults and the error body follow vLLM 0.26: ``vllm/entrypoints/openai/completion/protocol.py``
(``CompletionRequest``, ``CompletionResponse``, ``CompletionStreamResponse``),
``vllm/entrypoints/openai/chat_completion/protocol.py`` (``ChatCompletionRequest``) and
``vllm/entrypoints/openai/engine/protocol.py`` (``ErrorResponse``, ``ErrorInfo``, ``UsageInfo``, ``ModelCard``,
``ModelPermission``).
The fields the lab's engine honours are declared; so are vLLM's sampling fields it cannot serve
(beam search, ``logprob_token_ids``, ``suffix``, ...: :data:`UNSERVED`), with
vLLM's defaults, so that a request setting one to anything else is refused with a 400 rather than answered as
if it had not (a deliberate difference: vLLM serves them). As in vLLM, any other field is accepted and ignored
(``OpenAIBaseModel`` has ``extra="allow"``). vLLM's ``mode="before"`` request validators are here with their
messages and ``param`` (``validate_stream_options``, ``normalize_null_max_tokens``,
``validate_prompt_list_length``, ``check_generation_prompt``); they raise :class:`~pagedkv.engine.exceptions.
InvalidRequestError` (vLLM's ``VLLMValidationError``), whose ``parameter`` the server reports.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedkv.engine.exceptions import InvalidRequestError
from pagedkv.engine.logprobs import Logprob

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: The most prompts one ``/v1/completions`` request may list: vLLM 0.26's ``VLLM_MAX_COMPLETION_PROMPTS`` default.
MAX_COMPLETION_PROMPTS = 1024

#: vLLM's request fields the lab's engine cannot serve, and the values that ask for nothing (vLLM's defaults, and
#: what a client sends to mean "off"); any other value is refused with a 400 naming the field.
UNSERVED: dict[str, tuple[Any, ...]] = {
    "truncate_prompt_tokens": (None,),
    "suffix": (None,), "use_beam_search": (False,), "logprob_token_ids": (None, []),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "response_format": (None, {"type": "text"}), "structured_outputs": (None,), "tools": (None, []),
    "truncation_side": (None,), "prompt_embeds": (None,),
}


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Extra fields are allowed (and ignored), as in vLLM's ``OpenAIBaseModel``."""

    model_config = ConfigDict(extra="allow")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None  # vLLM fills it for chat only; the lab leaves it None
    multimodal_tokens: dict[str, int] | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(OpenAIBaseModel):
    """The sampling fields completions and chat share (names and defaults of vLLM 0.26)."""

    model: str | None = None
    n: int = 1
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: str | list[str] | None = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None  # None: the generation config's, else 1.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)  # vLLM's: null is refused
    stop_token_ids: list[int] | None = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    priority: int = 0
    cache_salt: str | None = None  # mixed into the first block's hash (vLLM 0.26; see kv_cache_utils)
    request_id: str = Field(default_factory=random_uuid)
    return_token_ids: bool | None = False  # vLLM 0.26: each choice carries its token ids
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:{id}"
    #: vLLM's extension: each prompt token's logprob and those of this many likeliest, in the response's
    #: ``prompt_logprobs`` (``-1``: the vocabulary; not with ``stream``)
    prompt_logprobs: int | None = None

    @model_validator(mode="before")
    @classmethod
    def check_prompt_logprobs(cls, data: Any) -> Any:
        """vLLM's ``check_logprobs`` for ``prompt_logprobs`` (its messages and param)."""
        prompt = data.get("prompt_logprobs") if isinstance(data, dict) else None
        if isinstance(prompt, (int, float)):  # True counts as 1, as in vLLM's comparison
            if data.get("stream") and (prompt > 0 or prompt == -1):
                raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.",
                                          "prompt_logprobs")
            if prompt < 0 and prompt != -1:
                raise InvalidRequestError("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        """vLLM's ``validate_stream_options``: ``stream_options`` only with ``stream``."""
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise InvalidRequestError("Stream options can only be defined when `stream=True`.", "stream_options")
        return data

    def unserved(self) -> str | None:
        """The first field of :data:`UNSERVED` this request sets to a value the engine cannot serve. A bool is
        only ``False``, not ``0``."""
        fields = {**(self.model_extra or {}), **{k: getattr(self, k) for k in type(self).model_fields}}

        def off(value: Any, ok: tuple[Any, ...]) -> bool:
            return any(value is v or (isinstance(value, bool) == isinstance(v, bool) and value == v) for v in ok)

        return next((k for k, ok in UNSERVED.items() if k in fields and not off(fields[k], ok)), None)

    def sample_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` for this request (``None``: no logprobs)."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs`` for this request (``None``: none)."""
        return self.prompt_logprobs

    def token_logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with integer keys and each bias clamped to [-100, 100]; ``InvalidRequestError`` naming
        the keys that are not integers. Mirrors ``SamplingParams.from_optional`` (``vllm/sampling_params.py``)."""
        if self.logit_bias is None:
            return None
        bias, bad = {}, []
        for token, value in self.logit_bias.items():
            try:
                bias[int(token)] = min(100.0, max(-100.0, value))
            except (ValueError, TypeError):
                bad.append(token)
        if bad:
            raise InvalidRequestError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                      f"{bad!r}", "logit_bias")
        return bias

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a list of
    token-id lists (one completion set per prompt)."""

    prompt: (
        list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]] | str | list[str] | None
    ) = None
    max_tokens: int | None = 16
    echo: bool | None = False
    add_special_tokens: bool = True  # the tokenizer's BOS and the like on a text prompt
    logprobs: int | None = None  # each token's logprob and those of this many likeliest

    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` the ``logprobs`` (the echoed prompt's, as many top tokens as the
        output's). Mirrors ``CompletionRequest.to_sampling_params``."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        """vLLM's ``check_logprobs`` (its message and param) for the fields the lab serves."""
        logprobs = data.get("logprobs") if isinstance(data, dict) else None
        if isinstance(logprobs, (int, float)) and logprobs < 0:
            raise InvalidRequestError("`logprobs` must be a positive value.", "logprobs")
        return data

    @model_validator(mode="before")
    @classmethod
    def normalize_null_max_tokens(cls, data: Any) -> Any:
        """vLLM's ``normalize_null_max_tokens``: ``"max_tokens": null`` means the default, 16 (not "all the room
        ``max_model_len`` leaves", which is chat's ``None``)."""
        if isinstance(data, dict) and data.get("max_tokens") is None:
            data = {**data, "max_tokens": cls.model_fields["max_tokens"].default}
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_prompt_list_length(cls, data: Any) -> Any:
        """vLLM's ``validate_prompt_list_length``: at most :data:`MAX_COMPLETION_PROMPTS` prompts in a list."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if (isinstance(prompt, list) and len(prompt) > MAX_COMPLETION_PROMPTS
                and not all(isinstance(p, int) for p in prompt)):
            raise InvalidRequestError(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of {MAX_COMPLETION_PROMPTS}. "
                "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.", "prompt")
        return data


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: the messages are rendered with the tokenizer's chat template."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # on top of the chat template's (which has them already)
    logprobs: bool | None = False
    top_logprobs: int | None = 0

    def sample_logprobs(self) -> int | None:
        """vLLM's ``to_sampling_params``: ``top_logprobs`` when ``logprobs`` is true."""
        return self.top_logprobs if self.logprobs else None

    @model_validator(mode="before")
    @classmethod
    def check_logprobs(cls, data: Any) -> Any:
        """vLLM's ``check_logprobs`` (its messages and params) for the fields the lab serves."""
        top = data.get("top_logprobs") if isinstance(data, dict) else None
        if isinstance(top, (int, float)):
            if top < 0 and top != -1:
                raise InvalidRequestError("`top_logprobs` must be a positive value or -1.", "top_logprobs")
            if (top == -1 or top > 0) and not data.get("logprobs"):
                raise InvalidRequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                                          "top_logprobs")
        return data

    def unserved(self) -> str | None:
        """As for completions, and ``echo`` (chat's echoes the last message; the lab's chat does not)."""
        return super().unserved() or ("echo" if (self.model_extra or {}).get("echo") else None)

    def untrusted_chat_template(self) -> bool:
        """A chat template sent with the request, which vLLM refuses unless ``--trust-request-chat-template``
        (the lab has no such flag): ``OnlineRenderer.validate_chat_template``."""
        extra = self.model_extra or {}
        kwargs = extra.get("chat_template_kwargs")
        return extra.get("chat_template") is not None or (
            isinstance(kwargs, dict) and kwargs.get("chat_template") is not None)

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        """vLLM's ``check_generation_prompt`` (its message; no ``param``): both set to true in the body. With
        ``add_generation_prompt`` left at its default (True) the chat template refuses the pair instead."""
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return data


class CompletionLogProbs(OpenAIBaseModel):
    """A completion's logprobs, OpenAI's legacy shape: per token its text, logprob, the text's offset in the
    completion and ``{text: logprob}`` of the top tokens (the sampled token first)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    #: with prompt_logprobs (or echo and logprobs): None, then each prompt token's ``{token_id: {logprob, rank,
    #: decoded_token}}``
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on a choice's first chunk
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)


class ChatMessageOut(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    #: with prompt_logprobs: None, then each prompt token's ``{token_id: {logprob, rank, decoded_token}}``
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = Field(default=None)
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on the first chunks
