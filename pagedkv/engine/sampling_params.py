"""How to sample one request's tokens. Mirrors ``vllm/sampling_params.py`` (``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

#: The smallest temperature above 0: vLLM 0.26 raises ``0 < t < 1e-2`` to ``1e-2`` (``_MAX_TEMP``).
MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingParams:
    """Sampling parameters of one request, named and defaulted as vLLM 0.26's ``SamplingParams``.

    ``temperature == 0`` is greedy (argmax; ``top_k`` and ``top_p`` are then reset to "no limit"); a
    temperature in ``(0, 0.01)`` is raised to 0.01; at most 2. ``top_k`` 0 (or -1) keeps every token; ``top_p``
    1.0 keeps the whole distribution. ``seed`` gives the request its own ``torch.Generator``, so its samples
    do not depend on what else is in the batch or on preemption (-1: no seed). ``n`` completions per prompt.
    Generation stops at ``max_tokens``, at the model's EOS token (unless ``ignore_eos``) or at any of
    ``stop_token_ids``.
    Invalid values raise ``ValueError`` at construction (vLLM's ``SamplingParams._verify_args``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not 0.0 <= self.temperature <= 2.0:  # also refuses NaN and inf
            raise ValueError(f"temperature must be >= 0 and at most 2 (0 is greedy), got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 0 (0 or -1: no limit), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.stop_token_ids is not None:
            ids = list(self.stop_token_ids)
            if not all(is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
            self.stop_token_ids = ids
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM raises it (with a warning): smaller overflows
            self.temperature = MIN_TEMPERATURE
        if self.temperature == 0.0:  # greedy: the limits mean nothing
            self.top_k, self.top_p = 0, 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of ``n``: the same, with ``seed + index`` when seeded.
        Mirrors ``ParentRequest._get_child_sampling_params`` (``vllm/v1/engine/parallel_sampling.py``)."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
