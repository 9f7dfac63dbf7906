"""Draw one frame of a block-table trace as a standalone SVG (no JavaScript, no fonts to load).

The block-table widget puts this picture next to its live view, so a notebook exported to HTML, GitHub's
preview and any front end without widgets still show the state; lessons can draw any frame directly::

    from IPython.display import SVG
    SVG(frame_to_svg(recorder.frames, 5))        # frame 5 of a recorded trace
    SVG(frame_to_svg(recorder.frames[-1]))       # one frame on its own (colours from that frame alone)

What is drawn (the same encoding as the widget): the physical pool as a grid (colour = the owning request,
bands of colours = a block shared by several, big number = ``ref_cnt``, small number = block id, a dark
corner = cached, hatching = the null block, a ring and a label = what the current event did to the block);
each request's block table (logical index → physical block, the bar under each entry = how full it is);
the free queue from head to tail; the waiting and running queues and the CPU swap pool when the state has
them; a legend.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from pagedkv.utils import check_int
from pagedkv.widgets.frames import (
    KIND_ROLE,
    ROLES,
    plain,
    request_colours,
    request_order,
    roles_used,
    validate_frames,
    view_frame,
)

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"
INK = "#1b1f24"
MUTED = "#6a737d"
FREE_BG, FREE_EDGE = "#f1f3f5", "#ced4da"
CACHED_FREE_BG, CACHED_EDGE = "#f3f0ff", "#9775fa"
CACHE_MARK = "#343a40"
NULL_BG = "#868e96"
ORPHAN_BG = "#ced4da"
FQ_HEAD, FQ_TAIL = 30, 10  # free-queue entries drawn at the head and tail of a long queue
#: Stands for the SVG's id prefix while it is drawn; ``unique_ids`` replaces it by one derived from the content,
#: so that several pictures inlined in one page (VS Code, the classic notebook, a filmstrip) never share an id.
ID = "@PKV@"


_WHOLE = re.compile(r'="(-?\d+)\.0"')


def unique_ids(svg: str) -> str:
    """Replace the ``ID`` placeholder by ``pkv`` + a hash of the picture (deterministic, distinct per picture),
    and write whole-number attributes without their ``.0``."""
    svg = _WHOLE.sub(r'="\1"', svg)
    return svg.replace(ID, "pkv" + hashlib.sha1(svg.encode()).hexdigest()[:8])


def _t(x: float, y: float, text: Any, size: float = 12, *, fill: str = INK, weight: str = "normal",
       anchor: str = "start", extra: str = "") -> str:  # fmt: skip
    # SVG's defaults (normal weight, start anchor) are left out: pictures of large pools hold thousands of texts
    attrs = (f' font-weight="{weight}"' if weight != "normal" else "") + (
        f' text-anchor="{anchor}"' if anchor != "start" else "")  # fmt: skip
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size:.1f}" fill="{fill}"{attrs}{extra}>{escape(str(text))}</text>'
    )


def _w(text: str, size: float) -> float:
    """Rough width of ``text`` at ``size`` px (for layout only)."""
    return len(str(text)) * size * 0.6


class _Canvas:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.defs: list[str] = []
        self._clip = 0

    def add(self, s: str) -> None:
        self.parts.append(s)

    def clip(self, x: float, y: float, w: float, h: float, rx: float) -> str:
        self._clip += 1
        cid = f"{ID}c{self._clip}"
        rect = f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx:.1f}"/>'
        self.defs.append(f'<clipPath id="{cid}">{rect}</clipPath>')
        return cid


def _block(c: _Canvas, x: float, y: float, s: float, *, owners: list[str], ref: int, bid: int, cached: bool,
           null: bool, free: bool, colours: Mapping[str, list[str]], role: str | None, show_id: bool = True,
           label: str | None = None) -> None:  # fmt: skip
    """One block cell: fill by owner(s), ref_cnt, id, cached corner, null hatching, highlight ring."""
    rx = max(2.0, s * 0.12)
    edge = FREE_EDGE
    if null:
        c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s}" height="{s}" rx="{rx:.1f}" fill="url(#{ID}hatch)" '
              f'stroke="{NULL_BG}"/>')  # fmt: skip
    elif len(owners) == 1:  # one owner: one rounded rectangle (no clip path: smaller pictures)
        edge = "#ffffff"
        c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s}" height="{s}" rx="{rx:.1f}" '
              f'fill="{colours.get(owners[0], [NULL_BG])[0]}" stroke="{edge}" stroke-opacity="0.9"/>')  # fmt: skip
    elif owners:
        cid = c.clip(x, y, s, s, rx)
        band = s / len(owners)
        for i, rid in enumerate(owners):
            c.add(f'<rect x="{x + i * band:.1f}" y="{y:.1f}" width="{band + 0.5:.1f}" height="{s}" '
                  f'fill="{colours.get(rid, [NULL_BG])[0]}" clip-path="url(#{cid})"/>')  # fmt: skip
        edge = "#ffffff" if len(owners) == 1 else INK
        c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s}" height="{s}" rx="{rx:.1f}" fill="none" '
              f'stroke="{edge}" stroke-opacity="0.9" stroke-width="{1.5 if len(owners) > 1 else 1}"/>')  # fmt: skip
    elif not free and ref > 0:  # held but in no table (an event recorded mid-allocation)
        c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s}" height="{s}" rx="{rx:.1f}" fill="{ORPHAN_BG}"/>')
    else:
        bg, edge = (CACHED_FREE_BG, CACHED_EDGE) if cached else (FREE_BG, FREE_EDGE)
        dash = ' stroke-dasharray="3 2"' if cached else ""
        c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{s}" height="{s}" rx="{rx:.1f}" fill="{bg}" '
              f'stroke="{edge}"{dash}/>')  # fmt: skip
    if cached and not null:
        k = s * 0.3
        c.add(f'<path d="M{x + s - k:.1f},{y:.1f} L{x + s - rx * 0.3:.1f},{y:.1f} L{x + s:.1f},{y + rx * 0.3:.1f} '
              f'L{x + s:.1f},{y + k:.1f} Z" fill="{CACHE_MARK}"/>')  # fmt: skip
    text_fill = INK
    if len(owners) == 1:
        text_fill = colours.get(owners[0], ["", INK])[1]
    if label is None:
        label = "" if null or (ref == 0 and free) else str(ref)
    if label:
        size = s * (0.42 if len(label) < 3 else 0.32)
        if len(owners) > 1:
            pw = _w(label, size) + s * 0.18
            c.add(f'<rect x="{x + (s - pw) / 2:.1f}" y="{y + s * 0.3:.1f}" width="{pw:.1f}" height="{s * 0.46:.1f}" '
                  f'rx="{s * 0.1:.1f}" fill="#ffffff" fill-opacity="0.92"/>')  # fmt: skip
            text_fill = INK
        c.add(_t(x + s / 2, y + s * 0.5 + size * 0.36, label, size, fill=text_fill, weight="bold", anchor="middle"))
    if show_id and s >= 28:
        idc = "#ffffff" if null else (text_fill if owners else MUTED)
        c.add(_t(x + s * 0.1, y + s * 0.27, bid, s * 0.23, fill=idc, extra=' fill-opacity="0.8"'))
    if null and s >= 28:
        c.add(_t(x + s / 2, y + s * 0.68, "null", s * 0.24, fill="#ffffff", weight="bold", anchor="middle"))
    if role:
        colour, tag, _ = ROLES.get(role, ROLES["event"])
        c.add(f'<rect x="{x - 2.5:.1f}" y="{y - 2.5:.1f}" width="{s + 5}" height="{s + 5}" rx="{rx + 2:.1f}" '
              f'fill="none" stroke="{colour}" stroke-width="3"/>')  # fmt: skip
        if tag and s >= 28:
            tw = _w(tag, 9) + 6
            c.add(f'<rect x="{x + (s - tw) / 2:.1f}" y="{y + s - 4:.1f}" width="{tw:.1f}" height="12" rx="3" '
                  f'fill="{colour}"/>')  # fmt: skip
            c.add(_t(x + s / 2, y + s + 5, tag, 9, fill="#ffffff", weight="bold", anchor="middle"))


def _chip(c: _Canvas, x: float, y: float, text: str, colours: Mapping[str, list[str]], rid: str,
          ring: str | None = None, size: float = 12) -> float:  # fmt: skip
    """A request's name on its colour; returns the width used."""
    bg, fg = colours.get(rid, [NULL_BG, "#ffffff"])
    w = _w(text, size) + 12
    h = size + 8
    c.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h}" rx="{h / 2:.1f}" fill="{bg}"/>')
    if ring:
        c.add(f'<rect x="{x - 2:.1f}" y="{y - 2:.1f}" width="{w + 4:.1f}" height="{h + 4}" rx="{h / 2 + 2:.1f}" '
              f'fill="none" stroke="{ring}" stroke-width="2.5"/>')  # fmt: skip
    c.add(_t(x + w / 2, y + h / 2 + size * 0.36, text, size, fill=fg, weight="bold", anchor="middle"))
    return w


