"""``pagedkv serve MODEL``: an OpenAI-compatible HTTP server on the lab's engine (FastAPI + uvicorn).

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (when
the tokenizer has a chat template), ``GET /metrics`` (Prometheus text, vLLM's metric names) and, as a lab
extension, ``GET /pagedkv/snapshot`` (the scheduler's queues and block tables, for the block-table widget).
Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, with vLLM's status codes: 400
for a bad request (malformed JSON, a bad parameter, a prompt too long, token ids outside the vocabulary),
404 for an unknown model, 500 only for a bug (the server keeps serving).

Mirrors ``vllm/entrypoints/openai/api_server.py`` (``build_app``, ``run_server``),
``vllm/entrypoints/openai/completion/serving.py`` (``OpenAIServingCompletion``),
``vllm/entrypoints/openai/chat_completion/serving.py`` and ``vllm/entrypoints/serve/utils/server_utils.py``
(the exception handlers). Flags are named as ``vllm serve``'s (``vllm/engine/arg_utils.py``,
``vllm/entrypoints/openai/cli_args.py``); the lab's ``--host`` defaults to 127.0.0.1 (vLLM listens on every
interface): a course server should not be reachable from the network unless asked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import io
import json
import socket
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.engine.async_llm import AsyncLLM, EngineDeadError
from pagedkv.engine.exceptions import InvalidRequestError
from pagedkv.engine.logprobs import Logprob
from pagedkv.engine.metrics import CONTENT_TYPE_LATEST
from pagedkv.engine.output_processor import CompletionDelta
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.entrypoints import protocol as P
from pagedkv.entrypoints.chat_utils import render_chat
from pagedkv.entrypoints.cli_args import make_arg_parser


class ServingError(Exception):
    """An error answered with OpenAI's body and a status code."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param
        self.err_type = err_type or {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.NOT_FOUND: "NotFoundError",
                                     HTTPStatus.NOT_IMPLEMENTED: "NotImplementedError"}.get(status,
                                                                                            "InternalServerError")


