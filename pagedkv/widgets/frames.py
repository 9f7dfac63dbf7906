"""Frames as the block-table widget and the SVG renderer see them: one view-model, shared by both.

A *frame* is what ``TraceRecorder`` stores for each event: ``{"event": TraceEvent.to_dict() or None,
"state": KVCacheManager.snapshot() or Scheduler.snapshot()}``. ``view_frame`` turns one into the flat
plain data that both the browser (``static/block_table.js``) and ``svg.frame_to_svg`` draw from: who owns
each block, which blocks the event touched and in what role, the free queue, the tables, the queues and
the CPU pool. Computing all of that once, in Python, keeps the live widget and its static picture in
agreement.

There is no vLLM counterpart; the state shown is that of ``vllm/v1/core/block_pool.py`` and
``vllm/v1/core/sched/scheduler.py``.
"""

from __future__ import annotations

import colorsys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Re-exported: the wire format lived here before it had a module of its own.
from pagedkv.utils import check_int, is_int
from pagedkv.widgets.view_codec import decode_views as decode_views
from pagedkv.widgets.view_codec import encode_views as encode_views

#: Request colours, in order of first appearance (Tableau 10 without its grey, then lighter companions).
PALETTE: tuple[str, ...] = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#499894", "#a0cbe8", "#ffbe7d", "#8cd17d", "#f1ce63", "#d4a6c8", "#d7b5a6",
)  # fmt: skip

#: Highlight roles: the ring colour drawn round a block the current event touched, its short tag, and the
#: legend's wording ("" when another role's legend entry covers it).
ROLES: dict[str, tuple[str, str, str]] = {
    "alloc": ("#2f9e44", "new", "new: just allocated"),
    "hit": ("#1971c2", "hit", "hit: prefix-cache hit"),
    "cache": ("#7048e8", "cached", "cached: just hashed"),
    "evict": ("#e03131", "evict", "evict: hash dropped for reuse"),
    "free": ("#f59f00", "freed", "freed: ref_cnt − 1"),
    "copy-src": ("#d6336c", "src", "src → dst: copy-on-write"),
    "copy-dst": ("#d6336c", "dst", ""),
    "share": ("#0c8599", "shared", "shared: forked"),
    "preempt": ("#c92a2a", "preempt", "preempt: victim's blocks"),
    "swap-out": ("#8d5524", "out", "out / in: swapped to / from CPU"),
    "swap-in": ("#8d5524", "in", ""),
    "event": ("#212529", "", ""),
}

#: The role each event kind gives to its ``block_ids`` (copy and swaps are special-cased below).
KIND_ROLE: dict[str, str] = {
    "allocate": "alloc",
    "touch": "hit",
    "cache": "cache",
    "evict": "evict",
    "free": "free",
    "finish": "free",
    "fork": "share",
    "reset": "evict",
    "preempt": "preempt",
    "copy": "copy-dst",
    "swap_out": "swap-out",
    "swap_in": "swap-in",
}

REQUIRED_STATE_KEYS = ("num_blocks", "blocks", "free_queue", "block_tables")


def plain(obj: Any) -> Any:
    """A deep copy made of JSON types only (tuples become lists, keys become strings)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(plain(v) for v in obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        return plain(obj.item())
    return str(obj)


def validate_frames(frames: Sequence[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` naming the first frame that is not ``{"event": dict | None, "state": {...}}``."""
    if isinstance(frames, (str, bytes)) or not isinstance(frames, Sequence):
        raise ValueError(f"frames must be a list of frames, got {type(frames).__name__}")
    if len(frames) == 0:
        raise ValueError("frames is empty: record at least one frame (TraceRecorder stores an initial one)")
    for k, frame in enumerate(frames):
        if not isinstance(frame, Mapping) or "state" not in frame:
            raise ValueError(f"frame {k} must be a dict with a 'state' key (and 'event'), got {frame!r:.80}")
        state = frame["state"]
        missing = [key for key in REQUIRED_STATE_KEYS if not isinstance(state, Mapping) or key not in state]
        if missing:
            raise ValueError(f"frame {k}: state lacks {missing} (expected KVCacheManager.snapshot()'s shape)")
        _check_state(state, k)
        event = frame.get("event")
        if event is not None and not isinstance(event, Mapping):
            raise ValueError(f"frame {k}: event must be a dict (TraceEvent.to_dict()) or None, got {event!r:.80}")


