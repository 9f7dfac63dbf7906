"""vLLM 0.26's own ``KVCacheManager`` and ``Scheduler`` behind the side interfaces of
:mod:`pagedkv.parity.workloads`. Imported only inside the worker process (:mod:`pagedkv.parity._worker`),
where vLLM's unpacked sources are importable; nothing of vLLM's compiled code is loaded.

Built as ``docs/vllm-core-on-cpu.md`` says vLLM's core runs on a CPU: a ``KVCacheConfig`` with one
full-attention group; block hashes with ``sha256`` after ``init_none_hash``; the scheduler from real
``SchedulerConfig``/``CacheConfig``/``ParallelConfig``/``ObservabilityConfig``/``KVEventsConfig`` and a
stand-in for ``ModelConfig`` (which would need vLLM's model registry) answering the attributes the
scheduler reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config import CacheConfig, KVEventsConfig, ObservabilityConfig, ParallelConfig
from vllm.config import SchedulerConfig as VllmSchedulerConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from pagedkv.parity.workloads import (
    HYBRID_MAX_MODEL_LEN,
    HybridManagerConfig,
    HybridSchedulerConfig,
    ManagerConfig,
    ManagerSideBase,
    SchedulerConfig,
    error_obs,
    hybrid_group_specs,
)

MAX_MODEL_LEN = 4096
init_none_hash(sha256)


def kv_cache_config(num_blocks: int, block_size: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])


def hybrid_kv_cache_config(num_blocks: int, block_size: int, groups) -> KVCacheConfig:
    specs = hybrid_group_specs(
        groups, block_size, FullAttentionSpec, SlidingWindowSpec, KVCacheGroupSpec, torch.float16
    )
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)


def group_tables(rid: str, block_ids) -> dict[str, list[int]]:
    """``{"rid.g0": [...], "rid.g1": [...]}``: one table per KV cache group."""
    return {f"{rid}.g{g}": [int(b) for b in ids] for g, ids in enumerate(block_ids)}


def make_request(rid: str, tokens: list[int], max_tokens: int, block_size: int,
                 eos_token_id: int | None = None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=eos_token_id is None)
    if eos_token_id is not None:  # what the engine's input processor does with the tokenizer's EOS
        params.update_from_generation_config({}, eos_token_id)
    return Request(rid, list(tokens), params, None, block_hasher=get_request_block_hasher(block_size, sha256))


class VllmManagerSide(ManagerSideBase):
    def __init__(self, cfg: ManagerConfig) -> None:
        self.cfg = cfg
        self.manager = KVCacheManager(
            kv_cache_config(cfg.num_blocks, cfg.block_size),
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=cfg.block_size,
            hash_block_size=cfg.block_size,
            enable_caching=cfg.enable_caching,
        )
        self.requests: dict[str, Request] = {}

    def _table(self, rid: str) -> list[int]:
        return [int(b) for b in self.manager.get_block_ids(rid)[0]]

    def admit(self, rid: str, tokens: list[int]) -> dict[str, Any]:
        try:
            request = make_request(rid, tokens, 1, self.cfg.block_size)
            hits, num_hit_tokens, _ = self.manager.get_computed_blocks(request)
            hit_ids = [int(b.block_id) for b in hits.blocks[0]]
            new = self.manager.allocate_slots(
                request, request.num_tokens - num_hit_tokens, num_hit_tokens, hits
            )
            obs: dict[str, Any] = {
                "hit_tokens": int(num_hit_tokens),
                "hit_blocks": hit_ids,
                "new_blocks": None if new is None else [int(b.block_id) for b in new.blocks[0]],
            }
            if new is not None:
                request.num_computed_tokens = request.num_tokens
                self.requests[rid] = request
                obs["table"] = self._table(rid)
            obs["num_free"] = self._free_count()
            return obs
        except Exception as exc:
            return error_obs(exc)

    def decode(self, rid: str, token: int) -> dict[str, Any]:
        try:
            request = self.requests[rid]
            request.append_output_token_ids(int(token))
            new = self.manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
            if new is not None:
                request.num_computed_tokens = request.num_tokens
            new_ids = None if new is None else [int(b.block_id) for b in new.blocks[0]]
            return {"new_blocks": new_ids, "table": self._table(rid), "num_free": self._free_count()}
        except Exception as exc:
            return error_obs(exc)


class _NoStructuredOutput:
    """Plain requests never use structured output; these are the calls the scheduler makes regardless."""

    def should_advance(self, request: Request) -> bool:
        return False

    def grammar_bitmask(self, *args: Any, **kwargs: Any) -> None:
        return None

    def trim_reasoning_for_advance(self, *args: Any, **kwargs: Any) -> None:
        return None


class VllmHybridManagerSide(ManagerSideBase):
    """vLLM 0.26's ``KVCacheManager`` over a hybrid ``KVCacheConfig`` (lesson 8)."""

    def __init__(self, cfg: HybridManagerConfig) -> None:
        self.cfg = cfg
        self.manager = KVCacheManager(
            hybrid_kv_cache_config(cfg.num_blocks, cfg.block_size, cfg.groups),
            max_model_len=HYBRID_MAX_MODEL_LEN,
            scheduler_block_size=cfg.block_size,
            hash_block_size=cfg.block_size,
            max_in_flight_tokens=cfg.max_in_flight_tokens,
            enable_caching=cfg.enable_caching,
        )
        self.requests: dict[str, Request] = {}

    def _obs(self, rid: str, new) -> dict[str, Any]:
        return {
            "new_blocks": None if new is None else [[int(b.block_id) for b in g] for g in new.blocks],
            "tables": group_tables(rid, self.manager.get_block_ids(rid)),
            "num_free": self._free_count(),
        }

    def admit(self, rid: str, tokens: list[int], chunk: int, gate: bool) -> dict[str, Any]:
        try:
            request = make_request(rid, tokens, 1, self.cfg.block_size)
            hits, num_hit_tokens, _ = self.manager.get_computed_blocks(request)
            num_new = min(chunk, request.num_tokens - num_hit_tokens)
            new = self.manager.allocate_slots(
                request, num_new, num_hit_tokens, hits, full_sequence_must_fit=gate
            )
            obs: dict[str, Any] = {
                "hit_tokens": int(num_hit_tokens),
                "hit_blocks": [[int(b.block_id) for b in g] for g in hits.blocks],
            }
            if new is not None:
                request.num_computed_tokens = num_hit_tokens + num_new
                self.requests[rid] = request
                obs.update(self._obs(rid, new))
            else:
                obs["new_blocks"] = None
            obs["num_free"] = self._free_count()
            return obs
        except Exception as exc:
            return error_obs(exc)

    def grow(self, rid: str, new_tokens: list[int], num_new: int) -> dict[str, Any]:
        try:
            request = self.requests[rid]
            for token in new_tokens:
                request.append_output_token_ids(int(token))
            new = self.manager.allocate_slots(request, num_new)
            if new is not None:
                request.num_computed_tokens += num_new
            return self._obs(rid, new)
        except Exception as exc:
            return error_obs(exc)


