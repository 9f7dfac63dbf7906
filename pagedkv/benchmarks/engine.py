"""Lesson 7's benchmark: the same model, prompts, new tokens and KV memory budget, served four ways.

Run it: ``python -m pagedkv.benchmarks.engine [--json FILE] [--plot FILE] [--tiny] [--gpu]``.

- ``hf_generate``: transformers ``model.generate``, one prompt at a time;
- ``hf_static_batch``: ``model.generate`` on left-padded batches, as many prompts per batch as the KV budget
  holds at the batch's padded length;
- ``hf_generate_batch``: transformers' continuous batching (``model.generate_batch``, its own paged cache,
  ``num_blocks`` from the budget);
- ``pagedkv``: this lab's engine (``pagedkv.engine.LLM``, ``num_gpu_blocks`` from the budget), on a CPU on its own
  Llama decoder (``pagedkv.engine.llama``); opt-in with ``--impls``: ``pagedkv_transformers``, the same engine on
  transformers' modules (``model_impl="transformers"``), and ``pagedkv_sync``, the sync loop.

Greedy decoding, no EOS (every request makes exactly ``max_new_tokens``), so the outputs are comparable token
for token: ``match`` is the share of prompts whose tokens equal ``hf_generate``'s. ``tokens_per_s`` counts
generated tokens over the wall time of the whole call. The lab's engine is built before the clock starts (its KV
pool and, on a GPU, its CUDA graphs: ``setup_seconds``), as ``vllm bench throughput`` builds its ``LLM``
(``vllm/benchmarks/throughput.py``: ``run_vllm``). The KV budget is the KV of every request at its full length
(prompt + new tokens, unpadded): the paged engines hold all of them at once; the static batch, which reserves
the padded length for every row, holds fewer per batch.

The default is the CPU configuration (a tiny seeded Llama in fp32), run with one torch thread (``--threads``).
Its vocabulary, 4,096 tokens, keeps the LM head's share of a decode token's multiply-adds where real small
models have it (``lm_head_share``: 27% here; Qwen2.5-0.5B 28%, Llama-3.2-1B and SmolLM2-135M 21%). With
Llama-2's 32,000 tokens on 256 hidden units it would be 74%, and every implementation would spend most of its
time in the one matrix product they all share; ``--vocab 32000`` measures that too. One thread, because at
these sizes every operation is small, and on a shared machine a second OpenMP thread mostly waits for a core
(measured on a busy 2-core box: one decode step 15-40x slower with two threads than with one, for every
implementation alike). ``--gpu`` is the prepared GPU run: a ~1B-parameter Llama-shaped model (random weights,
bf16), 256 prompts, CUDA graphs, a few minutes on one GPU.

**The roof.** In the same run, with the same thread count, the machine's own matrix-multiply speed is measured
on the model's own linear layers (its weights, ``F.linear``) at the step sizes the engine ran: every layer's
q/k/v/o, gate/up/down at each step's token count, and the LM head at each step's sampled rows
(:func:`measure_roof`). Each implementation's useful work is counted from the config (:func:`count_flops`: the
layers on every real token, attention over the real context lengths, the LM head on the rows it computes), and
``gflops`` = that work over its wall time, ``pct_of_roof`` = ``gflops`` over the roof's. The engine's wall time is
split (``time_split``) into the forward (layers and LM head), attention (every layer's attention call), sampling,
scheduling, input preparation and the rest (taking samples back, outputs, the ``generate`` loop).

**The second roof.** Decode attention does a few multiply-adds per byte of K and V it reads, so the matmul roof
says nothing about it: its floor is the machine's read bandwidth. The run measures that too
(:func:`measure_read_bandwidth`, a ``sum`` over 64 MiB) and counts the bytes the engine's attention must read
(:func:`kv_read_bytes`); ``kv_roof["seconds"]`` is their quotient. The engine's rows then carry
``attention_pct_of_kv_roof`` (that floor over its measured attention time; on a CPU only, where that time is
the attention's own, not its launches) and ``pct_of_both_roofs`` (the matmul
roof's seconds plus the bandwidth floor, over the run's wall time): what a perfect engine would take on this
machine, against what this one took.

The default (CPU) run repeats everything ``--runs`` times (3) and writes ``engine.json`` (and ``engine.png``) to
``--out DIR``, by default ``artifacts/bench_engine/<date>-<N>core/`` under the current folder (git-ignored, like
the kernel benchmark's ``artifacts/bench_interpreter``; a run to keep beside the committed ones is
``--out benchmarks/results/cpu/<date>-<N>core``): ``rows`` is the median run's (by the engine's share of the
roof), ``runs`` holds every run, ``spread`` each implementation's range over them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pagedkv.benchmarks.provenance import cpu_model, git_commit
from pagedkv.utils.paths import output_path_problem

IMPLS = ("hf_generate", "hf_static_batch", "hf_generate_batch", "pagedkv")
#: Where :func:`default_results_folder` puts the default run's folders (git-ignored).
DEFAULT_FOLDER = "artifacts/bench_engine"


@dataclass
class BenchConfig:
    """One run's settings (written to the JSON's ``config``)."""

    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 688
    vocab_size: int = 4096
    num_prompts: int = 64
    min_prompt_len: int = 20
    max_prompt_len: int = 200
    max_new_tokens: int = 64
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    threads: int | None = 1  # torch intra-op threads on a CPU (None: torch's default)
    impls: list[str] = field(default_factory=lambda: list(IMPLS))
    runs: int = 1  # repetitions of the whole comparison (each with its own roof); main() makes the default run 3

    @classmethod
    def tiny(cls) -> BenchConfig:
        """The test's size: seconds on one core."""
        return cls(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512, num_prompts=4, min_prompt_len=5, max_prompt_len=24,
                   max_new_tokens=4, max_num_batched_tokens=64)

    @classmethod
    def gpu(cls) -> BenchConfig:
        """The prepared GPU run: Llama-3.2-1B's shape (2048 hidden, 16 layers, 32/8 heads), bf16, 256 prompts.
        ``hf_generate`` (one prompt at a time) is left out: it alone would take most of the time budget;
        ``pagedkv_sync`` (the sync loop) is in, to set beside async scheduling where the overlap can show."""
        return cls(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=8192, vocab_size=128256, num_prompts=256, min_prompt_len=20,
                   max_prompt_len=200, max_new_tokens=128, max_num_batched_tokens=8192, dtype="bfloat16",
                   device="cuda", threads=None,
                   impls=["hf_static_batch", "hf_generate_batch", "pagedkv", "pagedkv_sync"])


