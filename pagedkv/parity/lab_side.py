"""The lab's side of a parity run: the library's classes, or a learner's compatible ones, behind the side
interfaces of :mod:`pagedkv.parity.workloads`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.kv_cache_manager import KVCacheManager
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
from pagedkv.request import Request
from pagedkv.scheduler import Scheduler


def _ids(blocks: Sequence[Any] | None) -> list[int] | None:
    return None if blocks is None else [int(b.block_id) for b in blocks]


def make_manager(cfg: ManagerConfig | SchedulerConfig, impl: Any = None) -> Any:
    """A KV cache manager for ``cfg``: the lab's, a learner's ``KVCacheManager``-compatible class (it has
    ``allocate_slots``), or the lab's manager on a learner's ``BlockPool``-compatible class (it has
    ``get_new_blocks``)."""
    if impl is None:
        return KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.enable_caching)
    if hasattr(impl, "allocate_slots"):
        return impl(cfg.num_blocks, cfg.block_size, enable_caching=cfg.enable_caching)
    if hasattr(impl, "get_new_blocks"):
        manager = KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.enable_caching)
        manager.block_pool = impl(cfg.num_blocks, cfg.enable_caching)
        return manager
    raise ValueError(
        f"impl must be a BlockPool-, KVCacheManager- or Scheduler-compatible class, got {impl!r}"
    )


def is_scheduler_factory(impl: Any) -> bool:
    """A ``Scheduler``-compatible class (it has ``schedule``), or any other callable that is not a pool or
    manager class, e.g. ``functools.partial(PluggableScheduler, schedule_waiting=...)``: called as
    ``impl(kv_cache_manager, max_num_seqs, max_num_batched_tokens)``."""
    if hasattr(impl, "schedule"):
        return True
    return callable(impl) and not isinstance(impl, type) and not (
        hasattr(impl, "allocate_slots") or hasattr(impl, "get_new_blocks")
    )


class LabManagerSide(ManagerSideBase):
    """``KVCacheManager`` operations as the manager driver calls them."""

    def __init__(self, cfg: ManagerConfig, impl: Any = None) -> None:
        self.manager = make_manager(cfg, impl)
        self.requests: dict[str, Request] = {}

    def admit(self, rid: str, tokens: list[int]) -> dict[str, Any]:
        try:
            request = Request(rid, tokens, max_tokens=1)
            hits, num_hit_tokens = self.manager.get_computed_blocks(request)
            new = self.manager.allocate_slots(request, request.num_tokens - num_hit_tokens, list(hits))
            obs: dict[str, Any] = {"hit_tokens": int(num_hit_tokens), "hit_blocks": _ids(hits), "new_blocks": _ids(new)}
            if new is not None:
                request.num_computed_tokens = request.num_tokens
                self.requests[rid] = request
                obs["table"] = [int(b) for b in self.manager.get_block_ids(rid)]
            obs["num_free"] = self._free_count()
            return obs
        except Exception as exc:  # a learner's class may raise anything: report it as the divergence
            return error_obs(exc)

    def decode(self, rid: str, token: int) -> dict[str, Any]:
        try:
            request = self.requests[rid]
            request.append_output_token_ids(token)
            new = self.manager.allocate_slots(request, request.num_tokens - request.num_computed_tokens)
            if new is not None:
                request.num_computed_tokens = request.num_tokens
            table = [int(b) for b in self.manager.get_block_ids(rid)]
            return {"new_blocks": _ids(new), "table": table, "num_free": self._free_count()}
        except Exception as exc:
            return error_obs(exc)


def hybrid_kv_cache_config(num_blocks: int, block_size: int, groups) -> KVCacheConfig:
    """The lab's ``KVCacheConfig`` for a hybrid driver's groups (the same specs vLLM's side builds)."""
    specs = hybrid_group_specs(groups, block_size, FullAttentionSpec, SlidingWindowSpec, KVCacheGroupSpec, "float16")
    return KVCacheConfig(num_blocks, [], specs)


def make_hybrid_manager(cfg: HybridManagerConfig | HybridSchedulerConfig, impl: Any = None) -> Any:
    """The lab's ``KVCacheManager`` over ``cfg``'s groups, or ``impl`` (a compatible class) built the same way:
    ``impl(kv_cache_config, max_model_len=..., max_in_flight_tokens=..., enable_caching=...)``."""
    cls = KVCacheManager if impl is None else impl
    in_flight = cfg.max_in_flight_tokens if isinstance(cfg, HybridManagerConfig) else None
    return cls(
        hybrid_kv_cache_config(cfg.num_blocks, cfg.block_size, cfg.groups),
        max_model_len=HYBRID_MAX_MODEL_LEN,
        max_in_flight_tokens=in_flight,
        enable_caching=cfg.enable_caching,
    )


def _per_group(blocks: Any) -> list[list[int]] | None:
    """Blocks as one id list per group, whatever form the manager returned (a list for one group)."""
    if blocks is None:
        return None
    groups = blocks.blocks if hasattr(blocks, "blocks") else [blocks]
    return [[int(b.block_id) for b in g] for g in groups]


def group_tables(rid: str, manager: Any) -> dict[str, list[int]]:
    """``{"rid.g0": [...], ...}``: the request's table in each KV cache group."""
    return {f"{rid}.g{g}": ids for g, ids in enumerate(_per_group(manager.get_blocks(rid)) or [])}


def scheduled_tables(manager: Any, ids: Sequence[str], hybrid: bool) -> dict[str, list[int]]:
    """Each scheduled request's block table: ``{"rid": [...]}``, or one per group (``{"rid.g0": [...], ...}``)."""
    if not hybrid:
        return {rid: [int(b) for b in manager.get_block_ids(rid)] for rid in ids}
    tables: dict[str, list[int]] = {}
    for rid in ids:
        tables.update(group_tables(rid, manager))
    return tables


class LabHybridManagerSide(ManagerSideBase):
    """The lab's ``KVCacheManager`` over a hybrid config, as the hybrid manager driver calls it."""

    def __init__(self, cfg: HybridManagerConfig, impl: Any = None) -> None:
        self.manager = make_hybrid_manager(cfg, impl)
        self.requests: dict[str, Request] = {}

    def _obs(self, rid: str, new: Any) -> dict[str, Any]:
        tables = group_tables(rid, self.manager)
        return {"new_blocks": _per_group(new), "tables": tables, "num_free": self._free_count()}

    def admit(self, rid: str, tokens: list[int], chunk: int, gate: bool) -> dict[str, Any]:
        try:
            request = Request(rid, tokens, max_tokens=1)
            hits, num_hit_tokens = self.manager.get_computed_blocks(request)
            num_new = min(chunk, request.num_tokens - num_hit_tokens)
            new = self.manager.allocate_slots(request, num_new, hits, full_sequence_must_fit=gate)
            obs: dict[str, Any] = {"hit_tokens": int(num_hit_tokens), "hit_blocks": _per_group(hits)}
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
            if new_tokens:
                request.append_output_token_ids(new_tokens)
            new = self.manager.allocate_slots(request, num_new)
            if new is not None:
                request.num_computed_tokens += num_new
            return self._obs(rid, new)
        except Exception as exc:
            return error_obs(exc)


class LabSchedulerSide:
    """The lab's ``Scheduler`` (FCFS, recompute, chunked prefill, vLLM 0.26's admission gate on) as the
    scheduler driver calls it; ``impl`` may be a learner's ``Scheduler`` subclass, or a manager or pool class
    to run under the lab's scheduler."""

    def __init__(self, cfg: SchedulerConfig | HybridSchedulerConfig, impl: Any = None) -> None:
        self.hybrid = isinstance(cfg, HybridSchedulerConfig)
        if self.hybrid:
            if impl is not None and is_scheduler_factory(impl):
                self.scheduler = impl(make_hybrid_manager(cfg), cfg.max_num_seqs, cfg.max_num_batched_tokens)
            else:
                self.scheduler = Scheduler(
                    make_hybrid_manager(cfg, impl), cfg.max_num_seqs, cfg.max_num_batched_tokens,
                    scheduler_reserve_full_isl=True,
                )
        elif impl is not None and is_scheduler_factory(impl):
            manager = KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=cfg.enable_caching)
            self.scheduler = impl(manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        else:
            manager = make_manager(cfg, impl)
            self.scheduler = Scheduler(
                manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, scheduler_reserve_full_isl=True
            )
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        request = Request(rid, prompt, max_tokens=max_tokens)
        self.requests[rid] = request
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.has_unfinished_requests())

    def step(self, sample: Callable[[Sequence[int]], int]) -> dict[str, Any]:
        s = self.scheduler
        try:
            out = s.schedule()
            scheduled = [[rid, int(n)] for rid, n in out.num_scheduled_tokens.items()]
            manager = s.kv_cache_manager
            tables = scheduled_tables(manager, [rid for rid, _ in scheduled], self.hybrid)
            before = {rid: len(self.requests[rid].output_token_ids) for rid, _ in scheduled}
            samples = {}
            for rid, _ in scheduled:
                request = self.requests[rid]
                if request.num_computed_tokens >= request.num_tokens:  # the chunk reached the end
                    samples[rid] = sample(request.all_token_ids[: request.num_computed_tokens])
            s.update_from_output(out, samples)
            kept = {rid: list(self.requests[rid].output_token_ids[n:]) for rid, n in before.items()}
            return {
                "scheduled": scheduled,
                "preempted": sorted(out.preempted_req_ids),
                "tables": tables,
                "kept": {rid: toks for rid, toks in kept.items() if toks},
                "finished": sorted(rid for rid, _ in scheduled if self.requests[rid].is_finished()),
                "num_free": int(manager.block_pool.get_num_free_blocks()),
            }
        except Exception as exc:
            return error_obs(exc)