def make_scheduler(cfg: SchedulerConfig | HybridSchedulerConfig, async_scheduling: bool = False) -> Scheduler:
    sched = VllmSchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        policy="fcfs",
        scheduler_reserve_full_isl=True,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )
    cache = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=cfg.enable_caching)
    cache.num_gpu_blocks = cfg.num_blocks
    model = SimpleNamespace(
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        is_multimodal_model=False,
        is_diffusion=False,
        uses_mrope=False,
        enable_return_routed_experts=False,
    )
    hybrid = isinstance(cfg, HybridSchedulerConfig)
    batches = 2 if async_scheduling else 1  # VllmConfig.max_concurrent_batches (one pipeline stage)
    vllm_config = SimpleNamespace(
        scheduler_config=sched,
        cache_config=cache,
        lora_config=None,
        parallel_config=ParallelConfig(),
        observability_config=ObservabilityConfig(),
        kv_events_config=KVEventsConfig(),
        model_config=model,
        kv_transfer_config=None,
        ec_transfer_config=None,
        speculative_config=None,
        num_speculative_tokens=0,
        # What VllmConfig.max_in_flight_tokens is (max_concurrent_batches · max_num_batched_tokens); the non-hybrid
        # drivers keep None (no sliding group reads it).
        max_in_flight_tokens=batches * cfg.max_num_batched_tokens if hybrid else None,
        # async: what 0.26 runs for dense models (Model Runner V2, two batches in flight)
        use_v2_model_runner=async_scheduling,
        max_concurrent_batches=batches,
    )
    kv_config = (
        hybrid_kv_cache_config(cfg.num_blocks, cfg.block_size, cfg.groups)  # type: ignore[union-attr]
        if hybrid
        else kv_cache_config(cfg.num_blocks, cfg.block_size)
    )
    return (AsyncScheduler if async_scheduling else Scheduler)(
        vllm_config,
        kv_config,
        structured_output_manager=_NoStructuredOutput(),
        block_size=cfg.block_size,
        log_stats=False,
    )


