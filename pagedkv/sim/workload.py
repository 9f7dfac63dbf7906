"""Synthetic request workloads with a realistic length distribution.

Chat traces such as ShareGPT have right-skewed lengths: most prompts and answers are a few hundred tokens,
a few are thousands. The PagedAttention paper (table/figure on its datasets) reports ShareGPT's mean input
as 161 tokens and mean output as 338. We draw both from lognormals with those means (median 100 and 205,
shape 1.0: mean = median * exp(sigma^2 / 2)), clip each request to ``max_len`` tokens in all, and fill the
prompts with random token ids (so no two requests share a prefix unless asked to). A stand-in shaped like
the real trace, not real data: nothing is downloaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedkv.request import Request
from pagedkv.utils import check_int, is_real


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 1000
    prompt_median: float = 100.0
    prompt_sigma: float = 1.0
    output_median: float = 205.0
    output_sigma: float = 1.0
    max_len: int = 2048  # prompt + output never exceeds this (the model's context length)
    min_prompt: int = 4
    vocab_size: int = 32000
    shared_prefix_len: int = 0  # a system prompt every request starts with (for prefix caching)
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse a workload that cannot be drawn, with the field at fault (numpy's own errors name none)."""
        check_int(self.num_requests, "num_requests", 0)
        check_int(self.min_prompt, "min_prompt", 1)
        check_int(self.shared_prefix_len, "shared_prefix_len", 0)
        check_int(self.max_len, "max_len", self.min_prompt + self.shared_prefix_len + 1,
                  why="room for the shortest prompt, the shared prefix and one output token")
        check_int(self.vocab_size, "vocab_size", 1)
        check_int(self.seed, "seed", 0)
        for name in ("prompt_median", "output_median", "prompt_sigma", "output_sigma"):
            value = getattr(self, name)
            low = 0.0 if name.endswith("sigma") else math.nextafter(0.0, 1.0)
            if not is_real(value) or not low <= value < math.inf:
                raise ValueError(f"{name} must be a finite number {'>= 0' if low == 0 else '> 0'}, got {value!r}")


def sample_lengths(spec: WorkloadSpec) -> tuple[list[int], list[int]]:
    """Prompt and output lengths, seeded, with ``prompt + output <= max_len`` and output >= 1."""
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prompts = np.rint(rng.lognormal(np.log(spec.prompt_median), spec.prompt_sigma, size=n)).astype(int)
    outputs = np.rint(rng.lognormal(np.log(spec.output_median), spec.output_sigma, size=n)).astype(int)
    prompts = np.clip(prompts + spec.shared_prefix_len, spec.min_prompt + spec.shared_prefix_len, spec.max_len - 1)
    outputs = np.clip(outputs, 1, spec.max_len - prompts)
    return [int(p) for p in prompts], [int(o) for o in outputs]


def make_requests(spec: WorkloadSpec | None = None, *, prefix: str = "r", **overrides) -> list[Request]:
    """``spec.num_requests`` fresh requests (ids ``f"{prefix}{i}"``, ``arrival_time = i``), each with a random
    prompt and ``max_tokens`` set to its sampled output length."""
    spec = spec or WorkloadSpec()
    if overrides:
        spec = WorkloadSpec(**{**spec.__dict__, **overrides})
    prompt_lens, output_lens = sample_lengths(spec)
    rng = np.random.default_rng(spec.seed + 1)
    system = rng.integers(0, spec.vocab_size, size=spec.shared_prefix_len).tolist()
    requests = []
    for i, (p, o) in enumerate(zip(prompt_lens, output_lens, strict=True)):
        body = rng.integers(0, spec.vocab_size, size=p - spec.shared_prefix_len).tolist()
        requests.append(Request(f"{prefix}{i}", system + body, max_tokens=o, arrival_time=float(i)))
    return requests


def clone_requests(requests: list[Request]) -> list[Request]:
    """Fresh copies (same ids, prompts, max_tokens, priorities, arrival times): to replay one workload under
    several schedulers."""
    return [
        Request(
            r.request_id,
            r.prompt_token_ids,
            max_tokens=r.max_tokens,
            priority=r.priority,
            arrival_time=r.arrival_time,
            eos_token_id=r.eos_token_id,
            cache_salt=r.cache_salt,
            lora_id=r.lora_id,
        )
        for r in requests
    ]
