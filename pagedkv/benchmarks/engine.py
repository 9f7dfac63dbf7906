"""Lesson 7's benchmark: the same model, prompts, new tokens and KV memory budget, served four ways.

Run it: ``python -m pagedkv.benchmarks.engine [--json FILE] [--plot FILE] [--tiny] [--gpu]``.

- ``hf_generate``: transformers ``model.generate``, one prompt at a time;
- ``hf_static_batch``: ``model.generate`` on left-padded batches, as many prompts per batch as the KV budget
  holds at the batch's padded length;
- ``hf_generate_batch``: transformers' continuous batching (``model.generate_batch``, its own paged cache,
  ``num_blocks`` from the budget);
- ``pagedkv``: this lab's engine (``pagedkv.engine.LLM``, ``num_gpu_blocks`` from the budget).

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
from typing import Any

import torch

from pagedkv.benchmarks.provenance import cpu_model, git_commit

IMPLS = ("hf_generate", "hf_static_batch", "hf_generate_batch", "pagedkv")


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


def make_pagedkv(model, cfg: BenchConfig, budget: int, async_scheduling: bool = True):
    """The engine, built once before the clock starts (its KV pool, and on a GPU its CUDA graphs), as
    ``vllm bench throughput`` builds its ``LLM`` before timing ``generate``. Async scheduling, vLLM 0.26's
    default, unless ``async_scheduling=False`` (``pagedkv_sync``: the sync loop, for comparison)."""
    from pagedkv.engine import LLM

    return LLM(model, block_size=cfg.block_size, num_gpu_blocks=budget // cfg.block_size + 1,
               max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=4096, seed=cfg.seed,
               async_scheduling=async_scheduling)


def step_times(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Per engine step of a timed run, from the engine core's counters (``LLM.stats``): ``steps``, and host
    milliseconds per step spent scheduling (``schedule_ms``), preparing inputs (``prepare_ms``: the runner's
    state updates, block moves and the device batch), in the forward and sampler (``forward_ms``: on a CPU the
    compute; on a GPU the launches, the device runs on) and taking the samples back (``update_ms``).
    ``host_ms`` = scheduling + input preparation: the host work async scheduling overlaps with the forward."""
    steps = max(1, int(after["steps"] - before["steps"]))
    ms = {k[:-2] + "_ms": 1e3 * (after[k] - before[k]) / steps for k in ("schedule_s", "prepare_s", "forward_s",
                                                                        "update_s")}
    return {"steps": steps, **ms, "host_ms": ms["schedule_ms"] + ms["prepare_ms"]}


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
}
#: Implementations with a set-up step kept out of the timing; its seconds are reported as ``setup_seconds``.
SETUPS = {"pagedkv": make_pagedkv,
          "pagedkv_sync": lambda model, cfg, budget: make_pagedkv(model, cfg, budget, async_scheduling=False)}


@contextlib.contextmanager
def hide_repo_kernels() -> Iterator[None]:
    """Take this repository's root off ``sys.path`` for the duration: transformers probes for Hugging Face's
    ``kernels`` package by importing ``kernels``, and from the root (``python -m`` puts it on the path) it
    would find the lab's ``kernels/`` folder instead (always imported as ``pagedkv.kernels``)."""
    def is_root(p: str) -> bool:
        base = os.path.abspath(p or os.getcwd())
        return os.path.isfile(os.path.join(base, "kernels", "__init__.py")) and os.path.isdir(
            os.path.join(base, "pagedkv"))

    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if not is_root(p)]
    try:
        yield
    finally:
        sys.path[:] = saved


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


def _run(cfg: BenchConfig, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    model = build_model(cfg)
    prompts = make_prompts(cfg)
    budget = kv_budget_tokens(cfg, prompts)
    warm = BenchConfig(**{**asdict(cfg), "num_prompts": 2, "max_new_tokens": 2})
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    for impl in tqdm(cfg.impls, desc="engine bench", disable=not progress):
        extra: dict[str, Any] = {}
        kwargs: dict[str, Any] = {}
        if impl in SETUPS:
            t0 = time.perf_counter()
            kwargs["engine"] = SETUPS[impl](model, cfg, budget)
            _sync(cfg.device)
            extra["setup_seconds"] = time.perf_counter() - t0
        RUNNERS[impl](model, prompts[:2], warm, budget, **kwargs)  # warm-up: first-call costs out of the timing
        _sync(cfg.device)
        before = dict(kwargs["engine"].stats) if "engine" in kwargs else None
        t0 = time.perf_counter()
        outs = RUNNERS[impl](model, prompts, cfg, budget, **kwargs)
        _sync(cfg.device)
        seconds = time.perf_counter() - t0
        if before is not None:
            extra["step_times"] = step_times(before, kwargs["engine"].stats)
        generated = sum(len(o) for o in outs)
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
    best_hf = {r["impl"]: r["tokens_per_s"] for r in rows}
    if "pagedkv" in best_hf:
        for r in rows:
            r["pagedkv_speedup"] = best_hf["pagedkv"] / r["tokens_per_s"]
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
        "gpu": torch.cuda.get_device_name() if cfg.device.startswith("cuda") else None,
    }
    return {"rows": rows, "config": config}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'impl':<20}{'tok/s':>10}{'seconds':>10}{'match':>8}{'pagedkv ×':>12}"]
    for r in result["rows"]:
        lines.append(f"{r['impl']:<20}{r['tokens_per_s']:>10.1f}{r['seconds']:>10.2f}{r['match']:>8.0%}"
                     f"{r.get('pagedkv_speedup', float('nan')):>11.2f}×")
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
                         f"{t['forward_ms']:.2f} ms (update {t['update_ms']:.2f} ms)")
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
    ax.set_title(f"{c['num_prompts']} prompts, {c['max_new_tokens']} new tokens, same KV budget "
                 f"({c['gpu'] or c['device']}; Llama, {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
                 f"vocabulary {c['vocab_size']:,})", fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="FILE", help='write {"rows": [...], "config": {...}} to FILE')
    parser.add_argument("--plot", metavar="FILE", help="save the bar chart to FILE (PNG)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="the seconds-long configuration the tests run")
    size.add_argument("--gpu", action="store_true", help="the prepared GPU run (~1B Llama shape, bf16, CUDA)")
    parser.add_argument("--impls", nargs="+", choices=sorted(RUNNERS), help="run only these (pagedkv_sync: opt-in)")
    parser.add_argument("--threads", type=int, help="torch threads on a CPU (default 1; 0: torch's default)")
    parser.add_argument("--vocab", type=int, metavar="N", help="the model's vocabulary size (default: the size's own)")
    args = parser.parse_args(argv)
    cfg = BenchConfig.tiny() if args.tiny else BenchConfig.gpu() if args.gpu else BenchConfig()
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
    with hide_repo_kernels():
        result = run(cfg)
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
