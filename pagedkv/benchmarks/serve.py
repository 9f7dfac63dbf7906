"""``pagedkv bench serve``: a load generator for the lab's OpenAI-compatible server, like ``vllm bench serve``.

    python -m pagedkv.benchmarks.serve --base-url http://127.0.0.1:8000 --rates 2 4 inf
    python -m pagedkv.benchmarks.serve --launch tiny --modes paged contiguous --num-gpu-blocks 48 \\
        --rates 1 2 4 8 inf --num-prompts 64 --json out.json --plot out.png

Requests arrive as a Poisson process at each ``--rates`` value (requests per second; ``inf`` sends them all at
once, a burst), each a random token-id prompt with ShareGPT-like lengths (lognormal, the input and output
length shape of the ShareGPT conversations the PagedAttention paper served, scaled to ``max_model_len``), each
a streaming completion with ``ignore_eos`` so that it makes exactly its output length. Per rate it reports,
under ``vllm bench serve``'s names: request throughput, output tokens/s, TTFT, TPOT and ITL (mean, median,
p99, in ms), and the preemptions, running batch size and KV usage read from the server's ``/metrics`` while
the load ran (sampled every ``--poll`` seconds: the time series go into the JSON).

``--launch MODEL`` starts a server per ``--modes`` entry (``paged``: blocks allocated as tokens arrive;
``contiguous``: ``max_model_len`` tokens reserved per request at admission, lesson 1's policy), each on the
same model and the same KV pool (``--num-gpu-blocks``), on 127.0.0.1 with a free port, all at once (the modes'
runs are interleaved, so a slow spell of a shared machine hits them alike), and stops them after.
``--repeats N`` runs every mode and rate N times; the table and the plot then show the median and the min-max
range (the JSON keeps every run and the aggregated rows).

Mirrors ``vllm/benchmarks/serve.py`` (``benchmark``, ``calculate_metrics``, ``get_request``) and the random
and ShareGPT datasets of ``vllm/benchmarks/datasets/datasets.py`` (``RandomDataset``, ``ShareGPTDataset``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.benchmarks.provenance import cpu_model, git_commit
from pagedkv.utils.paths import output_path_problem
from pagedkv.utils.validation import check_int, is_real

#: ShareGPT's lengths as the PagedAttention paper reports them (table 1 / figure 11): mean input 161.31 and
#: mean output 337.99 tokens. The lab draws lognormals with these means and ``SIGMA`` spread, then scales them
#: so that the longest sequences fit ``max_model_len``.
SHAREGPT_MEAN_INPUT, SHAREGPT_MEAN_OUTPUT, SIGMA = 161.31, 337.99, 0.8


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int


def sharegpt_like_requests(n: int, max_model_len: int, vocab_size: int, seed: int = 0,
                           scale: float | None = None) -> list[SampleRequest]:
    """``n`` requests with ShareGPT-shaped input/output lengths, scaled by ``scale`` (default: so that the mean
    total is a quarter of ``max_model_len``), each clipped to fit ``max_model_len``; random token ids in
    ``1..vocab_size - 1``. Bad figures are refused (``ValueError``) before anything is drawn."""
    n = check_int(n, "n", 0)
    max_model_len = check_int(max_model_len, "max_model_len", 2, why="a prompt token and an output token")
    vocab_size = check_int(vocab_size, "vocab_size", 2, why="token ids are drawn from 1..vocab_size - 1")
    if scale is not None and (not is_real(scale) or not 0 < scale < math.inf):
        raise ValueError(f"scale must be a finite number > 0 (or None), got {scale!r}")
    rng = np.random.default_rng(seed)
    if scale is None:
        scale = max_model_len / 4 / (SHAREGPT_MEAN_INPUT + SHAREGPT_MEAN_OUTPUT)
    mu = lambda mean: math.log(mean * scale) - SIGMA**2 / 2  # noqa: E731 - lognormal with this mean
    ins = np.clip(np.rint(rng.lognormal(mu(SHAREGPT_MEAN_INPUT), SIGMA, n)), 4, max_model_len // 2).astype(int)
    outs = np.rint(rng.lognormal(mu(SHAREGPT_MEAN_OUTPUT), SIGMA, n)).astype(int)
    outs = np.clip(outs, 2, max_model_len - ins).astype(int)
    return [SampleRequest(rng.integers(1, vocab_size, int(i)).tolist(), int(o)) for i, o in zip(ins, outs, strict=True)]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds: exponential gaps of mean ``1 / rate``; all 0 for ``rate = inf`` (a burst).
    Mirrors ``get_request`` (``vllm/benchmarks/serve.py``, burstiness 1). ``n = 0``: no arrivals; a ``rate`` that
    is not a number above 0 is refused (``ValueError``)."""
    n = check_int(n, "n", 0)
    if not is_real(rate) or not rate > 0:
        raise ValueError(f"rate must be a number of requests per second > 0 (inf: all at once), got {rate!r}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


@dataclass
class RequestResult:
    """One request as the client saw it: when it was sent, when each chunk with tokens came, how many tokens
    each carried; and :func:`request_metrics` of those."""

    prompt_len: int
    output_len: int = 0
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    tpot: float | None = None
    error: str = ""
    start: float = 0.0


def request_metrics(start: float, chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> dict[str, Any]:
    """One streamed request's latencies as ``vllm bench serve`` defines them (seconds): ``ttft``, the first
    chunk's arrival after ``start``; ``itl``, the gaps between consecutive chunks; ``latency``, the last chunk's
    arrival after ``start`` (``output.latency = most_recent_timestamp - st`` in
    ``vllm/benchmarks/lib/endpoint_request_func.py``: the timestamp moves only on chunks with ``choices``, so
    neither the usage chunk nor ``data: [DONE]`` counts); ``tpot``, ``(latency - ttft) / (output_len - 1)`` with
    ``output_len`` the tokens of all chunks, ``None`` for a single token (``calculate_metrics`` in
    ``vllm/benchmarks/serve.py``). vLLM reads ``output_len`` from the usage chunk's ``completion_tokens``; the
    lab counts the tokens the chunks carried, the same number for a stream that ran to its end."""
    if not chunk_times or len(chunk_times) != len(chunk_tokens):
        raise ValueError("give one arrival time and one token count per chunk, at least one chunk")
    output_len = sum(chunk_tokens)
    ttft = chunk_times[0] - start
    latency = chunk_times[-1] - start
    itl = [chunk_times[i] - chunk_times[i - 1] for i in range(1, len(chunk_times))]
    tpot = (latency - ttft) / (output_len - 1) if output_len > 1 else None
    return {"ttft": ttft, "itl": itl, "latency": latency, "tpot": tpot, "output_len": output_len}


async def send_request(client: Any, url: str, model: str, req: SampleRequest, t0: float) -> RequestResult:
    """One streaming completion, timed chunk by chunk (chunks without tokens, such as the usage chunk, are not
    counted)."""
    res = RequestResult(len(req.prompt_token_ids), start=time.perf_counter() - t0)
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    times: list[float] = []
    tokens: list[int] = []
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if n:
                    times.append(time.perf_counter())
                    tokens.append(n)
    except Exception as exc:  # a refused connection, a reset: counted as failed, the run goes on
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if times:
        m = request_metrics(start, times, tokens)
        res.ttft, res.itl, res.latency, res.tpot, res.output_len = (m["ttft"], m["itl"], m["latency"], m["tpot"],
                                                                    m["output_len"])
        res.ok = True
    return res


#: one sample line of Prometheus' text format: ``name[{labels}] value [timestamp]``; names may hold digits
#: (``vllm:e2e_request_latency_seconds``), values may be ``NaN``, ``+Inf``, ``-Inf``, labels are optional
_METRIC_RE = re.compile(r"^(vllm:[a-zA-Z0-9_:]+)(?:\{[^}]*\})?\s+(\S+)(?:\s+-?[0-9]+)?\s*$")


def parse_metrics(text: str) -> dict[str, float]:
    """The ``vllm:*`` samples of a Prometheus text page, summed over their labels (e.g. over ``finished_reason``),
    histogram buckets skipped (their ``_sum`` and ``_count`` kept). ``TypeError`` for anything but a string."""
    if not isinstance(text, str):
        raise TypeError(f"parse_metrics takes the text of a /metrics page (a str), got {type(text).__name__}")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line)
        if m and not m.group(1).endswith("_bucket"):
            try:
                value = float(m.group(2))  # "NaN", "+Inf" and "-Inf" too
            except ValueError:
                continue
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


async def poll_metrics(client: Any, base_url: str, period: float, t0: float, series: list[dict[str, float]],
                       stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):
            m = parse_metrics((await client.get(f"{base_url}/metrics")).text)
            series.append({"t": time.perf_counter() - t0,
                           "running": m.get("vllm:num_requests_running", 0.0),
                           "waiting": m.get("vllm:num_requests_waiting", 0.0),
                           "kv_cache_usage": m.get("vllm:kv_cache_usage_perc", 0.0),
                           "preemptions": m.get("vllm:num_preemptions_total", 0.0)})
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period)


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    arr = np.asarray(values, dtype=float) * 1000.0
    if arr.size == 0:
        return {f"mean_{prefix}_ms": float("nan"), f"median_{prefix}_ms": float("nan"),
                f"p99_{prefix}_ms": float("nan")}
    return {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.median(arr)),
            f"p99_{prefix}_ms": float(np.percentile(arr, 99))}


