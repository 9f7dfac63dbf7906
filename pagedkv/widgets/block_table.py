"""``BlockTableWidget``: a recorded trace of the KV cache, animated in the browser.

The animation runs in JavaScript (``static/block_table.js``, loaded by anywidget): the kernel sends the
frames once and never sleeps. Play, pause, step, scrub and change the speed in the browser; ``widget.frame``
follows the view (and setting it from Python moves the view).

When the widget is displayed, a static SVG is published as a second output: by default a filmstrip of the
run's key frames (``filmstrip.key_frames``: allocation, sharing, copy-on-write, the fullest pool, preemption,
swap; the last frame alone is often an empty pool), or one frame (``static_frame=k``). It goes out as HTML
showing the SVG as an image, plus ``image/svg+xml``. Where the live widget renders, its stylesheet hides that
picture. Where it cannot, the picture is what the reader sees: an nbconvert HTML export, GitHub's preview, a
front end without widgets, and JupyterLab itself on a notebook it does not trust yet (a fresh clone: Lab will
not run widget code from untrusted outputs, and its HTML sanitiser strips inline SVG but keeps an ``<img>``
data URI). It is a separate output rather than a second type in the widget's own bundle because nbconvert
always chooses the widget type when the notebook stores widget state (nbclient and ``nbconvert --execute``
store it by default), and would drop the picture.
"""

from __future__ import annotations

import base64
import html
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import anywidget
import traitlets

from pagedkv.utils import check_int
from pagedkv.widgets.filmstrip import DEFAULT_MAX_FRAMES, fit_filmstrip
from pagedkv.widgets.frames import ROLES, request_colours, request_order, roles_used, view_frames
from pagedkv.widgets.svg import render_view_svg
from pagedkv.widgets.view_codec import encode_views

STATIC = pathlib.Path(__file__).parent / "static"

#: Frames per second offered by the speed menu.
SPEEDS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


