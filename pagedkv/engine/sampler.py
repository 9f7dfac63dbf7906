"""From logits to tokens: logit bias (allowed tokens, biases, min_tokens), greedy, temperature, min-p, top-k,
top-p, a generator per seeded request.

Mirrors vLLM 0.26's ``Sampler`` (``vllm/v1/sample/sampler.py``) and ``random_sample``
(``vllm/v1/sample/ops/topk_topp_sampler.py``): instead of ``torch.multinomial`` it draws exponential noise
``q`` and takes ``argmax(probs / q)``, which samples from ``probs`` exactly; a request with a seed draws its
noise from its own ``torch.Generator``, so its tokens depend on nothing else in the batch. The generator is
advanced only for rows the runner samples: never for a partial prefill (the lab computes no logits there;
vLLM 0.26 samples those rows too and throws the samples away: Model Runner V2 draws its noise from the seed
and the position, so it has no generator to advance; the V1 runner rewinds its generator), so preemption,
which recomputes KV but keeps the tokens, never changes a seeded request's output. With async scheduling a
request that stops on a token still has one more step in flight; that sample is discarded, and it changes
nothing kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine import cpu_ops
from pagedkv.engine.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (one per seeded request)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def uses_logit_bias(params: SamplingParams | None) -> bool:
    """Whether a row's request asks for any of what :func:`apply_logit_bias` does (``use_logit_bias``)."""
    return params is not None and bool(params.allowed_token_ids or params.logit_bias or params.min_tokens)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams | None], positions: Sequence[int],
                     prompt_lens: Sequence[int]) -> None:
    """Each row's biases, in place in ``logits [S, V]``, in Model Runner V2's order (``_bias_kernel`` in
    ``vllm/v1/worker/gpu/sample/logit_bias.py``): with ``allowed_token_ids`` every other token is set to -inf;
    ``logit_bias`` is added to its tokens; and while the token sampled at ``positions[i] + 1`` is among the first
    ``min_tokens`` outputs (``positions[i] + 1 < prompt_lens[i] + min_tokens``) the stop tokens
    (``all_stop_token_ids``: ``stop_token_ids`` and the model's EOS ids) are set to -inf. ``positions[i]`` is the
    position of the row's last input token, ``prompt_lens[i]`` its request's original prompt length."""
    device = logits.device
    for i, p in enumerate(params):
        if not uses_logit_bias(p):
            continue
        row = logits[i]  # [V], a view
        if p.allowed_token_ids:
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)
            kept = row[ids].clone()
            row.fill_(float("-inf"))
            row[ids] = kept
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device)
        if p.min_tokens and p.all_stop_token_ids and positions[i] + 1 < prompt_lens[i] + p.min_tokens:
            ids = torch.tensor(sorted(p.all_stop_token_ids), dtype=torch.long, device=device)
            row[ids[ids < row.shape[0]]] = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens less likely than ``min_p`` times the likeliest, row by row; ``logits [S, V]``
    (after the temperature) changed in place, ``min_p [S]`` (0: no limit). In logits: below ``max + log(min_p)``.
    Mirrors ``_min_p_kernel`` (``vllm/v1/worker/gpu/sample/min_p.py``)."""
    threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)  # [S, 1]; log(0) = -inf
    return logits.masked_fill_(logits < threshold, float("-inf"))


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
        params: Sequence[SamplingParams | None],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """:meth:`sample`, as a list of token ids (waits for the device)."""
        return self.sample(logits, params, generators).tolist()

    def sample(
        self,
        logits: torch.Tensor,  # [S, V]
        params: Sequence[SamplingParams | None],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Greedy rows (and rows with no parameters) take the argmax of the logits (ties: the lowest id, as
        ``torch.argmax``); the others are divided by their temperature, cut by min-p, top-k and top-p, softmaxed
        and sampled with exponential noise. Returns one token id per row, ``[S]`` int64 on the logits' device;
        nothing here waits for the device (which cuts apply is decided from the host's parameters). Mirrors
        ``Sampler.sample`` and ``apply_sampling_params`` (``vllm/v1/worker/gpu/sample/sampler.py``), from the
        temperature on: the runner applies the logit bias (:func:`apply_logit_bias`) and the penalties
        (``pagedkv.engine.penalties``) and the bad words (``pagedkv.engine.bad_words``) before."""
        if logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"{logits.shape[0]} logit rows, {len(params)} params, {len(generators)} generators")
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        logits = logits.float()
        if cpu_ops.serves(logits) and logits.stride(-1) == 1:  # compiled: one pass, ~10x PyTorch's reduction
            tokens = cpu_ops.argmax(logits)  # [S]
        else:  # max(dim).indices: torch.argmax's token (ties: the first, the lowest id), about 3x faster on a CPU
            tokens = logits.max(dim=-1).indices  # [S]
        rows = [i for i, p in enumerate(params) if p is not None and not p.is_greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            sub = logits[idx]  # [R, V]
            temp = torch.tensor([params[i].temperature for i in rows], device=logits.device)
            sub = sub / temp[:, None]
            min_ps = [params[i].min_p for i in rows]
            if any(m > 0.0 for m in min_ps):
                apply_min_p(sub, torch.tensor(min_ps, device=logits.device))
            ks = [max(params[i].top_k, 0) for i in rows]
            ps = [params[i].top_p for i in rows]
            if any(k > 0 for k in ks) or any(p < 1.0 for p in ps):
                sub = apply_top_k_top_p(sub, torch.tensor(ks, device=logits.device),
                                        torch.tensor(ps, device=logits.device))
            probs = sub.softmax(dim=-1)
            q = torch.empty_like(probs)
            for j, i in enumerate(rows):
                gen = generators[i] if generators[i] is not None else self.generator
                q[j].exponential_(generator=gen)
            tokens[idx] = probs.div_(q).max(dim=-1).indices
        return tokens