def calculate_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """``vllm bench serve``'s summary: throughput and TTFT / TPOT / ITL / E2E statistics. Mirrors
    ``calculate_metrics`` (``vllm/benchmarks/serve.py``): each request's TPOT from :func:`request_metrics`; ITL
    pools every gap between chunks of every request."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        **_stats([r.ttft for r in ok], "ttft"), **_stats(tpots, "tpot"),
        **_stats([x for r in ok for x in r.itl], "itl"), **_stats([r.latency for r in ok], "e2el"),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


async def benchmark(base_url: str, model: str, requests: list[SampleRequest], rate: float, seed: int = 0,
                    poll: float = 0.25, max_concurrency: int | None = None, timeout: float = 600.0
                    ) -> dict[str, Any]:
    """Send ``requests`` at ``rate`` (Poisson) and return the summary, the preemptions seen on ``/metrics``
    during the run and the time series. Mirrors ``benchmark`` (``vllm/benchmarks/serve.py``)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        before = parse_metrics((await client.get(f"{base_url}/metrics")).text)
        series: list[dict[str, float]] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        poller = asyncio.create_task(poll_metrics(client, base_url, poll, t0, series, stop))
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        url = f"{base_url}/v1/completions"

        async def one(req: SampleRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            if sem is None:
                return await send_request(client, url, model, req, t0)
            async with sem:
                return await send_request(client, url, model, req, t0)

        arrivals = poisson_arrivals(len(requests), rate, seed)
        results = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals, strict=True)))
        duration = time.perf_counter() - t0
        stop.set()
        await poller
        after = parse_metrics((await client.get(f"{base_url}/metrics")).text)
    summary = calculate_metrics(list(results), duration)
    key = "vllm:num_preemptions_total"
    summary["num_preemptions"] = int(after.get(key, 0) - before.get(key, 0))
    summary.update(running_stats(series))
    summary["max_kv_cache_usage"] = float(max((s["kv_cache_usage"] for s in series), default=0.0))
    summary["request_rate"] = "inf" if math.isinf(rate) else rate
    summary["timeseries"] = series
    return summary


