"""An opt-in trace of everything the KV cache manager and the scheduler do, with a caption for each event.

The pool and the manager record plain KV cache events (``pagedkv.kv_events``, vLLM's
``vllm/distributed/kv_events.py`` plus the lab's table events); a manager with a trace attached hands each one
to ``EventTrace.record_kv_event``, which turns it into a ``TraceEvent`` with the caption a person reads
(``format_kv_event``). The scheduler records its own steps (admit, schedule, preempt, swap, finish) with
``EventTrace.record``. Recording is off by default.

The block-table widget and the tests consume traces. A listener (``EventTrace.subscribe``) is called right
after each event, once the state change that the event describes is complete, so a listener may take a
consistent snapshot (``KVCacheManager.snapshot()``, ``Scheduler.snapshot()``) at that moment.

There is no vLLM counterpart with this shape: vLLM publishes the events (``KVEventBatch``) for KV-aware
routing and shows nobody a caption.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.kv_cache_utils import make_block_hash_with_group_id, short_hash
from pagedkv.kv_events import (
    AllBlocksCleared,
    BlockCopied,
    BlockRemoved,
    BlocksAllocated,
    BlocksFreed,
    BlockStored,
    BlocksTouched,
    KVCacheEvent,
    RequestForked,
    SkippedBlocksRemoved,
)

#: The event kinds, with what each one means.
EVENT_KINDS: dict[str, str] = {
    "allocate": "fresh blocks popped from the free queue for a request (block_ids, in table order)",
    "touch": "cache hits: cached blocks added to a request's table, ref_cnt + 1 each",
    "cache": "full blocks given a hash and entered in the prefix cache",
    "evict": "a cached block popped for reuse: its hash cleared and removed from the cache map",
    "free": "a request's blocks released, ref_cnt - 1 each (block_ids in the order freed)",
    "copy": "copy-on-write: data['dst'] replaces data['src'] in the request's table, src's KV copied to it "
    "(the caption says so when src held nothing computed yet)",
    "fork": "a child request shares its parent's whole block table (data['parent'])",
    "reset": "the prefix cache was cleared (reset_prefix_cache)",
    "admit": "a waiting request was scheduled for the first time or again",
    "schedule": "a scheduler step was decided (data['num_scheduled_tokens'])",
    "preempt": "a running request was preempted (data['mode'] is 'recompute' or 'swap')",
    "swap_out": "GPU blocks copied to the CPU pool (data['pairs'] = [(gpu, cpu), ...])",
    "swap_in": "CPU blocks copied back to the GPU pool (data['pairs'] = [(cpu, gpu), ...])",
    "finish": "a request finished and released its blocks",
}


@dataclass(frozen=True)
class TraceEvent:
    """One recorded event: plain data, safe to compare, print or serialise."""

    index: int  # position in the trace, from 0
    kind: str  # a key of EVENT_KINDS
    request_id: str | None = None
    block_ids: tuple[int, ...] = ()
    caption: str = ""  # one line for a person, e.g. "req A allocates blocks [3, 4]"
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "request_id": self.request_id,
            "block_ids": list(self.block_ids),
            "caption": self.caption,
            "data": dict(self.data),
        }


class EventTrace:
    """An append-only list of ``TraceEvent`` with listeners.

    Attach one to a manager or scheduler with ``set_trace(trace)``; detach with ``set_trace(None)``.
    """

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self._listeners: list[Callable[[TraceEvent], None]] = []

    def record(
        self,
        kind: str,
        request_id: str | None = None,
        block_ids: tuple[int, ...] | list[int] = (),
        caption: str = "",
        **data: Any,
    ) -> TraceEvent:
        """Append an event and call every listener with it."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown trace event kind {kind!r}; expected one of {sorted(EVENT_KINDS)}")
        event = TraceEvent(len(self.events), kind, request_id, tuple(block_ids), caption, data)
        self.events.append(event)
        for listener in self._listeners:
            listener(event)
        return event

    def record_kv_event(self, event: KVCacheEvent) -> TraceEvent:
        """Append a KV cache event (``pagedkv.kv_events``) with its caption (``format_kv_event``)."""
        kind, request_id, block_ids, caption, data = format_kv_event(event)
        return self.record(kind, request_id, block_ids, caption, **data)

    def subscribe(self, listener: Callable[[TraceEvent], None]) -> None:
        """Call ``listener(event)`` after every future event."""
        self._listeners.append(listener)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def __getitem__(self, i: int) -> TraceEvent:
        return self.events[i]


