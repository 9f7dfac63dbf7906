"""A deterministic fake language model: the next token is a hash of every token so far.

Real sampling would make two runs of the same request differ; a real model would make the lesson need a
GPU. This model is neither: its next token depends only on the sequence's tokens, never on the batch it
ran in, the step, the blocks its KV sat in, or whether it was preempted. So any difference between two
runs' outputs is a scheduler or cache bug, which is exactly what the tests look for.

There is no vLLM counterpart; vLLM's tests use a tiny real model and greedy sampling for the same purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-mixed 64-bit permutation."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class FakeModel:
    """``next_token(tokens)`` = a 64-bit rolling hash of ``tokens``, reduced to ``[0, vocab_size)``.

    ``eos_token_id`` (optional) is never produced unless ``eos_probability`` > 0, in which case it is
    produced when the hash falls in that fraction of its range: requests then stop early, at points that
    still depend only on their tokens.
    """

    def __init__(
        self, vocab_size: int = 32000, seed: int = 0, eos_token_id: int | None = None, eos_probability: float = 0.0
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        if not 0.0 <= eos_probability < 1.0:
            raise ValueError(f"eos_probability must be in [0, 1), got {eos_probability}")
        if eos_probability > 0 and eos_token_id is None:
            raise ValueError("eos_probability > 0 needs an eos_token_id")
        self.vocab_size = vocab_size
        self.seed = seed
        self.eos_token_id = eos_token_id
        self.eos_probability = eos_probability
        self._eos_cut = int(eos_probability * (1 << 64))

    def initial_state(self) -> int:
        return _mix64(self.seed)

    def extend_state(self, state: int, token_ids: Sequence[int]) -> int:
        """The hash state after feeding ``token_ids`` (the rolling part: O(len(token_ids)))."""
        for t in token_ids:
            state = _mix64(state ^ (int(t) + 0x1234567))
        return state

    def token_from_state(self, state: int) -> int:
        h = _mix64(state ^ 0xABCDEF)
        if self.eos_token_id is not None and h < self._eos_cut:
            return self.eos_token_id
        token = h % self.vocab_size
        if token == self.eos_token_id:  # EOS only by the rule above
            token = (token + 1) % self.vocab_size
        return token

    def next_token(self, token_ids: Sequence[int]) -> int:
        """The token this model generates after ``token_ids``. Pure: same tokens, same answer."""
        return self.token_from_state(self.extend_state(self.initial_state(), token_ids))

    def generate(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        """What a request with this prompt generates alone (the reference the scheduler must reproduce)."""
        state = self.extend_state(self.initial_state(), prompt)
        out: list[int] = []
        for _ in range(max_tokens):
            tok = self.token_from_state(state)
            out.append(tok)
            if tok == self.eos_token_id:
                break
            state = self.extend_state(state, [tok])
        return out