def error_body(message: str, err_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body. Mirrors ``create_error_response`` (``vllm/entrypoints/serve/utils/error_response.py``)."""
    info = P.ErrorInfo(message=message, type=err_type, param=param, code=int(status))
    return P.ErrorResponse(error=info).model_dump()


def error_fields(exc: BaseException) -> tuple[HTTPStatus, str, str | None]:
    """``(status, type, param)`` of the error body for ``exc``. Mirrors ``create_error_response``'s cases; an
    :class:`EngineDeadError` is a 503 here (vLLM: 500), as ``/health`` says."""
    if isinstance(exc, ServingError):
        status, err_type, param = exc.status, exc.err_type, exc.param
    elif isinstance(exc, InvalidRequestError):
        status, err_type, param = HTTPStatus.BAD_REQUEST, "BadRequestError", exc.parameter
    elif isinstance(exc, (ValueError, TypeError, OverflowError)):
        status, err_type, param = HTTPStatus.BAD_REQUEST, "BadRequestError", None
    elif isinstance(exc, EngineDeadError):
        status, err_type, param = HTTPStatus.SERVICE_UNAVAILABLE, "EngineDeadError", None
    else:
        status, err_type, param = HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError", None
    return status, err_type, param


def error_response(exc: BaseException) -> JSONResponse:
    status, err_type, param = error_fields(exc)
    return JSONResponse(error_body(str(exc), err_type, status, param), status_code=int(status))


#: pydantic-core's names for its own wrappers and union branches, which are no field of the body (vLLM's
#: ``_INTERNAL_LOC_MARKERS``, ``vllm/entrypoints/serve/utils/server_utils.py``)
_INTERNAL_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype",
})


def clean_loc_for_param(loc: Sequence[Any]) -> str:
    """A validation error's ``loc`` as a dotted ``param``, without pydantic's wrapper and union-branch segments:
    ``("body", "stop", "str")`` -> ``"body.stop"``. Mirrors ``clean_loc_for_param``."""
    parts = [str(p) for p in loc
             if not any(c in str(p) for c in "[]{}()") and str(p).lower() not in _INTERNAL_LOC_MARKERS]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """vLLM's message for a body that fails validation: ``N validation error(s):`` then one line each; ``param``:
    the ``parameter`` of the first error a request validator raised (an :class:`InvalidRequestError`), else the
    first error's location (``validation_exception_handler``)."""
    if not errors:
        return "Validation error", None
    label = "error" if len(errors) == 1 else "errors"
    lines = []
    param = None
    for e in errors:
        if isinstance(e, dict):
            e = dict(e)
            e.pop("url", None)
            ctx_error = (e.pop("ctx", None) or {}).get("error")
            if param is None and isinstance(ctx_error, InvalidRequestError):
                param = ctx_error.parameter
        lines.append(f"  {e}")
    loc = errors[0].get("loc") if isinstance(errors[0], dict) else None  # validate_json_request's are strings
    if param is None and loc:
        param = clean_loc_for_param(loc)
    return f"{len(errors)} validation {label}:\n" + "\n".join(lines), param


async def validate_json_request(raw_request: Request) -> None:
    """A POST body must be ``application/json`` (a 400 otherwise, before the body is read as a request). Mirrors
    ``validate_json_request`` (``vllm/entrypoints/serve/utils/api_utils.py``), its message."""
    content_type = raw_request.headers.get("content-type", "").lower()
    if content_type.split(";", maxsplit=1)[0] != "application/json":
        raise RequestValidationError(errors=["Unsupported Media Type: Only 'application/json' is allowed"])


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler):
    """Cancel a non-streaming handler when its client disconnects (its request is then aborted by
    ``AsyncLLM.generate``). A streaming response listens for disconnects itself. Mirrors ``with_cancellation``
    (``vllm/entrypoints/serve/utils/api_utils.py``)."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        request = kwargs["raw_request"]
        work = asyncio.create_task(handler(*args, **kwargs))
        gone = asyncio.create_task(_listen_for_disconnect(request))
        done, pending = await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        if work in done:
            return work.result()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        return None

    return wrapper


# ---------------------------------------------------------------------------------------------------------
# Serving: requests -> engine inputs -> responses
# ---------------------------------------------------------------------------------------------------------
class OpenAIServing:
    """Turns completion and chat requests into engine requests and the engine's deltas into responses.
    Mirrors ``OpenAIServingCompletion`` and ``OpenAIServingChat``."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], model_path: str,
                 enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.model_path = model_path
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokenizer = engine.tokenizer

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None) is not None

    def check_model(self, model: str | None) -> None:
        if model and model not in self.served_model_names:
            raise ServingError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    @staticmethod
    def check_supported(request: P._SamplingFields) -> None:
        """A 400 naming the first field set to something the engine cannot serve (``protocol.UNSERVED``: vLLM
        serves them; the lab refuses rather than answer as if the field were not there)."""
        name = request.unserved()
        if name is not None:
            raise ServingError(f"{name} is not supported by this server (the lab's engine cannot serve it)",
                               HTTPStatus.BAD_REQUEST, name)
        if request.n < 1:
            # SamplingParams' check, a plain ValueError in vLLM: no param
            raise ServingError(f"n must be at least 1, got {request.n}.", HTTPStatus.BAD_REQUEST)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ServingError("text prompts need a tokenizer; this model has none: send token ids",
                               HTTPStatus.BAD_REQUEST, "prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_completion(self, request: P.CompletionRequest) -> list[list[int]]:
        """The prompts of a completion request as token-id lists. Mirrors ``OnlineRenderer.render_completion``."""
        prompt = request.prompt
        if prompt is None or prompt == [] or prompt == "":
            raise ServingError("prompt must be a non-empty string, list of strings or list of token ids",
                               HTTPStatus.BAD_REQUEST, "prompt")
        if isinstance(prompt, str):
            return [self.tokenize(prompt, request.add_special_tokens)]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        out = []
        for p in prompt:
            out.append(self.tokenize(p, request.add_special_tokens) if isinstance(p, str) else list(p))
        return out

    def prompt_texts(self, request: P.CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text, for ``echo``: as sent, or its token ids decoded (vLLM's ``_detokenize_prompt``:
        ``tokenizer.decode``, special tokens kept)."""
        sent = [request.prompt] if isinstance(request.prompt, str) else list(request.prompt or [])
        if len(sent) != len(prompts):  # one prompt of token ids
            sent = [prompts[0]]
        if self.tokenizer is None and not all(isinstance(p, str) for p in sent):
            raise ServingError("echo of token-id prompts needs a tokenizer; this model has none: use "
                               "return_token_ids", HTTPStatus.BAD_REQUEST, "echo")
        return [p if isinstance(p, str) else self.tokenizer.decode(ids) for p, ids in zip(sent, prompts, strict=True)]

    def render_chat(self, request: P.ChatCompletionRequest) -> list[int]:
        if not self.has_chat_template:
            raise ServingError("this model's tokenizer has no chat template: use /v1/completions",
                               HTTPStatus.BAD_REQUEST, "messages")
        if not request.messages:
            raise ServingError("messages must not be empty", HTTPStatus.BAD_REQUEST, "messages")
        if request.untrusted_chat_template():  # vLLM's message
            raise ServingError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                               "Refused request with untrusted chat template.", HTTPStatus.BAD_REQUEST)
        try:  # a non-text part, and the template's refusals (jinja2's TemplateError too), are the request's fault:
            # a 400, as in vLLM
            _, ids = render_chat(self.tokenizer, [m.model_dump() for m in request.messages],
                                 add_generation_prompt=request.add_generation_prompt,
                                 continue_final_message=request.continue_final_message,
                                 add_special_tokens=request.add_special_tokens)
        except Exception as exc:  # noqa: BLE001 - create_error_response's ValueError and TemplateError cases
            if not isinstance(exc, ValueError) and not any(c.__name__ == "TemplateError" for c in type(exc).__mro__):
                raise
            raise ServingError(str(exc), HTTPStatus.BAD_REQUEST) from None
        return ids

    def sampling_params(self, request: P._SamplingFields, max_tokens: int) -> SamplingParams:
        """vLLM's ``to_sampling_params``: a field the request leaves out is the engine's default
        (``default_sampling_params``: the model's generation config, :meth:`LLM.get_diff_sampling_param`, else
        temperature 1, top_p 1, top_k 0 = no limit)."""
        default = self.engine.llm.get_diff_sampling_param()
        try:
            params = SamplingParams(
                max_tokens=max_tokens, n=request.n,
                temperature=default.get("temperature", 1.0) if request.temperature is None else request.temperature,
                top_p=default.get("top_p", 1.0) if request.top_p is None else request.top_p,
                top_k=default.get("top_k", 0) if request.top_k is None else request.top_k,
                min_p=default.get("min_p", 0.0) if request.min_p is None else request.min_p,
                min_tokens=request.min_tokens,
                presence_penalty=request.presence_penalty or 0.0, frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=(default.get("repetition_penalty", 1.0) if request.repetition_penalty is None
                                    else request.repetition_penalty),
                seed=request.seed, stop_token_ids=list(request.stop_token_ids or []) or None,
                ignore_eos=request.ignore_eos, logprobs=request.sample_logprobs(),
                prompt_logprobs=request.requested_prompt_logprobs(), bad_words=request.bad_words,
                logit_bias=request.token_logit_bias(), allowed_token_ids=request.allowed_token_ids,
            )
        except ValueError as exc:  # the field where vLLM names it (its VLLMValidationError), else param null
            raise ServingError(str(exc), HTTPStatus.BAD_REQUEST, getattr(exc, "parameter", None)) from None
        try:
            self.engine.llm.verify_sampling_params(params)  # SamplingParams.verify: against the model
        except InvalidRequestError as exc:
            raise ServingError(str(exc), HTTPStatus.BAD_REQUEST, exc.parameter) from None
        return params

    def prepare(self, request: P._SamplingFields, prompts: list[list[int]], max_tokens: int | None,
                max_tokens_param: str = "max_tokens") -> list[SamplingParams]:
        """Check each prompt and make its sampling parameters; raises before anything is queued. ``max_tokens``
        above ``max_model_len`` is refused first, naming ``max_tokens_param`` (chat's ``max_completion_tokens``
        when that is the one given), with vLLM's message (``TokenizeParams.__post_init__``,
        ``vllm/renderers/params.py``; its f-string prints ``max_total_tokens=`` too)."""
        self.check_model(request.model)
        self.check_supported(request)
        limit = self.engine.max_model_len
        if max_tokens is not None and max_tokens > limit:
            raise ServingError(f"{max_tokens_param}={max_tokens} cannot be greater than max_model_len="
                               f"max_total_tokens={limit}. Please request fewer output tokens.",
                               HTTPStatus.BAD_REQUEST, max_tokens_param)
        stop = request.stop_list()
        if stop and self.tokenizer is None:
            raise ServingError("stop strings need a tokenizer; this model has none: use stop_token_ids",
                               HTTPStatus.BAD_REQUEST, "stop")
        if request.cache_salt is not None and not request.cache_salt:  # vLLM's check_cache_salt_support
            raise ServingError("Parameter 'cache_salt' must be a non-empty string if provided.",
                               HTTPStatus.BAD_REQUEST, "cache_salt")
        if any(not s for s in stop):
            raise ServingError("stop strings must not be empty", HTTPStatus.BAD_REQUEST, "stop")
        vocab = self.engine.llm.model.config.vocab_size
        bad = [t for t in request.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise ServingError(f"stop_token_ids has ids outside the vocabulary 0..{vocab - 1}: {bad}",
                               HTTPStatus.BAD_REQUEST, "stop_token_ids")
        out = []
        for ids in prompts:
            mt = self.engine.check_prompt(ids, max_tokens)
            out.append(self.sampling_params(request, mt))
        return out

    def generators(self, request: P._SamplingFields, request_id: str, prompts: list[list[int]],
                   params: list[SamplingParams]) -> list[AsyncGenerator[CompletionDelta, None]]:
        return [
            self.engine.generate(ids, p, f"{request_id}-{i}", stop=request.stop_list(),
                                 include_stop_str_in_output=request.include_stop_str_in_output,
                                 cache_salt=request.cache_salt, priority=request.priority)
            for i, (ids, p) in enumerate(zip(prompts, params, strict=True))
        ]

    def _token_text(self, logprob: Logprob | None, token_id: int, as_ids: bool) -> str:
        """A logprob's token as the client sees it: ``"token_id:{id}"`` with ``return_tokens_as_token_ids``, else
        its decoded text (decoded here when there is no record: an echoed prompt's first token). Mirrors
        ``OpenAIServing._get_decoded_token``."""
        if as_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            raise ServingError("logprobs' tokens need a tokenizer (this model has none): set "
                               "return_tokens_as_token_ids", HTTPStatus.BAD_REQUEST, "logprobs")
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, request: P.CompletionRequest, token_ids: Sequence[int],
                            entries: Sequence[dict[int, Logprob] | None], initial_text_offset: int = 0
                            ) -> P.CompletionLogProbs:
        """The legacy completions shape of ``entries`` (one record a token of ``token_ids``): each token's text and
        logprob (at least -9999, OpenAI's stand-in for -inf), its text's offset, and the first ``logprobs + 1``
        entries of its record (the sampled token, then the likeliest). A token without a record (an echoed
        prompt's first) has its text and ``null`` logprobs. Mirrors
        ``OpenAIServingCompletion._create_completion_logprobs``."""
        as_ids, num = bool(request.return_tokens_as_token_ids), request.logprobs or 0
        offsets: list[int] = []
        logprobs: list[float | None] = []
        tokens: list[str] = []
        tops: list[dict[str, float] | None] = []
        last_len = 0
        for token_id, step in zip(token_ids, entries, strict=True):
            if step is None:
                token = self._token_text(None, token_id, as_ids)
                logprobs.append(None)
                tops.append(None)
            else:
                token = self._token_text(step[token_id], token_id, as_ids)
                logprobs.append(max(step[token_id].logprob, -9999.0))
                tops.append({self._token_text(lp, t, as_ids): max(lp.logprob, -9999.0)
                             for i, (t, lp) in enumerate(step.items()) if num >= i})
            tokens.append(token)
            offsets.append(offsets[-1] + last_len if offsets else initial_text_offset)
            last_len = len(token)
        return P.CompletionLogProbs(text_offset=offsets, token_logprobs=logprobs, tokens=tokens, top_logprobs=tops)

    def chat_logprobs(self, request: P.ChatCompletionRequest, token_ids: Sequence[int],
                      entries: Sequence[dict[int, Logprob]]) -> P.ChatCompletionLogProbs:
        """The chat shape of ``entries``: each token's text, logprob and UTF-8 bytes, and the first
        ``top_logprobs`` entries of its record (which starts with the sampled token). Mirrors
        ``OpenAIServingChat._create_chat_logprobs`` and ``_get_top_logprobs``."""
        as_ids, top = bool(request.return_tokens_as_token_ids), request.top_logprobs
        content = []
        for token_id, step in zip(token_ids, entries, strict=True):
            chosen = step[token_id]
            tops = []
            for i, (t, lp) in enumerate(step.items()):
                if top == -1 or (top is not None and i < top):
                    text = self._token_text(lp, t, as_ids)
                    tops.append(P.ChatCompletionLogProb(token=text, logprob=max(lp.logprob, -9999.0),
                                                        bytes=list(text.encode("utf-8", errors="replace"))))
            content.append(P.ChatCompletionLogProbsContent(
                token=self._token_text(chosen, token_id, as_ids), logprob=max(chosen.logprob, -9999.0),
                bytes=None if chosen.decoded_token is None else list(chosen.decoded_token.encode("utf-8",
                                                                                                 errors="replace")),
                top_logprobs=tops))
        return P.ChatCompletionLogProbs(content=content)

    def usage(self, prompts: list[list[int]], completion_tokens: int, cached: int | None) -> P.UsageInfo:
        prompt_tokens = sum(map(len, prompts))
        usage = P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens)
        if self.enable_prompt_tokens_details and cached is not None:
            usage.prompt_tokens_details = P.PromptTokenUsageInfo(cached_tokens=cached)
        return usage


async def merge_async_iterators(*iterators: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    """``(i, item)`` from several async iterators as items arrive; closing this closes them all. Mirrors
    ``vllm/utils/async_utils.py: merge_async_iterators``."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for it in iterators:
            with contextlib.suppress(Exception):
                await it.aclose()  # type: ignore[attr-defined]


class CompletionRun:
    """Collects one request's deltas per choice: text, token ids, finish and stop reasons, and the prompt tokens
    served from the prefix cache as vLLM reports them: a stream, the first output's (``first_iteration``); a
    whole response, the last prompt's ``RequestOutput``, made when its last child finished
    (``request_output_to_completion_response``: ``last_final_res.num_cached_tokens``)."""

    def __init__(self, num_choices: int) -> None:
        self.text = [""] * num_choices
        self.token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        self.finish: list[str | None] = [None] * num_choices
        self.stop_reason: list[int | str | None] = [None] * num_choices
        self.logprobs: list[list[dict[int, Logprob]]] = [[] for _ in range(num_choices)]
        self.prompt_logprobs: list[list[dict[int, Logprob] | None]] = [[] for _ in range(num_choices)]
        self.cached: int | None = None  # the first delta's (a stream's usage)
        self._finished_cached: dict[int, int] = {}  # prompt -> the cached tokens of its choice that finished last

    def add(self, i: int, d: CompletionDelta, prompt: int = 0) -> None:
        if self.cached is None:
            self.cached = d.num_cached_tokens
        self.text[i] += d.text
        self.token_ids[i].extend(d.token_ids)
        self.logprobs[i].extend(d.logprobs or ())
        self.prompt_logprobs[i].extend(d.prompt_logprobs or ())
        if d.finish_reason is not None:
            self.finish[i], self.stop_reason[i] = d.finish_reason, d.stop_reason
            self._finished_cached[prompt] = d.num_cached_tokens

    @property
    def final_cached(self) -> int | None:
        """A whole response's cached tokens: the last prompt's, from its choice that finished last."""
        return self._finished_cached[max(self._finished_cached)] if self._finished_cached else self.cached

    @property
    def completion_tokens(self) -> int:
        return sum(map(len, self.token_ids))


def clamp_prompt_logprobs(records: list[dict[int, Logprob] | None]) -> list[dict[int, Logprob] | None] | None:
    """A response's ``prompt_logprobs``: ``None`` when there are none, each ``-inf`` logprob as -9999 (JSON has no
    infinity; in place). Mirrors ``clamp_prompt_logprobs`` (``vllm/entrypoints/generate/base/serving.py``)."""
    for record in records:
        for lp in (record or {}).values():
            if lp.logprob == float("-inf"):
                lp.logprob = -9999.0
    return records or None


def should_include_usage(stream_options: P.StreamOptions | None) -> tuple[bool, bool]:
    """``(include_usage, continuous)``: a usage chunk at the end, and usage on every chunk (the choice's tokens so
    far; only with ``include_usage``). Mirrors ``should_include_usage`` (``vllm/entrypoints/serve/utils/
    api_utils.py``; the lab has no ``--enable-force-include-usage``)."""
    include = bool(stream_options and stream_options.include_usage)
    return include, include and bool(stream_options and stream_options.continuous_usage_stats)


def _sse(obj: Any, final: bool = False) -> str:
    """One server-sent event. A chunk carries the fields set on it (vLLM sets ``object``, ``logprobs`` and the
    token-id fields on every chunk, ``null`` when not asked for); the ``final`` usage chunk drops its ``null`` ones
    (vLLM dumps it ``exclude_none=True``)."""
    if not hasattr(obj, "model_dump_json"):
        return f"data: {json.dumps(obj)}\n\n"
    data = obj.model_dump_json(exclude_none=True) if final else obj.model_dump_json(exclude_unset=True)
    return f"data: {data}\n\n"


async def _stream_with_error(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in ``data: [DONE]``; any error after the 200 is sent as an error event with the
    body a non-streamed error would have (its type and param), as vLLM's stream generators do
    (``except Exception``: ``create_streaming_error_response``)."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - reported to the client, the stream still ends in [DONE]
        status, err_type, param = error_fields(exc)
        yield f"data: {json.dumps(error_body(str(exc), err_type, int(status), param))}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------------
def build_app(engine: AsyncLLM, served_model_names: list[str] | None = None, model_path: str = "",
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The FastAPI app around ``engine``; the engine loop starts and stops with the app (its lifespan).
    Mirrors ``build_app`` (``vllm/entrypoints/openai/api_server.py``)."""
    names = served_model_names or [engine.model_name]
    serving = OpenAIServing(engine, names, model_path or names[0], enable_prompt_tokens_details)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(lifespan=lifespan, title="PagedKV Lab OpenAI-compatible server")
    app.state.engine = engine
    app.state.serving = serving

    async def validation_exception_handler(_: Request, exc: RequestValidationError | ValidationError
                                           ) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return JSONResponse(error_body(message, HTTPStatus.BAD_REQUEST.phrase, 400, param), status_code=400)

    async def http_exception_handler(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), HTTPStatus(exc.status_code).phrase, exc.status_code),
                            status_code=exc.status_code)

    async def exception_handler(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(ValidationError, validation_exception_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    for cls in (ServingError, InvalidRequestError, Exception):
        app.add_exception_handler(cls, exception_handler)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return JSONResponse(error_body(f"the engine loop failed: {engine.dead_error}", "EngineDeadError", 503),
                                status_code=503)
        return Response(status_code=200)

    try:  # read once: the installed package's version
        lab_version = importlib.metadata.version("pagedkv-lab")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        lab_version = "unknown"

    @app.get("/version")
    async def show_version() -> JSONResponse:
        """The server's version, as vLLM's ``show_version`` (``vllm/entrypoints/serve/instrumentator/basic.py``)
        reports vLLM's: here the lab's package."""
        return JSONResponse({"version": lab_version})

    @app.get("/v1/models")
    async def show_available_models() -> JSONResponse:
        cards = [P.ModelCard(id=name, root=serving.model_path, max_model_len=engine.max_model_len,
                             permission=[P.ModelPermission()]) for name in names]  # OpenAIModelRegistry's
        return JSONResponse(P.ModelList(data=cards).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/pagedkv/snapshot")
    async def snapshot() -> JSONResponse:
        """Lab extension: the scheduler's snapshot (queues, block tables, free blocks), taken between steps."""
        snap = await engine.call_between_steps(engine.llm.scheduler.snapshot)
        return JSONResponse(json.loads(json.dumps(snap, default=str)))

    @app.post("/v1/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    async def create_completion(request: P.CompletionRequest, raw_request: Request) -> Any:
        prompts = serving.render_completion(request)
        # echo: each choice starts with its prompt; echo with max_tokens 0 generates one token and shows the
        # prompt alone (vLLM's echo_without_generation, whose usage still counts that token)
        echo = bool(request.echo)
        echo_only = echo and request.max_tokens == 0
        # echo with logprobs: the prompt's logprobs come first (SamplingParams.prompt_logprobs; its first token's
        # are null: nothing comes before it)
        want_logprobs = request.logprobs is not None
        params = serving.prepare(request, prompts, 1 if echo_only else request.max_tokens)
        request_id = f"cmpl-{request.request_id}"
        created = int(time.time())
        num_choices = request.n
        with_ids = bool(request.return_token_ids)
        # vLLM echoes no prompt text when token ids are returned (they say it)
        prompt_texts = serving.prompt_texts(request, prompts) if echo and not with_ids else [""] * len(prompts)
        merged = merge_async_iterators(*serving.generators(request, request_id, prompts, params))
        if request.stream:
            include_usage, continuous = should_include_usage(request.stream_options)

            async def stream() -> AsyncIterator[str]:
                run = CompletionRun(num_choices * len(prompts))
                async for p, d in merged:
                    i = p * num_choices + d.index
                    first = not run.token_ids[i] and run.finish[i] is None  # the prompt's ids ride on it
                    offset = len(run.text[i])  # the text sent before this chunk
                    run.add(i, d)
                    ids, entries = ([], []) if echo_only else (d.token_ids, d.logprobs or [])
                    if echo and first:
                        ids, entries = prompts[p] + ids, (d.prompt_logprobs or []) + entries
                    logprobs = serving.completion_logprobs(request, ids, entries, offset) if want_logprobs else None
                    text = "" if echo_only else d.text
                    usage = {"usage": serving.usage([prompts[p]], len(run.token_ids[i]), None)} if continuous else {}
                    yield _sse(P.CompletionStreamResponse(
                        id=request_id, object="text_completion", created=created, model=serving.model_name,
                        choices=[P.CompletionResponseStreamChoice(
                            index=i, text=prompt_texts[p] + text if echo and first else text, logprobs=logprobs,
                            finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                            prompt_token_ids=prompts[p] if (with_ids or echo) and first else None,
                            token_ids=d.token_ids if with_ids else None)], **usage))
                if include_usage:
                    yield _sse(P.CompletionStreamResponse(id=request_id, created=created, model=serving.model_name,
                                                          choices=[], usage=serving.usage(prompts,
                                                                                          run.completion_tokens,
                                                                                          run.cached)),
                               final=True)

            return StreamingResponse(_stream_with_error(stream()), media_type="text/event-stream")

        run = CompletionRun(num_choices * len(prompts))
        async for p, d in merged:
            run.add(p * num_choices + d.index, d, p)
        choices = []
        for i in range(len(run.text)):
            p = i // num_choices
            text, ids = ("", []) if echo_only else (run.text[i], run.token_ids[i])
            if echo:
                text, ids = prompt_texts[p] + text, prompts[p] + ids
            entries = [] if echo_only else run.logprobs[i]
            if echo:
                entries = run.prompt_logprobs[i] + entries
            logprobs = serving.completion_logprobs(request, ids, entries) if want_logprobs else None
            choices.append(P.CompletionResponseChoice(index=i, text=text, logprobs=logprobs,
                                                      finish_reason=run.finish[i], stop_reason=run.stop_reason[i],
                                                      prompt_logprobs=clamp_prompt_logprobs(run.prompt_logprobs[i]),
                                                      prompt_token_ids=prompts[p] if with_ids else None,
                                                      token_ids=ids if with_ids else None))
        body = P.CompletionResponse(id=request_id, created=created, model=serving.model_name, choices=choices,
                                    usage=serving.usage(prompts, run.completion_tokens, run.final_cached))
        return JSONResponse(body.model_dump(exclude_none=False))

    @app.post("/v1/chat/completions", dependencies=[Depends(validate_json_request)])
    @with_cancellation
    async def create_chat_completion(request: P.ChatCompletionRequest, raw_request: Request) -> Any:
        prompt = serving.render_chat(request)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        params = serving.prepare(request, [prompt], max_tokens, "max_tokens" if request.max_completion_tokens is None
                                 else "max_completion_tokens")
        request_id = f"chatcmpl-{request.request_id}"
        created = int(time.time())
        merged = merge_async_iterators(*serving.generators(request, request_id, [prompt], params))
        with_ids = bool(request.return_token_ids)
        chunk = functools.partial(P.ChatCompletionStreamResponse, id=request_id, object="chat.completion.chunk",
                                  created=created, model=serving.model_name)
        if request.stream:
            include_usage, continuous = should_include_usage(request.stream_options)

            async def stream() -> AsyncIterator[str]:
                run = CompletionRun(request.n)
                for i in range(request.n):  # the role first, and the prompt's ids once (vLLM's first chunks)
                    usage = {"usage": serving.usage([prompt], 0, None)} if continuous else {}
                    yield _sse(chunk(choices=[P.ChatCompletionResponseStreamChoice(
                        index=i, delta=P.DeltaMessage(role="assistant", content=""), logprobs=None,
                        finish_reason=None)], prompt_token_ids=prompt if with_ids else None, **usage))
                async for _, d in merged:
                    run.add(d.index, d)
                    ids = {"token_ids": d.token_ids if with_ids else None}
                    if d.finish_reason is not None:  # only the last chunk of a choice has its stop_reason
                        ids["stop_reason"] = d.stop_reason
                    usage = {"usage": serving.usage([prompt], len(run.token_ids[d.index]), None)} if continuous else {}
                    logprobs = (serving.chat_logprobs(request, d.token_ids, d.logprobs or [])
                                if request.sample_logprobs() is not None else None)
                    yield _sse(chunk(choices=[P.ChatCompletionResponseStreamChoice(
                        index=d.index, delta=P.DeltaMessage(content=d.text), logprobs=logprobs,
                        finish_reason=d.finish_reason, **ids)], **usage))
                if include_usage:
                    yield _sse(chunk(choices=[], usage=serving.usage([prompt], run.completion_tokens, run.cached)),
                               final=True)

            return StreamingResponse(_stream_with_error(stream()), media_type="text/event-stream")

        run = CompletionRun(request.n)
        async for _, d in merged:
            run.add(d.index, d)
        choices = [P.ChatCompletionResponseChoice(index=i, message=P.ChatMessageOut(content=run.text[i]),
                                                  logprobs=(serving.chat_logprobs(request, run.token_ids[i],
                                                                                  run.logprobs[i])
                                                            if request.sample_logprobs() is not None else None),
                                                  finish_reason=run.finish[i], stop_reason=run.stop_reason[i],
                                                  token_ids=run.token_ids[i] if with_ids else None)
                   for i in range(request.n)]
        body = P.ChatCompletionResponse(id=request_id, created=created, model=serving.model_name, choices=choices,
                                        usage=serving.usage([prompt], run.completion_tokens, run.final_cached),
                                        prompt_logprobs=clamp_prompt_logprobs(run.prompt_logprobs[0]),
                                        prompt_token_ids=prompt if with_ids else None)
        return JSONResponse(body.model_dump())

    return app


# ---------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------
def build_engine(args: argparse.Namespace) -> tuple[AsyncLLM, str]:
    """The engine the flags describe, and the model's name for the API."""
    from pagedkv.engine.llm import LLM

    try:
        overrides = json.loads(args.hf_overrides) if args.hf_overrides else {}
    except ValueError as exc:
        raise ValueError(f"--hf-overrides is not valid JSON ({exc}): give an object, such as "
                         "'{\"num_hidden_layers\": 8}'") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--hf-overrides must be a JSON object, got {args.hf_overrides!r}")
    device = None
    if args.model == "tiny":
        import torch

        from pagedkv.entrypoints.tiny import tiny_model, tiny_tokenizer

        model: Any = tiny_model(args.seed, **overrides)
        tokenizer = tiny_tokenizer(model.config.vocab_size)
        device = "cuda" if torch.cuda.is_available() else None
    elif overrides:
        raise ValueError("--hf-overrides is supported with MODEL 'tiny' only")
    else:
        model, tokenizer = args.model, None
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # the engine's sizing lines: printed below where they are true
        llm = LLM(model, block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
                  gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=args.enable_prefix_caching and args.kv_reservation == "paged",
                  preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
                  dtype=args.dtype, seed=args.seed, max_logprobs=args.max_logprobs,
                  generation_config=args.generation_config,
                  enforce_eager=args.enforce_eager, tokenizer=tokenizer, device=device,
                  usage_context="OPENAI_API_SERVER")  # vLLM's server's batch defaults (EngineArgs.get_batch_defaults)
    print(describe_kv_pool(llm, args, log.getvalue()), flush=True)
    if args.kv_reservation == "contiguous":
        reserve_contiguous(llm)
    names = args.served_model_name or [args.model]
    return AsyncLLM(llm, names[0]), names


def describe_kv_pool(llm: Any, args: argparse.Namespace, log: str) -> str:
    """The start-up lines about the KV pool, true on the device the engine runs on. On a CUDA GPU whose pool
    was profiled: the engine's memory-profile lines (vLLM 0.26's own start-up log, ``Worker.
    determine_available_memory`` in ``vllm/v1/worker/gpu_worker.py``), measured. Otherwise one line saying how
    the pool was sized -- by a flag, or, on a CPU, from the lab's fixed memory budget (a CPU has no device memory
    to profile) -- and, when no flag chose it, which flags do."""
    n, block_size = llm.num_gpu_blocks, llm.block_size
    size = f"{n:,} blocks of {block_size} tokens ({llm.runner.kv_cache_bytes() / 2**20:,.1f} MiB on {llm.device})"
    profiled = args.num_gpu_blocks is None and args.kv_cache_memory_bytes is None
    if args.num_gpu_blocks is not None:
        how = "as --num-gpu-blocks sets"
    elif args.kv_cache_memory_bytes is not None:
        how = f"what --kv-cache-memory-bytes {args.kv_cache_memory_bytes:,} holds"
    elif llm.device.type == "cuda":
        return log.rstrip()
    elif llm.memory_profile is not None:
        prof = llm.memory_profile
        how = (f"sized without a GPU: a CPU has no device memory to profile, so the lab takes a fixed budget of "
               f"{prof.total_memory / 2**20:,.0f} MiB times --gpu-memory-utilization "
               f"{prof.gpu_memory_utilization}, then subtracts the weights ({prof.weights_memory / 2**20:,.1f} "
               f"MiB) and an activation estimate ({prof.peak_activation_memory / 2**20:,.1f} MiB)")
    else:
        how = "a fixed CPU budget (no memory profile for this model)"
    from pagedkv.sizing import max_concurrency

    lines = [f"KV pool: {size}, {how}. Maximum concurrency for {llm.max_model_len:,}-token requests: "
             f"{max_concurrency(n, block_size, llm.max_model_len):.2f}x."]
    if profiled:
        lines.append("Choose its size with --num-gpu-blocks N or --kv-cache-memory-bytes BYTES.")
    lines += [ln for ln in log.splitlines() if ln.startswith("Auto-fit max_model_len")]  # --max-model-len auto
    return "\n".join(lines)


def reserve_contiguous(llm: Any) -> None:
    """Switch a fresh engine to contiguous ``max_model_len`` reservation: the same pool and scheduler (its own
    class, so an ``AsyncScheduler`` stays one) with lesson 4's :class:`~pagedkv.sim.baseline.ContiguousKVCacheManager`
    (first fit, ``ceil(max_model_len / block_size)`` blocks per request, reserved at admission), so that paged and
    contiguous differ in the allocation rule alone. The engine core, where there is one, steps the new
    scheduler."""
    from pagedkv.sim.baseline import ContiguousKVCacheManager

    old = llm.scheduler
    if old.requests:
        raise ValueError("switch to contiguous reservation before any request is added")
    manager = ContiguousKVCacheManager(llm.num_gpu_blocks, llm.block_size, llm.max_model_len)
    llm.kv_cache_manager = manager
    llm.scheduler = type(old)(manager, old.max_num_running_reqs, old.max_num_batched_tokens,
                              policy=old.policy.value, preemption_mode=old.preemption_mode,
                              num_cpu_blocks=old.cpu_block_pool.num_blocks)
    core = getattr(llm, "engine_core", None)
    if core is not None:
        core.scheduler = llm.scheduler


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one, read back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()  # a failed bind leaves no socket open
        raise
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, bind the port, serve until interrupted. Mirrors ``run_server``."""
    import uvicorn

    if args.port_file is not None:  # written once the server answers: a bad path must not stop it then
        target = Path(args.port_file)
        if target.is_dir() or not target.resolve().parent.is_dir():
            print(f"pagedkv serve: --port-file {args.port_file}: give a file in an existing folder", file=sys.stderr)
            return 2
    # the port first, then the engine, as vLLM's setup_server (vllm/entrypoints/openai/api_server.py) binds it
    # "before the engine is set up": a port in use or out of range is refused before a model is loaded
    try:
        sock = bind_socket(args.host, args.port)
    except (OSError, OverflowError, ValueError) as exc:
        print(f"pagedkv serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    try:
        engine, names = build_engine(args)
    except (ValueError, OSError, TypeError) as exc:
        sock.close()
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    except BaseException:
        sock.close()
        raise
    app = build_app(engine, names, args.model, args.enable_prompt_tokens_details)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            llm = engine.llm
            print(f"pagedkv serve: {names[0]} on http://{args.host}:{port}/v1  ({llm.num_gpu_blocks} blocks of "
                  f"{llm.block_size} tokens, max_model_len {llm.max_model_len}, {args.kv_reservation} KV, on "
                  f"{llm.device})", flush=True)
            if args.port_file:
                with open(args.port_file, "w", encoding="utf-8") as f:
                    f.write(f"{port}\n")
        await task

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_server(make_arg_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

