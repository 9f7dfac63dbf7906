"""How to sample one request's tokens. Mirrors ``vllm/sampling_params.py`` (``SamplingParams``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.engine.exceptions import InvalidRequestError
from pagedkv.utils import check_int, is_int, is_real

#: The smallest temperature above 0: vLLM 0.26 raises ``0 < t < 1e-2`` to ``1e-2`` (``_MAX_TEMP``).
MIN_TEMPERATURE = 1e-2
#: The most completions one request may ask for: vLLM 0.26's ``VLLM_MAX_N_SEQUENCES`` default (``vllm/envs.py``).
MAX_N_SEQUENCES = 16384
#: The most ``allowed_token_ids`` and ``logit_bias`` entries one request may have: Model Runner V2's buffers
#: (``MAX_NUM_ALLOWED_TOKEN_IDS``, ``MAX_NUM_LOGIT_BIAS_TOKENS`` in ``vllm/v1/worker/gpu/sample/logit_bias.py``).
MAX_NUM_ALLOWED_TOKEN_IDS = MAX_NUM_LOGIT_BIAS_TOKENS = 1024
#: The most bad-word encodings one request may have, and their tokens together: Model Runner V2's buffers
#: (``MAX_NUM_BAD_WORDS``, ``MAX_BAD_WORDS_TOTAL_TOKENS`` in ``vllm/v1/worker/gpu/sample/bad_words.py``).
MAX_NUM_BAD_WORDS, MAX_BAD_WORDS_TOTAL_TOKENS = 128, 1024


@dataclass
class SamplingParams:
    """Sampling parameters of one request, named and defaulted as vLLM 0.26's ``SamplingParams``.

    ``temperature == 0`` is greedy (argmax; ``top_k`` and ``top_p`` are then reset to "no limit"); a
    temperature in ``(0, 0.01)`` is raised to 0.01; at most 2. ``top_k`` 0 (or -1) keeps every token; ``top_p``
    1.0 keeps the whole distribution. ``seed`` gives the request its own ``torch.Generator``, so its samples
    do not depend on what else is in the batch or on preemption (-1: no seed). ``n`` completions per prompt
    (at most :data:`MAX_N_SEQUENCES`; greedy sampling takes ``n == 1``: ``n`` greedy copies would be one answer).
    Generation stops at ``max_tokens`` (``None``: where ``max_model_len`` ends the request), at the model's EOS
    token (unless ``ignore_eos``), at any of ``stop_token_ids``, or when the text shows one of ``stop`` (a string
    or a list; the text is cut before it, or after it with ``include_stop_str_in_output``; needs a tokenizer).
    ``min_tokens`` (at most ``max_tokens``): the first ``min_tokens`` tokens are never a stop token or EOS (their
    logits are masked, ``ignore_eos`` or not) and no stop string is looked for in their text. ``min_p`` in [0, 1]:
    after the temperature, a token less likely than ``min_p`` times the likeliest one is dropped (0: off).
    Penalties, before the temperature, greedy rows too: ``repetition_penalty`` (> 0; 1: off) divides a positive
    logit of a token seen in the prompt or the output and multiplies a negative one; ``frequency_penalty`` and
    ``presence_penalty`` (in [-2, 2]; 0: off) subtract themselves times each output token's count, or once for
    a token that has come at all.
    ``logprobs``: with each generated token, its log-probability and rank and those of the ``logprobs`` likeliest
    tokens (``-1``: the whole vocabulary; ``True`` is 1; ``None``: none), from the raw logits (vLLM's default
    ``logprobs_mode``: before penalties, temperature and cuts); at most the engine's ``max_logprobs``.
    ``logit_bias`` (``{token_id: bias}``) adds to those tokens' logits; ``allowed_token_ids`` leaves only those
    tokens possible. Both come first, before the penalties (vLLM's ``_bias_kernel`` order).
    ``prompt_logprobs``: for each prompt token after the first, its log-probability given the tokens before it,
    its rank, and the ``prompt_logprobs`` likeliest tokens at that position (``-1``: all; ``True`` is 1; at most
    ``max_logprobs``); such a request reads nothing from the prefix cache (``skip_reading_prefix_cache``), so that
    every prompt position is computed.
    ``bad_words`` (strings; needs a tokenizer): a word's tokens, with and without a leading space, are never all
    generated in a row: its last token is masked whenever the output ends with the others (after the
    penalties, before the temperature: V2's order).
    Invalid values raise ``ValueError`` at construction (vLLM's ``SamplingParams._verify_args``).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    #: the KV cache manager finds no prefix-cache hit for the request (``None``: whether ``prompt_logprobs`` is
    #: set: a cached position would have no logits)
    skip_reading_prefix_cache: bool | None = None
    bad_words: list[str] | None = None
    #: each bad word's token ids, with and without a leading space (set by :meth:`update_from_tokenizer`)
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    #: every token ``min_tokens`` keeps from being sampled: ``stop_token_ids`` and the model's EOS ids, which the
    #: engine adds when it takes the request (vLLM's ``_all_stop_token_ids``, set by
    #: ``update_from_generation_config``), whether or not ``ignore_eos``
    _all_stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:  # vLLM's normalisation: None -> [], a string -> [it]
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif not isinstance(self.stop, list):
            try:
                self.stop = list(self.stop)
            except TypeError:
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}") from None
        if self.stop_token_ids is None:  # vLLM's normalisation too: None -> []
            self.stop_token_ids = []
        elif not isinstance(self.stop_token_ids, (str, bytes, list)):
            try:  # any iterable of ids (a tuple, a set, a generator), read once
                self.stop_token_ids = list(self.stop_token_ids)
            except TypeError:
                raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}") from None
        if isinstance(self.logprobs, bool):  # vLLM: True is 1 (and False, as an int, 0)
            self.logprobs = int(self.logprobs)
        if isinstance(self.prompt_logprobs, bool):
            self.prompt_logprobs = int(self.prompt_logprobs)
        if self.bad_words is None:  # vLLM's normalisation
            self.bad_words = []
        elif isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        else:
            self.bad_words = list(self.bad_words)
        self._verify_args()
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.prompt_logprobs is not None
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM raises it (with a warning): smaller overflows
            self.temperature = MIN_TEMPERATURE
        if self.temperature == 0.0:  # greedy: the limits mean nothing
            self.top_k, self.top_p, self.min_p = 0, 1.0, 0.0
        self._all_stop_token_ids = frozenset(self.stop_token_ids)
        if self.logit_bias is not None:  # the engine's own copies: a caller's later change reaches nothing queued
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]

    def _verify_args(self) -> None:
        """``ValueError`` naming the first invalid field and its valid range; changes nothing. Runs at
        construction and again (through :meth:`verified`) when a request is queued, so a field changed after
        construction is checked too. Mirrors ``SamplingParams._verify_args`` and ``_verify_greedy_sampling``
        (``vllm/sampling_params.py``)."""
        # the ranges in vLLM's words (its messages, its order); a wrong type is a ValueError here (vLLM: some
        # TypeErrors), so that every bad parameter is one kind of error
        check_int(self.n, "n", None)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N_SEQUENCES:  # envs.VLLM_MAX_N_SEQUENCES
            raise ValueError(f"n must be at most {MAX_N_SEQUENCES}, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise InvalidRequestError(f"temperature must be a finite number, got {self.temperature}.", "temperature")
        if self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if self.temperature > 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}.", "temperature")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        check_int(self.top_k, "top_k", None)
        if self.top_k < -1:  # -1 is quietly "no limit", as 0
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:  # None: up to max_model_len (vLLM's InputProcessor.process_inputs)
            check_int(self.max_tokens, "max_tokens", None)
            if self.max_tokens < 1:
                raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if any(not word for word in self.bad_words or ()):
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        check_int(self.min_tokens, "min_tokens", None)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.logprobs is not None:
            check_int(self.logprobs, "logprobs", None)
            if self.logprobs < -1:
                raise InvalidRequestError(f"logprobs must be non-negative or -1, got {self.logprobs}.", "logprobs")
        if self.prompt_logprobs is not None:
            check_int(self.prompt_logprobs, "prompt_logprobs", None)
            if self.prompt_logprobs < -1:
                raise InvalidRequestError(f"prompt_logprobs must be non-negative or -1, got "
                                          f"{self.prompt_logprobs}.", "prompt_logprobs")
        if self.logit_bias is not None:  # the lab's type checks (vLLM's server converts the keys: from_optional)
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(k) and is_real(v) and math.isfinite(v) for k, v in self.logit_bias.items()):
                raise InvalidRequestError(f"logit_bias must be a dict of token id (int) to a finite bias, got "
                                          f"{self.logit_bias!r}", "logit_bias")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not all(is_int(t) for t in self.allowed_token_ids):
                raise InvalidRequestError(f"allowed_token_ids must be a list of token ids (ints), got "
                                          f"{self.allowed_token_ids!r}", "allowed_token_ids")
        if self.seed is not None and self.seed != -1:
            # completion i of n is seeded with seed + i; torch.Generator.manual_seed takes -2**63 .. 2**64 - 1
            check_int(self.seed, "seed", -(2**63), 2**64 - self.n,
                      why=f"None or -1 for no seed; completion i of n={self.n} uses seed + i, and torch.Generator "
                      "takes -2**63 .. 2**64 - 1")
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)):
                raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
            for t in self.stop_token_ids:
                check_int(t, "each of stop_token_ids", 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.stop, list) or not all(isinstance(t, str) for t in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(not t for t in self.stop):  # vLLM's message
            raise ValueError("stop cannot contain an empty string.")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if self.temperature == 0.0 and self.n > 1:  # vLLM's _verify_greedy_sampling, its message
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def verified(self) -> SamplingParams:
        """A checked, normalised copy (``ValueError`` if a field was set to an invalid value after
        construction): what the engine keeps for a request, so changing this object later changes nothing
        already queued. The lab's own; vLLM's ``LLM`` copies the parameters too (``SamplingParams.clone``)."""
        return replace(self)

    def with_max_tokens(self, max_tokens: int) -> SamplingParams:
        """A copy that generates at most ``max_tokens`` (what the room ``max_model_len`` leaves, or less), its
        ``min_tokens`` capped to it: a request whose ``min_tokens`` passes the room ends at ``max_model_len``
        ("length"). vLLM 0.26's ``check_stop`` returns before its length check then, and the request is never
        scheduled again: the lab's own end for it."""
        return replace(self, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens))

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        """Each bad word's token ids: the word as given (its leading spaces stripped), and with one leading space
        when that makes other tokens of the same count (a word at the start of a text and in its middle).
        ``InvalidRequestError`` for an id the tokenizer does not have, more than 128 words' encodings or 1,024 of
        their tokens (V2's buffers: its worker raises those), a word of spaces only (vLLM fails on its first
        token), or, given the model's ``vocab_size``, an id past it (vLLM checks the tokenizer's ids only, and its
        kernel writes past the logits' row). Mirrors ``SamplingParams.update_from_tokenizer``."""
        if not self.bad_words:
            return
        words: list[list[int]] = []
        for word in self.bad_words:
            if not tokenizer.encode(word.lstrip(), add_special_tokens=False):  # vLLM fails on it (IndexError)
                raise InvalidRequestError(f"bad_words: {word!r} is no tokens once its leading spaces are "
                                          "stripped", "bad_words")
            for add_prefix_space in (False, True):
                ids = tokenizer.encode(("" if not add_prefix_space else " ") + word.lstrip(),
                                       add_special_tokens=False)
                if not add_prefix_space or (ids[0] != words[-1][0] and len(ids) == len(words[-1])):
                    words.append(ids)
        max_id = max(tokenizer.get_vocab().values())  # vLLM's max_token_id (vllm/tokenizers/hf.py): the vocabulary's
        if isinstance(getattr(tokenizer, "vocab_size", None), int):  # largest id, or vocab_size where that is more
            max_id = max(max_id, tokenizer.vocab_size)
        bad = [t for ids in words for t in ids if not 0 <= t <= max_id]
        if bad:
            raise InvalidRequestError(f"The model vocabulary size is {max_id + 1}, but the following tokens were "
                                      f"specified as bad: {bad}. All token id values should be integers "
                                      f"satisfying: 0 <= token_id <= {max_id}.", "bad_words")
        outside = [] if vocab_size is None else sorted({t for ids in words for t in ids if t >= vocab_size})
        if outside:
            raise InvalidRequestError(f"bad_words encode to token ids {outside}, outside the model's vocabulary "
                                      f"of {vocab_size} tokens", "bad_words")
        if len(words) > MAX_NUM_BAD_WORDS:
            raise InvalidRequestError(f"Too many bad words: {len(words)}. The max number is {MAX_NUM_BAD_WORDS}.",
                                      "bad_words")
        total = sum(map(len, words))
        if total > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise InvalidRequestError(f"Too many total bad word tokens: {total}. The max is "
                                      f"{MAX_BAD_WORDS_TOTAL_TOKENS}.", "bad_words")
        self._bad_words_token_ids = words

    def update_from_generation_config(self, generation_config: dict, eos_token_id: int | None = None) -> None:
        """Add the EOS ids (``eos_token_id``, the tokenizer's, and the generation config's ``"eos_token_id"``, an
        int or a list) to :attr:`all_stop_token_ids`, what ``min_tokens`` masks, ``ignore_eos`` or not. The engine
        calls it on its own copy when it takes a request with ``min_tokens``. Mirrors
        ``SamplingParams.update_from_generation_config`` (``vllm/sampling_params.py``), which also adds the
        generation config's EOS ids to ``stop_token_ids``; the lab's engine keeps the stop set itself
        (``EngineCore.add_request``)."""
        ids = generation_config.get("eos_token_id")
        eos = set() if ids is None else {ids} if isinstance(ids, int) else set(ids)
        if eos_token_id is not None:
            eos.add(eos_token_id)
        self._all_stop_token_ids = self._all_stop_token_ids | eos

    def verify(self, vocab_size: int, max_logprobs: int) -> None:
        """The checks that need the model: ``InvalidRequestError`` naming the field, in vLLM's words, when
        ``logprobs`` or ``prompt_logprobs`` is more than ``max_logprobs`` (``-1``: the vocabulary), when a
        ``logit_bias`` or ``allowed_token_ids`` id is outside the vocabulary, or ``allowed_token_ids`` is empty.
        Changes nothing.
        Mirrors ``SamplingParams.verify`` (``_validate_logprobs``, ``_validate_logit_bias``,
        ``_validate_allowed_token_ids``; vLLM checks ``allowed_token_ids`` against the tokenizer's length, the lab
        against the model's vocabulary). Lab additions, where vLLM's worker would fail instead: sample or prompt
        logprobs beyond the vocabulary, and more than 1024 ``allowed_token_ids`` or ``logit_bias`` entries (V2's
        buffers, whose words these are)."""
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            asked = getattr(self, name)
            if not asked:
                continue
            requested = vocab_size if asked == -1 else asked
            if requested > limit:
                raise InvalidRequestError(f"Requested {kind} logprobs of {requested}, which is greater than max "
                                          f"allowed: {limit}", name)
            if requested > vocab_size:
                raise InvalidRequestError(f"Requested {kind} logprobs of {requested}, which is more than the "
                                          f"vocabulary ({vocab_size} tokens); -1 asks for all of them", name)
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                                          f"Vocabulary size: {vocab_size}", "logit_bias")
            if len(self.logit_bias) > MAX_NUM_LOGIT_BIAS_TOKENS:
                raise InvalidRequestError(f"Too many logit bias tokens: {len(self.logit_bias)}. The max size is "
                                          f"{MAX_NUM_LOGIT_BIAS_TOKENS}.", "logit_bias")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise InvalidRequestError("allowed_token_ids is not None and empty!", "allowed_token_ids")
            if any(not 0 <= t < vocab_size for t in self.allowed_token_ids):
                raise InvalidRequestError("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
            if len(self.allowed_token_ids) > MAX_NUM_ALLOWED_TOKEN_IDS:
                raise InvalidRequestError(f"Too many allowed token IDs: {len(self.allowed_token_ids)}. The max "
                                          f"size is {MAX_NUM_ALLOWED_TOKEN_IDS}.", "allowed_token_ids")

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """``stop_token_ids`` and, once the engine has the request, the model's EOS ids. Mirrors vLLM's."""
        return self._all_stop_token_ids

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of ``n``: the same, with ``seed + index`` when seeded.
        Mirrors ``ParentRequest._get_child_sampling_params`` (``vllm/v1/engine/parallel_sampling.py``)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
