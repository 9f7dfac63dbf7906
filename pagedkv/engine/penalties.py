"""Repetition, frequency and presence penalties: what each request has said so far, kept on the device, and the
rule that bends its logits before the temperature.

Mirrors Model Runner V2's ``PenaltiesState`` and ``_penalties_kernel`` (``vllm/v1/worker/gpu/sample/penalties.py``):
a request's prompt tokens (a mask: ``prompt_bin_mask``) and its output tokens (counts: ``output_bin_counts``) are
counted when the runner takes it, new or resumed after a preemption (``bincount``: a resumed request's prefill
is its prompt then its outputs, told apart by the prompt's length), and each sample is counted as it is drawn, on
the device (``post_update``), so async scheduling never waits for it. vLLM keeps one ``[max_num_reqs, V]`` table;
the lab keeps rows only for the requests that use a penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def use_penalty(params: Any) -> bool:
    """Whether ``params`` asks for any penalty. Mirrors ``use_penalty``."""
    return params is not None and (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                                   or params.presence_penalty != 0.0)


def apply_penalties(
    logits: torch.Tensor,  # [R, V] float32, changed in place
    prompt_mask: torch.Tensor,  # [R, V] bool: the token is in the prompt
    output_counts: torch.Tensor,  # [R, V] int32: how often the request has sampled it
    repetition: torch.Tensor,  # [R]
    frequency: torch.Tensor,  # [R]
    presence: torch.Tensor,  # [R]
) -> torch.Tensor:
    """vLLM's rule, row by row: a token seen in the prompt or the output has its logit divided by the
    repetition penalty if positive, multiplied by it if not; then ``frequency * count`` and ``presence * (count >
    0)`` are subtracted. Mirrors ``_penalties_kernel`` (multiplying by ``1 / penalty``, as it does)."""
    output_mask = output_counts > 0
    scale = torch.where(prompt_mask | output_mask, repetition[:, None], 1.0)  # [R, V]
    logits *= torch.where(logits > 0, 1.0 / scale, scale)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * output_mask
    return logits


class PenaltiesState:
    """The prompt mask and output counts of each request that uses a penalty, by request id, on ``device``. A
    request's tensors are built the first time its row is penalised, as wide as the logits (under tensor
    parallelism a rank's own LM head holds only its slice of the vocabulary; the logits are gathered whole)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._taken: dict[str, tuple[list[int], int]] = {}  # not counted yet: token ids, prompt length
        self.prompt_mask: dict[str, torch.Tensor] = {}  # [V] bool
        self.output_counts: dict[str, torch.Tensor] = {}  # [V] int32

    def add_request(self, req_id: str, token_ids: Sequence[int], prompt_len: int, params: Any) -> None:
        """Take a request the runner takes (new, or resumed with its outputs after its prompt), to be counted: which
        tokens its prompt holds, how often each output token came. Nothing for a request without penalties.
        Mirrors ``PenaltiesState.add_request``."""
        self.remove_request(req_id)
        if use_penalty(params):
            self._taken[req_id] = (list(token_ids), prompt_len)

    def remove_request(self, req_id: str) -> None:
        self._taken.pop(req_id, None)
        self.prompt_mask.pop(req_id, None)
        self.output_counts.pop(req_id, None)

    def _count(self, req_id: str, vocab_size: int) -> None:
        """Build a taken request's mask and counts. Mirrors ``bincount``."""
        token_ids, prompt_len = self._taken.pop(req_id)
        ids = torch.tensor(token_ids, dtype=torch.long)
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[ids[:prompt_len]] = True
        self.prompt_mask[req_id] = mask.to(self.device)
        self.output_counts[req_id] = torch.bincount(ids[prompt_len:], minlength=vocab_size).to(
            torch.int32).to(self.device)

    def apply(self, logits: torch.Tensor, req_ids: Sequence[str], params: Sequence[Any]) -> None:
        """Penalise, in place, the rows of ``logits [S, V]`` whose request (``req_ids[i]``, ``params[i]``) uses a
        penalty. Mirrors ``PenaltiesState.apply_penalties``: no work when no row does."""
        rows = [i for i, r in enumerate(req_ids) if r in self._taken or r in self.output_counts]
        if not rows:
            return
        for i in rows:
            if req_ids[i] in self._taken:
                self._count(req_ids[i], logits.shape[-1])
        idx = torch.tensor(rows, device=logits.device)
        sub = logits[idx].float()  # [R, V]
        apply_penalties(
            sub,
            torch.stack([self.prompt_mask[req_ids[i]] for i in rows]),
            torch.stack([self.output_counts[req_ids[i]] for i in rows]),
            *(torch.tensor([getattr(params[i], name) for i in rows], device=logits.device)
              for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")),
        )
        logits[idx] = sub.to(logits.dtype)

    def update(self, req_ids: Sequence[str], sampled: torch.Tensor) -> None:
        """Count each sample ``sampled[i]`` (on the device) for request ``req_ids[i]``, if it keeps counts: the next
        step's penalties see it without the host reading it. Mirrors the counting in ``post_update``
        (``vllm/v1/worker/gpu/input_batch.py``)."""
        for i, rid in enumerate(req_ids):
            counts = self.output_counts.get(rid)
            if counts is not None:
                counts.index_add_(0, sampled[i : i + 1], torch.ones(1, dtype=torch.int32, device=counts.device))
