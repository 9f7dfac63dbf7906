"""From logits to tokens: greedy, temperature, top-k, top-p, with a generator per seeded request.

Mirrors vLLM 0.26's ``Sampler`` (``vllm/v1/sample/sampler.py``) and ``random_sample``
(``vllm/v1/sample/ops/topk_topp_sampler.py``): instead of ``torch.multinomial`` it draws exponential noise
``q`` and takes ``argmax(probs / q)``, which samples from ``probs`` exactly; a request with a seed draws its
noise from its own ``torch.Generator``, so its tokens depend on nothing else in the batch. The generator is
advanced only when a token is kept (the runner never samples a partial prefill), so preemption, which
recomputes KV but keeps the tokens, never changes a seeded request's output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (one per seeded request)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and top-p sets; ``logits [S, V]`` changed in place.

    ``top_k[S]`` (0: no limit), ``top_p[S]`` (1.0: no limit). Mirrors ``apply_top_k_top_p``
    (``vllm/v1/sample/ops/topk_topp_sampler.py``): sort once, cut both ways, scatter back.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [S, V] ascending
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (vocab - k).long().unsqueeze(1))  # [S, 1]: the k-th largest logit
    sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs_sum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # ascending: the mass below each token
    drop = probs_sum <= (1.0 - top_p.unsqueeze(1))
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)


class Sampler:
    """Samples one token per row of ``logits [S, V]``, row ``i`` with ``params[i]`` and ``generators[i]``
    (``None``: the engine's shared generator)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V]
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Greedy rows take the argmax of the raw logits (ties: the lowest id, as ``torch.argmax``); the others
        are divided by their temperature, cut by top-k and top-p, softmaxed and sampled with exponential
        noise. Returns one token id per row. Mirrors ``Sampler.forward``."""
        if logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators")
        if logits.shape[0] == 0:
            return []
        logits = logits.float()
        tokens = logits.argmax(dim=-1)  # [S]
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits[idx]  # [R, V]
            temp = torch.tensor([params[i].temperature for i in rows], device=logits.device)
            sub = sub / temp[:, None]
            top_k = torch.tensor([max(params[i].top_k, 0) for i in rows], device=logits.device)
            top_p = torch.tensor([params[i].top_p for i in rows], device=logits.device)
            if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
                sub = apply_top_k_top_p(sub, top_k, top_p)
            probs = sub.softmax(dim=-1)
            q = torch.empty_like(probs)
            for j, i in enumerate(rows):
                gen = generators[i] if generators[i] is not None else self.generator
                q[j].exponential_(generator=gen)
            tokens[idx] = probs.div_(q).argmax(dim=-1)
        return tokens.tolist()
