"""Bad words: a word's tokens are never all generated in a row.

Mirrors Model Runner V2's ``BadWordsState`` and ``_bad_words_kernel`` (``vllm/v1/worker/gpu/sample/bad_words.py``):
for each sampled row and each of its request's bad words (token ids, from ``SamplingParams.update_from_tokenizer``),
when the request's output so far ends with the word's tokens but the last, that last token's logit is set to
-inf; a one-token word is always masked. Only the output is looked at, never the prompt, and a word longer than
the output plus one cannot match yet. vLLM reads the output from its token table on the device; the lab keeps each
such request's last outputs (as many as its longest word needs) on the device and appends each sample as it is
drawn, so async scheduling never waits for the host to know it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class BadWordsState:
    """The bad words of each request that has some, and its recent outputs, on ``device``."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.words: dict[str, list[tuple[torch.Tensor, int]]] = {}  # req_id -> (prefix [L] int64, last token)
        self.recent: dict[str, torch.Tensor] = {}  # req_id -> its last outputs [W] int64 (-1: none yet)

    def add_request(self, req_id: str, token_ids: Sequence[int], prompt_len: int, params: Any) -> None:
        """Take a request the runner takes (new, or resumed with its outputs after its prompt). Mirrors
        ``BadWordsState.add_request``."""
        self.remove_request(req_id)
        words = getattr(params, "bad_words_token_ids", None)
        if not words:
            return
        self.words[req_id] = [(torch.tensor(w[:-1], dtype=torch.long, device=self.device), w[-1]) for w in words]
        width = max(len(w) for w in words) - 1
        if width:
            outs = list(token_ids[prompt_len:])[-width:]
            self.recent[req_id] = torch.tensor([-1] * (width - len(outs)) + outs, dtype=torch.long,
                                               device=self.device)

    def remove_request(self, req_id: str) -> None:
        self.words.pop(req_id, None)
        self.recent.pop(req_id, None)

    def apply(self, logits: torch.Tensor, req_ids: Sequence[str], num_outputs: Sequence[int]) -> None:
        """Mask, in place in ``logits [S, V]``, the last token of each bad word of row ``i``'s request whose other
        tokens end its output (``num_outputs[i]`` tokens before this row's sample). Mirrors
        ``apply_bad_words``: no work when no row's request has bad words."""
        for i, rid in enumerate(req_ids):
            for prefix, last in self.words.get(rid, ()):
                n = prefix.shape[0]
                if n > num_outputs[i]:
                    continue
                if n == 0:
                    logits[i, last] = float("-inf")
                    continue
                match = (self.recent[rid][-n:] == prefix).all()  # on the device: no wait for the host
                logits[i, last : last + 1].masked_fill_(match, float("-inf"))

    def update(self, req_ids: Sequence[str], sampled: torch.Tensor) -> None:
        """Append each sample ``sampled[i]`` (on the device) to request ``req_ids[i]``'s recent outputs."""
        for i, rid in enumerate(req_ids):
            recent = self.recent.get(rid)
            if recent is not None:
                self.recent[rid] = torch.cat((recent[1:], sampled[i : i + 1].to(recent.dtype)))
