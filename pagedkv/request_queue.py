"""The scheduler's waiting queue: first come first served, or by priority.

Mirrors ``vllm/v1/core/sched/request_queue.py`` (``SchedulingPolicy``, ``FCFSRequestQueue``,
``PriorityRequestQueue``, ``create_request_queue``). Both queues iterate in the order they hand requests
out, so ``list(scheduler.waiting)`` shows who is admitted next.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from pagedkv.request import Request


class SchedulingPolicy(enum.Enum):
    """Which waiting request is admitted next, and which running request is preempted first."""

    FCFS = "fcfs"  # arrival order; the newest running request is the victim
    PRIORITY = "priority"  # (priority, arrival_time), smaller first; the largest running one is the victim


class FCFSRequestQueue(deque):
    """A deque of requests: ``add_request`` appends, ``prepend_request`` puts a preempted request back at the
    head, so it is the next one admitted. Mirrors ``FCFSRequestQueue``."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def pop_request(self) -> Request:
        if not self:
            raise IndexError("pop from an empty waiting queue")
        return self.popleft()

    def peek_request(self) -> Request:
        if not self:
            raise IndexError("peek at an empty waiting queue")
        return self[0]

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        kept = [r for r in self if id(r) not in drop]
        self.clear()
        self.extend(kept)


class PriorityRequestQueue:
    """Requests kept sorted by ``(priority, arrival_time, request_id)``, smaller first (vLLM's convention:
    priority 0 beats priority 1; a full tie on priority and arrival time goes to the smaller request id, as
    ``Request.__lt__`` in ``vllm/v1/request.py``; only the same id twice keeps insertion order). A preempted
    request is re-inserted by its key, since a priority queue has no "front" of its own (as vLLM's
    ``PriorityRequestQueue.prepend_request``).

    vLLM keeps a heap; a sorted list gives the same order with plain indexing, which the lesson and the
    widget use (``scheduler.waiting[0]``).
    """

    def __init__(self) -> None:
        self._items: list[tuple[int, float, tuple[bool, str | int], int, Request]] = []
        self._seq = itertools.count()

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        # (is_str, id): ints and strs never meet in a comparison, so a mix of id types still sorts.
        item = (request.priority, request.arrival_time, (isinstance(rid, str), rid), next(self._seq), request)
        keys = [entry[:4] for entry in self._items]
        self._items.insert(bisect.bisect_right(keys, item[:4]), item)

    def pop_request(self) -> Request:
        if not self._items:
            raise IndexError("pop from an empty waiting queue")
        return self._items.pop(0)[-1]

    def peek_request(self) -> Request:
        if not self._items:
            raise IndexError("peek at an empty waiting queue")
        return self._items[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_request(self, request: Request) -> None:
        for i, item in enumerate(self._items):
            if item[-1] is request:
                del self._items[i]
                return
        raise ValueError(f"{request!r} is not in the waiting queue")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._items = [item for item in self._items if id(item[-1]) not in drop]

    def __getitem__(self, index: int) -> Request:
        return self._items[index][-1]

    def __iter__(self) -> Iterator[Request]:
        return iter([item[-1] for item in self._items])

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __repr__(self) -> str:
        return f"PriorityRequestQueue({[r.request_id for r in self]})"


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: SchedulingPolicy) -> FCFSRequestQueue | PriorityRequestQueue:
    """The waiting queue for ``policy``. Mirrors ``create_request_queue``."""
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityRequestQueue()
    if policy is SchedulingPolicy.FCFS:
        return FCFSRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
