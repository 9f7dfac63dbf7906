"""The tensor-parallel group of this process, and the collectives the sharded layers call.

One process per rank; each joins one ``torch.distributed`` group (gloo on a CPU, NCCL on GPUs) at start-up
(:func:`init_distributed_environment`) and leaves it at shutdown (:func:`destroy_distributed_environment`).
Outside a group (the ordinary one-process engine) the world has one rank and every collective returns its
input: the same layers then compute the unsharded model. Mirrors vLLM 0.26's ``vllm/distributed/
parallel_state.py`` (``init_distributed_environment``, ``get_tp_group``, ``GroupCoordinator``) and
``communication_op.py`` (``tensor_model_parallel_all_reduce``, ``tensor_model_parallel_all_gather``).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_TP_INITIALIZED = False


def init_distributed_environment(
    rank: int,
    world_size: int,
    store: dist.Store,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> None:
    """Join the group of ``world_size`` ranks as ``rank``, meeting the others through ``store`` (a
    ``TCPStore`` the engine holds on the loopback: it picked a free port, so parallel test runs never collide).
    ``timeout_s`` bounds every collective (gloo raises after it; a rank that died leaves the others waiting no
    longer). Mirrors ``init_distributed_environment`` (vLLM passes ``tcp://`` init methods instead)."""
    global _TP_INITIALIZED
    if _TP_INITIALIZED:
        raise RuntimeError("this process already belongs to a tensor-parallel group")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _TP_INITIALIZED = True


def destroy_distributed_environment() -> None:
    """Leave the group (idempotent). Mirrors ``destroy_distributed_environment``."""
    global _TP_INITIALIZED
    if _TP_INITIALIZED and dist.is_initialized():
        dist.destroy_process_group()
    _TP_INITIALIZED = False


def get_tensor_model_parallel_world_size() -> int:
    """Ranks in this process's group (1 outside one)."""
    return dist.get_world_size() if _TP_INITIALIZED else 1


def get_tensor_model_parallel_rank() -> int:
    """This process's rank (0 outside a group)."""
    return dist.get_rank() if _TP_INITIALIZED else 0


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` summed, on every rank (in place; returns ``x``). The one collective of a
    row-parallel layer. Mirrors ``tensor_model_parallel_all_reduce``."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` (same shape on each) concatenated along ``dim`` in rank order, on every rank.
    Mirrors ``tensor_model_parallel_all_gather`` (what ``LogitsProcessor._gather_logits`` calls: vLLM 0.26's
    platforms default to all-gather, ``Platform.use_all_gather``)."""
    world = get_tensor_model_parallel_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
