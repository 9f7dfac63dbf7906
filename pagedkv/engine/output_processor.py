"""Turning the engine's new tokens into text for one client: incremental detokenizing and stop strings.

The engine core knows token ids only; stop *token ids* and EOS end a request inside it. Stop *strings* can only
be seen in text, so they are checked here, on the API side, after each step: when one appears, the text is cut
there, the request finishes with ``finish_reason="stop"`` and ``stop_reason`` the string, and the engine is
told to abort it (its blocks are freed on the next loop turn). Text that might be the start of a stop string
(or ends in a half-decoded character) is held back until the next token settles it, so a streamed client
never sees text that is later taken back.

Mirrors ``vllm/v1/engine/output_processor.py`` (``RequestState``, ``OutputProcessor.process_outputs``) and
``vllm/v1/engine/detokenizer.py`` (``IncrementalDetokenizer``, ``check_stop_strings``). A fast tokenizer's
text is decoded as vLLM's ``FastIncrementalDetokenizer`` decodes it: one token at a time through the
``tokenizers`` library's ``DecodeStream``, primed with the prompt's ids, so that a completion reads as it
continues its prompt (a SentencePiece token's leading space is kept after a prompt; decoded alone it is dropped)
and a character whose bytes are split over tokens appears once it is whole. Another tokenizer (a slow one, or
any object with ``decode``) has its output decoded whole again on every token, without the prompt.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.logprobs import Logprob, LogprobsLists, SampleLogprobs, prompt_logprobs_record
from pagedkv.engine.sampling_params import SamplingParams


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
                       ) -> tuple[str, int] | None:
    """The first stop string of ``stop`` (in list order) that occurs in ``output_text`` ending within its last
    ``new_char_count`` characters (the text before them was searched already); ``(stop_string, offset)``
    where ``offset`` is the length to cut the text to: the stop string's start, or its end with
    ``include_in_output`` (``-1`` when that end is the end of the text: nothing to cut). ``None`` when no stop
    string matches or nothing is new. Mirrors ``check_stop_strings`` (``vllm/v1/engine/detokenizer.py``)."""
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index == -1:
            continue
        if include_in_output:
            index += len(stop_str)
            if index >= len(output_text):
                return stop_str, -1
        return stop_str, index
    return None


#: What ``DecodeStream.step`` raises when a tokenizer's output stopped being a prefix of what it decoded before
#: (vLLM's ``INVALID_PREFIX_ERR_MSG``): the stream starts over without the prompt.
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """One completion's text, token by token, special tokens skipped. Mirrors ``FastIncrementalDetokenizer``
    (``vllm/v1/engine/detokenizer.py``): a ``tokenizers.decoders.DecodeStream(ids=prompt_token_ids)`` stepped
    once per new token, each step's text (None while a character is incomplete) appended; on "Invalid prefix
    encountered" a fresh stream without the prompt, as vLLM's ``_protected_step`` does. A tokenizer that is not a
    fast one (no ``tokenizers`` backend) is decoded whole on every update (vLLM's ``SlowIncrementalDetokenizer``
    also reads the prompt; the lab does not there)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.token_ids: list[int] = []
        self._backend: Any = None
        self._stream: Any = None
        try:
            from tokenizers import Tokenizer
            from tokenizers.decoders import DecodeStream

            backend = getattr(tokenizer, "_tokenizer", None)
            if isinstance(backend, Tokenizer):
                self._stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=True)
                self._backend = backend
        except (ImportError, TypeError):  # tokenizers before 0.22 has no DecodeStream(ids=...): decode whole
            self._stream = None

    def update(self, new_token_ids: list[int]) -> str:
        """Decode ``new_token_ids`` after those before them; the whole text so far."""
        self.token_ids.extend(new_token_ids)
        if self._stream is None:
            self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            return self.text
        for token_id in new_token_ids:
            self.text += self._step(token_id) or ""
        return self.text

    def _step(self, token_id: int) -> str | None:
        from tokenizers.decoders import DecodeStream

        try:
            return self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):  # an id the tokenizer cannot decode: no text (vLLM logs it)
            return None
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=True)
            return self._stream.step(self._backend, token_id)


def decode_output(tokenizer: Any, token_ids: list[int], finish_reason: str | None, include_stop_str_in_output: bool,
                  prompt_token_ids: list[int] | None = None) -> str:
    """A completion's text (:class:`IncrementalDetokenizer`, after ``prompt_token_ids``), without the last token
    when the engine stopped it on a stop token or EOS (``finish_reason == "stop"``) unless
    ``include_stop_str_in_output``: a stop token is no part of the answer. Mirrors
    ``IncrementalDetokenizer.update(new_token_ids, stop_terminated)`` (``vllm/v1/engine/detokenizer.py``), which
    skips that token's text."""
    if finish_reason == "stop" and not include_stop_str_in_output:
        token_ids = token_ids[:-1]
    return IncrementalDetokenizer(tokenizer, prompt_token_ids or []).update(list(token_ids))


