"""``pagedkv serve``'s flags: those of ``vllm serve`` that the lab's engine has, with the same names and defaults
unless noted. Mirrors ``vllm/entrypoints/openai/cli_args.py`` and ``vllm/engine/arg_utils.py`` (``EngineArgs``).
Kept apart from the server so that ``pagedkv --help`` does not import FastAPI."""

from __future__ import annotations

import argparse

from pagedkv.utils.argparse_utils import human_readable_int, human_readable_int_or_auto

DESCRIPTION = "An OpenAI-compatible HTTP server on the lab's engine (FastAPI + uvicorn)."


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """``vllm serve``'s flags that the lab's engine has (same names, same defaults unless noted)."""
    p = parser or argparse.ArgumentParser(prog="pagedkv serve", description=DESCRIPTION)
    p.add_argument("model", help="a Hugging Face id, a local folder, or 'tiny' (lesson 7's tiny Llama with an "
                   "offline byte-level tokenizer: nothing is downloaded)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", nargs="+", default=None, help="name(s) the API answers to "
                   "(default: MODEL)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", "--num-gpu-blocks", dest="num_gpu_blocks", type=int, default=None,
                   help="KV pool size in blocks (default: profiled, as lesson 5)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                   help="KV pool size in bytes (blocks = bytes // one block over all layers), instead of profiling; "
                   "1k = 1,000, 1K = 1,024 (also M, G, T)")
    p.add_argument("--max-model-len", type=human_readable_int_or_auto, default=None,
                   help="tokens per request, prompt and output (default: the model's length as vLLM derives it: "
                   "max_position_embeddings, times a RoPE scaling factor); "
                   "'auto' or -1: the longest the KV pool holds, at most that default; 32k = 32,000, 32K = 32,768")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once (default: vLLM's for its server: 128 on a CPU, 256 or 1024 on a GPU)")
    p.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                   help="tokens per step (default: vLLM's for its server: 2048 on a CPU, 2048 or 8192 on a GPU; at "
                   "most max-num-seqs whole sequences)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="'priority': the waiting queue ordered by each request's priority field (lower first), "
                   "then arrival; 'fcfs' ignores it")
    p.add_argument("--kv-reservation", choices=("paged", "contiguous"), default="paged",
                   help="lab extension: 'contiguous' reserves max_model_len tokens per request up front "
                   "(lesson 1's policy, before paging); 'paged' allocates blocks as tokens arrive")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="config fields to change, as JSON (only with MODEL 'tiny' here): e.g. "
                   "'{\"hidden_size\": 256, \"num_hidden_layers\": 4}'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs a request may ask for (-1: the whole vocabulary)")
    p.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="'auto': the model's generation config gives the sampling defaults of omitted fields; "
                   "'vllm': vLLM's neutral ones (vLLM also takes a folder; the lab does not)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (off by default, as in vLLM)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    p.add_argument("--port-file", default=None, help="lab extension: write the port listened on to this file "
                   "once the server answers (for --port 0)")
    return p
