"""The block-table widget's Python side: recorded frames, the view-model, the SVG picture, the mime bundle,
and the static picture surviving an nbconvert HTML export. (The browser side: tests/test_browser.py.)"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pagedkv import EventTrace, KVCacheManager, Request
from pagedkv.widgets import BlockTableWidget, TraceRecorder, block_owners, frame_to_svg, view_frame, view_frames
from pagedkv.widgets.filmstrip import MAX_SVG_CHARS, filmstrip_svg, fit_filmstrip, key_frames
from pagedkv.widgets.frames import ROLES, decode_views, grid_shape, request_colours, request_order, roles_used

REPO = Path(__file__).resolve().parents[1]
DEMO_NOTEBOOK = REPO / "tests" / "browser" / "block_table_demo.ipynb"
STATIC = REPO / "pagedkv" / "widgets" / "static"


# --------------------------------------------------------------------------------------------------
# A known trace: 12 blocks of 4 tokens; a prefix hit, a fork with copy-on-write, a free, an eviction.
# --------------------------------------------------------------------------------------------------
def _prefill(m: KVCacheManager, req: Request) -> None:
    hits, n = m.get_computed_blocks(req)
    assert m.allocate_slots(req, req.num_tokens - n, hits) is not None
    req.num_computed_tokens = req.num_tokens


def _decode(m: KVCacheManager, req: Request, token: int) -> None:
    req.append_output_token_ids(token)
    assert m.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1


def demo_trace() -> TraceRecorder:
    m = KVCacheManager(num_blocks=12, block_size=4)
    rec = TraceRecorder(m)
    system = list(range(100, 108))  # two full blocks shared by A and B
    a = Request("A", system + [1, 2, 3])  # 11 tokens: blocks 1, 2 full, 3 partly
    b = Request("B", system + [7, 8, 9, 10, 11])  # 13 tokens
    _prefill(m, a)
    _prefill(m, b)
    c = Request("C", list(a.all_token_ids))
    m.fork(a, c)
    _decode(m, a, 5)  # A writes into the shared block 3: copy-on-write
    for t in range(4):
        _decode(m, b, 20 + t)
    m.free(b)
    d = Request("D", list(range(200, 226)))  # 26 tokens = 7 blocks: the whole free queue
    _prefill(m, d)
    rec.detach()
    return rec


@pytest.fixture(scope="module")
def rec() -> TraceRecorder:
    return demo_trace()


def find(frames: list[dict[str, Any]], kind: str, request_id: str | None = None, nth: int = 0) -> int:
    """Index of the nth frame whose event is ``kind`` (for ``request_id``)."""
    hits = [
        k
        for k, f in enumerate(frames)
        if f["event"] and f["event"]["kind"] == kind and (request_id is None or f["event"]["request_id"] == request_id)
    ]
    assert len(hits) > nth, f"no {kind!r} event #{nth} for {request_id!r}; kinds: {[_kind(f) for f in frames]}"
    return hits[nth]


def _kind(frame: dict[str, Any]) -> str | None:
    return frame["event"]["kind"] if frame["event"] else None


def refs(frame: dict[str, Any]) -> list[int]:
    return [b["ref_cnt"] for b in frame["state"]["blocks"]]


def cached(frame: dict[str, Any]) -> set[int]:
    return {b["block_id"] for b in frame["state"]["blocks"] if b["cached"]}


# --------------------------------------------------------------------------------------------------
# Frames from the recorder
# --------------------------------------------------------------------------------------------------
def test_initial_frame_is_the_empty_pool(rec: TraceRecorder) -> None:
    f0 = rec.frames[0]
    assert f0["event"] is None
    assert f0["state"]["free_queue"] == list(range(1, 12))
    assert f0["state"]["block_tables"] == {}
    assert refs(f0) == [0] * 12
    assert [b["null"] for b in f0["state"]["blocks"]] == [True] + [False] * 11
    assert view_frame(f0, 0)["caption"] == "initial state: 11 of 11 usable blocks free"


def test_frames_follow_the_known_trace(rec: TraceRecorder) -> None:
    fr = rec.frames
    k = find(fr, "allocate", "A")
    assert fr[k]["state"]["block_tables"] == {"A": [1, 2, 3]}
    assert refs(fr[k])[:5] == [0, 1, 1, 1, 0]
    assert fr[k]["state"]["free_queue"] == list(range(4, 12))

    k = find(fr, "cache", "A")
    assert cached(fr[k]) == {1, 2}, "only A's two full blocks are cached, not the partly filled one"

    k = find(fr, "touch", "B")  # B hits A's two prefix blocks
    assert fr[k]["event"]["block_ids"] == [1, 2]
    assert fr[k]["state"]["block_tables"]["B"] == [1, 2]
    assert refs(fr[k])[1:4] == [2, 2, 1]
    assert block_owners(fr[k]["state"])[1] == ["A", "B"]

    k = find(fr, "allocate", "B")
    assert fr[k]["state"]["block_tables"]["B"] == [1, 2, 4, 5]
    assert fr[k]["state"]["free_queue"] == list(range(6, 12))

    k = find(fr, "fork", "C")
    assert fr[k]["state"]["block_tables"]["C"] == [1, 2, 3]
    assert refs(fr[k])[1:4] == [3, 3, 2]
    assert block_owners(fr[k]["state"])[3] == ["A", "C"]

    k = find(fr, "copy", "A")  # A's write into shared block 3 gives it block 6, the head of the free queue
    st = fr[k]["state"]
    assert st["block_tables"]["A"] == [1, 2, 6] and st["block_tables"]["C"] == [1, 2, 3]
    assert refs(fr[k])[3] == 1 and refs(fr[k])[6] == 1
    assert sorted(view_frame(fr[k], k)["hl"]) == [[3, "copy-src"], [6, "copy-dst"]]

    k = find(fr, "free", "B")  # reverse order [7, 5, 4, 2, 1]: 7 (no hash) to the head, 5 and 4 to the tail
    assert fr[k]["event"]["block_ids"] == [7, 5, 4, 2, 1]
    assert fr[k]["state"]["free_queue"] == [7, 8, 9, 10, 11, 5, 4]
    assert refs(fr[k])[1:3] == [2, 2]
    assert "B" not in fr[k]["state"]["block_tables"]
    v = view_frame(fr[k], k)
    assert v["stats"]["cached_free"] == 2 and v["stats"]["free"] == 7

    # D pops 5 then 4: both lose their hash; the evictions are recorded once the blocks sit in D's table
    e1, e2 = find(fr, "evict", nth=0), find(fr, "evict", nth=1)
    assert (fr[e1]["event"]["block_ids"], fr[e2]["event"]["block_ids"]) == ([5], [4])
    assert fr[e1]["event"]["request_id"] == "D" and fr[e1]["state"]["block_tables"]["D"][-2:] == [5, 4]
    assert 5 not in cached(fr[e1]) and 4 not in cached(fr[e1])

    last = fr[-1]
    assert last["state"]["block_tables"] == {"A": [1, 2, 6], "C": [1, 2, 3], "D": [7, 8, 9, 10, 11, 5, 4]}
    assert last["state"]["free_queue"] == []
    assert refs(last) == [0, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_every_frame_keeps_the_pool_invariants(rec: TraceRecorder) -> None:
    """In every complete frame: a free block has ref_cnt 0; a held one has ref_cnt = its number of tables."""
    for k, f in enumerate(rec.frames):
        st = f["state"]
        owners = block_owners(st)
        counts = {bid: sum(ids.count(bid) for ids in st["block_tables"].values()) for bid in owners}
        for b in st["blocks"][1:]:
            if b["block_id"] in st["free_queue"]:
                assert b["ref_cnt"] == 0, (k, b)
            else:
                assert b["ref_cnt"] == counts.get(b["block_id"], 0) > 0, (k, b)


def test_frames_are_plain_json(rec: TraceRecorder) -> None:
    assert json.loads(json.dumps(rec.frames)) == rec.frames
    views = view_frames(rec.frames)
    assert json.loads(json.dumps(views)) == views


def test_recorder_options_and_errors() -> None:
    m = KVCacheManager(num_blocks=6, block_size=2)
    with pytest.raises(ValueError, match="snapshot"):
        TraceRecorder(object())
    with pytest.raises(ValueError, match="unknown event kinds"):
        TraceRecorder(m, kinds={"allocate", "explode"})
    with pytest.raises(ValueError, match="max_frames"):
        TraceRecorder(m, max_frames=0)
    assert m.trace is None, "a refused recorder must not attach"

    with TraceRecorder(m, kinds={"allocate"}) as rec:
        r = Request("r", [1, 2, 3])
        m.allocate_slots(r, 3)
        rec.note("r prefilled")
        m.free(r)
    assert [_kind(f) for f in rec.frames] == [None, "allocate", "note"]
    assert view_frame(rec.frames[2])["caption"] == "r prefilled"
    assert m.trace is None, "detach() removes the trace the recorder set"
    m.allocate_slots(Request("s", [1]), 1)
    assert len(rec.frames) == 3, "nothing is recorded after detach()"

    # An existing trace is listened to, not replaced.
    trace = EventTrace()
    m2 = KVCacheManager(num_blocks=6, block_size=2)
    m2.set_trace(trace)
    rec2 = TraceRecorder(m2, caption="start")
    m2.allocate_slots(Request("x", [1, 2]), 2)
    rec2.detach()
    assert m2.trace is trace and len(trace) == 2 and len(rec2) == 3
    assert view_frame(rec2.frames[0])["caption"] == "start"

    with pytest.warns(UserWarning, match="max_frames"):
        rec3 = TraceRecorder(KVCacheManager(num_blocks=20, block_size=1), max_frames=3)
        for i in range(4):
            rec3.target.allocate_slots(Request(f"q{i}", [i]), 1)
    assert len(rec3) == 3 and rec3.truncated


# --------------------------------------------------------------------------------------------------
# Scheduler frames: waiting / running queues, the CPU pool, the step; preemption by swap
# --------------------------------------------------------------------------------------------------
def scheduler_trace(mode: str = "swap") -> TraceRecorder:
    """Three 7-token requests with max_tokens 8 in 9 usable blocks: decode growth forces a preemption."""
    from pagedkv.scheduler import Scheduler

    m = KVCacheManager(num_blocks=10, block_size=4)
    s = Scheduler(m, max_num_seqs=4, max_num_batched_tokens=32, preemption_mode=mode, num_cpu_blocks=8)
    for i in range(3):
        s.add_request(Request(f"r{i}", list(range(i * 10, i * 10 + 7)), max_tokens=8))
    rec = TraceRecorder(s)
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        s.update_from_output(out, {rid: 1 for rid in out.num_scheduled_tokens})
    rec.detach()
    assert not s.has_unfinished_requests()
    return rec


def test_scheduler_frames_show_queues_and_cpu_pool() -> None:
    rec = scheduler_trace("swap")
    fr = rec.frames
    v0 = view_frame(fr[0], 0)
    assert v0["waiting"] == ["r0", "r1", "r2"] and v0["running"] == [] and v0["cpu"]["owners"] == [[]] * 8

    k = find(fr, "swap_out")
    v = view_frame(fr[k], k)
    victim = fr[k]["event"]["request_id"]
    pairs = fr[k]["event"]["data"]["pairs"]
    cpu_ids = [c for _, c in pairs]
    assert [v["cpu"]["owners"][c] for c in cpu_ids] == [[victim]] * len(cpu_ids)
    assert sorted(v["cpu_hl"]) == sorted([c, "swap-out"] for c in cpu_ids)
    assert sorted(v["hl"]) == sorted([g, "swap-out"] for g, _ in pairs)
    assert v["step"] is not None

    k = find(fr, "preempt", victim)
    v = view_frame(fr[k], k)
    assert v["waiting"][0] == victim and victim not in v["running"]
    assert victim not in dict((r, ids) for r, ids, _ in v["tables"]), "a swapped-out request holds no GPU table"

    k = find(fr, "swap_in", victim)
    v = view_frame(fr[k], k)
    assert {r for _, r in v["cpu_hl"]} == {"swap-in"} and {r for _, r in v["hl"]} == {"swap-in"}
    gpu_ids = [g for _, g in fr[k]["event"]["data"]["pairs"]]
    assert dict((r, ids) for r, ids, _ in v["tables"])[victim][: len(gpu_ids)] == gpu_ids

    k = find(fr, "schedule")
    v = view_frame(fr[k], k)
    assert v["scheduled"] == fr[k]["event"]["data"]["num_scheduled_tokens"]

    last = view_frame(fr[-1], len(fr) - 1)
    assert last["waiting"] == [] and last["running"] == [] and last["tables"] == []
    for k in range(len(fr)):
        svg = frame_to_svg(fr, k)
        ET.fromstring(svg)
    assert "CPU swap space" in svg and "waiting" in svg and "running" in svg


def test_recompute_preemption_empties_the_table() -> None:
    fr = scheduler_trace("recompute").frames
    k = find(fr, "preempt")
    victim = fr[k]["event"]["request_id"]
    assert fr[k]["event"]["data"]["mode"] == "recompute"
    assert victim not in fr[k]["state"]["block_tables"] and fr[k]["state"]["waiting"][0] == victim
    assert not fr[k]["state"]["cpu"]["block_tables"]
    # A manager-only frame has no queues and no CPU pool.
    plain = view_frame({"event": None, "state": KVCacheManager(num_blocks=4, block_size=2).snapshot()})
    assert plain["waiting"] is None and plain["cpu"] is None and plain["step"] is None


# --------------------------------------------------------------------------------------------------
# The SVG picture
# --------------------------------------------------------------------------------------------------
def test_svg_renders_every_frame(rec: TraceRecorder) -> None:
    for k, f in enumerate(rec.frames):
        svg = frame_to_svg(rec.frames, k, title="demo")
        root = ET.fromstring(svg)  # well-formed XML
        assert root.tag.endswith("svg") and root.get("class") == "pkv-static-svg"
        assert "demo" in svg and f"frame {k} (of 0–{len(rec.frames) - 1})" in svg
        caption = view_frame(f, k)["caption"]
        assert caption.replace("&", "&amp;")[:40] in svg
        for _, role in view_frame(f, k)["hl"]:
            assert ROLES[role][0] in svg, f"frame {k}: no ring for {role}"
    # One frame on its own, and the last frame by default.
    assert ET.fromstring(frame_to_svg(rec.frames[-1])) is not None
    assert frame_to_svg(rec.frames) == frame_to_svg(rec.frames, len(rec.frames) - 1)


def test_svg_colours_follow_owners(rec: TraceRecorder) -> None:
    colours = request_colours(["A", "B", "C", "D"])
    k = find(rec.frames, "fork", "C")
    svg = frame_to_svg(rec.frames, k)
    for rid in "ABC":
        assert colours[rid][0] in svg
    assert colours["D"][0] in svg  # in the legend: D appears later in the trace


def test_svg_scales_to_hundreds_of_blocks() -> None:
    m = KVCacheManager(num_blocks=500, block_size=16)
    rec = TraceRecorder(m)
    for i in range(30):
        m.allocate_slots(Request(f"r{i}", [i] * (16 * (1 + i % 5) + 3)), 16 * (1 + i % 5) + 3)
    svg = frame_to_svg(rec.frames)
    root = ET.fromstring(svg)
    width = float(root.get("width"))
    assert width <= 1400, f"a 500-block pool should shrink its cells, got width {width}"
    cols, cell = grid_shape(500)
    assert cell < 20 and cols * cell < 1400
    assert "more" not in svg or "…" in svg  # a long free queue is elided


@pytest.mark.parametrize(("change", "match"), [
    (lambda st: st["blocks"][1].pop("ref_cnt"), "each block must be a dict with int 'block_id' and 'ref_cnt'"),
    (lambda st: st.update(block_tables=[[1, 2]]), r"state\['block_tables'\] must be a dict"),
    (lambda st: st.update(free_queue=["1", "2"]), r"state\['free_queue'\] must be a list of block ids"),
    (lambda st: st.update(num_blocks="8"), r"state\['num_blocks'\] must be an int"),
    (lambda st: st["block_tables"].update(A=[1, 99]), "the block table of 'A' must be a list of block ids in 0..7"),
    (lambda st: st.update(free_queue=[1, 99]), r"free_queue'\] must be a list of block ids in 0\.\.7"),
])  # fmt: skip
def test_a_malformed_snapshot_is_named_not_drawn(change, match) -> None:
    """A block without ref_cnt was a KeyError while drawing, block_tables as a list an AttributeError, a block id
    past the pool drawn silently, num_blocks "8" read "state has 8 blocks but num_blocks is 8"."""
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate_slots(Request("A", [1] * 6), 6)
    frame = {"event": None, "state": json.loads(json.dumps(m.snapshot()))}
    change(frame["state"])
    with pytest.raises(ValueError, match=match):
        frame_to_svg([frame])
    with pytest.raises(ValueError, match=match):
        BlockTableWidget([frame])


def test_a_bool_is_no_frame_index(rec: TraceRecorder) -> None:
    with pytest.raises(ValueError, match="frame index must be an int"):
        frame_to_svg(rec.frames, True)
    with pytest.raises(ValueError, match="frame index must be an int"):
        BlockTableWidget(rec.frames).to_svg(1.5)


def test_bad_frames_raise_clear_errors(rec: TraceRecorder) -> None:
    with pytest.raises(ValueError, match="empty"):
        frame_to_svg([])
    with pytest.raises(ValueError, match="state lacks"):
        frame_to_svg([{"event": None, "state": {"num_blocks": 2}}])
    with pytest.raises(ValueError, match=r"frame index must be an int in -\d+\.\.\d+"):
        frame_to_svg(rec.frames, len(rec.frames))
    with pytest.raises(ValueError, match="num_blocks"):
        bad = json.loads(json.dumps(rec.frames[0]))
        bad["state"]["num_blocks"] = 99
        view_frames([bad])


# --------------------------------------------------------------------------------------------------
# The widget object and its outputs
# --------------------------------------------------------------------------------------------------
def test_widget_state(rec: TraceRecorder) -> None:
    w = BlockTableWidget.from_recorder(rec, title="demo", fps=4)
    n = len(rec.frames)
    assert len(w.frames) == n and w.frame == n - 1, "starts on the last frame"
    assert w.request_ids == ["A", "B", "C", "D"] and set(w.colors) == {"A", "B", "C", "D"}
    assert w.fps == 4.0 and w.title == "demo"
    assert {"copy-src", "hit", "evict", "free"} <= set(w.legend_roles)
    assert "export default" in str(w._esm) and ".pkv-root" in str(w._css)
    assert BlockTableWidget(rec, frame=0).frame == 0
    assert BlockTableWidget(rec.frames, frame=-2).frame == n - 2
    w.frame = 3
    assert "frame 3 (of 0–" in w.to_svg()
    with pytest.raises(Exception, match="frame must be in"):
        w.frame = n
    assert w.frame == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"frame": 99}, "frame must be an int"),
        ({"fps": 0}, "fps must be a finite number of frames per second > 0"),
        ({"fps": "2"}, "fps must be a finite number"),  # was a raw TypeError
        ({"fps": float("inf")}, "fps must be a finite number"),
        ({"frame": 1.5}, "frame must be"),
        ({"frame": True}, "frame must be an int"),
        ({"static_frame": False}, "static_frame must be an int"),
        ({"static_frame": -99}, "static_frame must be"),
        ({"static_frame": "last"}, "static_frame must be"),
        ({"static_max_frames": 0}, "static_max_frames must be"),
        ({"static_max_frames": True}, "static_max_frames must be"),
    ],
)
def test_widget_rejects_bad_arguments(rec: TraceRecorder, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockTableWidget(rec.frames, **kwargs)


def test_widget_rejects_bad_frames() -> None:
    with pytest.raises(ValueError, match="empty"):
        BlockTableWidget([])
    with pytest.raises(ValueError, match="'state' key"):
        BlockTableWidget([{"event": None}])


def test_display_publishes_widget_and_static_picture(rec: TraceRecorder, monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython.display

    published: list[tuple[dict[str, Any], dict[str, Any]]] = []
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data, metadata=None: published.append(
        (data, metadata or {})))  # fmt: skip
    w = BlockTableWidget.from_recorder(rec, title="demo")
    w._ipython_display_()
    assert len(published) == 2
    (view, _), (static, meta) = published
    assert view["application/vnd.jupyter.widget-view+json"]["model_id"] == w.model_id
    # By default the picture is the filmstrip of the run's key frames.
    assert static["image/svg+xml"].startswith("<svg") and static["image/svg+xml"] == w.filmstrip_svg()
    picks = w.key_frames()
    assert static["text/html"].startswith(f'<div class="pkv-static-fallback" data-frame-index="{picks[0][0]},')
    assert _svg_in_html(static["text/html"]) == [static["image/svg+xml"]], "the HTML shows it as an <img>"
    assert static["text/plain"].startswith(f"[block table, {len(rec.frames)} frames; key frames: allocation (frame")
    n = len(rec.frames)
    assert view["text/plain"] == f"BlockTableWidget({n} frames, showing frame {w.frame}; run this cell to animate it)"
    assert meta == {"pagedkv": {"static_fallback": True}}
    published.clear()
    BlockTableWidget.from_recorder(rec, static=False)._ipython_display_()
    assert len(published) == 1
    published.clear()
    BlockTableWidget.from_recorder(rec, frame=0, static_frame=3)._ipython_display_()
    assert "frame 3 (of 0–" in published[1][0]["image/svg+xml"], "static_frame picks the picture's frame"
    published.clear()
    BlockTableWidget.from_recorder(rec, frame=0, static_frame=-1)._ipython_display_()
    assert f"frame {n - 1} (of 0–{n - 1})" in published[1][0]["image/svg+xml"], "static_frame=-1: the last frame"
    assert published[1][0]["text/plain"].startswith(f"[block table, frame {n - 1} (of 0–{n - 1}):")


def _svg_in_html(html: str) -> list[str]:
    """The SVG documents shown by ``<img src="data:image/svg+xml;base64,...">`` tags in ``html``."""
    found = re.findall(r'src="data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)"', html)
    return [base64.b64decode(m).decode() for m in found]


def test_static_bundle_is_the_current_frame(rec: TraceRecorder) -> None:
    w = BlockTableWidget.from_recorder(rec)
    w.frame = 2
    bundle = w.static_mimebundle()
    assert 'data-frame-index="2"' in bundle["text/html"] and "frame 2 (of 0–" in bundle["image/svg+xml"]
    assert _svg_in_html(bundle["text/html"]) == [bundle["image/svg+xml"]]
    assert "frame 4 (of 0–" in w.static_mimebundle(4)["image/svg+xml"]


def test_javascript_parses() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: cannot syntax-check the widget's JavaScript here")
    src = STATIC / "block_table.js"
    proc = subprocess.run(
        [node, "--input-type=module", "--check"], input=src.read_text(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


# --------------------------------------------------------------------------------------------------
# nbconvert: an exported notebook still shows the picture
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_nbconvert_html_export_shows_the_picture(tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(DEMO_NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    # nbclient stores widget state by default, so the exporter picks the widget's own output type for the
    # widget; the picture must be (and is) a separate output.
    assert nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    outputs = nb.cells[-1].outputs
    kinds = [sorted(o.get("data", {})) for o in outputs]
    assert ["application/vnd.jupyter.widget-view+json", "text/plain"] in kinds
    assert ["image/svg+xml", "text/html", "text/plain"] in kinds
    html, _ = HTMLExporter().from_notebook_node(nb)
    svgs = _svg_in_html(html)
    assert len(svgs) == 1, "the export should show the static picture exactly once"
    assert 'class="pkv-static-svg"' in svgs[0] and "key frames of 16;" in svgs[0]
    picks = key_frames(view_frames(demo_trace().frames))  # the notebook records the same trace
    assert svgs[0].count("<svg ") == 1 + len(picks), "one panel per key frame"
    assert '<div class="pkv-static-fallback"' in html
    (tmp_path / "export.html").write_text(html)


def test_encoded_frames_round_trip(rec: TraceRecorder) -> None:
    """The browser gets each frame as its changes; decoding (Python's twin of the JS decoder) gives it back."""
    w = BlockTableWidget.from_recorder(rec)
    assert decode_views(w.frames) == [{k: v for k, v in x.items()} for x in w.views]
    assert w.frames[0]["full"] and not w.frames[1].get("full")
    assert len(json.dumps(w.frames)) < len(json.dumps(w.views))
    big = BlockTableWidget.from_recorder(scheduler_trace("swap"))
    assert decode_views(big.frames) == big.views
    assert len(json.dumps(big.frames)) < len(json.dumps(big.views)) / 2, "deltas should shrink a trace"


def test_javascript_decoder_matches_python(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: cannot run the widget's JavaScript here")
    w = BlockTableWidget.from_recorder(scheduler_trace("swap"))
    (tmp_path / "frames.json").write_text(json.dumps(w.frames))
    (tmp_path / "bt.mjs").write_text((STATIC / "block_table.js").read_text())
    script = (
        "import { decodeFrames } from './bt.mjs'; import { readFileSync } from 'node:fs';"
        "process.stdout.write(JSON.stringify(decodeFrames(JSON.parse(readFileSync('frames.json', 'utf8')))));"
    )
    proc = subprocess.run(
        [node, "--input-type=module", "-e", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    decoded = json.loads(proc.stdout)
    assert [{k: v for k, v in f.items() if k != "full"} for f in decoded] == json.loads(json.dumps(w.views))


# --------------------------------------------------------------------------------------------------
# The filmstrip: the static picture shows the run's key frames, not its (often empty) last frame
# --------------------------------------------------------------------------------------------------
def _kinds_at(views: list[dict[str, Any]], picks: list[tuple[int, str]]) -> dict[str, str | None]:
    return {label: views[k]["kind"] for k, label in picks}


def test_key_frames_of_a_fork_with_copy_on_write(rec: TraceRecorder) -> None:
    views = view_frames(rec.frames)
    picks = key_frames(views)
    assert [k for k, _ in picks] == sorted(k for k, _ in picks), "time order"
    kinds = _kinds_at(views, picks)
    assert kinds["allocation"] == "allocate" and kinds["sharing"] == "fork" and kinds["copy-on-write"] == "copy"
    assert picks[0][0] == find(rec.frames, "allocate"), "the first allocation"
    assert dict((label, k) for k, label in picks)["copy-on-write"] == find(rec.frames, "copy")
    peak = max(v["stats"]["held"] for v in views)
    assert any(views[k]["stats"]["held"] == peak for k, _ in picks), "the fullest pool is shown"
    assert len(picks) <= 6 and all(k > 0 for k, _ in picks), "never the empty initial pool"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_key_frames_of_a_preempting_scheduler(mode: str) -> None:
    frames = scheduler_trace(mode).frames
    views = view_frames(frames)
    assert views[-1]["stats"]["held"] == 0, "this trace ends with an empty pool: the old picture showed nothing"
    picks = key_frames(views)
    kinds = _kinds_at(views, picks)
    labels = [label for _, label in picks]
    assert len(views) - 1 not in [k for k, _ in picks]
    if mode == "swap":
        assert kinds["preemption (swap out)"] == "swap_out" and kinds["swap in"] == "swap_in"
        assert views[dict((lb, k) for k, lb in picks)["preemption (swap out)"]]["cpu_hl"], "the CPU blocks are lit"
    else:
        assert kinds["preemption"] == "preempt" and "swap in" not in labels
    assert labels[0] == "allocation" and "fullest pool" in labels


def test_key_frames_cap_keeps_the_most_telling(rec: TraceRecorder) -> None:
    views = view_frames(rec.frames)
    assert [label for _, label in key_frames(views, 3)] == ["allocation", "sharing", "copy-on-write"]
    assert key_frames(views, 1) == [(find(rec.frames, "allocate"), "allocation")]
    swap = view_frames(scheduler_trace("swap").frames)
    labels = [label for _, label in key_frames(swap, 4)]
    assert labels == ["allocation", "fullest pool", "preemption (swap out)", "swap in"]


def test_key_frames_of_a_trace_without_events() -> None:
    m = KVCacheManager(num_blocks=4, block_size=2)
    views = view_frames(TraceRecorder(m).frames)
    assert key_frames(views) == [(0, "start")]
    a = Request("A", [1, 2, 3])
    rec = TraceRecorder(m, kinds={"cache"})  # records no allocation; its last frame holds blocks
    m.allocate_slots(a, 3)
    views = view_frames(rec.frames)
    assert [label for _, label in key_frames(views)] == ["fullest pool"]
    with pytest.raises(ValueError, match="max_frames"):
        key_frames(views, 0)
    with pytest.raises(ValueError, match="empty"):
        key_frames([])


def test_filmstrip_svg_has_a_panel_per_key_frame_and_unique_ids() -> None:
    rec = scheduler_trace("swap")
    views = view_frames(rec.frames)
    picks = key_frames(views)
    ids = [r for r in ("r0", "r1", "r2")]
    svg = filmstrip_svg(views, request_colours(ids), picks, title="swap", request_ids=ids,
                        legend_roles=roles_used(views))  # fmt: skip
    root = ET.fromstring(svg)  # well-formed
    ns = "{http://www.w3.org/2000/svg}"
    panels = root.findall(f"{ns}svg")
    assert len(panels) == len(picks)
    for (k, label), panel in zip(picks, panels, strict=True):
        text = ET.tostring(panel, encoding="unicode")
        assert f"frame {k} (of 0–{len(views) - 1})" in text
        assert f"{label} (frame {k})" in svg
    all_ids = [el.get("id") for el in root.iter() if el.get("id")]
    assert len(all_ids) == len(set(all_ids)), "ids repeat: panels would borrow each other's clip paths"
    for el in root.iter():
        for attr in ("fill", "clip-path"):
            ref = el.get(attr) or ""
            if ref.startswith("url(#"):
                assert ref[5:-1] in all_ids, f"{attr} points at a missing id: {ref}"
    assert svg.count("null block") == 1, "one legend for the whole strip"
    assert "@PKV@" not in svg
    with pytest.raises(ValueError, match=r"frame index must be an int in 0\.\.\d+ \(\d+ frames\)"):
        filmstrip_svg(views, request_colours(ids), [(len(views), "x")])
    with pytest.raises(ValueError, match="empty"):
        filmstrip_svg(views, request_colours(ids), [])


def test_two_pictures_never_share_an_id(rec: TraceRecorder) -> None:
    """Pictures inlined into one page (VS Code, the classic notebook) must not borrow each other's clip paths."""
    a, b = frame_to_svg(rec.frames, 3), frame_to_svg(rec.frames, 7)
    ids_a = set(re.findall(r'id="([^"]+)"', a))
    ids_b = set(re.findall(r'id="([^"]+)"', b))
    assert ids_a and ids_b and not ids_a & ids_b
    assert frame_to_svg(rec.frames, 3) == a, "deterministic"


def test_widget_filmstrip_matches_its_frames(rec: TraceRecorder) -> None:
    w = BlockTableWidget.from_recorder(rec, title="demo", static_max_frames=3)
    assert w.key_frames() == key_frames(w.views, 3)
    bundle = w.filmstrip_mimebundle()
    assert bundle["image/svg+xml"].count("<svg ") == 1 + 3
    assert _svg_in_html(bundle["text/html"]) == [bundle["image/svg+xml"]]
    assert "copy-on-write (frame" in bundle["text/plain"]
    one = BlockTableWidget(rec.frames[:1])
    assert one.key_frames() == [(0, "start")] and "start (frame 0)" in one.filmstrip_mimebundle()["text/plain"]


# --------------------------------------------------------------------------------------------------
# Beyond JupyterLab: Colab and VS Code load the same bundle through anywidget
# --------------------------------------------------------------------------------------------------
def test_bundle_uses_only_anywidgets_portable_api() -> None:
    """Colab and VS Code run the ES module through anywidget's ``render({model, el})``: the bundle must not
    import anything or reach for JupyterLab's globals, and may use only the model methods every host has."""
    js = (STATIC / "block_table.js").read_text()
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", js, flags=re.S)  # comments may name anything
    assert re.search(r"^\s*import\b|\bimport\(|\brequire\(", code, flags=re.M) is None, "no imports: one file"
    for name in ("@jupyterlab", "@jupyter-widgets", "jupyterapp", "Jupyter.", "IPython.", "define(", "jp-"):
        assert name not in code, f"the bundle uses {name!r}, which only JupyterLab provides"
    assert re.search(r"export default \{\s*render\s*\}", code)
    used = set(re.findall(r"\bmodel\.(\w+)\(", code))
    assert used <= {"get", "set", "save_changes", "on", "off", "send"}, used


def test_colab_gets_its_custom_widget_manager(rec: TraceRecorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """In Colab (``google.colab.output`` imported), anywidget enables Colab's custom widget manager and names it
    in the output's metadata; the widget's display passes that metadata on."""
    import sys
    import types

    import IPython.display

    calls: list[str] = []
    output = types.ModuleType("google.colab.output")
    output.enable_custom_widget_manager = lambda: calls.append("enabled")  # type: ignore[attr-defined]
    output._widgets = types.SimpleNamespace(_installed_url="https://ssl.gstatic.com/colaboratory-static/widgets/x")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    published: list[tuple[dict[str, Any], dict[str, Any]]] = []
    monkeypatch.setattr(IPython.display, "publish_display_data", lambda data, metadata=None: published.append(
        (data, metadata or {})))  # fmt: skip
    BlockTableWidget.from_recorder(rec)._ipython_display_()
    meta = published[0][1]["application/vnd.jupyter.widget-view+json"]
    assert meta["colab"]["custom_widget_manager"]["url"].startswith("https://")
    assert calls in (["enabled"], []), calls  # enabled once per process (anywidget caches it)


def test_filmstrip_of_a_large_pool_stays_small() -> None:
    """A notebook stores the picture beside every widget: past the budget, panels go compact, then fewer."""
    views = view_frames(scheduler_trace("swap").frames)
    ids = request_order(scheduler_trace("swap").frames)
    colours = request_colours(ids)
    full, picks = fit_filmstrip(views, colours)
    assert picks == key_frames(views) and "block tables: logical block" in full, "a small trace: full panels"
    budget = len(full) * 2 // 3
    svg, fewer = fit_filmstrip(views, colours, max_chars=budget)
    assert len(svg) <= budget and "block tables: logical block" not in svg and "shown in the live widget" in svg
    assert [k for k, _ in fewer] == [k for k, _ in key_frames(views, len(fewer))], "the most telling frames kept"
    one, last = fit_filmstrip(views, colours, max_chars=10)  # nothing fits: one compact frame all the same
    assert len(last) == 1 and ET.fromstring(one) is not None

    m = KVCacheManager(num_blocks=400, block_size=4)
    rec = TraceRecorder(m)
    for i in range(40):
        req = Request(f"r{i}", list(range(i * 1000, i * 1000 + 37)))
        m.allocate_slots(req, req.num_tokens)
    w = BlockTableWidget.from_recorder(rec)
    assert len(w.filmstrip_svg()) <= MAX_SVG_CHARS
    text = w.filmstrip_mimebundle()["text/plain"]
    assert text.startswith(f"[block table, {len(rec.frames)} frames; key frames: allocation"), text