class BlockTableWidget(anywidget.AnyWidget):
    """Animate a trace of block-pool states (``TraceRecorder.frames``) in the notebook.

    ``frames``: the frames ``[{"event": ..., "state": ...}, ...]`` or a ``TraceRecorder``.
    ``frame``: the frame shown first (default ``-1``: the last one, so the picture summarises the run;
    pressing play from the end starts again at frame 0). ``fps``: frames per second when playing.
    ``loop``: start again after the last frame. ``title``: a heading. ``static``: also publish the
    static SVG picture when displayed (default ``True``). ``static_frame``: what that picture shows: ``"keyframes"``
    (the default: a filmstrip of up to ``static_max_frames`` key frames, see ``filmstrip.key_frames``) or one
    frame's index (``-1``: the last).
    """

    _esm = STATIC / "block_table.js"
    _css = STATIC / "block_table.css"

    frames = traitlets.List().tag(sync=True)  # view frames, delta-encoded (view_codec.encode_views)
    frame = traitlets.Int(0).tag(sync=True)
    fps = traitlets.Float(2.0).tag(sync=True)
    loop = traitlets.Bool(False).tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    colors = traitlets.Dict().tag(sync=True)  # request id -> [background, text]
    request_ids = traitlets.List().tag(sync=True)  # legend order
    roles = traitlets.Dict().tag(sync=True)  # highlight role -> [colour, label]
    legend_roles = traitlets.List().tag(sync=True)
    speeds = traitlets.List().tag(sync=True)

    def __init__(
        self,
        frames: Sequence[Mapping[str, Any]] | Any,
        *,
        frame: int = -1,
        fps: float = 2.0,
        loop: bool = False,
        title: str = "",
        static: bool = True,
        static_frame: int | str = "keyframes",
        static_max_frames: int = DEFAULT_MAX_FRAMES,
        **kwargs: Any,
    ) -> None:
        raw = getattr(frames, "frames", frames)  # a TraceRecorder, or the frames themselves
        views = view_frames(raw)
        n = len(views)
        check_int(frame, "frame", -n, n - 1, why=f"{n} frames")
        if static_frame != "keyframes":
            check_int(static_frame, "static_frame", -n, n - 1, why=f'{n} frames; or "keyframes"')
        check_int(static_max_frames, "static_max_frames", 1)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf"):
            raise ValueError(f"fps must be a finite number of frames per second > 0, got {fps!r}")
        ids = request_order(raw)
        self.views = views  # the decoded views, for the static pictures
        self._static = static
        self._static_frame: int | str = static_frame if isinstance(static_frame, str) else static_frame % n
        self._static_max_frames = static_max_frames
        self._strips: dict[int, tuple[str, list[tuple[int, str]]]] = {}
        super().__init__(
            frames=encode_views(views),
            frame=frame % n,
            fps=float(fps),
            loop=loop,
            title=title,
            colors=request_colours(ids),
            request_ids=ids,
            roles={k: list(v) for k, v in ROLES.items()},
            legend_roles=roles_used(views),
            speeds=list(SPEEDS),
            **kwargs,
        )

    @traitlets.validate("frames")
    def _check_frames(self, proposal: dict[str, Any]) -> list[dict[str, Any]]:
        encoded = proposal["value"]
        if not encoded or not isinstance(encoded[0], dict) or not encoded[0].get("full"):
            raise traitlets.TraitError("frames must be encoded views; build a new BlockTableWidget(frames) instead")
        return encoded

    @classmethod
    def from_recorder(cls, recorder: Any, **kwargs: Any) -> BlockTableWidget:
        """The widget over everything ``recorder`` (a ``TraceRecorder``) has stored so far."""
        return cls(recorder.frames, **kwargs)

    @traitlets.validate("frame")
    def _check_frame(self, proposal: dict[str, Any]) -> int:
        k = proposal["value"]
        n = len(self.frames)
        if n and not 0 <= k < n:
            raise traitlets.TraitError(f"frame must be in [0, {n - 1}], got {k}")
        return k

    # --- the static picture ---------------------------------------------------------------------------
    def to_svg(self, index: int | None = None) -> str:
        """The SVG of frame ``index`` (default: the current frame), drawn as the widget draws it."""
        n = len(self.frames)
        k = self.frame if index is None else check_int(index, "frame index", -n, n - 1, why=f"{n} frames")
        return render_view_svg(
            self.views[k % n], self.colors, title=self.title, total=n, legend_roles=self.legend_roles,
            request_ids=self.request_ids,
        )  # fmt: skip

    def static_mimebundle(self, index: int | None = None) -> dict[str, str]:
        """The static picture of frame ``index`` (default: the current frame) as an output, three ways: HTML
        showing the SVG as an ``<img>`` data URI (it survives the sanitiser JupyterLab applies to an untrusted
        notebook's HTML, which strips inline SVG; the widget's stylesheet hides it wherever the live widget
        renders), the bare SVG, and a line of text."""
        svg = self.to_svg(index)
        k = self.frame if index is None else index % len(self.frames)
        data_uri = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")
        caption = html.escape(self.views[k]["caption"], quote=True)
        return {
            "text/html": (
                f'<div class="pkv-static-fallback" data-frame-index="{k}">'
                f'<img src="{data_uri}" alt="block table, frame {k}: {caption}" style="max-width: 100%"/></div>'
            ),
            "image/svg+xml": svg,
            "text/plain": f"[block table, frame {k} (of 0–{len(self.frames) - 1}): {self.views[k]['caption']}]",
        }

    def _filmstrip(self, max_frames: int | None) -> tuple[str, list[tuple[int, str]]]:
        k = self._static_max_frames if max_frames is None else max_frames
        if k not in self._strips:
            self._strips[k] = fit_filmstrip(
                self.views, self.colors, k, title=self.title, request_ids=self.request_ids,
                legend_roles=self.legend_roles,
            )  # fmt: skip
        return self._strips[k]

    def key_frames(self, max_frames: int | None = None) -> list[tuple[int, str]]:
        """The frames the filmstrip shows, ``[(index, label), ...]`` in time order (``filmstrip.key_frames``;
        fewer when a large pool's strip would pass ``filmstrip.MAX_SVG_CHARS``)."""
        return list(self._filmstrip(max_frames)[1])

    def filmstrip_svg(self, max_frames: int | None = None) -> str:
        """The key frames as one SVG strip of numbered panels, drawn as the widget draws them
        (``filmstrip.fit_filmstrip``)."""
        return self._filmstrip(max_frames)[0]

    def filmstrip_mimebundle(self, max_frames: int | None = None) -> dict[str, str]:
        """The filmstrip as an output, the same three ways as ``static_mimebundle``."""
        picks = self.key_frames(max_frames)
        svg = self.filmstrip_svg(max_frames)
        data_uri = "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode("ascii")
        moments = ", ".join(f"{label} (frame {k})" for k, label in picks)
        return {
            "text/html": (
                f'<div class="pkv-static-fallback" data-frame-index="{",".join(str(k) for k, _ in picks)}">'
                f'<img src="{data_uri}" alt="block table, key frames: {html.escape(moments, quote=True)}" '
                'style="max-width: 100%"/></div>'
            ),
            "image/svg+xml": svg,
            "text/plain": f"[block table, {len(self.frames)} frames; key frames: {moments}]",
        }

    def __repr__(self) -> str:
        n = len(self.frames)
        return f"BlockTableWidget({n} frames, showing frame {self.frame}; run this cell to animate it)"

    def _ipython_display_(self) -> None:
        from IPython.display import publish_display_data

        data, metadata = self._repr_mimebundle_()
        publish_display_data(data, metadata)
        if self._static:
            k = self._static_frame
            bundle = self.filmstrip_mimebundle() if k == "keyframes" else self.static_mimebundle(int(k))
            publish_display_data(bundle, {"pagedkv": {"static_fallback": True}})
