"""The tuned decode dispatch: which kernel, tile, warps, stages and splits for a shape, as one small rule.

The four decode versions stay as the lesson writes them; this module only chooses how to *launch* them.
The rule was derived from a CUDA-graph sweep on an NVIDIA H200 (132 SMs; bf16; 32 query heads, 8 KV
heads, head dim 128, block size 16; ``benchmarks/results/gpu/2026-11-30-h200/sweep_graph.json``):
versions 3 and 4 at every tile (32/64/128), warp count (4/8), pipeline depth (2/3) and split count
around the old heuristic, at 12 shapes from (batch 1, 512 tokens) to (batch 256, 32768 tokens).
What it showed, and the rule that follows:

1. **Fill the GPU with about two programs per SM, not four.** Versions 2/3 launch ``B * Hkv``
   programs. Where that is fewer than ``TARGET_PROGRAMS_PER_SM * num_sms``, split-K multiplies it by
   ``num_splits``; the fastest split count at every small-batch shape made ``B * Hkv * splits`` 256
   programs (batch 1: 4, 32, 32 splits; batch 8: 4 splits), i.e. about 2 per SM. The old rule aimed
   at 4 per SM: it over-split at batch 32-64, where version 3 alone was fastest, and its 256-token
   minimum slice under-split batch 1 at 512-4096 tokens (2 and 16 slices where 4 and 32 won).
2. **A slice is at least one tile.** Splits are capped by the number of tiles in the longest
   sequence (a slice with no tile is a program that does nothing), and rounded down to a power of two
   so every shape picks from a few measured values.
3. **Bigger tiles when programs are few.** With split-K or with at most ~2 programs per SM each program
   must keep more bytes in flight: ``tile_tokens=128`` won there (a 128 x 128 fp16 K tile is 32 KiB per
   load). With more programs (batch >= 64) several share each SM and 64-token tiles, which need half the
   shared memory per pipeline stage, won (by up to 11% at batch 64, 512 tokens).
4. **Three pipeline stages, four warps, everywhere.** ``num_stages=3`` won or tied (within 1%) at
   every shape; ``num_warps=8`` never won.

The sweep measured 2-byte K/V (bf16). An fp8 cache moves half the bytes per tile and uses the same rule.
A 4-byte (fp32) cache was not measured, so it keeps the lesson's 64-token tiles and two stages (a 64-token fp32
tile holds the bytes of a 128-token 16-bit one); only its split count follows the rule.

The choice depends on integers only, so it is cached (``functools.lru_cache``): no GPU time at import,
no timing at run time, the same answer on every machine with the same SM count.

Mirrors: flash-attn's ``num_splits_heuristic`` (fill the SMs, cap the splits) and the launch choices of
vLLM 0.26's ``unified_attention`` (vllm/v1/attention/ops/triton_unified_attention.py), which picks its 2-D
or 3-D (segmented) kernel and tile sizes from the batch and the sequence lengths.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

RESULTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu"  # in a source checkout
SWEEP_PATH = RESULTS_DIR / "2026-11-30-h200" / "sweep_graph.json"  # the measurements this rule was read from
DEFAULT_NUM_SMS = 132  # an H100 SXM / H200; used when no GPU is present to ask
TARGET_PROGRAMS_PER_SM = 2  # programs in flight per SM that the fastest configurations reached
MAX_SPLITS = 64
SPLIT_TILE_TOKENS = 128  # version 4's tile
FEW_PROGRAMS_TILE_TOKENS = 128  # version 3's tile at <= TARGET_PROGRAMS_PER_SM programs per SM
MANY_PROGRAMS_TILE_TOKENS = 64  # version 3's tile above that
NUM_WARPS = 4
NUM_STAGES = 3


class DecodeConfig(NamedTuple):
    """Launch parameters of one decode call (what ``choose_decode_config`` returns)."""

    version: int  # 3 (one program per sequence and KV head) or 4 (split-K)
    tile_tokens: int  # tokens per loop iteration
    num_warps: int
    num_stages: int
    num_splits: int  # 1 for version 3


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int = DEFAULT_NUM_SMS,
    *,
    tile_tokens: int = SPLIT_TILE_TOKENS,
) -> int:
    """How many slices to cut each sequence's context into: enough for ~2 programs per SM, no empty slice.

    ``floor_pow2(min(TARGET_PROGRAMS_PER_SM * num_sms // (batch * Hkv), tiles, MAX_SPLITS))`` with
    ``tiles = ceil(max_seq_len / tile_tokens)``, at least 1. On 132 SMs with 8 KV heads: batch 1 gets 4
    slices at 512 tokens, 32 at 4096 and 32768; batch 8 gets 4, batch 16 gets 2; batch 17 and up get 1 (no split).

    Mirrors: flash-attn's ``num_splits_heuristic``; vLLM 0.26's ``unified_attention`` splits the
    context into a fixed number of segments for its 3-D kernel instead.
    """
    if min(batch, num_kv_heads, max_seq_len, num_sms, tile_tokens) < 1:
        raise ValueError(
            f"choose_num_splits needs positive sizes; got batch={batch}, num_kv_heads={num_kv_heads}, "
            f"max_seq_len={max_seq_len}, num_sms={num_sms}, tile_tokens={tile_tokens}"
        )
    wanted = TARGET_PROGRAMS_PER_SM * num_sms // (batch * num_kv_heads)
    tiles = -(-max_seq_len // tile_tokens)
    return _floor_pow2(min(wanted, tiles, MAX_SPLITS))


FP32_TILE_TOKENS = 64  # 4-byte caches: the lesson's tile and pipeline depth (not swept; see above)
FP32_NUM_STAGES = 2


@functools.lru_cache(maxsize=4096)
def choose_decode_config(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = DEFAULT_NUM_SMS,
                         element_size: int = 2) -> DecodeConfig:
    """The launch parameters ``paged_attention_decode`` uses by default for a shape (see the module docstring).

    Version 4 with ``choose_num_splits`` slices of 128-token tiles when the GPU would otherwise hold
    fewer than ~2 programs per SM; else version 3, with 128-token tiles up to 2 programs per SM and 64
    above. Always 4 warps and 3 stages. ``element_size`` is the KV cache's (2 for fp16/bf16, 1 for fp8, 4
    for fp32: 64-token tiles and 2 stages). Cached per shape.
    """
    if element_size >= 4:
        splits = choose_num_splits(batch, num_kv_heads, max_seq_len, num_sms, tile_tokens=FP32_TILE_TOKENS)
        return DecodeConfig(4 if splits > 1 else 3, FP32_TILE_TOKENS, NUM_WARPS, FP32_NUM_STAGES, splits)
    splits = choose_num_splits(batch, num_kv_heads, max_seq_len, num_sms)
    if splits > 1:
        return DecodeConfig(4, SPLIT_TILE_TOKENS, NUM_WARPS, NUM_STAGES, splits)
    few = batch * num_kv_heads <= TARGET_PROGRAMS_PER_SM * num_sms
    tile = FEW_PROGRAMS_TILE_TOKENS if few else MANY_PROGRAMS_TILE_TOKENS
    return DecodeConfig(3, tile, NUM_WARPS, NUM_STAGES, 1)


#: Shared memory a decode program needs besides its K and V tiles (bytes), read off Triton's compiled kernels.
SHARED_MEMORY_OVERHEAD = 8192


def fit_tile_tokens(tile_tokens: int, head_dim: int, element_size: int, max_shared_memory: int) -> int:
    """``tile_tokens`` halved until one K and one V tile fit the GPU's shared memory per block (at least 16).

    A program holds ``2 * tile_tokens * next_pow2(head_dim) * max(element_size, 2)`` bytes of tiles plus
    ``SHARED_MEMORY_OVERHEAD`` (what Triton 3.6 compiles these kernels to; an fp8 tile is widened to 16 bits).
    The H200's 227 KiB holds every tile the rule picks; a T4's 64 KiB does not hold a 128-token 16-bit tile, or a
    64-token fp32 one, at head dim 128 (72 KiB): there the tile halves, and Triton would otherwise refuse the
    launch (``OutOfResources``).
    """
    block_d = max(16, 1 << (max(1, head_dim) - 1).bit_length())
    while tile_tokens > 16 and (2 * tile_tokens * block_d * max(element_size, 2) + SHARED_MEMORY_OVERHEAD
                                > max_shared_memory):
        tile_tokens //= 2
    return tile_tokens


def reachable_configs(num_sms: int = DEFAULT_NUM_SMS) -> list[DecodeConfig]:
    """Every configuration ``choose_decode_config`` can return for ``num_sms`` (the tests run each one)."""
    configs = {DecodeConfig(3, FEW_PROGRAMS_TILE_TOKENS, NUM_WARPS, NUM_STAGES, 1),
               DecodeConfig(3, MANY_PROGRAMS_TILE_TOKENS, NUM_WARPS, NUM_STAGES, 1),
               DecodeConfig(3, FP32_TILE_TOKENS, NUM_WARPS, FP32_NUM_STAGES, 1)}
    splits = 2
    while splits <= min(MAX_SPLITS, TARGET_PROGRAMS_PER_SM * num_sms):
        configs.add(DecodeConfig(4, SPLIT_TILE_TOKENS, NUM_WARPS, NUM_STAGES, splits))
        configs.add(DecodeConfig(4, FP32_TILE_TOKENS, NUM_WARPS, FP32_NUM_STAGES, splits))
        splits *= 2
    return sorted(configs)
