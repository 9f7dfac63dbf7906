"""What one layer's KV cache looks like, and how layers are grouped onto one pool.

A *spec* says how a layer stores KV (``block_size`` tokens per page, heads, head size, dtype) and which
tokens it still needs (all of them for full attention, the last ``sliding_window`` for a sliding-window
layer). Layers with the same spec form a *group*: they share one block table per request, so the KV cache
manager treats the group as one layer. A model with one attention type has one group; a hybrid model (Gemma 3,
gpt-oss) has one group per type, and every group's blocks come from the same pool.

Mirrors ``vllm/v1/kv_cache_interface.py`` (``KVCacheSpec``, ``AttentionSpec``, ``FullAttentionSpec``,
``SlidingWindowSpec``, ``KVCacheTensor``, ``KVCacheGroupSpec``, ``KVCacheConfig``). Lab differences:
``max_memory_usage_bytes`` takes ``max_model_len`` and ``max_in_flight_tokens`` instead of a whole
``VllmConfig``; ``dtype`` may be a torch dtype or a name (``"float16"``, ``"bfloat16"``, ``"float32"``,
``"fp8"``); quantisation modes, MLA, Mamba and the other specs of 0.26 are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.utils import cdiv, check_int

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def get_dtype_size(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or one of ``DTYPE_BYTES``' names). Mirrors
    ``vllm.utils.torch_utils.get_dtype_size``."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and not isinstance(dtype, str):
        return itemsize
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; use a torch dtype or one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache format of one layer: ``block_size`` tokens per page. Mirrors ``KVCacheSpec``."""

    block_size: int

    def __post_init__(self) -> None:
        check_int(self.block_size, "block_size", 1)

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int | None = None) -> int:
        raise NotImplementedError

    def copy_with_new_block_size(self, block_size: int) -> KVCacheSpec:
        """The same spec with another ``block_size`` (page-size unification scales block sizes). Mirrors
        ``KVCacheSpec.copy_with_new_block_size``."""
        return replace(self, block_size=block_size)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """An attention layer's KV: ``num_kv_heads`` heads of ``head_size`` for K and V. Mirrors
    ``AttentionSpec``."""

    num_kv_heads: int
    head_size: int
    dtype: Any
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.num_kv_heads, "num_kv_heads", 1)
        check_int(self.head_size, "head_size", 1)
        get_dtype_size(self.dtype)  # refuse an unknown dtype now
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the page itself "
                f"({self.real_page_size_bytes} bytes)"
            )

    @property
    def real_page_size_bytes(self) -> int:
        """``2 · block_size · num_kv_heads · head_size · dtype bytes``: K and V of ``block_size`` tokens."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * get_dtype_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer: the real page, or ``page_size_padded`` when the page was padded
        to match another group's (page-size unification). Mirrors ``AttentionSpec.page_size_bytes``."""
        return self.real_page_size_bytes if self.page_size_padded is None else self.page_size_padded

    def max_num_blocks_per_req(self, max_len: int) -> int:
        """Block-table entries a request of ``max_len`` tokens needs (the row length of the worker's table;
        out-of-window entries are the null block). Mirrors ``AttentionSpec.max_num_blocks_per_req``."""
        return cdiv(max_len, self.block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """A layer that attends to every earlier token, so it keeps every block until the request ends.

    ``sliding_window`` is set only when the hybrid allocator is off and a sliding layer is treated as full
    (blocks kept for all tokens, the window applied by the kernel). Mirrors ``FullAttentionSpec``.
    """

    sliding_window: int | None = None

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int | None = None) -> int:
        """The most one request can hold: ``cdiv(max_model_len, block_size)`` pages. Mirrors
        ``FullAttentionSpec.max_memory_usage_bytes``."""
        check_int(max_model_len, "max_model_len", 1)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """A layer whose token ``t`` attends to tokens ``t - sliding_window + 1 .. t`` only.

    Blocks wholly before the window of the next token are released while the request runs (the
    ``SlidingWindowManager`` replaces them by the null block), so one request holds at most
    ``max_admission_blocks_per_request`` blocks however long it grows. Mirrors ``SlidingWindowSpec``.
    """

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.sliding_window, "sliding_window", 1)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """The most blocks one request holds at once: the last ``sliding_window - 1`` computed tokens plus the
        tokens in flight (scheduled, not yet processed: blocks are freed on the processed basis), at most
        ``max_model_len``, in blocks, plus one because the window need not start at a block boundary (block
        size 4: the 4 tokens ``CDEF`` span two blocks, ``[xxCD][EF..]``). Used both to size the pool at start-up
        and as the admission gate's per-request cap. Mirrors ``SlidingWindowSpec.max_admission_blocks_per_request``.
        """
        check_int(max_in_flight_tokens, "max_in_flight_tokens", 1)
        check_int(max_model_len, "max_model_len", 1)
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, max_model_len: int, max_in_flight_tokens: int | None = None) -> int:
        """``max_admission_blocks_per_request`` pages. vLLM passes ``max_in_flight_tokens =
        max_concurrent_batches · max_num_batched_tokens`` (``VllmConfig.max_in_flight_tokens``); ``None``
        here means ``max_model_len`` (no cap). Mirrors ``SlidingWindowSpec.max_memory_usage_bytes``."""
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        return self.max_admission_blocks_per_request(in_flight, max_model_len) * self.page_size_bytes


@dataclass
class KVCacheTensor:
    """One KV cache allocation of ``size`` bytes, shared by the layers ``shared_by`` (one layer of each
    group: with hybrid models a block id names the same bytes in each of them). Mirrors ``KVCacheTensor``."""

    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table per request, and their common spec. Mirrors ``KVCacheGroupSpec``."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    """How the KV cache of a model is laid out: ``num_blocks`` blocks in one pool (block 0 the null block),
    the tensors the worker allocates, and the groups. One group for a model with one attention type; one
    group per type (per window size) for a hybrid model. Mirrors ``KVCacheConfig``."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor] = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_int(self.num_blocks, "num_blocks", 1, why="block 0 is the null block")
        if not self.kv_cache_groups:
            raise ValueError("a KVCacheConfig needs at least one KV cache group")
        for g in self.kv_cache_groups:
            if not isinstance(g, KVCacheGroupSpec) or not isinstance(g.kv_cache_spec, KVCacheSpec):
                raise ValueError(f"kv_cache_groups must hold KVCacheGroupSpec(layer_names, spec), got {g!r}")

    @classmethod
    def single_group(cls, num_blocks: int, spec: KVCacheSpec, layer_names: list[str] | None = None) -> KVCacheConfig:
        """A config with one group (every layer alike): what ``KVCacheManager(num_blocks, block_size)`` means."""
        return cls(num_blocks, [], [KVCacheGroupSpec(list(layer_names or ["layer"]), spec)])
