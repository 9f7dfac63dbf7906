"""The README's measured numbers are the committed result files' (issue 21, item 3).

Each number the README's "Measured" section states is recomputed here from the file it links, so a new result
file, or a number typed by hand, fails until the two agree. Nothing is timed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
MEASURED = README.split("## Measured", 1)[1].split("\n## ", 1)[0]
TEXT = " ".join(MEASURED.split())  # one line: sentences wrap anywhere


def _linked(prefix: str, holding: str) -> Path:
    """The one result folder the Measured section links under ``benchmarks/results/<prefix>/`` that holds the file
    ``holding`` (the section also links other runs, such as lesson 9's serving results)."""
    linked = sorted(set(re.findall(rf"\]\((benchmarks/results/{prefix}/[^/)]+)/", MEASURED)))
    found = [f for f in linked if (ROOT / f / holding).is_file()]
    assert len(found) == 1, (holding, linked)
    return ROOT / found[0]


def _span(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(min(xs))}–{fmt.format(max(xs))}"


def test_the_engine_numbers_are_engine_json():
    folder = _linked("cpu", "engine.json")
    for name, vocab_only in (("engine.json", False), ("engine_vocab32000.json", True)):
        data = json.loads((folder / name).read_text())
        rows = {r["impl"]: r for r in data["rows"]}
        assert all(r["match"] == 1.0 for r in rows.values())
        wanted = [f"{rows[i]['pagedkv_speedup']:.2f}×" for i in ("hf_generate_batch", "hf_static_batch")]
        if vocab_only:
            wanted.append(f"{round(100 * data['config']['lm_head_share'])}%")
        else:
            wanted += [f"{rows[i]['tokens_per_s']:,.0f}" for i in ("pagedkv", "hf_generate_batch", "hf_static_batch",
                                                                   "hf_generate")]
            wanted.append(f"at commit {data['config']['commit']}")
        for text in wanted:
            assert text in TEXT, (name, text)


def test_the_kernel_numbers_are_the_h200_files():
    folder = _linked("gpu", "meta.json")
    meta = json.loads((folder / "meta.json").read_text())
    assert f"commit {meta['commit']}" in TEXT and meta["date"] in TEXT
    bench = json.loads((folder / "bench_decode.json").read_text())
    timed = {(r["dtype"], r["batch"], r["context"], r["impl"]): r["ms"] for r in bench["timings"]}
    # the benchmark stops at the first implementation that fails its float64 check: all were checked, none skipped
    assert {(c["dtype"], c["batch"], c["context"], c["impl"]) for c in bench["correctness"]} == set(timed)
    assert not bench["skipped"] and "Every implementation passed its float64 check at every shape" in MEASURED
    compare = {(r["batch"], r["ctx"]): r for r in json.loads((folder / "compare.json").read_text())}
    large = sorted(s for s in compare if s[0] >= 64 and s[1] >= 4096)
    for dtype in ("bf16", "fp16"):
        ratio = [timed[(dtype, *s, "v3")] / timed[(dtype, *s, "sdpa_contiguous")] for s in large]
        assert re.search(rf"{_span(ratio)}×[^,.]* in {dtype}", TEXT), (dtype, _span(ratio))
    sdpa = [compare[s]["sdpa_graph_ms"] / compare[s]["sdpa_eager_ms"] for s in large]
    lab = [compare[s]["lab_graph_ms"] / compare[s]["lab_eager_ms"] for s in large]
    assert f"SDPA took {_span(sdpa)}× its eagerly launched time" in TEXT
    assert f"the lab's dispatch {_span(lab)}×" in TEXT
    lo, hi = round(100 * (min(sdpa) - 1)), round(100 * (max(sdpa) - 1))
    assert f"about {lo}–{hi}%" in TEXT


@pytest.mark.slow
def test_the_tuned_dispatch_numbers_follow_from_the_sweep():
    """What the tuned rule picks, as lesson 6 computes it: its pick's time in the sweep against the fastest, and
    against SDPA's and vLLM's in compare.json."""
    import pagedkv.kernels as pk

    folder = _linked("gpu", "meta.json")
    meta = json.loads((folder / "meta.json").read_text())
    shape = meta["model_shape"]
    sweep = json.loads((folder / "sweep_graph.json").read_text())
    compare = {(r["batch"], r["ctx"]): r for r in json.loads((folder / "compare.json").read_text())}
    worst, to_sdpa, to_vllm = 1.0, [], []
    for batch, ctx in sorted({(r["batch"], r["ctx"]) for r in sweep}):
        here = [r for r in sweep if (r["batch"], r["ctx"]) == (batch, ctx)]
        pick = pk.choose_decode_config(batch, shape["num_kv_heads"], ctx, meta["num_sms"])
        ms = next(r["ms"] for r in here if pk.DecodeConfig(int(r["ver"][1]), r["tile"], r["warps"], r["stages"],
                                                           r["splits"]) == pick)
        worst = max(worst, ms / min(r["ms"] for r in here))
        to_sdpa.append(ms / compare[(batch, ctx)]["sdpa_graph_ms"])
        to_vllm.append(ms / compare[(batch, ctx)]["vllm_graph_ms"])
    assert f"within {100 * (worst - 1):.1f}% of the fastest" in TEXT
    assert f"{_span(to_sdpa)}× and {_span(to_vllm)}×" in TEXT