def lm_head_share(cfg: BenchConfig) -> float:
    """The LM head's share of the multiply-adds of one decode token (the layers' projections and MLP, plus the
    head; attention over the context left out)."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attn = cfg.hidden_size * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)  # q, o, k, v
    layer = attn + 3 * cfg.hidden_size * cfg.intermediate_size
    head = cfg.hidden_size * cfg.vocab_size
    return head / (cfg.num_hidden_layers * layer + head)


def linear_shapes(cfg: BenchConfig) -> list[tuple[int, int]]:
    """One decoder layer's linear layers as ``(in_features, out_features)``: q, k, v, o, gate, up, down
    (``LlamaAttention`` / ``LlamaMLP``)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    d = h // cfg.num_attention_heads
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return [(h, hq), (h, hkv), (h, hkv), (hq, h), (h, i), (h, i), (i, h)]


def count_flops(cfg: BenchConfig, prompt_lens: list[int], lm_head_rows: int) -> dict[str, float]:
    """The useful floating-point operations of generating ``max_new_tokens`` for every prompt, counted from the
    config (a multiply-add is 2 FLOPs): ``layers``, every decoder layer's linear layers on every real token (each
    prompt token and each generated token but the last, which is never fed back; padding not counted);
    ``attention``, ``Q·Kᵀ`` and ``P·V`` of each such token over its real context (``4·Hq·D·(p+1)`` per layer at
    position ``p``); ``lm_head``, ``2·H·V`` per computed row; ``matmul`` = layers + LM head (what the roof
    measures) and ``total``."""
    per_token = 2 * sum(a * b for a, b in linear_shapes(cfg)) * cfg.num_hidden_layers
    d = cfg.hidden_size // cfg.num_attention_heads
    tokens = [n + cfg.max_new_tokens - 1 for n in prompt_lens]  # positions 0 .. n-1 of each request
    layers = per_token * sum(tokens)
    attention = 4 * cfg.num_attention_heads * d * cfg.num_hidden_layers * sum(n * (n + 1) // 2 for n in tokens)
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size * lm_head_rows
    return {"layers": float(layers), "attention": float(attention), "lm_head": float(lm_head),
            "matmul": float(layers + lm_head), "total": float(layers + attention + lm_head)}


def best_seconds(fn: Any, device: str, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed warm-up), each waited for on ``device``:
    what both roofs time their probes with."""
    fn()  # warm-up
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_roof(model: torch.nn.Module, cfg: BenchConfig, steps: list[tuple[int, int]],
                 repeats: int = 3) -> dict[str, Any]:
    """The matrix-multiply roof at the run's step sizes: ``steps`` are the engine's ``(tokens, sampled rows)``
    per step; for each distinct token count, every layer's seven ``F.linear`` calls with the model's own weights
    on a ``[tokens, in]`` input (best of ``repeats``), and for each distinct row count the LM head; the roof's
    seconds are those times summed over the steps, its ``gflops`` the steps' matmul FLOPs over them. Same
    process, same thread count as the implementations just measured."""
    import torch.nn.functional as F

    weights = []  # [(in, out) weight of every linear layer of every decoder layer]
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight, m.gate_proj.weight,
                    m.up_proj.weight, m.down_proj.weight]
    head = model.get_output_embeddings().weight  # [V, H]
    dev, dtype = head.device, head.dtype
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)

    def layers_at(t: int):
        xs = {n: torch.randn(t, n, generator=gen).to(dev, dtype) for n in {w.shape[1] for w in weights}}
        return lambda: [F.linear(xs[w.shape[1]], w) for w in weights]

    def head_at(r: int):
        x = torch.randn(r, head.shape[1], generator=gen).to(dev, dtype)
        return lambda: F.linear(x, head)

    layer_s = {t: best_seconds(layers_at(t), cfg.device, repeats) for t in sorted({t for t, _ in steps if t})}
    head_s = {r: best_seconds(head_at(r), cfg.device, repeats) for r in sorted({r for _, r in steps if r})}
    seconds = sum(layer_s.get(t, 0.0) + head_s.get(r, 0.0) for t, r in steps)
    per_token = 2 * sum(w.shape[0] * w.shape[1] for w in weights)
    flops = sum(per_token * t + 2 * head.shape[0] * head.shape[1] * r for t, r in steps)
    return {"seconds": seconds, "flops": float(flops), "gflops": flops / seconds / 1e9 if seconds else 0.0,
            "steps": len(steps), "step_tokens": sorted({t for t, _ in steps}), "repeats": repeats}


def kv_read_bytes(cfg: BenchConfig, prompt_lens: list[int]) -> int:
    """The bytes of K and V the paged engine's attention must read, counted from the config: every layer reads
    a request's whole context once per step it is scheduled in, ``2·Hkv·D`` elements per position (K and V).
    A prompt in one chunk reads its ``n`` positions; each decode step after it reads the context so far
    (``n + 1``, ..., ``n + max_new_tokens - 1``: the last token is never fed back). A prompt split between two
    steps (at ``max_num_batched_tokens``) reads its first chunk again: not counted, a few prompts of the default
    bench, so the floor is a little low, never high."""
    d = cfg.hidden_size // cfg.num_attention_heads
    per_position = 2 * cfg.num_key_value_heads * d * torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size()
    m = cfg.max_new_tokens
    positions = sum(n + (m - 1) * n + (m - 1) * m // 2 for n in prompt_lens)  # n + sum_{j=1}^{m-1} (n + j)
    return cfg.num_hidden_layers * per_position * positions


def measure_read_bandwidth(cfg: BenchConfig, n_bytes: int = 64 << 20, repeats: int = 5) -> dict[str, Any]:
    """The machine's read bandwidth, in the same process and thread count as the run: a ``sum`` over a
    contiguous float32 tensor of ``n_bytes`` (best of ``repeats``). 64 MiB by default: more than a decode step's
    K and V of every layer together (about 37 MB in the default bench), so it is read as the step reads them,
    from beyond the core's own caches. The second roof: attention cannot take less than its bytes over this."""
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=cfg.device)
    seconds = best_seconds(x.sum, cfg.device, repeats)
    return {"gbps": n_bytes / seconds / 1e9, "probe_bytes": n_bytes, "method": f"torch.sum, best of {repeats}"}


