"""A generation request: its tokens, how many of them have KV in the cache, and its status.

Mirrors ``vllm/v1/request.py`` (``Request``, ``RequestStatus``).
"""

from __future__ import annotations

import enum
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.kv_cache_utils import BlockHash
from pagedkv.utils import check_int

_arrival_counter = itertools.count()

#: The largest token id a request takes. On ``[0, 2**61 - 1)`` Python's hash of an int is the int itself
#: (CPython reduces ints modulo the prime 2**61 - 1), so the lab's default ``builtin`` block hash cannot
#: confuse two token ids: without the bound, ``hash(2**61 - 1) == hash(0)`` and a block of token
#: 2**61 - 1 would be a false prefix hit for a block of token 0. Real vocabularies are far smaller.
MAX_TOKEN_ID = 2**61 - 2


def as_token_ids(request_id: object, token_ids: Iterable[object]) -> list[int]:
    """Check and convert token ids: each an integer (a Python, NumPy or 0-d integer tensor value; never a
    bool or a float, which would be truncated silently) in ``[0, MAX_TOKEN_ID]``. ``ValueError`` otherwise."""
    out: list[int] = []
    for t in token_ids:
        if isinstance(t, bool):
            raise ValueError(f"request {request_id!r}: a token id must be an int, got {t!r}")
        try:
            token = operator.index(t)  # ints and integer scalars only: 1.9 is refused, not truncated to 1
        except TypeError:
            raise ValueError(f"request {request_id!r}: a token id must be an int, got {t!r}") from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"request {request_id!r}: token ids must be in [0, {MAX_TOKEN_ID}], got {token}")
        out.append(token)
    return out


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Statuses after PREEMPTED are finished (as in vLLM)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # sampled its stop (EOS) token
    FINISHED_LENGTH_CAPPED = enum.auto()  # reached max_tokens
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    """One sequence to generate.

    ``num_computed_tokens`` counts the tokens, from the start of ``all_token_ids``, whose KV is (or, in
    the step being scheduled, will be) in the cache. The scheduler advances it; a recompute preemption
    sets it back to 0. Output tokens are only ever appended, so a request's block hashes never change.
    """

    def __init__(
        self,
        request_id: str | int,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
        lora_id: int | None = None,
        sampling_params: Any = None,
    ) -> None:
        if isinstance(request_id, bool) or not isinstance(request_id, (str, int)) or request_id == "":
            raise ValueError(f"request_id must be a non-empty str (or an int), got {request_id!r}")
        if isinstance(prompt_token_ids, (str, bytes)):
            raise ValueError(f"request {request_id!r}: prompt_token_ids must be a sequence of ints, not text")
        prompt = as_token_ids(request_id, prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; a request needs >= 1 token")
        max_tokens = check_int(max_tokens, f"request {request_id!r}: max_tokens", 1)
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt)
        self.max_tokens = int(max_tokens)
        self.priority = int(priority)  # lower value = more important (vLLM's convention)
        self.arrival_time = float(next(_arrival_counter)) if arrival_time is None else float(arrival_time)
        self.eos_token_id = eos_token_id
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens scheduled whose step's output has not been taken yet (update_from_output): their KV may still
        # be being written, so a sliding window frees blocks only up to num_computed_tokens minus these.
        # 0 whenever each step's output comes back before the next step is scheduled. Mirrors
        # Request.num_in_flight_tokens in vllm/v1/request.py.
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        # Async scheduling (``AsyncScheduler``): tokens scheduled whose samples have not arrived yet. Always 0
        # under the plain ``Scheduler``. Mirrors ``Request.num_output_placeholders`` (``vllm/v1/request.py``).
        self.num_output_placeholders = 0
        # Samples still in flight when ``reset_prefix_cache`` force-preempted it: dropped when they arrive.
        self.async_tokens_to_discard = 0
        # The engine's sampling parameters, carried to the model runner in ``NewRequestData`` (the scheduler
        # never reads them). Mirrors ``Request.sampling_params``.
        self.sampling_params = sampling_params
        # No prefix-cache hit is looked for (a request that asks for prompt logprobs needs every prompt position
        # computed). Mirrors ``Request.skip_reading_prefix_cache`` (``vllm/v1/request.py``).
        self.skip_reading_prefix_cache = bool(getattr(sampling_params, "skip_reading_prefix_cache", False))
        # Hashes of the request's full blocks, extended by the KV cache manager as blocks fill up.
        self.block_hashes: list[BlockHash] = []
        self.block_hasher_key: tuple[object, ...] | None = None  # (block_size, hash_fn) they were made with

    # --- tokens -------------------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs (a read-only view: do not mutate it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append sampled token(s) to the outputs (and to ``all_token_ids``).

        One token or a sequence of them; each is checked (``as_token_ids``) before any is appended, so a
        refused call changes nothing. Mirrors ``Request.append_output_token_ids`` in ``vllm/v1/request.py``.
        """
        one = not isinstance(token_ids, Iterable) or getattr(token_ids, "ndim", 1) == 0  # an int, or 0-d array
        ids = as_token_ids(self.request_id, [token_ids] if one else token_ids)
        self.output_token_ids.extend(ids)
        self._all_token_ids.extend(ids)

    # --- status -------------------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.name})"
        )