class VllmSchedulerSide:
    def __init__(self, cfg: SchedulerConfig | HybridSchedulerConfig) -> None:
        self.cfg = cfg
        self.scheduler = make_scheduler(cfg)
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        request = make_request(rid, prompt, max_tokens, self.cfg.block_size)
        self.requests[rid] = request
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def step(self, sample: Callable[[Sequence[int]], int]) -> dict[str, Any]:
        s = self.scheduler
        try:
            out = s.schedule()
            scheduled = [[rid, int(n)] for rid, n in out.num_scheduled_tokens.items()]
            if isinstance(self.cfg, HybridSchedulerConfig):
                tables = {}
                for rid, _ in scheduled:
                    tables.update(group_tables(rid, s.kv_cache_manager.get_block_ids(rid)))
            else:
                tables = {rid: [int(b) for b in s.kv_cache_manager.get_block_ids(rid)[0]] for rid, _ in scheduled}
            before = {rid: len(self.requests[rid].output_token_ids) for rid, _ in scheduled}
            ids = [rid for rid, _ in scheduled]
            sampled: list[list[int]] = []
            for rid in ids:
                request = self.requests[rid]
                reached_end = request.num_computed_tokens >= request.num_tokens
                tokens = list(request.all_token_ids[: request.num_computed_tokens])
                sampled.append([sample(tokens)] if reached_end else [])
            runner_output = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
            )
            s.update_from_output(out, runner_output)
            kept = {rid: [int(t) for t in self.requests[rid].output_token_ids[n:]] for rid, n in before.items()}
            return {
                "scheduled": scheduled,
                "preempted": sorted(out.preempted_req_ids or ()),
                "tables": tables,
                "kept": {rid: toks for rid, toks in kept.items() if toks},
                "finished": sorted(rid for rid in ids if self.requests[rid].is_finished()),
                "num_free": int(s.kv_cache_manager.block_pool.get_num_free_blocks()),
            }
        except Exception as exc:
            return error_obs(exc)


class VllmAsyncSchedulerSide:
    """vLLM 0.26's ``AsyncScheduler``, called as ``EngineCore.step_with_batch_queue`` calls it."""

    def __init__(self, cfg: SchedulerConfig | HybridSchedulerConfig) -> None:
        self.cfg = cfg
        self.scheduler = make_scheduler(cfg, async_scheduling=True)
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, eos_token_id: int | None = None) -> None:
        request = make_request(rid, prompt, max_tokens, self.cfg.block_size, eos_token_id)
        self.requests[rid] = request
        self.scheduler.add_request(request)

    def has_requests(self) -> bool:
        return bool(self.scheduler.has_requests())

    def _placeholders(self, rids: Any) -> dict[str, int]:
        return {rid: int(self.requests[rid].num_output_placeholders) for rid in rids}

    def _tables(self, ids: list[str]) -> dict[str, list[int]]:
        """Each request's block table: ``{"rid": [...]}``, or one per group (``{"rid.g0": [...], ...}``)."""
        manager = self.scheduler.kv_cache_manager
        if not isinstance(self.cfg, HybridSchedulerConfig):
            return {rid: [int(b) for b in manager.get_block_ids(rid)[0]] for rid in ids}
        tables: dict[str, list[int]] = {}
        for rid in ids:
            tables.update(group_tables(rid, manager.get_block_ids(rid)))
        return tables

    def schedule(self) -> tuple[Any, dict[str, Any]]:
        s = self.scheduler
        try:
            out = s.schedule()
            scheduled = [[rid, int(n)] for rid, n in out.num_scheduled_tokens.items()]
            ids = [rid for rid, _ in scheduled]
            sampled = [rid for rid in ids if not self.requests[rid].is_prefill_chunk]
            preempted = sorted(out.preempted_req_ids or ())
            obs = {
                "num_tokens": int(out.total_num_scheduled_tokens),
                "scheduled": scheduled,
                "starts": {rid: int(self.requests[rid].num_computed_tokens) - n for rid, n in scheduled},
                "preempted": preempted,
                "tables": self._tables(ids),
                "placeholders": self._placeholders(ids + preempted),
                "finished_req_ids": sorted(out.finished_req_ids),
                "num_free": int(s.kv_cache_manager.block_pool.get_num_free_blocks()),
            }
            return (out, sampled), obs
        except Exception as exc:
            return None, error_obs(exc)

    def update(self, handle: Any, sample: Callable[[Sequence[int]], int]) -> dict[str, Any]:
        s = self.scheduler
        try:
            out, sampled = handle
            ids = list(out.num_scheduled_tokens)
            before = {rid: len(self.requests[rid].output_token_ids) for rid in ids}
            alive = {rid for rid in sampled if rid in s.requests and not self.requests[rid].is_finished()}
            tokens = [[sample(list(self.requests[rid].all_token_ids))] if rid in alive else [] for rid in ids]
            s.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=tokens))
            kept = {rid: [int(t) for t in self.requests[rid].output_token_ids[n:]] for rid, n in before.items()}
            return {
                "kept": {rid: toks for rid, toks in kept.items() if toks},
                "finished": sorted(rid for rid in ids if self.requests[rid].is_finished()),
                "placeholders": self._placeholders(rid for rid in ids if not self.requests[rid].is_finished()),
                "num_free": int(s.kv_cache_manager.block_pool.get_num_free_blocks()),
            }
        except Exception as exc:
            return error_obs(exc)