def build_model(cfg: BenchConfig) -> torch.nn.Module:
    """A Llama with seeded random weights (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=4096, eos_token_id=None,
        bos_token_id=None, pad_token_id=0,
    )
    with torch.device(cfg.device):  # built where it runs: a 1B model's random init on a CPU takes a while
        model = LlamaForCausalLM(config)
    model = model.to(dtype=getattr(torch, cfg.dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(cfg: BenchConfig) -> list[list[int]]:
    rng = random.Random(cfg.seed)
    return [
        [rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(cfg.min_prompt_len, cfg.max_prompt_len))]
        for _ in range(cfg.num_prompts)
    ]


def kv_budget_tokens(cfg: BenchConfig, prompts: list[list[int]]) -> int:
    """Tokens of KV in the shared budget: every request at full length, unpadded, rounded up to blocks."""
    bs = cfg.block_size
    return sum(-(-(len(p) + cfg.max_new_tokens) // bs) * bs for p in prompts)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_generate(model, prompts, cfg: BenchConfig, budget: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=cfg.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cfg.max_new_tokens,
                             min_new_tokens=cfg.max_new_tokens, do_sample=False)
        outs.append(out[0, len(p):].tolist())
    return outs


def static_batches(lens: list[int], max_new_tokens: int, budget: int) -> list[list[int]]:
    """Prompt indices per static batch, in prompt order: a batch grows while ``rows * (longest prompt +
    max_new_tokens) <= budget`` (every row reserves the padded length)."""
    batches: list[list[int]] = [[]]
    longest = 0
    for i, n in enumerate(lens):
        new_longest = max(longest, n)
        if batches[-1] and (len(batches[-1]) + 1) * (new_longest + max_new_tokens) > budget:
            batches.append([])
            new_longest = n
        batches[-1].append(i)
        longest = new_longest
    return batches


def run_hf_static_batch(model, prompts, cfg: BenchConfig, budget: int) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]
    for batch in static_batches([len(p) for p in prompts], cfg.max_new_tokens, budget):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, i in enumerate(batch):  # left padding, as generation needs
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        out = model.generate(ids.to(cfg.device), attention_mask=mask.to(cfg.device),
                             max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens, do_sample=False)
        for r, i in enumerate(batch):
            outs[i] = out[r, width:].tolist()
    return outs


def run_hf_generate_batch(model, prompts, cfg: BenchConfig, budget: int) -> list[list[int]]:
    import logging

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "eos_token_id not set": on purpose

    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, min_new_tokens=cfg.max_new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=cfg.block_size, num_blocks=budget // cfg.block_size,
                                  max_batch_tokens=cfg.max_num_batched_tokens)
    res = model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                               progress_bar=False)
    by_index = {}
    for rid, out in res.items():
        by_index[int(str(rid).rsplit("_", 1)[-1])] = list(out.generated_tokens)
    return [by_index[i] for i in range(len(prompts))]


def make_pagedkv(model, cfg: BenchConfig, budget: int, async_scheduling: bool = True, model_impl: str = "auto"):
    """The engine, built once before the clock starts (its KV pool, and on a GPU its CUDA graphs), as
    ``vllm bench throughput`` builds its ``LLM`` before timing ``generate``. Async scheduling, vLLM 0.26's
    default, unless ``async_scheduling=False`` (``pagedkv_sync``: the sync loop, for comparison); on a CPU the
    lab's own Llama decoder unless ``model_impl="transformers"`` (``pagedkv_transformers``: transformers' modules with
    the lab's attention, the engine as it was before it had its own model code)."""
    from pagedkv.engine import LLM

    return LLM(model, block_size=cfg.block_size, num_gpu_blocks=budget // cfg.block_size + 1,
               max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=4096, seed=cfg.seed,
               async_scheduling=async_scheduling, model_impl=model_impl)


