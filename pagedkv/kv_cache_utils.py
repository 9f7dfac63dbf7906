"""The pieces the block pool is made of: KV cache blocks, the free-block queue, and block hashes.

Mirrors ``vllm/v1/core/kv_cache_utils.py`` (``KVCacheBlock``, ``FreeKVCacheBlockQueue``,
``hash_block_tokens``, ``NONE_HASH``). ``PrefixCacheStats`` lives in :mod:`pagedkv.metrics.stats`, as in vLLM
(``vllm/v1/metrics/stats.py``); it is re-exported here for code that imported it from this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, Union

from pagedkv.metrics.stats import PrefixCacheStats  # noqa: F401 - re-exported: its old import path

#: A block's hash: an int from Python's ``hash`` or 32 bytes from sha256.
BlockHash = Union[int, bytes]  # noqa: UP007 - kept a plain alias so it reads the same in the lesson
#: The hash standing in for "no parent" before a request's first block: a fixed seed, so that the same
#: first block always hashes the same way (vLLM seeds it from PYTHONHASHSEED or at random).
NONE_HASH: int = 0x5EED_B10C_0000_0001


# --------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------
class KVCacheBlock:
    """One physical block of the KV cache pool: ``block_size`` token slots of K and V.

    ``ref_cnt`` counts the requests whose block table holds the block. ``block_hash`` is set once the block
    is full and entered in the prefix cache, and cleared when the block is evicted. ``prev_free_block`` and
    ``next_free_block`` thread the block into the free queue (both ``None`` while it is not there).
    Mirrors ``KVCacheBlock`` in ``vllm/v1/core/kv_cache_utils.py``.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a hash; reset_hash() it first")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash: the block no longer holds a cached prefix (it was evicted or the cache reset)."""
        self._block_hash = None

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free_block is not None

    def __repr__(self) -> str:
        h = "" if self._block_hash is None else f", hash={short_hash(self._block_hash)}"
        null = ", null" if self.is_null else ""
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{h}{null})"


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    The head is the next block handed out (and, if it holds a cached prefix, the next one evicted); the
    tail is the last. Two sentinel blocks (id -1) bound the list, so every operation is a fixed number of
    pointer updates: ``popleft``, ``remove`` (a cache hit takes a block out of the middle), ``append`` and
    ``appendleft`` are all O(1). A Python list would make ``remove`` O(n); a ``deque`` cannot remove from
    the middle at all. Mirrors ``FreeKVCacheBlockQueue`` in ``vllm/v1/core/kv_cache_utils.py``.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        blocks = list(blocks)
        if len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("a block appears twice in the blocks given to the free queue")
        for block in blocks:
            if block.prev_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in a free queue")
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    # The operations below are written out in full rather than sharing link/unlink helpers: each is a few
    # pointer updates, and in CPython a helper call costs as much as the updates themselves.

    # --- removing -----------------------------------------------------------------------------------
    def popleft(self) -> KVCacheBlock:
        """Take the head block off the queue. Raises ``ValueError`` when the queue is empty."""
        head = self.fake_free_list_head
        first = head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            raise ValueError("No free blocks available")
        nxt = first.next_free_block
        head.next_free_block = nxt
        nxt.prev_free_block = head  # type: ignore[union-attr]
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head, in order. ``ValueError`` (and no change) if fewer are free."""
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: {self.num_free_blocks} are free")
        head = self.fake_free_list_head
        out: list[KVCacheBlock] = []
        block = head.next_free_block
        for _ in range(n):
            assert block is not None
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            out.append(block)
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle of the queue (a cache hit on a free cached block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    # --- adding -------------------------------------------------------------------------------------
    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it is handed out (evicted) last."""
        if block.prev_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail, in order. ``ValueError`` (and no change) if one is already queued."""
        self._insert_after(self.fake_free_list_tail.prev_free_block, list(blocks))  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head: it is handed out next."""
        if block.prev_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        head = self.fake_free_list_head
        first = head.next_free_block
        head.next_free_block = block
        block.prev_free_block = head
        block.next_free_block = first
        first.prev_free_block = block  # type: ignore[union-attr]
        self.num_free_blocks += 1

    def appendleft_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head as a group, in order: ``blocks[0]`` becomes the new head.
        ``ValueError`` (and no change) if one is already queued."""
        self._insert_after(self.fake_free_list_head, list(blocks))

    def _insert_after(self, anchor: KVCacheBlock, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        for block in blocks:
            if block.prev_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
        if len(blocks) > 1 and len({id(b) for b in blocks}) != len(blocks):
            raise ValueError("a block appears twice in the blocks to queue")
        after = anchor.next_free_block
        prev = anchor
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = after
        after.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    # --- reading ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks from head to tail (O(n): for tests, lessons and the widget)."""
        return list(self)

    def __len__(self) -> int:
        return self.num_free_blocks


# --------------------------------------------------------------------------------------------------
# Block hashes (prefix caching)
# --------------------------------------------------------------------------------------------------
#: What ``builtin_hash`` hashes in place of ``None`` (an unsalted block's ``extra``): before Python 3.12
#: ``hash(None)`` is derived from None's address, which differs from run to run.
_NONE_STAND_IN = 0x4E6F_6E65_0000_0001


