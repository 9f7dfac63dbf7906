"""What the lessons teach about vLLM 0.26, pinned where it can be checked mechanically.

The reference is vLLM 0.26.0's source (``vllm/config/cache.py``, ``vllm/v1/worker/gpu_worker.py``,
``vllm/v1/core/sched/output.py``, ``vllm/v1/core/kv_cache_utils.py``). These tests hold the lab to the facts
the lessons state, and keep the claims a review found wrong (issue 13) out of every lesson.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
from pathlib import Path

import pytest

import pagedkv.sched_output as sched_output
from pagedkv.kv_cache_utils import builtin_hash, hash_request_tokens, sha256_hash
from pagedkv.sim.cost import DEFAULT_GPU_MEMORY_UTILIZATION, H100_SXM, LLAMA2_7B, CostModel

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# ``SchedulerOutput``'s fields in vLLM 0.26 (``vllm/v1/core/sched/output.py``). Any other field of the lab's
# SchedulerOutput is the lab's own and must say so.
VLLM_SCHEDULER_OUTPUT_FIELDS = {
    "scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
    "scheduled_spec_decode_tokens", "scheduled_encoder_inputs", "num_common_prefix_blocks", "finished_req_ids",
    "free_encoder_mm_hashes", "scheduled_encoder_input_stats", "preempted_req_ids",
    "has_structured_output_requests", "pending_structured_output_tokens", "num_invalid_spec_tokens",
    "kv_connector_metadata", "ec_connector_metadata", "new_block_ids_to_zero", "kv_cache_block_copies",
    "num_spec_tokens_to_schedule",
}  # fmt: skip

# Claims a reader of vLLM 0.26 would not find there (issue 13), and project talk that is no lesson's business.
WRONG_PHRASES = [
    r"32 hashes",  # 500 tokens in blocks of 16 have 31 full blocks, so 31 hashes (only full blocks are hashed)
    r"\butil(?:ization)?\s*=?\s*0\.90?\b",  # vLLM 0.26's gpu_memory_utilization default is 0.92
    r"0\.9 × 80 GB",
    r"from version 0\.10 its `prefix_caching_hash_algo`",  # sha256 became the default in v0.10.2
    r"the scheduler falls back to recompute",  # V0 raised when swap space ran out; the fallback is the lab's
    r"used between branches of one request, not between strangers",  # hybrid models share partial blocks
    r"hash the request's full blocks, walk the chain",  # vLLM hashes on Request creation and append
    r"→ the scheduler's `blocks_to_copy`",  # V1 has no fork; blocks_to_copy is the lab's (vLLM V0's)
    r"as vLLM and flash-attn lay it out",  # vLLM 0.26's FlashAttention packs K and V in one tensor per layer
    r"the lab's (?:second )?target",
    r"\(target [<>]=",
]


def test_gpu_memory_utilization_default_is_vllm_026s():
    assert DEFAULT_GPU_MEMORY_UTILIZATION == 0.92
    default = inspect.signature(CostModel.num_gpu_blocks).parameters["gpu_memory_utilization"].default
    assert default == 0.92


def test_num_gpu_blocks_follows_determine_available_memory():
    """requested = ceil(total * util); minus weights, peak activations, non-torch memory and the CUDA-graph
    estimate; divided by the bytes of one block (all layers). The graph term defaults to 0: Llama-2-7B is dense,
    so 0.26 runs it on Model Runner V2, whose profile_cudagraph_memory() returns 0."""
    cm = CostModel()
    page = 2 * LLAMA2_7B.num_layers * LLAMA2_7B.num_kv_heads * LLAMA2_7B.head_dim * 2 * 16
    assert cm.kv_bytes_per_block == page
    act, graphs, non_torch = 1.5e9, 0.5e9, 0.3e9
    requested = math.ceil(H100_SXM.hbm_bytes * 0.92)
    expected = int((requested - LLAMA2_7B.weight_bytes - act - non_torch - graphs) // page)
    assert cm.num_gpu_blocks(activation_bytes=act, cudagraph_bytes=graphs, non_torch_bytes=non_torch) == expected
    assert cm.num_gpu_blocks() == int((requested - LLAMA2_7B.weight_bytes - act - non_torch) // page)
    assert inspect.signature(CostModel.num_gpu_blocks).parameters["cudagraph_bytes"].default == 0
    # each term lowers the count; more utilization raises it
    expected = cm.num_gpu_blocks()
    assert cm.num_gpu_blocks(cudagraph_bytes=graphs) < expected
    assert cm.num_gpu_blocks(non_torch_bytes=0) > expected
    assert cm.num_gpu_blocks(gpu_memory_utilization=0.95) > expected > cm.num_gpu_blocks(0.9)
    # kv_cache_memory_bytes is the KV budget itself, whatever the utilization
    assert cm.num_gpu_blocks(0.5, kv_cache_memory_bytes=40 * 2**30) == 40 * 2**30 // page
    with pytest.raises(ValueError):
        cm.num_gpu_blocks(gpu_memory_utilization=0.1)
    with pytest.raises(ValueError):
        cm.num_gpu_blocks(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError):
        cm.num_gpu_blocks(kv_cache_memory_bytes=-1)


@pytest.mark.parametrize(("block_size", "num_hashes"), [(16, 31), (64, 7), (256, 1)])
@pytest.mark.parametrize("hash_fn", [builtin_hash, sha256_hash], ids=["builtin", "sha256"])
def test_only_full_blocks_are_hashed(block_size, num_hashes, hash_fn):
    assert len(hash_request_tokens(hash_fn, block_size, list(range(500)))) == num_hashes == 500 // block_size


def _docstring_paragraphs() -> list[str]:
    docs = [sched_output.__doc__ or "", sched_output.SchedulerOutput.__doc__ or ""]
    return [p for doc in docs for p in re.split(r"\n\s*\n", inspect.cleandoc(doc))]


def test_lab_only_scheduler_output_fields_are_documented_as_lab_extensions():
    lab_only = sorted(
        f.name for f in dataclasses.fields(sched_output.SchedulerOutput) if f.name not in VLLM_SCHEDULER_OUTPUT_FIELDS
    )
    assert {"blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "block_tables", "slot_mapping"} <= set(
        lab_only
    )
    extension_paragraphs = [p for p in _docstring_paragraphs() if "lab extension" in p.lower()]
    undocumented = [name for name in lab_only if not any(name in p for p in extension_paragraphs)]
    assert not undocumented, (
        f"SchedulerOutput fields that vLLM 0.26 does not have, not named in a docstring paragraph that says "
        f"'lab extension': {undocumented}"
    )


def _lesson_text(path: Path) -> str:
    nb = json.loads(path.read_text(encoding="utf-8"))
    parts = []
    for cell in nb["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


@pytest.mark.parametrize("path", LESSONS, ids=[p.name for p in LESSONS])
def test_no_lesson_repeats_a_wrong_claim(path: Path):
    text = _lesson_text(path)
    found = [pattern for pattern in WRONG_PHRASES if re.search(pattern, text)]
    assert not found, f"{path.name} contains {found}"


@pytest.mark.parametrize("path", LESSONS, ids=[p.name for p in LESSONS])
def test_every_lesson_names_the_vllm_version_it_follows(path: Path):
    assert "vLLM 0.26" in _lesson_text(path), f"{path.name} never says which vLLM it follows"