def step_times(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per engine step of a timed run, from the engine core's counters (``LLM.stats``): ``steps``, and host
    milliseconds per step spent scheduling (``schedule_ms``), preparing inputs (``prepare_ms``: the runner's
    state updates, block moves and the device batch), in the forward and sampler (``forward_ms``: on a CPU the
    compute; on a GPU the launches, the device runs on) and taking the samples back (``update_ms``).
    ``host_ms`` = scheduling + input preparation: the host work async scheduling overlaps with the forward."""
    steps = max(1, int(after["steps"] - before["steps"]))
    ms = {k[:-2] + "_ms": 1e3 * (after.get(k, 0.0) - before.get(k, 0.0)) / steps
          for k in ("schedule_s", "prepare_s", "forward_s", "attention_s", "sample_s", "update_s")}
    return {"steps": steps, **ms, "host_ms": ms["schedule_ms"] + ms["prepare_ms"]}


SPLIT = ("forward", "attention", "sampling", "scheduling", "input_preparation", "other")


def time_split(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """The engine's wall ``seconds`` of a timed run as shares (summing to 1) of :data:`SPLIT`, from the engine
    core's counters: ``forward`` (the decoder's layers, norms and LM head: the forward minus attention and the
    sampler), ``attention`` (every layer's attention call: writing the new K/V and attending), ``sampling``,
    ``scheduling``, ``input_preparation`` (the runner's state updates, block moves and device batch) and
    ``other`` (taking the samples back, outputs, the ``generate`` loop: the rest of the wall time)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("schedule_s", "prepare_s", "forward_s",
                                                             "attention_s", "sample_s")}
    parts = {"forward": d["forward_s"] - d["attention_s"] - d["sample_s"], "attention": d["attention_s"],
             "sampling": d["sample_s"], "scheduling": d["schedule_s"], "input_preparation": d["prepare_s"]}
    parts["other"] = max(0.0, seconds - sum(parts.values()))
    total = sum(parts.values())
    return {k: parts[k] / total if total else 0.0 for k in SPLIT}


def run_pagedkv(model, prompts, cfg: BenchConfig, budget: int, engine=None) -> list[list[int]]:
    from pagedkv.engine import SamplingParams

    llm = engine if engine is not None else make_pagedkv(model, cfg, budget)
    outs = llm.generate(prompts, SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


RUNNERS = {
    "hf_generate": run_hf_generate,
    "hf_static_batch": run_hf_static_batch,
    "hf_generate_batch": run_hf_generate_batch,
    "pagedkv": run_pagedkv,
    "pagedkv_sync": run_pagedkv,  # opt-in (--impls): the same engine with async_scheduling=False
    "pagedkv_transformers": run_pagedkv,  # opt-in (--impls): the same engine on transformers' modules
}
#: Implementations with a set-up step kept out of the timing; its seconds are reported as ``setup_seconds``.
SETUPS = {"pagedkv": make_pagedkv,
          "pagedkv_sync": lambda model, cfg, budget: make_pagedkv(model, cfg, budget, async_scheduling=False),
          "pagedkv_transformers": lambda model, cfg, budget: make_pagedkv(model, cfg, budget,
                                                                          model_impl="transformers")}


def run(cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run every implementation in ``cfg.impls`` once (after a small warm-up of each) and return
    ``{"rows": [...], "config": {...}}``."""
    torch.set_grad_enabled(False)
    threads_before = torch.get_num_threads()
    if cfg.threads and not cfg.device.startswith("cuda"):
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress)
    finally:
        torch.set_num_threads(threads_before)


@contextlib.contextmanager
def recorded_steps(engine) -> Iterator[list[tuple[int, int]]]:
    """The engine's steps while the context is open, as ``(scheduled tokens, sampled rows)``: the step sizes the
    roof is measured at (a sampled row is a request whose chunk reaches the end of its tokens)."""
    executor = engine.engine_core.model_executor
    inner = executor.execute_model
    steps: list[tuple[int, int]] = []

    def execute_model(so, *args, **kwargs):
        if so.total_num_scheduled_tokens:
            partial = so.partial_prefill_req_ids or set()
            steps.append((so.total_num_scheduled_tokens, sum(r not in partial for r in so.num_scheduled_tokens)))
        return inner(so, *args, **kwargs)

    executor.execute_model = execute_model
    try:
        yield steps
    finally:
        del executor.execute_model  # the bound method again


def _run(cfg: BenchConfig, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    model = build_model(cfg)
    prompts = make_prompts(cfg)
    budget = kv_budget_tokens(cfg, prompts)
    runs = []
    bar = tqdm(total=cfg.runs * (len(cfg.impls) + 1), desc="engine bench", disable=not progress)
    for _ in range(cfg.runs):
        runs.append(_run_once(model, prompts, budget, cfg, bar))
    bar.close()
    # the median run by the engine's share of the roof (else by the first implementation's tokens/s)
    def key(run: dict[str, Any]) -> float:
        rows = {r["impl"]: r for r in run["rows"]}
        r = rows.get("pagedkv", run["rows"][0])
        return r.get("pct_of_roof", r["tokens_per_s"])

    median = sorted(runs, key=key)[(len(runs) - 1) // 2]
    spread: dict[str, dict[str, list[float]]] = {}
    for impl in cfg.impls:
        mine = [next(r for r in run["rows"] if r["impl"] == impl) for run in runs]
        spread[impl] = {k: [min(r[k] for r in mine), max(r[k] for r in mine)]
                        for k in ("tokens_per_s", "gflops", "pct_of_roof", "pagedkv_speedup", "pct_of_both_roofs",
                                  "attention_pct_of_kv_roof") if k in mine[0]}
    import transformers

    config = {
        **asdict(cfg),
        "kv_budget_tokens": budget,
        "lm_head_share": round(lm_head_share(cfg), 4),
        "reference_impl": cfg.impls[0],
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": cpu_model(),
        "cpu_count": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "load_avg": _load_avg(),
        "gpu": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else None,
    }
    return {"rows": median["rows"], "roof": median["roof"], "kv_roof": median["kv_roof"], "flops": median["flops"],
            "runs": runs, "spread": spread, "config": config}


def _load_avg() -> list[float] | None:
    """The machine's 1-, 5- and 15-minute load averages (``os.getloadavg``) where there are any."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _run_once(model, prompts: list[list[int]], budget: int, cfg: BenchConfig, bar) -> dict[str, Any]:
    """Every implementation once (after a small warm-up of each), then the roof at the engine's step sizes."""
    warm = BenchConfig(**{**asdict(cfg), "num_prompts": 2, "max_new_tokens": 2})
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    steps: list[tuple[int, int]] = []
    load_before = _load_avg()
    for impl in cfg.impls:
        extra: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        if impl in SETUPS:
            t0 = time.perf_counter()
            kwargs["engine"] = SETUPS[impl](model, cfg, budget)
            _sync(cfg.device)
            extra["setup_seconds"] = time.perf_counter() - t0
        # warm-up: first-call costs out of the timing; on prompts of their own (reversed), so that the engine's
        # prefix cache holds none of the timed prompts' blocks
        RUNNERS[impl](model, [p[::-1] for p in prompts[:2]], warm, budget, **kwargs)
        _sync(cfg.device)
        engine = kwargs.get("engine")
        before = dict(engine.stats) if engine is not None else None
        with recorded_steps(engine) if engine is not None else contextlib.nullcontext([]) as impl_steps:
            t0 = time.perf_counter()
            outs = RUNNERS[impl](model, prompts, cfg, budget, **kwargs)
            _sync(cfg.device)
            seconds = time.perf_counter() - t0
        if before is not None:
            extra["step_times"] = step_times(before, engine.stats)
            extra["time_split"] = time_split(before, engine.stats, seconds)
            if impl == "pagedkv" or not steps:
                steps = list(impl_steps)
        generated = sum(len(o) for o in outs)
        # the LM head's rows: one per sampled token (the engine: its sampled rows, counted; transformers' generate
        # and static batch: logits_to_keep=1, one row per step and sequence; generate_batch: one per request and
        # step, its partial prefill chunks' rows not counted)
        lm_rows = sum(r for _, r in impl_steps) if engine is not None else generated
        extra["flops"] = count_flops(cfg, [len(p) for p in prompts], lm_rows)["total"]
        if reference is None:
            reference = outs
        rows.append({
            "impl": impl,
            "tokens_per_s": generated / seconds,
            "seconds": seconds,
            "generated_tokens": generated,
            "match": sum(a == b for a, b in zip(outs, reference, strict=True)) / len(prompts),
            **extra,
        })
        bar.update()
    if not steps:  # no engine in the run: the roof at the transformers' decode steps (one row per prompt)
        steps = [(len(prompts), len(prompts))] * cfg.max_new_tokens
    roof = measure_roof(model, cfg, steps)
    bandwidth = measure_read_bandwidth(cfg)
    kv_bytes = kv_read_bytes(cfg, [len(p) for p in prompts])
    kv_roof = {**bandwidth, "kv_bytes": kv_bytes, "seconds": kv_bytes / (bandwidth["gbps"] * 1e9)}
    bar.update()
    for r in rows:
        r["gflops"] = r["flops"] / r["seconds"] / 1e9
        r["pct_of_roof"] = r["gflops"] / roof["gflops"] if roof["gflops"] else 0.0
        t = r.get("step_times")
        if t:  # the engine: both roofs, the matrix products at the roof's speed plus K and V at the bandwidth
            r["pct_of_both_roofs"] = (roof["seconds"] + kv_roof["seconds"]) / r["seconds"]
            attention_s = t["attention_ms"] * t["steps"] / 1e3  # on a GPU the launches only: not compared
            if not cfg.device.startswith("cuda"):
                r["attention_pct_of_kv_roof"] = kv_roof["seconds"] / attention_s if attention_s else 0.0
    by_impl = {r["impl"]: r["tokens_per_s"] for r in rows}
    if "pagedkv" in by_impl:
        for r in rows:
            r["pagedkv_speedup"] = by_impl["pagedkv"] / r["tokens_per_s"]
    flops = count_flops(cfg, [len(p) for p in prompts], sum(r for _, r in steps))
    return {"rows": rows, "roof": roof, "kv_roof": kv_roof, "flops": flops, "load_avg": [load_before, _load_avg()]}


def format_table(result: dict[str, Any]) -> str:
    roof, flops = result.get("roof"), result.get("flops")  # absent from runs made before the roof was measured
    lines = [f"{'impl':<20}{'tok/s':>10}{'seconds':>10}{'match':>8}{'pagedkv ×':>12}"
             + (f"{'GFLOP/s':>10}{'% roof':>8}" if roof else "")]
    for r in result["rows"]:
        lines.append(f"{r['impl']:<20}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}{r['match']:>8.0%}"
                     f"{r.get('pagedkv_speedup', float('nan')):>11.2f}×"
                     + (f"{r['gflops']:>10.1f}{r['pct_of_roof']:>8.0%}" if roof else ""))
    if roof and flops:
        lines.append(f"roof: F.linear on the model's own layers at the engine's {roof['steps']} step sizes, "
                     f"{roof['gflops']:.1f} GFLOP/s ({roof['seconds']:.2f} s for {roof['flops'] / 1e9:.1f} GFLOP); "
                     f"work counted: {flops['total'] / 1e9:.1f} GFLOP (layers {flops['layers'] / 1e9:.1f}, attention "
                     f"{flops['attention'] / 1e9:.1f}, LM head {flops['lm_head'] / 1e9:.1f})")
    kv = result.get("kv_roof")
    if kv:
        lines.append(f"second roof: K and V read by attention, {kv['kv_bytes'] / 1e9:.2f} GB at the measured read "
                     f"bandwidth {kv['gbps']:.1f} GB/s ({kv['method']} over {kv['probe_bytes'] >> 20} MiB) = "
                     f"{kv['seconds']:.3f} s")
        for r in result["rows"]:
            if "pct_of_both_roofs" in r:
                attention = (f"attention at {r['attention_pct_of_kv_roof']:.0%} of the bandwidth roof; "
                             if "attention_pct_of_kv_roof" in r else "")
                lines.append(f"{r['impl']}: {attention}the run at {r['pct_of_both_roofs']:.0%} of both roofs "
                             f"(matrix products at the roof plus K/V at the bandwidth: "
                             f"{roof['seconds'] + kv['seconds']:.2f} s against {r['seconds']:.2f} s)")
    runs = result.get("runs") or []
    if len(runs) > 1:
        sp = result["spread"]
        lines.append(f"{len(runs)} runs (the table: the median by pagedkv's % of the roof); ranges: " + "; ".join(
            f"{impl} {v['pct_of_roof'][0]:.0%}-{v['pct_of_roof'][1]:.0%} of the roof"
            + (f", pagedkv {v['pagedkv_speedup'][0]:.2f}-{v['pagedkv_speedup'][1]:.2f}×"
               if "pagedkv_speedup" in v and not impl.startswith("pagedkv") else "")
            for impl, v in sp.items()))
    c = result["config"]
    lines.append(f"{c['num_prompts']} prompts of {c['min_prompt_len']}-{c['max_prompt_len']} tokens, "
                 f"{c['max_new_tokens']} new tokens each, KV budget {c['kv_budget_tokens']} tokens, "
                 f"{c['dtype']} on {c['gpu'] or c['device']}; match = same tokens as {c['reference_impl']}")
    lines.append(f"model: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, vocabulary {c['vocab_size']:,} "
                 f"(LM head {c['lm_head_share']:.0%} of a decode token's multiply-adds), "
                 f"{c['num_threads']} torch thread(s)")
    for r in result["rows"]:
        t = r.get("step_times")
        if t:
            lines.append(f"{r['impl']}: {t['steps']} steps; per step, host {t['host_ms']:.2f} ms (scheduling "
                         f"{t['schedule_ms']:.2f} + input preparation {t['prepare_ms']:.2f}) beside the forward "
                         f"{t['forward_ms']:.2f} ms (attention {t.get('attention_ms', 0.0):.2f}, sampling "
                         f"{t.get('sample_ms', 0.0):.2f}; update {t['update_ms']:.2f} ms)")
        split = r.get("time_split")
        if split:
            lines.append(f"{r['impl']} time split: " + ", ".join(f"{k.replace('_', ' ')} {v:.0%}"
                                                                 for k, v in split.items()))
    if c.get("load_avg"):
        lines.append(f"load average at the end: {' '.join(f'{x:.2f}' for x in c['load_avg'])} "
                     f"({c['cpu_count']} CPUs)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | None = None):
    """A bar chart of tokens/s per implementation (saved to ``path`` when given); returns the figure."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    names = [r["impl"] for r in rows]
    vals = [r["tokens_per_s"] for r in rows]
    bars = ax.barh(names, vals, color=["#bbb" if n != "pagedkv" else "#1f77b4" for n in names])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in vals], padding=3)
    ax.set_xlabel("generated tokens per second (higher is better)")
    ax.set_xlim(0, max(vals) * 1.2)
    ax.invert_yaxis()
    c = result["config"]
    ax.set_title(f"{c['num_prompts']} prompts, {c['max_new_tokens']} new tokens, same KV budget\n"
                 f"({c['gpu'] or c['device']}; Llama, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                 f"vocabulary {c['vocab_size']:,})", fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv bench engine", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="FILE", help='write {"rows": [...], "config": {...}} to FILE')
    parser.add_argument("--plot", metavar="FILE", help="save the bar chart to FILE (PNG)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="the seconds-long configuration the tests run")
    size.add_argument("--gpu", action="store_true", help="the prepared GPU run (~1B Llama shape, bf16, CUDA)")
    parser.add_argument("--impls", nargs="+", choices=sorted(RUNNERS),
                        help="run only these (pagedkv_sync, pagedkv_transformers: opt-in)")
    parser.add_argument("--threads", type=int, help="torch threads on a CPU (default 1; 0: torch's default)")
    parser.add_argument("--vocab", type=int, metavar="N", help="the model's vocabulary size (default: the size's own)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help="repeat the whole comparison N times (default: 3 for the default run, else 1)")
    parser.add_argument("--out", metavar="DIR",
                        help="write engine.json and engine.png to DIR (the default run's default: "
                             "artifacts/bench_engine/<date>-<N>core, git-ignored)")
    args = parser.parse_args(argv)
    if args.out and args.json:
        parser.error("--out names the folder of engine.json; give --out or --json, not both")
    cfg = BenchConfig.tiny() if args.tiny else BenchConfig.gpu() if args.gpu else BenchConfig()
    default_run = not (args.tiny or args.gpu)
    cfg.runs = args.runs if args.runs is not None else 3 if default_run else 1
    if cfg.runs < 1:
        parser.error("--runs must be at least 1")
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA GPU")
    if args.impls:
        cfg.impls = list(args.impls)
    if args.threads is not None:
        cfg.threads = args.threads or None
    if args.vocab is not None:
        if args.vocab < 2:
            parser.error("--vocab must be at least 2")
        cfg.vocab_size = args.vocab
    keep = args.out or (default_run and not args.json and not args.impls)  # kept, outside the tracked files
    problem = output_path_problem(  # before minutes of work, not after
        files={"--json": args.json, "--plot": args.plot},
        folders={"--out": args.out} if args.out else {"the default folder": DEFAULT_FOLDER} if keep else {})
    if problem:
        print(f"pagedkv bench engine: {problem}", file=sys.stderr)
        return 2
    result = run(cfg)
    print(format_table(result))
    json_path, plot_path = args.json, args.plot
    if keep:
        folder = Path(args.out) if args.out else default_results_folder(result)
        folder.mkdir(parents=True, exist_ok=True)
        name = "engine" if args.vocab is None else f"engine_vocab{cfg.vocab_size}"
        json_path, plot_path = str(folder / f"{name}.json"), plot_path or str(folder / f"{name}.png")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {json_path}")
    if plot_path:
        plot(result, plot_path)
    return 0


def default_results_folder(result: dict[str, Any]) -> Path:
    """``artifacts/bench_engine/<date>-<N>core/`` under the current folder: where the default run writes its
    JSON without ``--out``. Git ignores ``artifacts/``, so a plain ``./lab bench`` changes no tracked file;
    a run under ``benchmarks/results/cpu/`` is committed on purpose (``--out``), with a README."""
    c = result["config"]
    return Path(DEFAULT_FOLDER) / f"{c['date'][:10]}-{c['cpu_count']}core"


if __name__ == "__main__":
    raise SystemExit(main())