def builtin_hash(obj: Any) -> int:
    """Python's ``hash``, with ``None`` (the object itself, or an element of a tuple) hashed as a fixed int:
    so a key of ints, tuples of ints and ``None`` (every block without a cache salt) is the same in every run
    and process, on every Python from 3.10 on. Strings and bytes (a cache salt) still hash differently in every
    process (PYTHONHASHSEED), so these hashes must never leave the process. A lab choice: vLLM 0.26 offers
    only sha256 and xxhash (``vllm/utils/hashing.py::get_hash_fn_by_name``)."""
    if obj is None:
        return hash(_NONE_STAND_IN)
    if type(obj) is tuple and any(x is None for x in obj):  # "is": an element's == might not return a bool
        obj = tuple(_NONE_STAND_IN if x is None else x for x in obj)
    return hash(obj)


def _canonical(obj: Any) -> bytes:
    """A type-tagged, unambiguous byte encoding of ints, strs, bytes, None and tuples/lists of them."""
    if obj is None:
        return b"N"
    if isinstance(obj, bool):
        return b"B1" if obj else b"B0"
    if isinstance(obj, int):
        return b"I" + str(obj).encode() + b";"
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return b"S" + str(len(data)).encode() + b":" + data
    if isinstance(obj, bytes):
        return b"Y" + str(len(obj)).encode() + b":" + obj
    if isinstance(obj, (tuple, list)):
        return b"T" + str(len(obj)).encode() + b"(" + b"".join(_canonical(x) for x in obj) + b")"
    raise TypeError(f"cannot hash a {type(obj).__name__} stably; use ints, strs, bytes, None, tuples")


def sha256_hash(obj: Any) -> bytes:
    """sha256 of a canonical encoding: the same 32 bytes in every process and on every machine, which is
    what a prefix cache shared across processes (or persisted) needs. Mirrors vLLM's ``sha256_cbor``."""
    return hashlib.sha256(_canonical(obj)).digest()


HASH_FUNCTIONS: dict[str, Callable[[Any], BlockHash]] = {"builtin": builtin_hash, "sha256": sha256_hash}


def get_hash_fn(hash_fn: str | Callable[[Any], BlockHash]) -> Callable[[Any], BlockHash]:
    if callable(hash_fn):
        return hash_fn
    try:
        return HASH_FUNCTIONS[hash_fn]
    except KeyError:
        raise ValueError(f"unknown hash function {hash_fn!r}; use one of {sorted(HASH_FUNCTIONS)}") from None


def hash_block_tokens(
    hash_fn: Callable[[Any], BlockHash],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """The hash of one full block: of its parent's hash, its own tokens and its extra keys.

    Chaining the parent's hash makes a block's hash stand for the whole prefix up to and including it:
    two blocks with the same tokens after different prefixes hash differently, because their KV differs.
    Mirrors ``hash_block_tokens`` in ``vllm/v1/core/kv_cache_utils.py``.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    return hash_fn((parent, tuple(curr_block_token_ids), extra_keys))


class HashableRequest(Protocol):
    """What block hashing reads from a request and writes back (``pagedkv.request.Request`` is one). A
    protocol rather than an import, so that this module, at the bottom of the library, imports no other
    (``request`` imports ``BlockHash`` from here)."""

    lora_id: int | None
    cache_salt: str | None
    block_hashes: list[BlockHash]
    block_hasher_key: tuple[object, ...] | None

    @property
    def all_token_ids(self) -> list[int]: ...


def generate_block_hash_extra_keys(request: HashableRequest, block_index: int) -> tuple[Any, ...] | None:
    """What besides the tokens decides a block's KV, as vLLM orders it: the adapter (in every block's key),
    then the cache salt (in the first block's only: chaining carries it into every later hash). ``None``
    when there is neither. Mirrors ``generate_block_hash_extra_keys`` in ``vllm/v1/core/kv_cache_utils.py``."""
    keys: list[Any] = []
    if request.lora_id is not None:
        keys.append(request.lora_id)
    if block_index == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    return tuple(keys) if keys else None


def update_block_hashes(request: HashableRequest, block_size: int, hash_fn: Callable[[Any], BlockHash]) -> None:
    """Extend ``request.block_hashes`` to cover every full block of its tokens (partial blocks are never
    hashed: their tokens, and so their KV, are not final). Mirrors vLLM's ``get_request_block_hasher``."""
    key = (block_size, hash_fn)
    if request.block_hasher_key != key:  # first use, or the request moved to a differently shaped cache
        request.block_hashes.clear()
        request.block_hasher_key = key
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else None
        block_tokens = tokens[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(hash_fn, parent, block_tokens, generate_block_hash_extra_keys(request, i)))


def hash_request_tokens(
    hash_fn: Callable[[Any], BlockHash], block_size: int, token_ids: Sequence[int], extra_keys: Any = None
) -> list[BlockHash]:
    """The hash chain of a token list's full blocks (``extra_keys`` on every block). For lessons/tests."""
    hashes: list[BlockHash] = []
    for i in range(len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(hash_fn, parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys))
    return hashes


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> Any:
    """The prefix-cache key of a block of KV cache group ``group_id``: the hash itself for group 0 (so a
    single-group model's keys are its block hashes, as lessons 2-7 show them), ``(hash, group_id)`` for the
    others. vLLM 0.26 appends the group id to every hash (``make_block_hash_with_group_id`` in
    ``vllm/v1/core/kv_cache_utils.py``); the lab leaves group 0's bare. Either way two groups' blocks of the
    same prefix never collide."""
    return block_hash if group_id == 0 else (block_hash, group_id)


def short_hash(block_hash: Any) -> str:
    """Six hex digits of a hash, for captions and pictures (``…/g1`` for a group-1 key)."""
    if isinstance(block_hash, tuple):
        return f"{short_hash(block_hash[0])}/g{block_hash[1]}"
    if isinstance(block_hash, bytes):
        return block_hash[:3].hex()
    return f"{block_hash & 0xFFFFFF:06x}"