def _held(tables: list[list[int]]) -> list[int]:
    """Every block a request's tables hold (the null block left out), in id order."""
    return sorted({i for t in tables for i in t if i != 0})


def format_kv_event(event: KVCacheEvent) -> tuple[str, str | None, list[int], str, dict[str, Any]]:
    """``(kind, request_id, block_ids, caption, data)`` of a KV cache event: the trace's form of it, with one
    line for a person (what the widget shows). ``ValueError`` for anything that is not a known event."""
    tables = getattr(event, "tables", None)
    on = f": tables {tables}" if tables is not None else ""
    group = {"tables": tables} if tables is not None else {}
    if isinstance(event, BlocksAllocated):
        rid, ids = event.request_id, list(event.block_ids)
        if tables is not None:
            return "allocate", rid, _held(tables), f"{rid} allocates blocks{on}", group
        return "allocate", rid, ids, f"{rid} allocates blocks {ids} (table now {event.num_blocks_in_table} blocks)", {}
    if isinstance(event, BlocksTouched):
        rid, ids = event.request_id, list(event.block_ids)
        if tables is not None:
            return "touch", rid, _held(tables), f"{rid} hits cached blocks ({event.num_tokens} tokens){on}", group
        return "touch", rid, ids, f"{rid} hits cached blocks {ids} ({event.num_tokens} tokens)", {}
    if isinstance(event, BlockCopied):
        rid, src, dst = event.request_id, event.src, event.dst
        caption = f"{rid} writes into shared block {src}: copy-on-write to block {dst}"
        if not event.copied:
            caption = f"{rid} writes into shared block {src}: block {dst} in its place (nothing computed to copy)"
        return "copy", rid, [src, dst], caption, {"src": src, "dst": dst}
    if isinstance(event, RequestForked):
        cid, pid = event.request_id, event.parent_request_id
        if tables is not None:
            caption = f"{cid} forks from {pid}, sharing its blocks{on}"
            return "fork", cid, _held(tables), caption, group | {"parent": pid}
        ids = list(event.block_ids)
        return "fork", cid, ids, f"{cid} forks from {pid}, sharing blocks {ids}", {"parent": pid}
    if isinstance(event, BlocksFreed):
        rid, ids = event.request_id, list(event.block_ids)
        return "free", rid, ids, f"{rid} frees blocks {ids}", {}
    if isinstance(event, SkippedBlocksRemoved):
        rid, dropped = event.request_id, list(event.block_ids)
        caption = f"{rid}: blocks {dropped} fell out of the window (freed, the null block in their place){on}"
        return "free", rid, _held(event.tables), caption, group
    if isinstance(event, BlockStored):
        rid, ids = event.request_id, list(event.block_ids)
        return "cache", rid, ids, f"{rid} caches full blocks {ids}", {}
    if isinstance(event, BlockRemoved):
        rid, ids = event.request_id, list(event.block_ids)
        keys = [make_block_hash_with_group_id(h, event.group_idx or 0) for h in event.block_hashes]
        held = ", ".join(short_hash(k) for k in keys)
        by = f" for {rid}" if rid is not None else ""
        which = f"block {ids[0]}" if len(ids) == 1 else f"blocks {ids}"
        return "evict", rid, ids, f"{which} evicted{by} (held prefix {held})", {}
    if isinstance(event, AllBlocksCleared):
        return "reset", None, [], "prefix cache reset: every hash forgotten", {}
    raise ValueError(f"not a KV cache event: {event!r:.80}")