def _check_state(state: Mapping[str, Any], k: int) -> None:
    """Frame ``k``'s snapshot has the types ``KVCacheManager.snapshot()`` gives, and every block id it names lies in
    the pool: a malformed one fails here, naming the frame and the field, not later as a KeyError while drawing
    (or drawn with a block the pool does not have)."""
    num_blocks = check_int(state["num_blocks"], f"frame {k}: state['num_blocks']", 1)
    blocks = state["blocks"]
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence) or len(blocks) != num_blocks:
        got = len(blocks) if isinstance(blocks, Sequence) else type(blocks).__name__
        raise ValueError(f"frame {k}: state has {got} blocks but num_blocks is {num_blocks}")
    for b in blocks:  # a snapshot's blocks are dicts of plain ints: checked at C speed first (pools of 20,000)
        try:
            fields = (b["block_id"], b["ref_cnt"])
        except (TypeError, KeyError, IndexError):
            fields = None
        if fields is None or not (type(fields[0]) is int is type(fields[1]) or all(map(is_int, fields))):
            raise ValueError(f"frame {k}: each block must be a dict with int 'block_id' and 'ref_cnt' "
                             f"(KVCacheManager.snapshot()), got {b!r:.80}")

    def ids(where: str, value: Any) -> None:
        ok = not isinstance(value, (str, bytes)) and isinstance(value, Sequence)
        if ok and value and not (set(map(type, value)) <= {int} and 0 <= min(value) and max(value) < num_blocks):
            ok = all(is_int(x) and 0 <= x < num_blocks for x in value)
        if not ok:
            raise ValueError(f"frame {k}: {where} must be a list of block ids in 0..{num_blocks - 1}, "
                             f"got {value!r:.80}")

    ids("state['free_queue']", state["free_queue"])
    tables = state["block_tables"]
    if not isinstance(tables, Mapping):
        raise ValueError(f"frame {k}: state['block_tables'] must be a dict of request id -> block ids, "
                         f"got {type(tables).__name__}")
    for rid, table in tables.items():
        ids(f"the block table of {rid!r}", table)
    per_group = state.get("group_block_tables")
    if per_group is not None:
        if not isinstance(per_group, Mapping):
            raise ValueError(f"frame {k}: state['group_block_tables'] must be a dict, got {type(per_group).__name__}")
        for rid, group_tables in per_group.items():
            if isinstance(group_tables, (str, bytes)) or not isinstance(group_tables, Sequence):
                raise ValueError(f"frame {k}: the group tables of {rid!r} must be a list, got {group_tables!r:.80}")
            for g, table in enumerate(group_tables):
                ids(f"group {g}'s block table of {rid!r}", table)


def group_label(group: Mapping[str, Any]) -> str:
    """A KV cache group's short name: ``"full"`` or ``"window 8"``."""
    if group.get("kind") == "sliding_window":
        return f"window {group.get('sliding_window')}"
    return "full"


def table_rows(state: Mapping[str, Any]) -> list[tuple[str, list[int], str]]:
    """``(request id, block ids, group label)`` per table: one per request, or, in the snapshot of a manager
    with several KV cache groups (or a sliding-window one), one per request and group (label ``""`` when
    there is one full-attention group)."""
    groups = state.get("groups")
    tables = state.get("group_block_tables")
    if not groups or tables is None or (len(groups) == 1 and groups[0].get("kind") != "sliding_window"):
        return [(str(rid), [int(x) for x in ids], "") for rid, ids in state["block_tables"].items()]
    labels = [group_label(g) for g in groups]
    return [
        (str(rid), [int(x) for x in ids], labels[g])
        for rid, per_group in tables.items()
        for g, ids in enumerate(per_group)
    ]


