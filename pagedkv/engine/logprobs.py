"""Sample logprobs: each generated token's log-probability, its rank, and the ``k`` likeliest tokens beside it.

Three parts, each vLLM 0.26's:

- on the device, after sampling (:func:`compute_topk_logprobs`; Model Runner V2's ``compute_topk_scores`` in
  ``vllm/v1/worker/gpu/sample/logprob.py``): for each sampled row, the sampled token then the batch's largest
  ``k`` tokens by logit, their log-softmax, and the sampled token's rank (how many tokens have a logit at least
  as large). The logits are the raw ones (``logprobs_mode="raw_logprobs"``, vLLM's default): before the
  penalties, the min-tokens mask, the temperature and the top-k/top-p/min-p cuts;
- the per-request record (:class:`Logprob`, one ``{token_id: Logprob}`` dict a position; ``vllm/logprobs.py``:
  ``Logprob``, ``append_logprobs_for_next_position``): the sampled token first with its own rank, then this
  request's top ``logprobs`` with ranks 1, 2, ... (a sampled token among them keeps its place and takes the
  top-k entry);
- the tokens' text (:func:`convert_ids_list_to_tokens`, ``vllm/tokenizers/detokenizer_utils.py``, and the UTF-8
  repair of ``LogprobsProcessor._verify_tokens``, ``vllm/v1/engine/logprobs.py``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Logprob:
    """One token's log-probability at one position, its rank in the vocabulary (1: the likeliest) and its text
    (``None`` without a tokenizer). Mirrors ``Logprob`` (``vllm/logprobs.py``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class LogprobsTensors:
    """One step's logprobs on the device: ``logprob_token_ids [S, 1 + k]`` (the sampled token, then the top ``k``),
    ``logprobs [S, 1 + k]`` float32, ``selected_token_ranks [S]``. Mirrors ``LogprobsTensors``
    (``vllm/v1/outputs.py``)."""

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    selected_token_ranks: torch.Tensor

    def pinned_copy(self) -> LogprobsTensors:
        """The same in fresh pinned host memory, copied without waiting (read them after the step's event)."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        return LogprobsTensors(copy(self.logprob_token_ids), copy(self.logprobs), copy(self.selected_token_ranks))

    def tolists(self) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids.tolist(), self.logprobs.tolist(),
                             self.selected_token_ranks.tolist())


@dataclass
class LogprobsLists:
    """The same on the host, row ``i`` for the step's ``i``-th sampled request. Mirrors ``LogprobsLists``."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


def num_logprobs(logprobs: int | None, vocab_size: int) -> int | None:
    """How many top tokens a request asks for beside the sampled one (``-1``: the whole vocabulary; ``None``:
    no logprobs)."""
    return vocab_size if logprobs == -1 else logprobs


def compute_topk_logprobs(logits: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """``logits [S, V]`` (raw), ``sampled [S]``: each row's sampled token and its ``k`` likeliest tokens, their
    log-softmax in float32, and the sampled token's rank (the count of logits ``>=`` its own, so ties share the
    worse rank). Mirrors ``compute_topk_scores``, ``_topk_log_softmax_kernel`` and ``_ranks_kernel``."""
    ids = sampled.long().unsqueeze(1)  # [S, 1]
    if k > 0:
        ids = torch.cat((ids, torch.topk(logits, k, dim=-1).indices), dim=1)  # [S, 1 + k]
    logprobs = logits.float().log_softmax(dim=-1).gather(1, ids)  # [S, 1 + k]
    chosen = logits.gather(1, sampled.long().unsqueeze(1))  # [S, 1]
    ranks = (logits >= chosen).sum(dim=-1)  # [S]
    return LogprobsTensors(ids, logprobs, ranks)


class PromptLogprobsWorker:
    """The runner's prompt logprobs: for each prompt position ``p >= 1`` of a request that asks for them, the
    log-softmax of the logits the model computed at ``p - 1`` (raw, in chunks of :attr:`CHUNK` rows), at prompt
    token ``p`` and at the request's ``prompt_logprobs`` likeliest tokens, and token ``p``'s rank. A prompt
    prefilled in several chunks is kept here until its last chunk, then returned whole (``[prompt_len - 1, 1 + k]``),
    in the step that samples its first token. Mirrors ``PromptLogprobsWorker``
    (``vllm/v1/worker/gpu/sample/prompt_logprob.py``; ``compute_prompt_logprobs_with_chunking``)."""

    CHUNK = 1024  # rows of logits at a time: a whole prompt's [P, V] logits can be larger than the model

    def __init__(self) -> None:
        self.in_progress: dict[str, list[LogprobsTensors]] = {}  # req_id -> the chunks so far

    def add_request(self, req_id: str, params: Any) -> None:
        """Start a request's record if it asks (a request resumed after preemption keeps the chunks it has: the
        runner starts them again when its prompt starts again at position 0)."""
        if getattr(params, "prompt_logprobs", None) is not None:
            self.in_progress.setdefault(req_id, [])

    def remove_request(self, req_id: str) -> None:
        self.in_progress.pop(req_id, None)

    def compute(self, req_id: str, logits_fn: Any, hidden: torch.Tensor, target_ids: list[int], num: int,
                chunked: bool) -> LogprobsTensors | None:
        """One request's rows of this step: ``hidden [R, H]`` the hidden states of its scheduled prompt positions
        (the last one left out when it is the prompt's last, whose logits sample the first output token),
        ``target_ids`` (``R`` ids) the prompt tokens that follow them, ``num`` its ``prompt_logprobs`` (``-1``:
        all). Returns the whole prompt's record once its last chunk is in (``chunked`` False), else None."""
        parts = self.in_progress[req_id]
        targets = torch.tensor(target_ids, dtype=torch.long, device=hidden.device)
        for a in range(0, hidden.shape[0], self.CHUNK):
            logits = logits_fn(hidden[a : a + self.CHUNK])  # [r, V]
            k = logits.shape[-1] if num == -1 else num
            parts.append(compute_topk_logprobs(logits, targets[a : a + self.CHUNK], k))
        if chunked or not parts:
            return None
        self.in_progress[req_id] = []
        return LogprobsTensors(torch.cat([x.logprob_token_ids for x in parts]), torch.cat([x.logprobs for x in parts]),
                               torch.cat([x.selected_token_ranks for x in parts]))


def position_logprobs(token_ids: list[int], logprobs: list[float], rank: int, num: int,
                      decoded: Iterable[str | None]) -> dict[int, Logprob]:
    """One position's record: ``token_ids[0]`` (the sampled token) with ``rank``, then the first ``num`` of the
    top tokens with ranks 1..num (``num == -1``: all given). Mirrors ``append_logprobs_for_next_position``."""
    if num == -1:
        num = len(logprobs)
    ranks = itertools.chain((rank,), range(1, num + 1))
    # zip stops at the shortest: the ranks, 1 + num of them
    return {t: Logprob(lp, r, text) for t, lp, r, text in zip(token_ids, logprobs, ranks, decoded, strict=False)}


# ---------------------------------------------------------------------------------------------------------
# The tokens' text
# ---------------------------------------------------------------------------------------------------------
def _leading_space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character (``"▁"`` for SentencePiece tokenizers) whose leading copies
    ``decode`` strips from a lone token, or None. Mirrors ``_get_leading_space_marker``."""
    cached = getattr(tokenizer, "_pagedkv_space_marker", ...)
    if cached is not ...:
        return cached
    result = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
        except Exception:  # noqa: BLE001 - a tokenizer that cannot say: decode as it is (vLLM's too)
            pre = {}
        subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        result = next((s.get("replacement", "▁") for s in subs if s.get("type") == "Metaspace"), None)
    try:
        tokenizer._pagedkv_space_marker = result
    except AttributeError:
        pass
    return result


def convert_ids_list_to_tokens(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each id decoded alone, with the leading spaces ``decode`` stripped put back (a SentencePiece piece
    ``"▁the"`` reads ``" the"``). Mirrors ``convert_ids_list_to_tokens``."""
    marker = _leading_space_marker(tokenizer)
    texts = [tokenizer.decode([t]) or "" for t in token_ids]
    if marker is None:
        return texts
    out = []
    for raw, text in zip(tokenizer.convert_ids_to_tokens(token_ids), texts, strict=True):
        markers = len(raw) - len(raw.lstrip(marker)) if raw else 0
        missing = markers - (len(text) - len(text.lstrip(" ")))
        out.append(" " * missing + text if missing > 0 else text)
    return out


def _correct_decoded_token(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """The text a token completes when it ends a character whose bytes began in the tokens before it (decoded
    alone it reads U+FFFD); "" while the character is still incomplete. Mirrors
    ``LogprobsProcessor._correct_decoded_token``."""
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = tokenizer.decode(ctx + [token_id])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if tokenizer.decode([ctx[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix = tokenizer.decode(ctx[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0  # a tokenizer's normalisation may change the prefix: the longest common part
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def decode_logprob_tokens(tokenizer: Any, token_ids: list[int], context: list[int]) -> list[str]:
    """The texts of one position's tokens (the sampled one and its alternatives), those ending in U+FFFD repaired
    from ``context``, the tokens sampled before (at most the last four). Mirrors ``_update_sample_logprobs``'s
    ``convert_ids_list_to_tokens`` then ``_verify_tokens``."""
    texts = convert_ids_list_to_tokens(tokenizer, token_ids)
    return [_correct_decoded_token(tokenizer, t, context) if text.endswith("\ufffd") else text
            for t, text in zip(token_ids, texts, strict=True)]


def prompt_logprobs_record(num_logprobs: int, rows: LogprobsLists, prompt_token_ids: list[int],
                           tokenizer: Any = None) -> list[dict[int, Logprob] | None]:
    """A request's prompt logprobs as the user gets them: ``None`` for the first prompt token (nothing comes
    before it), then one ``{token_id: Logprob}`` dict a prompt token (the prompt token first, with its rank, then
    the ``num_logprobs`` likeliest). Mirrors ``LogprobsProcessor._update_prompt_logprobs`` (the texts decoded
    alone, and those ending a split UTF-8 character repaired from the prompt tokens before them)."""
    record: list[dict[int, Logprob] | None] = [None]
    for pos, (ids, lps, rank) in enumerate(zip(rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks,
                                               strict=True)):
        keep = len(ids) if num_logprobs == -1 else 1 + num_logprobs
        ids, lps = ids[:keep], lps[:keep]
        # the context: the record's last four entries' tokens, the first entry (None) left out
        context = prompt_token_ids[max(1, pos - 3) : pos + 1]
        decoded: Iterable[str | None] = (itertools.repeat(None) if tokenizer is None
                                         else decode_logprob_tokens(tokenizer, ids, context))
        record.append(position_logprobs(ids, lps, rank, num_logprobs, decoded))
    return record


class SampleLogprobs:
    """One completion's logprobs as they come: ``logprobs`` (one dict a token) and ``cumulative_logprob`` (the
    sampled tokens' sum). Mirrors ``LogprobsProcessor`` (``vllm/v1/engine/logprobs.py``) for sample logprobs."""

    def __init__(self, num_logprobs: int, tokenizer: Any = None) -> None:
        self.num_logprobs = num_logprobs
        self.tokenizer = tokenizer
        self.logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0

    def update(self, token_ids: list[int], logprobs: list[float], rank: int) -> dict[int, Logprob]:
        """Add one position (the row :func:`compute_topk_logprobs` gave for this request) and return its record."""
        keep = len(token_ids) if self.num_logprobs == -1 else 1 + self.num_logprobs  # the batch may give more
        token_ids, logprobs = token_ids[:keep], logprobs[:keep]
        if self.tokenizer is None:
            decoded: Iterable[str | None] = itertools.repeat(None)
        else:
            context = [next(iter(d)) for d in self.logprobs[-4:]]
            decoded = decode_logprob_tokens(self.tokenizer, token_ids, context)
        self.cumulative_logprob += logprobs[0]
        entry = position_logprobs(token_ids, logprobs, rank, self.num_logprobs, decoded)
        self.logprobs.append(entry)
        return entry
