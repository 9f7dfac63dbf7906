"""The prefix cache as a timing side channel (CVE-2025-46570), measured against the lab's own server.

With prefix caching, a prompt whose first blocks are already cached skips their prefill, so its time to first
token is shorter. An attacker who shares the server can therefore test a guess of another client's prompt: send
the guess and time the first token. Each trial here: a victim sends a secret prefix (``prefix_len`` random
tokens) plus its question; the attacker then sends, in random order, the true secret and a wrong guess (random
tokens of the same length), each followed by its own question, ``max_tokens=1``, and times both. Over many
trials the two TTFT distributions separate (a cache hit and a miss), and a threshold between them tells which
guess was right: ``auc`` is the probability that a miss takes longer than a hit (0.5: no signal; 1.0: the
attacker is always right).

vLLM's fix (PR #17045, in ``vllm/v1/core/kv_cache_utils.py: generate_block_hash_extra_keys``) is ``cache_salt``:
a request field mixed into the hash of the first block, and through the hash chain into every later one, so
requests with different salts never share a block. Run the trials with the victim and the attacker on
different salts and the hit disappears: ``auc`` falls to chance.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SideChannelResult:
    """TTFTs (seconds) of the attacker's correct and wrong guesses, one pair per trial."""

    hit: list[float] = field(default_factory=list)  # the guess equal to the victim's secret
    miss: list[float] = field(default_factory=list)  # the wrong guess
    cached_tokens: list[int] = field(default_factory=list)  # what the server reused for the correct guess

    @property
    def auc(self) -> float:
        """P(miss TTFT > hit TTFT), ties counting half (the ROC AUC of "a short TTFT means a hit")."""
        pairs = [(m > h) + 0.5 * (m == h) for h in self.hit for m in self.miss]
        return sum(pairs) / len(pairs) if pairs else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"hit": self.hit, "miss": self.miss, "cached_tokens": self.cached_tokens, "auc": self.auc}


def ttft(client: Any, base_url: str, prompt: list[int], salt: str | None) -> tuple[float, int | None]:
    """Time to the first (and only) token of a ``max_tokens=1`` completion, measured by the client; and the
    cached prompt tokens the server reports (``None`` unless it runs with ``--enable-prompt-tokens-details``)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    start = time.perf_counter()
    r = client.post(f"{base_url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return elapsed, details.get("cached_tokens")


def run_trials(base_url: str, trials: int = 20, prefix_len: int = 256, question_len: int = 8,
               victim_salt: str | None = None, attacker_salt: str | None = None, vocab_size: int = 512,
               seed: int = 0, progress: bool = False) -> SideChannelResult:
    """``trials`` victim/attacker rounds against the server at ``base_url`` (see the module's docstring)."""
    import httpx
    from tqdm import tqdm

    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(1, vocab_size) for _ in range(n)]  # noqa: E731
    out = SideChannelResult()
    with httpx.Client(timeout=120) as client:
        ttft(client, base_url, rand(prefix_len + question_len), attacker_salt)  # warm-up, not counted
        for _ in tqdm(range(trials), desc="trials", disable=not progress):
            secret = rand(prefix_len)
            ttft(client, base_url, secret + rand(question_len), victim_salt)  # the victim's request
            guesses = [("hit", secret), ("miss", rand(prefix_len))]
            rng.shuffle(guesses)
            for kind, guess in guesses:
                t, cached = ttft(client, base_url, guess + rand(question_len), attacker_salt)
                getattr(out, kind).append(t)
                if kind == "hit":
                    out.cached_tokens.append(cached if cached is not None else -1)
    return out