def running_stats(series: list[dict[str, float]]) -> dict[str, float]:
    """``max_running`` and ``mean_running``, the running batch over the ``/metrics`` samples of a run; NaN (shown
    as "-") when no sample saw a request on the server (none running or waiting): a run shorter than ``--poll``
    is over before its first sample, or sampled only at its start, before the requests reached the scheduler,
    and 0 would then say that nothing ran."""
    if not any(s["running"] or s["waiting"] for s in series):
        return {"max_running": math.nan, "mean_running": math.nan}
    running = [s["running"] for s in series]
    return {"max_running": float(np.max(running)), "mean_running": float(np.mean(running))}


async def compare(bases: dict[str, str], model: str, requests: list[SampleRequest], rates: Sequence[float],
                  repeats: int = 1, seed: int = 0, poll: float = 0.25, progress: bool = False) -> list[dict[str, Any]]:
    """:func:`benchmark` of ``requests`` at every rate on every server of ``bases`` (mode name -> base URL),
    ``repeats`` times, the modes interleaved (repetition, then rate, then mode): a machine that slows down for a
    while (another job on a shared CPU) slows every mode alike instead of the one measured then. Repetition ``i``
    draws its arrivals with ``seed + i``; the requests are the same in all. Each run is tagged ``mode`` and
    ``repeat``; :func:`aggregate` takes their median."""
    from tqdm import tqdm  # the text bar: its last state reads well in a saved notebook

    runs: list[dict[str, Any]] = []
    with tqdm(total=repeats * len(rates) * len(bases), desc="load runs", disable=not progress) as bar:
        for i in range(repeats):
            for rate in rates:
                for mode, base in bases.items():
                    result = await benchmark(base, model, requests, rate, seed=seed + i, poll=poll)
                    runs.append(dict(result, mode=mode, repeat=i))
                    bar.update(1)
    return runs


