"""An opt-in event trace of everything the KV cache manager and the scheduler do.

Every allocation, free, touch (cache hit), caching, eviction, copy-on-write, fork, preemption and swap can
be recorded as plain data. Recording is off by default: the library checks ``self.trace is not None``
before it builds an event, so an untraced run pays one attribute test per operation.

The block-table widget and the tests consume traces. A listener (``EventTrace.subscribe``) is called right
after each event, once the state change that the event describes is complete, so a listener may take a
consistent snapshot (``KVCacheManager.snapshot()``, ``Scheduler.snapshot()``) at that moment.

There is no vLLM counterpart with this shape; the nearest is ``vllm/distributed/kv_events.py``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), which vLLM publishes for KV-aware routing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The event kinds, with what each one means.
EVENT_KINDS: dict[str, str] = {
    "allocate": "fresh blocks popped from the free queue for a request (block_ids, in table order)",
    "touch": "cache hits: cached blocks added to a request's table, ref_cnt + 1 each",
    "cache": "full blocks given a hash and entered in the prefix cache",
    "evict": "a cached block popped for reuse: its hash cleared and removed from the cache map",
    "free": "a request's blocks released, ref_cnt - 1 each (block_ids in the order freed)",
    "copy": "copy-on-write: data['src'] is copied to data['dst'], which replaces it in the request's table",
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