@dataclass
class CompletionDelta:
    """What one step added to one completion: the new text and token ids; ``finish_reason`` once it ends."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at admission
    logprobs: list[dict[int, Logprob]] | None = None  # with SamplingParams.logprobs: one record a new token
    #: with SamplingParams.prompt_logprobs, in the completion's first delta only: None for the first prompt token,
    #: then one record a prompt token (vLLM's DELTA outputs: ``pop_prompt_logprobs``)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class RequestState:
    """The API side's record of one engine request (one of a prompt's ``n`` completions)."""

    request_id: str
    index: int  # completion index within the parent request
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str]
    include_stop_str_in_output: bool
    tokenizer: Any
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the text decoded so far (cut at a stop string)
    sent: int = 0  # characters of ``text`` already handed to the client
    first_token_time: float | None = None
    last_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    _logprobs: SampleLogprobs | None = field(default=None, repr=False)
    _prompt_logprobs_sent: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self._logprobs = SampleLogprobs(self.params.logprobs, self.tokenizer)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _hold_back(self) -> int:
        """Characters at the end of ``text`` not yet safe to send: a possible stop-string prefix. None with
        ``include_stop_str_in_output``: the text is then cut after a stop string, which ends in text not sent yet
        (vLLM's ``output_text_buffer_length``, 0 in that case: ``SamplingParams.__post_init__``)."""
        if not self.stop or self.finished or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def _check_stop_strings(self, new_char_count: int) -> bool:
        """Cut ``text`` at a stop string among its last ``new_char_count`` characters; True when one was found."""
        match = check_stop_strings(self.text, new_char_count, self.stop, self.include_stop_str_in_output)
        if match is None:
            return False
        stop_str, offset = match
        if offset != -1:
            self.text = self.text[:offset]
        self.finish_reason, self.stop_reason = "stop", stop_str
        return True

    def add_tokens(self, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None,
                   now: float, new_logprobs: tuple[list[int], list[float], int] | None = None,
                   new_prompt_logprobs: LogprobsLists | None = None) -> CompletionDelta | None:
        """Take one step's new tokens (and the engine's finish reason, if it finished; ``new_logprobs``, the
        engine's row for the new token when logprobs were asked for; ``new_prompt_logprobs``, the prompt's rows,
        with the first token, when prompt logprobs were); return what the client may see now, or None
        when nothing new can be shown yet. A stop string found here finishes the request (the caller then aborts
        it in the engine); tokens after it are dropped."""
        if self.finished:
            return None
        new_entries = None
        if self._logprobs is not None and new_logprobs is not None:
            new_entries = [self._logprobs.update(*new_logprobs)]
        prompt_entries = None
        if self.params.prompt_logprobs is not None and token_ids and not self._prompt_logprobs_sent:
            rows = new_prompt_logprobs if new_prompt_logprobs is not None else LogprobsLists([], [], [])
            prompt_entries = prompt_logprobs_record(self.params.prompt_logprobs, rows, self.prompt_token_ids,
                                                    self.tokenizer)
            self._prompt_logprobs_sent = True
        if token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
            self.token_times.extend([now] * len(token_ids))
        self.output_token_ids.extend(token_ids)
        if self.tokenizer is not None and token_ids:
            before = self.text
            if self._detokenizer is None:
                self._detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
            stop_token = finish_reason == "stop" and not self.include_stop_str_in_output
            new_ids = token_ids[:-1] if stop_token else token_ids
            # min_tokens: no stop string is looked for in the text of the first min_tokens tokens (vLLM's
            # detokenizer moves stop_check_offset past each of them, and checks only once there are more)
            min_tokens = self.params.min_tokens
            count = len(self.output_token_ids)  # this step's tokens included
            floor = 0
            if min_tokens:
                first = max(0, min(len(new_ids), min_tokens - (count - len(token_ids))))
                if first:
                    floor = len(self._detokenizer.update(new_ids[:first]))
                    new_ids = new_ids[first:]
            self.text = self._detokenizer.update(new_ids)
            # the new characters are those after the part of the text that did not change: a character whose
            # bytes were split over tokens showed as U+FFFD and is replaced now, perhaps by a stop string (the
            # length alone may not grow). vLLM's detokenizer emits such a character once complete, as new text
            # (IncrementalDetokenizer.update: stop_check_offset, vllm/v1/engine/detokenizer.py)
            unchanged = max(len(os.path.commonprefix([before, self.text])), floor)
            found = count > min_tokens and self._check_stop_strings(len(self.text) - unchanged)
            if not found and finish_reason is not None:
                self.finish_reason, self.stop_reason = finish_reason, stop_reason
        elif finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason
        end = len(self.text)
        while end > self.sent and not self.finished and self.text[end - 1] == "\ufffd":
            end -= 1  # a character still being decoded (the rest of its bytes come with the next token)
        # then the possible stop-string prefix, counted in the settled text: vLLM's detokenizer has not emitted a
        # half-decoded character yet, so its hold-back (output_text_buffer_length) ends before it
        end = max(end - self._hold_back(), self.sent)
        delta_text = self.text[self.sent:end]
        self.sent = end
        if not delta_text and not token_ids and not self.finished:
            return None
        return CompletionDelta(self.index, delta_text, list(token_ids), self.finish_reason, self.stop_reason,
                               self.num_cached_tokens, new_entries, prompt_entries)
