"""One tensor-parallel rank: its shard of the model, its shard of every layer's KV cache, its model runner.

A :class:`Worker` lives in its own process (started by :class:`~pagedkv.engine.multiproc_executor.
MultiprocExecutor`) and does what the executor asks, in the same order on every rank: load and shard the model,
report how many blocks fit in its memory, allocate the cache with the count the engine chose (the minimum over
the ranks), then run each step's forward pass. All ranks run the same step on the same scheduler output: they
differ only in the heads, MLP features and vocabulary slice they hold, and meet in the all-reduces inside the
model. Mirrors vLLM 0.26's ``Worker`` (``vllm/v1/worker/gpu_worker.py``: ``load_model``,
``determine_available_memory``, ``initialize_from_config``, ``execute_model``).
"""

from __future__ import annotations

import inspect
import io
from typing import Any

import torch

from pagedkv.distributed.layers import ParallelLMHead
from pagedkv.distributed.shard import shard_model
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.sched_output import SchedulerOutput
from pagedkv.sizing.kv_cache_utils import kv_page_bytes

#: Bytes of KV cache per rank on a CPU when the engine names none: the one-process engine's CPU pool
#: (``pagedkv.engine.llm.CPU_KV_CACHE_BYTES``).
CPU_KV_CACHE_BYTES = 128 * 2**20


class TPModelRunner(ModelRunner):
    """The model runner of one rank: the same runner over the shard, whose LM head all-gathers the logits of the
    sampled rows across the ranks (``LogitsProcessor._gather_logits``), so every rank ends with ``[S, V]``."""

    def compute_logits(self, hidden: torch.Tensor, reuse_buffer: bool = True) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        if isinstance(head, ParallelLMHead):
            return head.compute_logits(hidden)  # [S, V], all-gathered (a fresh tensor)
        return super().compute_logits(hidden, reuse_buffer)


def serialize_model(model: torch.nn.Module) -> bytes:
    """The model's class, config and weights as bytes (``torch.save``), what each rank rebuilds its shard from.
    vLLM's workers read their slices from the checkpoint files instead (``weight_loader``)."""
    buf = io.BytesIO()
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}  # each rank moves its shard to its device
    torch.save({"cls": type(model), "config": model.config, "state_dict": state}, buf)
    return buf.getvalue()


class Worker:
    """One rank of ``world_size``: device ``cuda:rank`` under NCCL, the CPU under gloo."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.model: torch.nn.Module | None = None
        self.runner: TPModelRunner | None = None

    def load_model(self, blob: bytes) -> dict[str, Any]:
        """Rebuild the model from :func:`serialize_model`'s bytes, keep this rank's shard (``shard_model``), move
        it to the device. Returns what the rank holds: parameter count and KV heads."""
        from pagedkv.engine.attention import register_pagedkv_attention

        register_pagedkv_attention()
        data = torch.load(io.BytesIO(blob), weights_only=False)
        dtype = next(iter(data["state_dict"].values())).dtype
        model = data["cls"](data["config"]).to(dtype)
        model.load_state_dict(data["state_dict"])
        del data
        self.model = shard_model(model, self.world_size, self.rank).to(self.device).eval()
        return {"rank": self.rank, "num_parameters": sum(p.numel() for p in self.model.parameters()),
                "num_kv_heads": self.model.config.num_key_value_heads}

    def block_bytes(self, block_size: int) -> int:
        """One block on this rank, all layers, K and V: lesson 5's page (``2 · block_size · kv_heads_per_rank ·
        head_dim · bytes``, the sharded config's KV heads) times ``num_layers``."""
        c = self.model.config
        return kv_page_bytes(c, block_size, next(self.model.parameters()).dtype) * c.num_hidden_layers

    def determine_num_blocks(self, block_size: int, kv_cache_memory_bytes: int | None,
                             gpu_memory_utilization: float) -> int:
        """How many blocks fit on this rank: ``kv_cache_memory_bytes`` (vLLM's ``CacheConfig.
        kv_cache_memory_bytes``, per rank) or, when it is None, what the device has left (a CUDA GPU:
        ``ceil(total · utilization)`` minus what is already in use, as measured by ``torch.cuda.mem_get_info``, a
        simpler account than ``determine_available_memory``'s profile run; a CPU: ``CPU_KV_CACHE_BYTES``), divided
        by this rank's block bytes. Mirrors ``Worker.determine_available_memory`` then ``get_num_blocks``."""
        if kv_cache_memory_bytes is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                kv_cache_memory_bytes = int(-(-total * gpu_memory_utilization // 1)) - (total - free)
            else:
                kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        return max(0, int(kv_cache_memory_bytes) // self.block_bytes(block_size))

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, max_model_len: int,
                         backend: str, max_num_seqs: int, seed: int = 0) -> tuple[int, ...]:
        """Allocate this rank's cache with the engine's block count and build its runner (a runner that samples
        gets the engine's ``seed``: every rank then draws the same tokens from the same gathered logits). Returns
        one layer's key-cache shape, ``(num_blocks, block_size, kv_heads_per_rank, head_dim)``. Mirrors
        ``Worker.initialize_from_config``."""
        kwargs: dict[str, Any] = {}
        if "sampler" in inspect.signature(ModelRunner).parameters:
            from pagedkv.engine.sampler import Sampler, make_generator

            kwargs["sampler"] = Sampler(make_generator(seed, self.device))
        self.runner = TPModelRunner(self.model, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                    max_model_len=max_model_len, num_cpu_blocks=num_cpu_blocks, backend=backend,
                                    use_cuda_graph=False, max_num_seqs=max_num_seqs, **kwargs)
        return tuple(self.runner.kv_caches[0][0].shape)

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache (all layers, K and V)."""
        return int(self.runner.kv_cache_bytes())

    def kv_cache_shape(self) -> tuple[int, ...]:
        """One layer's key-cache shape on this rank."""
        return tuple(self.runner.kv_caches[0][0].shape)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        """Run the step on this rank's shard. Rank 0 returns the runner's output (the executor's output rank,
        ``MultiprocExecutor._get_output_rank``; every rank computed the same); the others return None."""
        out = self.runner.execute_model(scheduler_output)
        if hasattr(out, "get_output"):  # the samples of an asynchronous step: wait for them
            out = out.get_output()
        if self.rank != 0:
            return None
        if isinstance(out, tuple):  # (sample_req_ids, logits [S, V]): the logits to the CPU
            req_ids, logits = out
            return req_ids, logits.detach().to("cpu", copy=True)
        return out

    def check_replicated(self, name: str) -> float:
        """A replicated parameter's (e.g. a norm's) sum, to check every rank holds the same copy."""
        return float(self.model.get_parameter(name).double().sum())