#: What :func:`aggregate` keeps the spread of (min and max over the repetitions), beside the median.
SPREAD_KEYS = ("request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms", "max_running")


#: What :func:`aggregate` reads of every run.
_RUN_KEYS = ("mode", "request_rate", "errors", "timeseries")


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, rate), in first-seen order: the median over its repetitions of every numeric figure
    (over those that measured it: NaN, no figure, only where none did),
    ``KEY_min`` and ``KEY_max`` for :data:`SPREAD_KEYS`, ``repeats``, and the time series of the last repetition.
    The median of a few short runs reads right where one long run can be thrown by a burst of load; the min-max
    range shows how far the repetitions disagreed. ``ValueError`` names a run that is not one of
    :func:`compare`'s (a dict with ``mode``, ``request_rate``, ``errors`` and ``timeseries``)."""
    groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
    for i, r in enumerate(runs):
        missing = [k for k in _RUN_KEYS if k not in r] if isinstance(r, dict) else list(_RUN_KEYS)
        if missing:
            raise ValueError(f"run {i} is not a benchmark run (as compare() returns): it has no {', '.join(missing)}")
    for r in runs:
        groups.setdefault((r["mode"], r["request_rate"]), []).append(r)
    rows = []
    for (mode, rate), rs in groups.items():
        errors = sorted({e for r in rs for e in r["errors"]})
        row: dict[str, Any] = {"mode": mode, "request_rate": rate, "repeats": len(rs),
                               "timeseries": rs[-1]["timeseries"], "errors": errors}
        for key, value in rs[0].items():
            if key not in row and key != "repeat" and isinstance(value, (int, float)) and not isinstance(value, bool):
                values = [float(r[key]) for r in rs]
                values = [v for v in values if not math.isnan(v)] or [math.nan]  # NaN: not measured in that run
                row[key] = float(np.median(values))
                if key in SPREAD_KEYS:
                    row[f"{key}_min"], row[f"{key}_max"] = min(values), max(values)
        rows.append(row)
    return rows