def block_owners(state: Mapping[str, Any]) -> dict[int, list[str]]:
    """Block id → the requests whose block table (in any group) holds it, in table order of the requests.
    The null block has no owner."""
    nulls = {int(b["block_id"]) for b in state.get("blocks", []) if b.get("null")}
    owners: dict[int, list[str]] = {}
    for rid, ids, _ in table_rows(state):
        for bid in ids:
            if int(bid) in nulls:
                continue
            holders = owners.setdefault(int(bid), [])
            if rid not in holders:
                holders.append(str(rid))
    return owners


def request_order(frames: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every request id in the trace, in order of first appearance (this fixes each request's colour)."""
    seen: dict[str, None] = {}
    for frame in frames:
        state = frame["state"]
        names: list[Any] = list(state.get("running") or []) + list(state.get("waiting") or [])
        names += list(state["block_tables"])
        cpu = state.get("cpu") or {}
        names += list(cpu.get("block_tables") or {})
        event = frame.get("event") or {}
        if event.get("request_id") is not None:
            names.append(event["request_id"])
        parent = (event.get("data") or {}).get("parent")
        if parent is not None:
            names.append(parent)
        for name in names:
            seen.setdefault(str(name), None)
    return list(seen)


def _text_on(colour: str) -> str:
    r, g, b = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#1b1f24" if luminance > 0.55 else "#ffffff"


def request_colours(request_ids: Sequence[str]) -> dict[str, list[str]]:
    """Request id → ``[background, text]`` colours: the palette first, then golden-angle hues."""
    colours: dict[str, list[str]] = {}
    for i, rid in enumerate(request_ids):
        if i < len(PALETTE):
            bg = PALETTE[i]
        else:
            r, g, b = colorsys.hls_to_rgb(((i - len(PALETTE)) * 0.381966) % 1.0, 0.62, 0.55)
            bg = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
        colours[rid] = [bg, _text_on(bg)]
    return colours


def highlights(event: Mapping[str, Any] | None) -> tuple[list[list[Any]], list[list[Any]]]:
    """The GPU and CPU blocks the event touched, as ``[[block_id, role], ...]`` (roles in ``ROLES``)."""
    if not event:
        return [], []
    kind = event.get("kind")
    data = event.get("data") or {}
    ids = [int(b) for b in event.get("block_ids") or []]
    gpu: dict[int, str] = {}
    cpu: dict[int, str] = {}
    if kind == "copy":
        src = data.get("src", ids[0] if ids else None)
        dst = data.get("dst", ids[1] if len(ids) > 1 else None)
        if src is not None:
            gpu[int(src)] = "copy-src"
        if dst is not None:
            gpu[int(dst)] = "copy-dst"
    elif kind in ("swap_out", "swap_in") and data.get("pairs"):
        role = KIND_ROLE[kind]
        for a, b in data["pairs"]:
            g, c = (a, b) if kind == "swap_out" else (b, a)
            gpu[int(g)] = role
            cpu[int(c)] = role
    else:
        role = KIND_ROLE.get(str(kind), "event")
        for bid in ids:
            gpu[bid] = role
    return [[b, r] for b, r in gpu.items()], [[b, r] for b, r in cpu.items()]


def _caption(frame: Mapping[str, Any], index: int, state: Mapping[str, Any]) -> str:
    event = frame.get("event")
    if frame.get("caption"):
        text = str(frame["caption"])
    elif event:
        text = event.get("caption") or f"{event.get('kind')} {event.get('request_id') or ''}".strip()
    else:
        usable = state["num_blocks"] - sum(1 for b in state["blocks"] if b.get("null"))
        text = f"initial state: {len(state['free_queue'])} of {usable} usable blocks free"
    return text


def _str_or_none(x: Any) -> str | None:
    return None if x is None else str(x)


def view_frame(frame: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    """One frame as the flat plain data the widget's JavaScript and ``frame_to_svg`` draw."""
    state = frame["state"]
    event = frame.get("event") or None
    blocks = state["blocks"]
    owners = block_owners(state)
    num_tokens = state.get("num_tokens") or {}
    hl, cpu_hl = highlights(event)
    nulls = [int(b["block_id"]) for b in blocks if b.get("null")]
    usable = len(blocks) - len(nulls)
    free = [int(b) for b in state["free_queue"]]
    free_set = set(free)
    # A cached block's short hash; "cached" when the snapshot marks it cached without giving the hash.
    hashes = [(b.get("hash") or "cached") if (b.get("cached") or b.get("hash") is not None) else None for b in blocks]
    view: dict[str, Any] = {
        "index": index,
        "kind": event.get("kind") if event else None,
        "kind_colour": ROLES[KIND_ROLE.get(str(event.get("kind")), "event")][0] if event else "#495057",
        "request_id": _str_or_none(event.get("request_id")) if event else None,
        "parent": _str_or_none((event.get("data") or {}).get("parent")) if event else None,
        "caption": _caption(frame, index, state),
        "block_size": int(state.get("block_size") or 0),
        "num_blocks": int(state["num_blocks"]),
        "grid": list(grid_shape(int(state["num_blocks"]))),
        "ref": [int(b["ref_cnt"]) for b in blocks],
        "hash": [None if h is None else str(h) for h in hashes],
        "null": nulls,
        "owners": [owners.get(int(b["block_id"]), []) for b in blocks],
        # [request id, block ids, tokens, (group label: only with KV cache groups)]
        "tables": [
            [rid, ids, int(num_tokens.get(rid, 0)), *([group] if group else [])]
            for rid, ids, group in table_rows(state)
        ],
        "free": free,
        "hl": hl,
        "cpu_hl": cpu_hl,
        "stats": {
            "usable": usable,
            "free": len(free),
            "held": usable - len(free),
            "cached": sum(1 for h in hashes if h is not None),
            "cached_free": sum(
                1 for b, h in zip(blocks, hashes, strict=True) if h is not None and b["block_id"] in free_set
            ),
            "usage": (usable - len(free)) / usable if usable else 0.0,
        },
        "waiting": None,
        "running": None,
        "cpu": None,
        "step": None,
        "scheduled": None,  # on a "schedule" event: request id -> tokens scheduled this step
    }
    if "waiting" in state or "running" in state:
        view["waiting"] = [str(r) for r in state.get("waiting") or []]
        view["running"] = [str(r) for r in state.get("running") or []]
    if event and event.get("kind") == "schedule":
        tokens = (event.get("data") or {}).get("num_scheduled_tokens") or {}
        view["scheduled"] = {str(r): int(n) for r, n in tokens.items()}
    if state.get("step") is not None:
        view["step"] = int(state["step"])
    cpu = state.get("cpu")
    if cpu and int(cpu.get("num_blocks") or 0) > 0:
        cpu_owners: dict[int, list[str]] = {}
        for rid, ids in (cpu.get("block_tables") or {}).items():
            for bid in ids:
                cpu_owners.setdefault(int(bid), []).append(str(rid))
        n = int(cpu["num_blocks"])
        view["cpu"] = {
            "num_blocks": n,
            "owners": [cpu_owners.get(i, []) for i in range(n)],
            "tables": [[str(r), [int(x) for x in ids]] for r, ids in (cpu.get("block_tables") or {}).items()],
            "free": [int(x) for x in cpu.get("free") or []],
        }
    return view


def view_frames(frames: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``view_frame`` over a whole trace, after checking its shape."""
    validate_frames(frames)
    return [view_frame(f, k) for k, f in enumerate(frames)]


def roles_used(views: Iterable[Mapping[str, Any]]) -> list[str]:
    """Highlight roles that occur in these frames, in ``ROLES`` order (for a compact legend)."""
    pairs = {"copy-dst": "copy-src", "swap-in": "swap-out"}  # one legend entry covers both
    used = {pairs.get(r, r) for v in views for _, r in list(v["hl"]) + list(v["cpu_hl"])}
    return [r for r in ROLES if r in used]


def grid_shape(num_blocks: int) -> tuple[int, int]:
    """Columns and cell size (px) for a pool of ``num_blocks``: about 2.5 : 1, cells shrink as it grows."""
    cols = max(1, min(num_blocks, max(8, round((num_blocks * 2.5) ** 0.5))))
    if num_blocks <= 64:
        cell = 40
    elif num_blocks <= 160:
        cell = 30
    elif num_blocks <= 400:
        cell = 22
    else:
        cell = 14
    return cols, cell