def _as_view(frame: Mapping[str, Any], index: int) -> dict[str, Any]:
    if "ref" in frame and "owners" in frame:  # already a view
        return dict(frame)
    validate_frames([frame])
    return view_frame(plain(frame), index)


def render_view_svg(view: Mapping[str, Any], colours: Mapping[str, list[str]], *, title: str = "",
                    total: int | None = None, legend_roles: Sequence[str] | None = None,
                    request_ids: Sequence[str] | None = None, legend: bool = True,
                    min_width: int = 720, compact: bool = False) -> str:  # fmt: skip
    """The SVG of one view (``frames.view_frame``); ``colours`` maps request id → [background, text].
    ``legend=False`` leaves the legend out (a filmstrip draws one for all its panels); ``min_width``: the
    narrowest picture (px) whatever the pool's size (long captions are cut to fit); ``compact=True`` leaves out
    the free queue and the block tables (a filmstrip of a large pool stays a few hundred KB)."""
    c = _Canvas()
    n = view["num_blocks"]
    cols, cell = view.get("grid") or (10, 40)
    gap = 6 if cell >= 28 else 3
    pad = 16
    rows = -(-n // cols)
    grid_w = cols * (cell + gap) - gap
    width = max(grid_w + 2 * pad, min_width)
    y = pad

    # Header: title, the event's kind and caption, the counters.
    if title:
        c.add(_t(pad, y + 14, title, 15, weight="bold"))
        y += 22
    kind = view.get("kind")
    x = pad
    badge = kind.replace("_", " ").upper() if kind else "START"
    colour = view.get("kind_colour") or ROLES[KIND_ROLE.get(str(kind), "event")][0]
    kw = len(badge) * 10 * 0.72 + 12
    c.add(f'<rect x="{x}" y="{y}" width="{kw:.1f}" height="17" rx="4" fill="{colour}"/>')
    c.add(_t(x + kw / 2, y + 12.5, badge, 10, fill="#ffffff", weight="bold", anchor="middle"))
    x += kw + 8
    caption = str(view.get("caption", ""))
    max_chars = int((width - x - pad) / (13 * 0.6))
    if len(caption) > max_chars:
        caption = caption[: max_chars - 1] + "…"
    c.add(_t(x, y + 13, caption, 13, weight="bold"))
    y += 24
    st = view["stats"]
    where = f"frame {view['index']}" + (f" (of 0–{total - 1})" if total else "")  # numbered as frames[k]
    if view.get("step") is not None:
        where += f" · step {view['step']}"
    c.add(_t(pad, y + 11, f"{where} · free {st['free']}/{st['usable']} blocks · usage {st['usage']:.0%} · "
             f"cached {st['cached']} ({st['cached_free']} evictable) · block_size {view['block_size']}",
             11.5, fill=MUTED))  # fmt: skip
    y += 26

    # The physical pool.
    c.add(_t(pad, y + 11, "GPU KV cache: physical blocks (colour = owner, number = ref_cnt)", 12, weight="bold"))
    y += 20
    hl = {int(b): r for b, r in view["hl"]}
    nulls = set(view["null"])
    free = set(view["free"])
    for bid in range(n):
        r, k = divmod(bid, cols)
        _block(
            c, pad + k * (cell + gap), y + r * (cell + gap), cell,
            owners=list(view["owners"][bid]), ref=view["ref"][bid], bid=bid, cached=view["hash"][bid] is not None,
            null=bid in nulls, free=bid in free, colours=colours, role=hl.get(bid),
        )  # fmt: skip
    y += rows * (cell + gap) - gap + 22

    actor = view.get("request_id")
    if compact:  # a filmstrip panel of a large pool: the grid and the queues only
        c.add(_t(pad, y + 11, f"free queue: {len(view['free'])} blocks · block tables of {len(view['tables'])} "
                 "requests: shown in the live widget", 11.5, fill=MUTED))  # fmt: skip
        y += 24
    else:
        # The free queue, head to tail.
        fq = list(view["free"])
        c.add(_t(pad, y + 11, f"free queue ({len(fq)}): head (reused next) → tail (evicted last)", 12, weight="bold"))
        y += 18
        fs, fgap = 24, 4
        per_row = max(1, int((width - 2 * pad + fgap) // (fs + fgap)))
        shown: list[int | None] = fq if len(fq) <= FQ_HEAD + FQ_TAIL + 1 else fq[:FQ_HEAD] + [None] + fq[-FQ_TAIL:]
        if not shown:
            c.add(_t(pad, y + 14, "(empty: every usable block is held)", 11.5, fill=MUTED))
            y += 24
        for i, bid in enumerate(shown):
            r, k = divmod(i, per_row)
            fx, fy = pad + k * (fs + fgap), y + r * (fs + fgap)
            if bid is None:
                c.add(_t(fx + fs / 2, fy + fs * 0.62, "…", 12, fill=MUTED, anchor="middle"))
                continue
            _block(c, fx, fy, fs, owners=[], ref=0, bid=bid, cached=view["hash"][bid] is not None, null=False,
                   free=True, colours=colours, role=hl.get(bid), show_id=False, label=str(bid))  # fmt: skip
        if shown:
            y += (-(-len(shown) // per_row)) * (fs + fgap) + 16

        # Block tables: logical index -> physical block.
        c.add(_t(pad, y + 11, "block tables: logical block → physical block (bar = slots filled)", 12, weight="bold"))
        y += 20
        bs = max(1, view["block_size"])
        ts, tgap = 26, 4
        label_w = 96
        per_row = max(1, int((width - 2 * pad - label_w + tgap) // (ts + tgap)))
        if not view["tables"]:
            c.add(_t(pad, y + 12, "(no request holds blocks)", 11.5, fill=MUTED))
            y += 22
        for rid, ids, ntok, *group in view["tables"]:
            ring = INK if rid in (actor, view.get("parent")) else None
            _chip(c, pad, y + 12, rid, colours, rid, ring=ring)
            c.add(_t(pad, y + 44, f"{ntok} tokens" if ntok else "", 10, fill=MUTED))
            if group:  # one table per KV cache group: say which
                c.add(_t(pad, y + 56, group[0], 10, fill=MUTED, extra=' font-style="italic"'))
            for i, bid in enumerate(ids):
                r, k = divmod(i, per_row)
                tx, ty = pad + label_w + k * (ts + tgap), y + 10 + r * (ts + 16)
                c.add(_t(tx + ts / 2, ty - 5, i, 8.5, fill=MUTED, anchor="middle"))
                _block(c, tx, ty, ts, owners=[rid], ref=view["ref"][bid], bid=bid, cached=view["hash"][bid] is not None,
                       null=bid in nulls, free=False, colours=colours, role=hl.get(bid), show_id=False,
                       label=str(bid))  # fmt: skip
                filled = min(bs, max(0, ntok - i * bs)) if ntok else 0
                c.add(f'<rect x="{tx:.1f}" y="{ty + ts + 2:.1f}" width="{ts}" height="3" fill="#e9ecef"/>')
                if filled:
                    c.add(f'<rect x="{tx:.1f}" y="{ty + ts + 2:.1f}" width="{ts * filled / bs:.1f}" height="3" '
                          f'fill="{colours.get(rid, [INK])[0]}"/>')  # fmt: skip
                if view["ref"][bid] > 1:
                    c.add(_t(tx + ts - 1.5, ty + ts - 2, f"×{view['ref'][bid]}", 7.5,
                             fill=colours.get(rid, ["", INK])[1], weight="bold", anchor="end"))  # fmt: skip
            nrows = max(1, -(-len(ids) // per_row))
            y += max(62 if group else 50, 10 + nrows * (ts + 16)) + 4

    # Scheduler queues and the CPU swap pool.
    if view.get("running") is not None:
        y += 6
        for name in ("running", "waiting"):
            c.add(_t(pad, y + 15, name, 12, weight="bold"))
            x = pad + 70
            reqs = view[name] or []
            if not reqs:
                c.add(_t(x, y + 15, "(empty)", 11.5, fill=MUTED))
            scheduled = view.get("scheduled") or {}
            for rid in reqs:
                ring = ROLES["preempt"][0] if (rid == actor and kind == "preempt") else (INK if rid == actor else None)
                text = f"{rid} +{scheduled[rid]}" if rid in scheduled else rid
                x += _chip(c, x, y + 2, text, colours, rid, ring=ring) + 6
            y += 28
    cpu = view.get("cpu")
    if cpu:
        y += 6
        c.add(_t(pad, y + 11, f"CPU swap space ({len(cpu['free'])} of {cpu['num_blocks']} free)", 12, weight="bold"))
        y += 18
        cs = 22
        per_row = max(1, int((width - 2 * pad + 4) // (cs + 4)))
        cpu_hl = {int(b): r for b, r in view["cpu_hl"]}
        for bid in range(cpu["num_blocks"]):
            r, k = divmod(bid, per_row)
            owners = cpu["owners"][bid]
            _block(c, pad + k * (cs + 4), y + r * (cs + 4), cs, owners=owners, ref=len(owners), bid=bid,
                   cached=False, null=False, free=not owners, colours=colours, role=cpu_hl.get(bid),
                   show_id=False, label=str(bid))  # fmt: skip
        y += (-(-cpu["num_blocks"] // per_row)) * (cs + 4) + 12

    if legend:
        y = draw_legend(c, y, width, colours, request_ids, legend_roles)
    else:
        y += pad
    return _document(c, width, int(y), f"{title or 'block table'}: {view.get('caption', '')}")


def draw_legend(c: _Canvas, y: float, width: float, colours: Mapping[str, list[str]],
                request_ids: Sequence[str] | None, legend_roles: Sequence[str] | None,
                pad: float = 16) -> float:  # fmt: skip
    """The legend (requests, block kinds, highlight roles) below ``y``, across ``width``; returns the new ``y``."""
    y += 8
    c.add(f'<line x1="{pad}" y1="{y}" x2="{width - pad}" y2="{y}" stroke="#dee2e6"/>')
    y += 10
    x = pad
    for rid in request_ids if request_ids is not None else list(colours):
        w = _w(rid, 11) + 12
        if x + w > width - pad:
            x, y = pad, y + 24
        x += _chip(c, x, y, rid, colours, rid, size=11) + 6
    y += 28
    x = pad
    items: list[tuple[str, dict[str, Any]]] = [
        ("free", {"owners": [], "free": True, "cached": False}),
        ("free, cached (evictable)", {"owners": [], "free": True, "cached": True}),
        ("held, cached", {"owners": ["__legend__"], "free": False, "cached": True}),
        ("shared (ref_cnt > 1)", {"owners": ["__a__", "__b__"], "free": False, "cached": False}),
        ("null block", {"owners": [], "free": False, "cached": False, "null": True}),
    ]
    legend_colours = dict(colours)
    legend_colours.update({"__legend__": ["#adb5bd", INK], "__a__": ["#adb5bd", INK], "__b__": ["#dee2e6", INK]})
    for text, kw in items:
        w = 18 + 6 + _w(text, 11) + 14
        if x + w > width - pad:
            x, y = pad, y + 26
        _block(c, x, y, 18, ref=2 if len(kw["owners"]) > 1 else (1 if kw["owners"] else 0), bid=0,
               colours=legend_colours, role=None, show_id=False, null=kw.get("null", False),
               owners=kw["owners"], free=kw["free"], cached=kw["cached"])  # fmt: skip
        c.add(_t(x + 24, y + 13, text, 11))
        x += w
    y += 26
    x = pad
    for role in legend_roles if legend_roles is not None else list(ROLES):
        colour, _, text = ROLES[role]
        if not text:
            continue
        w = 18 + 6 + _w(text, 11) + 14
        if x + w > width - pad:
            x, y = pad, y + 24
        c.add(f'<rect x="{x + 1.5}" y="{y + 1.5}" width="15" height="15" rx="3" fill="{FREE_BG}" stroke="{colour}" '
              f'stroke-width="3"/>')  # fmt: skip
        c.add(_t(x + 24, y + 13, text, 11))
        x += w
    return y + 24 + pad


def _document(c: _Canvas, width: float, height: int, label: str) -> str:
    """Wrap the canvas into a standalone SVG document (with its defs, ids made unique)."""
    defs = (
        f'<pattern id="{ID}hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        f'<rect width="6" height="6" fill="{NULL_BG}"/><line x1="0" y1="0" x2="0" y2="6" stroke="#495057" '
        'stroke-width="3"/></pattern>' + "".join(c.defs)
    )
    return unique_ids(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="pkv-static-svg" width="{width:g}" height="{height}" '
        f'viewBox="0 0 {width:g} {height}" font-family="{escape(FONT)}" role="img" aria-label="{escape(label)}">'
        f"<defs>{defs}</defs>"
        f'<rect width="{width:g}" height="{height}" fill="#ffffff"/>' + "".join(c.parts) + "</svg>"
    )


def frame_to_svg(
    frames: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    index: int = -1,
    *,
    title: str = "",
) -> str:
    """Draw one frame as an SVG string.

    ``frames`` is a recorder's frame list (``TraceRecorder.frames``; colours then follow the whole trace, as
    in the widget) and ``index`` picks the frame (negative counts from the end); or ``frames`` is one frame
    (``{"event": ..., "state": ...}``). Raises ``ValueError`` on frames of the wrong shape or an index out
    of range.
    """
    if isinstance(frames, Mapping):
        view = _as_view(frames, 0)
        ids = request_order([frames]) if "state" in frames else sorted({r for o in view["owners"] for r in o})
        return render_view_svg(view, request_colours(ids), title=title, request_ids=ids,
                               legend_roles=roles_used([view]))  # fmt: skip
    validate_frames(frames)
    check_int(index, "frame index", -len(frames), len(frames) - 1, why=f"{len(frames)} frames")
    k = index % len(frames)
    ids = request_order(frames)
    view = view_frame(plain(frames[k]), k)
    return render_view_svg(view, request_colours(ids), title=title, total=len(frames), request_ids=ids,
                           legend_roles=roles_used([view]))  # fmt: skip
