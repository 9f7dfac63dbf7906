"""Record a KV cache manager's (or a scheduler's) events as frames for the block-table widget.

``TraceRecorder(target)`` attaches an ``EventTrace`` to ``target`` (anything with ``set_trace`` and
``snapshot``: ``KVCacheManager``, ``Scheduler``) and, after every event, stores the frame
``{"event": event.to_dict(), "state": target.snapshot()}``. The first frame (``event`` ``None``) is the state
when recording began. Frames are plain data (lists, dicts, str, int, bool, None): they can be compared in
tests, saved as JSON, or drawn with ``pagedkv.widgets.frame_to_svg``.

The trace calls its listeners once the change an event describes is complete (see ``pagedkv.trace``), so
each snapshot is consistent. There is no vLLM counterpart; the nearest is the KV event publisher
(``vllm/distributed/kv_events.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pagedkv.trace import EVENT_KINDS, EventTrace, TraceEvent
from pagedkv.utils import check_int
from pagedkv.widgets.frames import plain

if TYPE_CHECKING:
    from pagedkv.widgets.block_table import BlockTableWidget

#: Recording stops (with a warning) after this many frames: each frame holds a whole-pool snapshot.
DEFAULT_MAX_FRAMES = 2000


class TraceRecorder:
    """Stores one frame per traced event of ``target`` (a ``KVCacheManager`` or a ``Scheduler``).

    ``kinds`` keeps only those event kinds (for example ``{"allocate", "free"}``); by default every event is
    kept. If ``target`` already has a trace, the recorder listens to it instead of replacing it. Use it as a
    context manager, or call ``detach()``, to stop recording.
    """

    def __init__(
        self,
        target: Any,
        *,
        kinds: Iterable[str] | None = None,
        max_frames: int = DEFAULT_MAX_FRAMES,
        caption: str | None = None,
    ) -> None:
        if not callable(getattr(target, "snapshot", None)) or not callable(getattr(target, "set_trace", None)):
            raise ValueError(
                f"cannot record {type(target).__name__}: it needs snapshot() and set_trace() "
                "(a KVCacheManager or a Scheduler)"
            )
        if kinds is not None:
            kinds = set(kinds)
            unknown = sorted(kinds - set(EVENT_KINDS))
            if unknown:
                raise ValueError(f"unknown event kinds {unknown}; expected some of {sorted(EVENT_KINDS)}")
        check_int(max_frames, "max_frames", 1)
        self.target = target
        self.kinds: set[str] | None = kinds
        self.max_frames = max_frames
        self.frames: list[dict[str, Any]] = []
        self.truncated = False
        existing = getattr(target, "trace", None)
        self.trace: EventTrace = existing if isinstance(existing, EventTrace) else EventTrace()
        self._owns_trace = self.trace is not existing
        self._attached = True
        self._append(None, caption)
        self.trace.subscribe(self._on_event)
        if self._owns_trace:
            target.set_trace(self.trace)

    # --- recording ----------------------------------------------------------------------------------
    def _append(self, event: dict[str, Any] | None, caption: str | None = None) -> None:
        if len(self.frames) >= self.max_frames:
            if not self.truncated:
                self.truncated = True
                warnings.warn(
                    f"TraceRecorder stopped after {self.max_frames} frames (max_frames); "
                    "record fewer events (kinds=...) or raise max_frames",
                    stacklevel=3,
                )
            return
        frame: dict[str, Any] = {"event": event, "state": plain(self.target.snapshot())}
        if caption is not None:
            frame["caption"] = str(caption)  # shown instead of the event's own caption
        self.frames.append(frame)

    def _on_event(self, event: TraceEvent) -> None:
        if not self._attached or (self.kinds is not None and event.kind not in self.kinds):
            return
        self._append(plain(event.to_dict()))

    def note(self, caption: str) -> None:
        """Add a frame of the current state with a caption of your own (e.g. "step 3: B finishes")."""
        event = {"index": None, "kind": "note", "request_id": None, "block_ids": [], "caption": str(caption),
                 "data": {}}  # fmt: skip
        self._append(event)

    def detach(self) -> None:
        """Stop recording; the frames stay. Removes the trace from the target if the recorder set it."""
        if not self._attached:
            return
        self._attached = False
        if self._owns_trace and getattr(self.target, "trace", None) is self.trace:
            self.target.set_trace(None)

    def __enter__(self) -> TraceRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # --- reading ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.frames)

    def __getitem__(self, k: int) -> dict[str, Any]:
        return self.frames[k]

    def widget(self, **kwargs: Any) -> BlockTableWidget:
        """A ``BlockTableWidget`` over the frames recorded so far (keyword arguments are passed on)."""
        from pagedkv.widgets.block_table import BlockTableWidget

        return BlockTableWidget(self.frames, **kwargs)
