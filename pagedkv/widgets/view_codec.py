"""The widget's wire format: a trace's views sent to the browser as the first frame whole, then each frame's
changes against the one before (``encode_views``); ``decode_views`` undoes it, the Python twin of
``decodeFrames`` in ``static/block_table.js``.

There is no vLLM counterpart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: View keys that usually change little between frames: sent as changes against the previous frame.
_DELTA_LISTS = ("ref", "hash", "owners")
#: View keys sent only when they differ from the previous frame's.
_WHEN_CHANGED = ("free", "waiting", "running", "cpu", "null", "grid", "block_size", "num_blocks")


def encode_views(views: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Compress a trace's views for the browser: the first frame whole, each later one as its changes.

    Per-block lists (``ref``, ``hash``, ``owners``) become ``d_<key>: [[block_id, value], ...]`` for the blocks
    that changed; tables become ``d_tables: [[row, block_ids, num_tokens(, group)], ...]`` while the rows
    tables stay the same; the free queue, queues and CPU pool are left out when unchanged. A frame whose
    pool size differs is sent whole (``full``). ``static/block_table.js`` (``decodeFrames``) and
    ``decode_views`` undo it. A 200-block, 900-frame scheduler trace shrinks about tenfold.
    """
    out: list[dict[str, Any]] = []
    prev: Mapping[str, Any] | None = None
    for v in views:
        if prev is None or v["num_blocks"] != prev["num_blocks"]:
            out.append({**v, "full": True})
        else:
            skip = {*_DELTA_LISTS, *_WHEN_CHANGED, "tables"}
            e: dict[str, Any] = {k: val for k, val in v.items() if k not in skip}
            for key in _DELTA_LISTS:
                changed = [[i, x] for i, (x, y) in enumerate(zip(v[key], prev[key], strict=True)) if x != y]
                if changed:
                    e["d_" + key] = changed
            for key in _WHEN_CHANGED:
                if v[key] != prev[key]:
                    e[key] = v[key]
            if [row[0] for row in v["tables"]] == [row[0] for row in prev["tables"]]:
                pairs = enumerate(zip(v["tables"], prev["tables"], strict=True))
                changed = [[i, *row[1:]] for i, (row, old) in pairs if row != old]
                if changed:
                    e["d_tables"] = changed  # [[row index, block ids, num_tokens], ...]
            else:
                e["tables"] = v["tables"]
            out.append(e)
        prev = v
    return out


def decode_views(encoded: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Undo ``encode_views`` (the Python twin of ``decodeFrames`` in ``static/block_table.js``)."""
    out: list[dict[str, Any]] = []
    for e in encoded:
        if e.get("full") or not out:
            out.append({k: v for k, v in e.items() if k != "full"})
            continue
        prev = out[-1]
        f = {k: v for k, v in e.items() if not k.startswith("d_")}
        for key in _DELTA_LISTS:
            values = list(prev[key])
            for i, x in e.get("d_" + key, []):
                values[i] = x
            f[key] = values
        for key in _WHEN_CHANGED:
            if key not in e:
                f[key] = prev[key]
        if "tables" not in e:
            tables = [list(row) for row in prev["tables"]]
            for i, *rest in e.get("d_tables", []):
                tables[i] = [tables[i][0], *rest]
            f["tables"] = tables
        out.append(f)
    return out
