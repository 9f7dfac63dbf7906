"""Widgets for the lessons: watch the KV cache's block pool and block tables change, event by event.

How a lesson makes one::

    from pagedkv import KVCacheManager, Request
    from pagedkv.widgets import BlockTableWidget, TraceRecorder

    manager = KVCacheManager(num_blocks=16, block_size=4)
    rec = TraceRecorder(manager)                 # attaches an EventTrace; frame 0 = the state now
    a = Request("A", list(range(10)))
    manager.allocate_slots(a, a.num_tokens)      # every allocate / cache / touch / evict / free / copy ...
    a.num_computed_tokens = a.num_tokens         # ... becomes one frame: {"event": ..., "state": snapshot}
    rec.note("A has been prefilled")             # optional: a frame with a caption of your own
    manager.free(a)
    rec.detach()                                 # optional: stop recording
    BlockTableWidget.from_recorder(rec, title="one request's life")   # last expression of the cell

The same works with a ``Scheduler`` (``TraceRecorder(scheduler)``): its frames add the waiting and
running queues, the CPU swap pool and the step number, and the widget draws them.

The widget animates in the browser (play / pause, step back and forward, a scrubber, a speed menu; arrow
keys and space when it has focus) and publishes next to itself a static SVG filmstrip of the run's key
frames (allocation, sharing, copy-on-write, the fullest pool, preemption, swap: ``key_frames``), which is
what an nbconvert HTML export or GitHub's preview shows. ``frame_to_svg(rec.frames, k)`` draws any frame on
its own (wrap it in ``IPython.display.SVG`` to show it). ``TraceRecorder.frames`` is plain data, so tests
and exercises can check them directly (owners, ``ref_cnt``, free-queue order at frame k).
"""

from pagedkv.widgets.block_table import BlockTableWidget
from pagedkv.widgets.filmstrip import filmstrip_svg, key_frames
from pagedkv.widgets.frames import block_owners, view_frame, view_frames
from pagedkv.widgets.recorder import TraceRecorder
from pagedkv.widgets.svg import frame_to_svg

__all__ = [
    "BlockTableWidget",
    "TraceRecorder",
    "block_owners",
    "filmstrip_svg",
    "frame_to_svg",
    "key_frames",
    "view_frame",
    "view_frames",
]
