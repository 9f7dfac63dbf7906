"""What a parity check found: per driver, how many random workloads agreed with vLLM 0.26, how long each
side took, and the first diverging step with both sides' observations and block tables."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

DRIVER_DESCRIPTIONS = {
    "manager": "block pool + KV cache manager: block ids, hit lengths and free counts after every operation",
    "scheduler": "scheduler (FCFS, recompute, chunked prefill, admission gate): scheduled tokens, preemptions, "
    "block tables and kept outputs after every step",
    "hybrid_manager": "KV cache manager over full + sliding-window groups (and all-sliding): block ids per group, "
    "hit lengths and free counts after every operation",
    "hybrid_scheduler": "scheduler over full + sliding-window groups (and all-sliding): scheduled tokens, "
    "preemptions, block tables per group and kept outputs after every step",
    "async_scheduler": "async scheduler driven as step_with_batch_queue drives it (two batches in flight): "
    "scheduled tokens, placeholders, preemptions, block tables, kept and discarded samples after every call",
    "hybrid_async_scheduler": "async scheduler over full + sliding-window groups (and all-sliding), two batches "
    "in flight: scheduled tokens, placeholders, preemptions, block tables per group and kept samples after every "
    "call",
}


@dataclass
class Divergence:
    """The first entry where the two traces differ."""

    seed: int
    index: int  # operation or step number within the workload
    config: dict[str, Any]
    op: dict[str, Any]
    vllm: dict[str, Any] | None  # vLLM's observation (None: its trace had ended)
    lab: dict[str, Any] | None

    def tables(self) -> dict[str, tuple[list[int] | None, list[int] | None]]:
        """Block tables in the observation, by request: ``(vLLM's, the lab side's)``."""
        out: dict[str, tuple[list[int] | None, list[int] | None]] = {}
        for side, obs in ((0, self.vllm), (1, self.lab)):
            if not obs:
                continue
            tables = dict(obs.get("tables", obs.get("schedule", {}).get("tables", {})))
            if "table" in obs and "rid" in self.op:
                tables[self.op["rid"]] = obs["table"]
            for rid, table in tables.items():
                pair = list(out.get(rid, (None, None)))
                pair[side] = table
                out[rid] = (pair[0], pair[1])
        return out

    def render(self, who: str) -> str:
        label = "yours" if who.startswith("Your") else "library"
        op = ", ".join(f"{k}={v}" for k, v in self.op.items() if k != "op")
        lines = [
            f"first divergence: workload seed {self.seed} ({_config(self.config)}), "
            f"{'step' if self.op.get('op') == 'step' else 'operation'} {self.index}: {self.op.get('op')}({op})",
        ]
        keys = sorted(set(self.vllm or {}) | set(self.lab or {}))
        for key in keys:
            if key == "tables":
                continue
            v, mine = (self.vllm or {}).get(key), (self.lab or {}).get(key)
            mark = "  <-- differs" if v != mine else ""
            lines.append(f"  {key:<11} vLLM 0.26: {v}")
            lines.append(f"  {'':<11} {label:<9}: {mine}{mark}")
        if self.vllm is None or self.lab is None:
            lines.append(f"  {'vLLM' if self.vllm is None else who}'s trace ended here")
        tables = self.tables()
        if tables:
            lines.append(f"  block tables (vLLM 0.26 | {label}):")
            for rid, (v, mine) in tables.items():
                mark = "" if v == mine else "   <-- differs"
                lines.append(f"    {rid:>5}: {v} | {mine}{mark}")
        return "\n".join(lines)


def _config(cfg: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


@dataclass
class DriverResult:
    name: str
    seeds_run: int = 0
    seeds_agreeing: int = 0
    vllm_seconds: float = 0.0
    lab_seconds: float = 0.0
    divergence: Divergence | None = None
    enable_caching: bool | None = None


@dataclass
class ParityReport:
    """The result of :func:`pagedkv.parity.check`. ``ok`` is True when every workload agreed; printing it says
    "agrees with vLLM 0.26 on N random workloads" or shows the first diverging step."""

    lessons: list[int]
    who: str
    drivers: list[DriverResult] = field(default_factory=list)
    skipped: str | None = None  # why vLLM's side could not run
    vllm_import_seconds: float | None = None
    cached: bool = False  # vLLM's traces came from the cache (no worker was started)

    @property
    def ok(self) -> bool:
        return self.skipped is None and all(d.divergence is None for d in self.drivers)

    @property
    def num_workloads(self) -> int:
        return sum(d.seeds_run for d in self.drivers)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        if self.skipped is not None:
            return f"vLLM 0.26 parity check skipped: {self.skipped}"
        lines = []
        for d in self.drivers:
            what = DRIVER_DESCRIPTIONS[d.name]
            if d.enable_caching is not None:
                what += f" (prefix caching {'on' if d.enable_caching else 'off'})"
            label = "yours" if self.who.startswith("Your") else "library"
            timing = f"[vLLM {d.vllm_seconds:.2f} s, {label} {d.lab_seconds:.2f} s]"
            if d.divergence is None:
                lines.append(f"{self.who} agrees with vLLM 0.26 on {d.seeds_run} random workloads: {what} {timing}")
            else:
                lines.append(
                    f"{self.who} DIVERGES from vLLM 0.26 on {d.seeds_run - d.seeds_agreeing} of {d.seeds_run} random "
                    f"workloads: {what} {timing}"
                )
                lines.append(d.divergence.render(self.who))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour = "#1a7f37" if self.ok else ("#6e7781" if self.skipped else "#cf222e")
        parts = [f'<pre style="color:{colour}">{html.escape(str(self))}</pre>']
        for d in self.drivers:
            if d.divergence is not None and d.divergence.tables():
                parts.append(_tables_html(d.divergence, "yours" if self.who.startswith("Your") else "library"))
        return "".join(parts)


def _cells(table: list[int] | None, other: list[int] | None) -> str:
    if table is None:
        return "<td><i>no table</i></td>"
    out = []
    for i, block_id in enumerate(table):
        same = other is not None and i < len(other) and other[i] == block_id
        style = "" if same else ' style="background:#ffd7d5"'
        out.append(f'<td{style}>{block_id}</td>')
    return "".join(out) or "<td><i>empty</i></td>"


def _tables_html(d: Divergence, label: str) -> str:
    """Both sides' block tables at the first divergence, one row per request and side; cells that differ
    from the other side are shaded."""
    rows = []
    for rid, (v, mine) in d.tables().items():
        rows.append(f"<tr><th rowspan=2>{html.escape(str(rid))}</th><td>vLLM 0.26</td>{_cells(v, mine)}</tr>")
        rows.append(f"<tr><td>{label}</td>{_cells(mine, v)}</tr>")
    caption = f"block tables at workload seed {d.seed}, {d.op.get('op')} {d.index}"
    return f'<table style="font-family:monospace"><caption>{html.escape(caption)}</caption>{"".join(rows)}</table>'
