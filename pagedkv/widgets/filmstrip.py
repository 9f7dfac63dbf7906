"""A trace's key frames side by side: the static picture published beside the block-table widget.

The widget animates in the browser, but GitHub's preview, an nbconvert HTML export and any front end without
widgets show only the picture published next to it. One frame tells little: the last is often an empty pool
(every request finished), the first always is. ``key_frames`` picks the moments a reader should see — the
first allocation, the first sharing (a fork or a prefix hit), the first copy-on-write, the fullest pool, the
first preemption, swap-out and swap-in, the first eviction — and ``filmstrip_svg`` draws them as a strip of
numbered panels in time order, with one legend for all.

There is no vLLM counterpart: the moments are events of ``vllm/v1/core/block_pool.py`` (allocation, cache hits,
eviction) and ``vllm/v1/core/sched/scheduler.py`` (preemption); copy-on-write and swapping are the lab's
extensions (vLLM V0's block manager had both).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.utils import check_int
from pagedkv.widgets.svg import INK, MUTED, _Canvas, _document, _t, draw_legend, render_view_svg

#: The moments a filmstrip looks for: (label, event kinds that mark it), most telling first. When a trace has
#: more of them than ``max_frames``, the earlier entries win; the strip then shows them in time order.
KEY_MOMENTS: tuple[tuple[str, frozenset[str]], ...] = (
    ("allocation", frozenset({"allocate"})),
    ("sharing", frozenset({"fork"})),
    ("copy-on-write", frozenset({"copy"})),
    ("preemption", frozenset({"preempt"})),
    ("swap out", frozenset({"swap_out"})),
    ("swap in", frozenset({"swap_in"})),
    ("prefix hit", frozenset({"touch"})),
    ("eviction", frozenset({"evict"})),
)
#: The label of the fullest pool's frame, which ranks after these moments and before the rest.
PEAK = "fullest pool"
_BEFORE_PEAK = ("allocation", "sharing", "copy-on-write", "preemption", "swap out", "swap in")

#: How many panels a strip shows by default.
DEFAULT_MAX_FRAMES = 6
#: The most characters a strip's SVG may take (a notebook stores it twice): past it, ``fit_filmstrip`` draws the
#: panels compact (no free queue, no block tables), then with fewer frames.
MAX_SVG_CHARS = 300_000


def key_frames(views: Sequence[Mapping[str, Any]], max_frames: int = DEFAULT_MAX_FRAMES) -> list[tuple[int, str]]:
    """The frames worth showing of a trace, as ``[(frame index, label), ...]`` in time order.

    ``views`` are ``frames.view_frames(...)`` (each has ``kind`` and ``stats``). For each of ``KEY_MOMENTS`` the
    first frame whose event is of that kind, plus the fullest pool (the first frame holding the most blocks,
    labelled ``"fullest pool"``; it ranks after the swap-in). Then, while there is room,
    the last frame if it still holds blocks. A trace with none of these moments gives its last frame (or its
    only one). ``max_frames`` (>= 1) caps the count; the most telling moments are kept.
    """
    check_int(max_frames, "max_frames", 1)
    if not views:
        raise ValueError("views is empty: a trace has at least its initial frame")
    first: dict[str, int] = {}
    for k, v in enumerate(views):
        for label, kinds in KEY_MOMENTS:
            if label not in first and v.get("kind") in kinds:
                first[label] = k
    names = {label: label for label, _ in KEY_MOMENTS}
    if "preemption" in first and 0 <= first["preemption"] - first.get("swap out", -99) <= 3:
        first["preemption"] = first.pop("swap out")  # a swap preemption: its swap-out frame shows the blocks go
        names["preemption"] = "preemption (swap out)"
    held = [int(v["stats"]["held"]) for v in views]
    wanted: list[tuple[str, int]] = [(names[label], first[label]) for label, _ in KEY_MOMENTS if label in first]
    if max(held) > 0:
        rank = sum(1 for label, _ in wanted if label.split(" (")[0] in _BEFORE_PEAK)
        wanted.insert(rank, (PEAK, held.index(max(held))))
    last = len(views) - 1
    if held[last] > 0:
        wanted.append(("end", last))
    picked: dict[int, str] = {}
    for label, k in wanted:
        if len(picked) == max_frames:
            break
        picked.setdefault(k, label)  # one moment per frame: the more telling label wins
    if not picked:
        picked[last] = "end" if last else "start"
    return sorted(picked.items())


def _nest(svg: str, x: float, y: float, scale: float) -> tuple[str, float, float]:
    """Turn a standalone SVG document into a nested ``<svg>`` placed at (x, y), scaled; returns it and its
    scaled width and height."""
    m = re.match(r'<svg [^>]*?width="([\d.]+)" height="([\d.]+)"[^>]*>', svg)
    if m is None:
        raise ValueError("not an SVG document drawn by render_view_svg")
    w, h = float(m.group(1)), float(m.group(2))
    head = f'<svg x="{x:.1f}" y="{y:.1f}" width="{w * scale:.1f}" height="{h * scale:.1f}" viewBox="0 0 {w:g} {h:g}">'
    return head + svg[m.end() :], w * scale, h * scale


def filmstrip_svg(
    views: Sequence[Mapping[str, Any]],
    colours: Mapping[str, list[str]],
    picks: Sequence[tuple[int, str]],
    *,
    title: str = "",
    request_ids: Sequence[str] | None = None,
    legend_roles: Sequence[str] | None = None,
    columns: int = 2,
    scale: float = 0.7,
    panel_width: int = 600,
    compact: bool = False,
    panel_cache: dict[tuple[int, bool], str] | None = None,
) -> str:
    """One SVG with the frames ``picks`` (``[(index, label), ...]``, e.g. from ``key_frames``) as numbered panels,
    ``columns`` to a row, each drawn as the widget draws it (at least ``panel_width`` px wide) and scaled by
    ``scale``; one legend below. The defaults keep a six-frame strip about as wide as a notebook's output.
    ``compact``: panels without the free queue and the block tables. ``panel_cache``: drawn panels by
    ``(index, compact)``, reused across calls (``fit_filmstrip`` draws the same frames more than once)."""
    if not picks:
        raise ValueError("picks is empty: give at least one (frame index, label)")
    n = len(views)
    for k, _ in picks:
        check_int(k, "frame index", 0, n - 1, why=f"{n} frames")
    check_int(columns, "columns", 1)
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")
    pad, gap, label_h = 16, 14, 22
    columns = min(columns, len(picks))
    cache = {} if panel_cache is None else panel_cache
    for k, _ in picks:
        if (k, compact) not in cache:
            cache[(k, compact)] = render_view_svg(
                views[k], colours, total=n, legend_roles=legend_roles, request_ids=request_ids, legend=False,
                min_width=panel_width, compact=compact,
            )  # fmt: skip
    panels = [cache[(k, compact)] for k, _ in picks]
    sizes = [_nest(p, 0, 0, scale)[1:] for p in panels]
    col_w = max(w for w, _ in sizes)
    width = 2 * pad + columns * col_w + (columns - 1) * gap
    c = _Canvas()
    y = pad
    if title:
        c.add(_t(pad, y + 15, title, 16, weight="bold"))
        y += 24
    c.add(_t(pad, y + 12, f"{len(picks)} key frames of {n}; run the notebook to animate them all", 12, fill=MUTED))
    y += 24
    nested: list[str] = []
    for row in range(-(-len(picks) // columns)):
        row_items = list(range(row * columns, min(len(picks), (row + 1) * columns)))
        row_h = max(sizes[i][1] for i in row_items)
        for j, i in enumerate(row_items):
            k, label = picks[i]
            x = pad + j * (col_w + gap)
            c.add(f'<circle cx="{x + 10:.1f}" cy="{y + 9:.1f}" r="10" fill="{INK}"/>')
            c.add(_t(x + 10, y + 13.5, i + 1, 12, fill="#ffffff", weight="bold", anchor="middle"))
            c.add(_t(x + 26, y + 14, f"{label} (frame {k})", 13, weight="bold"))
            svg, w, h = _nest(panels[i], x, y + label_h, scale)
            nested.append(svg)
            c.add(f'<rect x="{x - 0.5:.1f}" y="{y + label_h - 0.5:.1f}" width="{w + 1:.1f}" height="{h + 1:.1f}" '
                  'fill="none" stroke="#dee2e6"/>')  # fmt: skip
        y += label_h + row_h + gap
    c.parts.extend(nested)
    y = draw_legend(c, y - gap, width, colours, request_ids, legend_roles, pad=pad)
    return _document(c, width, int(y), f"{title or 'block table'}: key frames {', '.join(str(k) for k, _ in picks)}")


def fit_filmstrip(
    views: Sequence[Mapping[str, Any]],
    colours: Mapping[str, list[str]],
    max_frames: int = DEFAULT_MAX_FRAMES,
    *,
    max_chars: int = MAX_SVG_CHARS,
    **kwargs: Any,
) -> tuple[str, list[tuple[int, str]]]:
    """``key_frames`` drawn by ``filmstrip_svg`` within a size budget; returns the SVG and the frames it shows.

    Full panels when the strip fits in ``max_chars`` characters; otherwise compact panels (the pool, the
    queues and the CPU pool, without the free queue and the block tables), with fewer frames if need be (the
    least telling dropped first), down to one. A notebook stores the picture beside every widget, so a trace
    of a large pool must not cost megabytes. Other keyword arguments go to ``filmstrip_svg``."""
    cache: dict[tuple[int, bool], str] = {}
    picks = key_frames(views, max_frames)
    svg = filmstrip_svg(views, colours, picks, panel_cache=cache, **kwargs)
    if len(svg) <= max_chars:
        return svg, picks
    for k in range(len(picks), 0, -1):
        picks = key_frames(views, k)
        svg = filmstrip_svg(views, colours, picks, compact=True, panel_cache=cache, **kwargs)
        if len(svg) <= max_chars:
            break
    return svg, picks


__all__ = ["DEFAULT_MAX_FRAMES", "KEY_MOMENTS", "MAX_SVG_CHARS", "PEAK", "filmstrip_svg", "fit_filmstrip", "key_frames"]