class ServerProcess:
    """``pagedkv serve MODEL --host 127.0.0.1 --port 0 ...`` in a child process (one torch thread unless
    ``OMP_NUM_THREADS`` says otherwise). :meth:`start` returns once ``/health`` answers (``base_url`` is then
    set); :meth:`stop` ends it (SIGTERM, then SIGKILL) and is safe to call twice. A notebook starts one in a
    cell and stops it in a later one; :func:`launched_server` (one) and :func:`launched_servers` (several, started
    together) are the ``with`` forms."""

    def __init__(self, model: str, server_args: Sequence[str] = (), timeout: float = 300.0) -> None:
        self.model, self.server_args, self.timeout = model, list(server_args), timeout
        self.proc: subprocess.Popen | None = None
        self.base_url: str | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log: list[str] = []

    def start(self) -> ServerProcess:
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> ServerProcess:
        """Start the process and return at once (:meth:`wait_ready` waits for it): several servers then load
        their models at the same time."""
        self._tmp = tempfile.TemporaryDirectory()
        port_file = Path(self._tmp.name) / "port"
        log_file = Path(self._tmp.name) / "server.log"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "pagedkv.entrypoints.api_server", self.model, "--host", "127.0.0.1",
               "--port", "0", "--port-file", str(port_file), *self.server_args]
        self._log = open(log_file, "w+", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        self._deadline = time.monotonic() + self.timeout
        return self

    def wait_ready(self) -> ServerProcess:
        """Wait until the spawned server answers ``/health`` (``base_url`` is then set); stop it and raise if it
        exits or does not answer within ``timeout`` seconds of :meth:`spawn`."""
        import httpx

        assert self.proc is not None and self._tmp is not None, "spawn() first"
        port_file = Path(self._tmp.name) / "port"
        try:
            deadline = self._deadline
            while not port_file.exists() or not port_file.read_text().strip():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.output()[-2000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the server did not start within {self.timeout:.0f} s")
                time.sleep(0.1)
            self.base_url = f"http://127.0.0.1:{int(port_file.read_text())}"
            httpx.get(f"{self.base_url}/health", timeout=30).raise_for_status()
        except BaseException:
            self.stop()
            raise
        return self

    def output(self) -> str:
        """What the server printed so far."""
        if self._tmp is None:
            return ""
        self._log.flush()
        return (Path(self._tmp.name) / "server.log").read_text(encoding="utf-8")

    def stop(self) -> int | None:
        """Stop the server; returns its exit status (None if it never started)."""
        rc = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=20)
            rc = self.proc.returncode
            self.proc = None
        if self._tmp is not None:
            self._log.close()
            self._tmp.cleanup()
            self._tmp = None
        return rc


@contextlib.contextmanager
def launched_server(model: str, server_args: Sequence[str] = (), timeout: float = 300.0) -> Iterator[str]:
    """A :class:`ServerProcess` for the ``with`` block, yielding its base URL; stopped on exit, whatever
    happens."""
    with launched_servers(model, {"": server_args}, timeout) as bases:
        yield bases[""]


@contextlib.contextmanager
def launched_servers(model: str, server_args: dict[str, Sequence[str]], timeout: float = 300.0
                     ) -> Iterator[dict[str, str]]:
    """One :class:`ServerProcess` per entry of ``server_args`` (a name -> its flags), started together, for the
    ``with`` block; yields each one's base URL under its name. All are stopped on exit, whatever happens."""
    servers = {name: ServerProcess(model, args, timeout) for name, args in server_args.items()}
    try:
        for server in servers.values():
            server.spawn()
        for server in servers.values():
            server.wait_ready()
        yield {name: str(server.base_url) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def format_table(runs: list[dict[str, Any]]) -> str:
    """One line per run (or per :func:`aggregate` row); latencies in ms, "-" where there is no figure (no
    completed request; no ``/metrics`` sample that saw the load, with a note under the table)."""
    cols = [("mode", "mode", "{}"), ("rate", "request_rate", "{}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_throughput", "{:.1f}"), ("TTFT med (ms)", "median_ttft_ms", "{:.0f}"),
            ("TTFT p99 (ms)", "p99_ttft_ms", "{:.0f}"), ("TPOT med (ms)", "median_tpot_ms", "{:.1f}"),
            ("ITL med (ms)", "median_itl_ms", "{:.1f}"), ("ITL p99 (ms)", "p99_itl_ms", "{:.1f}"),
            ("preempt", "num_preemptions", "{:g}"), ("run max", "max_running", "{:.0f}"),
            ("run mean", "mean_running", "{:.1f}"), ("fail", "failed", "{:g}")]
    if runs and "request_throughput_min" in runs[0]:  # aggregated repetitions: the median, then its range
        cols[3:3] = [("req/s range", "request_throughput", "range:{:.2f}")]
        cols[6:6] = [("TTFT med range (ms)", "median_ttft_ms", "range:{:.0f}")]
        cols.insert(2, ("reps", "repeats", "{}"))

    def figure(f: str, value: Any) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f.format(value)

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        if fmt.startswith("range:"):
            f = fmt.removeprefix("range:")
            lo, hi = figure(f, r[key + "_min"]), figure(f, r[key + "_max"])
            return lo if lo == hi == "-" else f"{lo}-{hi}"
        return figure(fmt, r.get(key))

    rows = [[h for h, _, _ in cols]] + [[cell(r, k, f) for _, k, f in cols] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    if any(math.isnan(r.get("max_running", 0.0)) for r in runs):
        lines.append('run max / run mean "-": no /metrics sample saw a request on the server (the run was over '
                     "within --poll seconds of its start); a smaller --poll samples it")
    return "\n".join(lines)


def _spread(rows: list[dict[str, Any]], key: str) -> list[list[float]]:
    """Matplotlib's asymmetric error bars: how far below and above the median the min and max lie."""
    return [[r[key] - r[f"{key}_min"] for r in rows], [r[f"{key}_max"] - r[key] for r in rows]]


def plot(runs: list[dict[str, Any]], path: str | None = None) -> Any:
    """Latency against achieved throughput per mode (median TTFT and TPOT; for :func:`aggregate`'s rows, the
    median of the repetitions with min-max bars on both axes), and at the highest rate the running batch and
    the KV cache usage over time, each preemption marked on the usage. Saved to ``path`` when given; returns the
    figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.2))
    (ttft_ax, tpot_ax), (run_ax, kv_ax) = axes
    for mode in dict.fromkeys(r["mode"] for r in runs):
        rs = [r for r in runs if r["mode"] == mode]
        x = [r["request_throughput"] for r in rs]
        for ax, key in ((ttft_ax, "median_ttft_ms"), (tpot_ax, "median_tpot_ms")):
            y = [r[key] for r in rs]
            if f"{key}_min" in rs[0]:  # repetitions: the median, bars from the smallest to the largest
                ax.errorbar(x, y, fmt="o-", capsize=3, label=f"{mode} (median of {rs[0]['repeats']}, min-max bars)",
                            xerr=_spread(rs, "request_throughput"), yerr=_spread(rs, key))
            else:
                ax.plot(x, y, "o-", label=mode)
        last = rs[-1]
        ts = last["timeseries"]
        label = f"{mode}, rate {last['request_rate']}"
        run_ax.plot([p["t"] for p in ts], [p["running"] for p in ts], label=label)
        t = [p["t"] for p in ts]
        line, = kv_ax.plot(t, [100 * p["kv_cache_usage"] for p in ts])
        base = ts[0]["preemptions"] if ts else 0.0
        hits = [i for i in range(1, len(ts)) if ts[i]["preemptions"] > ts[i - 1]["preemptions"]]
        kv_ax.plot([t[i] for i in hits], [100 * ts[i]["kv_cache_usage"] for i in hits], "x", ms=8,
                   color=line.get_color())
        line.set_label(f"{label}: {(ts[-1]['preemptions'] - base) if ts else 0:g} preemptions")
    ttft_ax.set(xlabel="achieved throughput (requests/s)", ylabel="median TTFT (ms)", yscale="log",
                title="time to first token")
    tpot_ax.set(xlabel="achieved throughput (requests/s)", ylabel="median TPOT (ms)", title="time per output token")
    run_ax.set(xlabel="time since the first request (s)", ylabel="running requests",
               title="running batch at the highest rate")
    kv_ax.set(xlabel="time since the first request (s)", ylabel="KV blocks in use (% of the pool)", ylim=(0, 105),
              title="KV cache usage at the highest rate (x: a preemption)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in (run_ax, kv_ax):
        ax.legend(loc="best", fontsize=8, framealpha=0.9)
    # The two latency panels share one legend above them: inside, "best" still covered the error bars (a legend
    # placed by matplotlib avoids the points and lines, not the bars).
    handles, labels = ttft_ax.get_legend_handles_labels()
    rates = " -> ".join(str(r["request_rate"]) for r in runs if r["mode"] == runs[0]["mode"]) if runs else ""
    fig.legend(handles, labels, loc="upper center", ncol=max(1, len(labels)), fontsize=8, frameon=False,
               title=f"each line joins the rates in order ({rates} requests/s)" if rates else None,
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    if path:
        fig.savefig(path, dpi=120)
    return fig


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv bench serve", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--launch", metavar="MODEL", help="start `pagedkv serve MODEL` per mode (e.g. tiny)")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's first model)")
    p.add_argument("--modes", nargs="+", default=["paged"], choices=("paged", "contiguous"),
                   help="with --launch: KV reservation modes to compare (default paged)")
    p.add_argument("--rates", nargs="+", default=["inf"], help="request rates in requests/s; inf = a burst")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--repeats", type=_positive_int, default=1, help="runs per mode and rate, the modes interleaved; "
                   "the table and the plot show their median and min-max range")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll", type=float, default=0.25, help="seconds between /metrics samples")
    p.add_argument("--length-scale", type=float, default=None,
                   help="multiply ShareGPT's lengths by this (default: mean total = max_model_len / 4)")
    p.add_argument("--vocab-size", type=int, default=512, help="prompt token ids are drawn from 1..this - 1")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--plot", help="save the curves here (PNG)")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'shared machine')")
    p.add_argument("--server-args", default="", help="with --launch: more `pagedkv serve` flags, one string "
                   "split as a shell would (e.g. '--num-gpu-blocks 48 --max-model-len 512')")
    return p


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _model_info(base_url: str) -> tuple[str, int]:
    import httpx

    r = httpx.get(f"{base_url}/v1/models", timeout=30)
    try:
        card = r.json()["data"][0]
        return card["id"], int(card["max_model_len"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"{base_url}/v1/models answered HTTP {r.status_code} without a model card (id, "
                           "max_model_len): is it `pagedkv serve` or `vllm serve`?") from None


def _unreachable(base_url: str | None, exc: Exception) -> str:
    """One line for an ``httpx`` transport error: which server could not be reached, and why, in words."""
    import httpx

    if base_url is None:  # a launched server that went away: the URL the request was for
        try:
            url = exc.request.url
            base_url = f"{url.scheme}://{url.netloc.decode()}"
        except (AttributeError, RuntimeError):  # httpx raises RuntimeError for an error without its request
            base_url = "the server"
    text = str(exc) or type(exc).__name__
    if "refused" in text.lower():
        why = "connection refused"
    elif isinstance(exc, httpx.TimeoutException):
        why = f"no answer in time: {type(exc).__name__}"
    elif isinstance(exc, httpx.RemoteProtocolError):
        why = f"the connection was closed: {text}"
    else:
        why = text
    return f"cannot reach {base_url} ({why}): is a server running there?"


def run(args: argparse.Namespace) -> dict[str, Any]:
    rates = [float(r) for r in args.rates]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta: dict[str, Any] = {}

    def sweep(bases: dict[str, str]) -> list[dict[str, Any]]:
        import httpx

        model, max_len = _model_info(next(iter(bases.values())))
        for mode, base in bases.items():
            snap = httpx.get(f"{base}/pagedkv/snapshot", timeout=30).json()
            meta[mode] = {"num_gpu_blocks": snap.get("num_blocks"), "model": model, "max_model_len": max_len}
        reqs = sharegpt_like_requests(args.num_prompts, max_len, args.vocab_size, args.seed, args.length_scale)
        return asyncio.run(compare(bases, args.model or model, reqs, rates, args.repeats, args.seed, args.poll,
                                   progress=True))

    if args.launch:  # every mode's server at once, so that compare() can interleave them
        extra = shlex.split(args.server_args)
        with launched_servers(args.launch, {m: [*extra, "--kv-reservation", m] for m in args.modes}) as bases:
            runs = sweep(bases)
    else:
        runs = sweep({"server": args.base_url.rstrip("/")})
    shown = aggregate(runs) if args.repeats > 1 else runs
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    report = {
        "benchmark": "serve", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "cpu": cpu_model(), "cpu_count": os.cpu_count(), "loadavg_before": load_before,
        "loadavg_after": load, "python": platform.python_version(), "torch": _version("torch"),
        "transformers": _version("transformers"),
        "note": args.note, "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "servers": meta, "runs": runs,
    }
    if args.repeats > 1:
        report["aggregated"] = shown
    print(format_table(shown))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot(shown, args.plot)
    return report


def main(argv: list[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    problem = output_path_problem(files={"--json": args.json, "--plot": args.plot})  # before the run, not after
    if problem is None and args.base_url is not None and not re.match(r"https?://[^/]", args.base_url):
        problem = f"--base-url {args.base_url}: give a URL such as http://127.0.0.1:8000"
    if problem:
        print(f"pagedkv bench serve: {problem}", file=sys.stderr)
        return 2
    try:
        run(args)
    except httpx.TransportError as exc:  # nothing listens there, or the server went away during the run
        print(f"pagedkv bench serve: {_unreachable(args.base_url and args.base_url.rstrip('/'), exc)}",
              file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"pagedkv bench serve: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