class LabAsyncSchedulerSide:
    """The lab's ``AsyncScheduler`` (or ``impl``, a learner's class with the same constructor) as the async driver
    calls it: ``schedule`` and ``update`` apart, two batches in flight (``workloads.run_async_scheduler``)."""

    def __init__(self, cfg: SchedulerConfig | HybridSchedulerConfig, impl: Any = None) -> None:
        from pagedkv.async_scheduler import AsyncScheduler

        self.hybrid = isinstance(cfg, HybridSchedulerConfig)
        factory = impl if impl is not None and is_scheduler_factory(impl) else AsyncScheduler
        if self.hybrid and isinstance(factory, type) and not issubclass(factory, AsyncScheduler):
            # lesson 8's Scheduler-compatible impl is a synchronous one: this driver runs the lab's AsyncScheduler
            factory = AsyncScheduler
        manager_impl = None if factory is not AsyncScheduler or is_scheduler_factory(impl) else impl
        # hybrid: built without max_in_flight_tokens, so the scheduler sets max_concurrent_batches · budget
        manager = make_hybrid_manager(cfg, manager_impl) if self.hybrid else make_manager(cfg, manager_impl)
        self.scheduler = factory(manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, eos_token_id: int | None = None) -> None:
        request = Request(rid, prompt, max_tokens=max_tokens, eos_token_id=eos_token_id)
        self.requests[rid] = request
        self.scheduler.add_request(request)

    def has_requests(self) -> bool:
        s = self.scheduler
        return bool(s.has_unfinished_requests() or s.has_finished_requests())

    def _placeholders(self, rids: Any) -> dict[str, int]:
        return {rid: int(self.requests[rid].num_output_placeholders) for rid in rids}

    def schedule(self) -> tuple[Any, dict[str, Any]]:
        s = self.scheduler
        try:
            out = s.schedule()
            scheduled = [[rid, int(n)] for rid, n in out.num_scheduled_tokens.items()]
            manager = s.kv_cache_manager
            ids = [rid for rid, _ in scheduled]
            sampled = [rid for rid in ids if rid not in (out.partial_prefill_req_ids or set())]
            preempted = sorted(out.preempted_req_ids)
            obs = {
                "num_tokens": int(out.total_num_scheduled_tokens),
                "scheduled": scheduled,
                "starts": {rid: int(self.requests[rid].num_computed_tokens) - n for rid, n in scheduled},
                "preempted": preempted,
                "tables": scheduled_tables(manager, ids, self.hybrid),
                "placeholders": self._placeholders(ids + preempted),
                "finished_req_ids": sorted(out.finished_req_ids),
                "num_free": int(manager.block_pool.get_num_free_blocks()),
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
            samples = {rid: sample(self.requests[rid].all_token_ids) for rid in sampled if rid in s.requests}
            s.update_from_output(out, samples)
            kept = {rid: list(self.requests[rid].output_token_ids[n:]) for rid, n in before.items()}
            return {
                "kept": {rid: toks for rid, toks in kept.items() if toks},
                "finished": sorted(rid for rid in ids if self.requests[rid].is_finished()),
                "placeholders": self._placeholders(rid for rid in ids if not self.requests[rid].is_finished()),
                "num_free": int(s.kv_cache_manager.block_pool.get_num_free_blocks()),
            }
        except Exception as exc:
            return error_obs(exc)
