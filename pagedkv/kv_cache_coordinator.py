"""Several KV cache groups on one block pool: the coordinator asks each group's manager and combines them.

``KVCacheManager`` built from a ``KVCacheConfig`` talks to one coordinator, which owns the ``BlockPool`` and
one ``SingleTypeKVCacheManager`` per group. Allocation sums the groups' needs (all or nothing: a step that
cannot get every group's blocks gets none); freeing and releasing out-of-window blocks go to every group; a
prefix hit must be a hit for every group at the same length:

- ``UnitaryKVCacheCoordinator``: one group (every layer alike: a dense model, or Mistral's all-sliding
  layers); the hit is that group's.
- ``HybridKVCacheCoordinator``: several attention types (Gemma 3, gpt-oss). Full attention is asked first
  (its hit only shrinks as the length does), then each other type, with the length found so far as its
  limit; a type that answers shorter makes the others check again, until none shrinks it. With one full
  and one other type a single pass is enough.
- ``KVCacheCoordinatorNoPrefixCache``: prefix caching off; never a hit.

Mirrors ``vllm/v1/core/kv_cache_coordinator.py``. Lab differences: every group has the same block size
(so the scheduler's block size, the hash block size and each group's are one number); no EAGLE, context
parallelism, KV connectors, encoder or Mamba groups, or sparse retention.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from pagedkv.kv_cache_utils import BlockHash, KVCacheBlock
from pagedkv.request import Request
from pagedkv.single_type_kv_cache_manager import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from pagedkv.utils import cdiv


class KVCacheCoordinator:
    """The block pool and one manager per KV cache group (``single_type_managers[i]`` for group ``i``).
    Mirrors ``KVCacheCoordinator``."""

    def __init__(
        self, kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int, enable_caching: bool
    ) -> None:
        sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
        if len(sizes) != 1:
            raise ValueError(
                f"every KV cache group must have the same block_size here, got {sorted(sizes)} (vLLM 0.26 also "
                "allows multiples of one hash_block_size; the lab does not)"
            )
        self.kv_cache_config = kv_cache_config
        self.block_size = sizes.pop()
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching)
        self.max_in_flight_tokens = max_in_flight_tokens
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                g.kv_cache_spec, self.block_pool, enable_caching, i, max_model_len, max_in_flight_tokens
            )
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )

    def set_max_in_flight_tokens(self, max_in_flight_tokens: int) -> None:
        """Set the in-flight bound that caps what the admission gate counts for a sliding-window group
        (``SlidingWindowSpec.max_admission_blocks_per_request``). vLLM's scheduler passes
        ``max_concurrent_batches · max_num_batched_tokens`` when it builds the manager; the lab's
        ``Scheduler`` calls this with its ``max_num_batched_tokens`` when the manager was built without one."""
        self.max_in_flight_tokens = max_in_flight_tokens
        for m in self.single_type_managers:
            spec = m.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                m._max_admission_blocks_per_request = spec.max_admission_blocks_per_request(
                    max_in_flight_tokens, self.max_model_len
                )

    def set_block_pool(self, block_pool: BlockPool) -> None:
        """Use another (compatible) pool, in every group: only while no request holds blocks."""
        self.block_pool = block_pool
        for manager in self.single_type_managers:
            manager.block_pool = block_pool

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Sum over the groups of ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``. Mirrors
        ``KVCacheCoordinator.get_num_blocks_to_allocate``."""
        return sum(
            m.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i], total_computed_tokens, apply_admission_cap
            )
            for i, m in enumerate(self.single_type_managers)
        )

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]], num_local_computed_tokens: int
    ) -> None:
        """Every group takes its hits (first all touches, then nothing else: the lab has no external KV).
        A no-op for a request that already holds blocks. Mirrors ``allocate_new_computed_blocks``."""
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            return
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        """Each group's fresh blocks for ``num_tokens`` token slots, group by group. Mirrors
        ``KVCacheCoordinator.allocate_new_blocks``."""
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Every group enters its newly full blocks in the prefix cache. Mirrors ``cache_blocks``."""
        for m in self.single_type_managers:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Group by group, each group's blocks last first. Mirrors ``KVCacheCoordinator.free``."""
        for m in self.single_type_managers:
            m.free(request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> None:
        """Every group releases what its attention no longer reads. Mirrors ``remove_skipped_blocks``."""
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, processed_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's table in each group (empty lists for an unknown id). Mirrors ``get_blocks``."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [m.get_num_common_prefix_blocks(running_request_id) for m in self.single_type_managers]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Each group's hit blocks and the common hit length (at most ``max_cache_hit_length`` tokens)."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any number of groups, never a hit. Mirrors ``KVCacheCoordinatorNoPrefixCache``."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: its manager's hit is the hit. Mirrors ``UnitaryKVCacheCoordinator``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if len(self.kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("UnitaryKVCacheCoordinator takes exactly one KV cache group")
        self.kv_cache_spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        manager = self.single_type_managers[0]
        return type(manager).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec
        )


class SpecGroup(NamedTuple):
    """The KV cache groups that share one spec, looked up together. Mirrors ``SpecGroup``."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several attention types on one pool. ``attention_groups`` gathers the groups by spec, full attention
    first. Mirrors ``HybridKVCacheCoordinator``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.verify_and_split_kv_cache_groups()

    def verify_and_split_kv_cache_groups(self) -> None:
        """Gather groups with equal specs (looked up with one pass), full attention first: its left-to-right
        scan gives the tightest first bound. Mirrors ``verify_and_split_kv_cache_groups``."""
        self.attention_groups: list[SpecGroup] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            for group in self.attention_groups:
                if group.spec == g.kv_cache_spec:
                    group.group_ids.append(i)
                    break
            else:
                self.attention_groups.append(SpecGroup(g.kv_cache_spec, [i], type(self.single_type_managers[i])))
        if len(self.attention_groups) < 2:
            raise ValueError("HybridKVCacheCoordinator needs at least two different KV cache specs")
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """A fixed point: each attention type accepts the current length or shortens it; any shortening
        makes every type check again, and the length only decreases, so it ends. Full attention's hit is
        looked up once and then cut to the length. One pass suffices for one full plus one other type.
        E.g. full + window 8, block size 4, a 20-token prefix cached in both groups but the window group's
        blocks 0-2 since freed: full finds 5 blocks (20 tokens), the window group finds blocks 3-4 (its 2
        needed), so the hit is 20 tokens, tables ``[b0..b4]`` and ``[null, null, null, b3, b4]``. Mirrors
        ``HybridKVCacheCoordinator.find_longest_cache_hit``."""
        num_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_length = max_cache_hit_length
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_lengths = [0] * num_groups
        is_simple_hybrid = len(self.attention_groups) == 2 and isinstance(
            self.attention_groups[0].spec, FullAttentionSpec
        )
        while True:
            curr = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                first = group_ids[0]
                if isinstance(spec, FullAttentionSpec) and hit_blocks[first] is not None:
                    curr = min(curr, hit_lengths[first])  # downward closed: no second lookup
                    continue
                blocks, new_length = manager_cls.find_longest_cache_hit(
                    block_hashes, curr, group_ids, self.block_pool, spec
                )
                curr = new_length
                for gid, b in zip(group_ids, blocks, strict=True):
                    hit_blocks[gid] = b
                    hit_lengths[gid] = new_length
            if curr >= hit_length:
                break
            hit_length = curr
            if is_simple_hybrid:
                break
        first_group = self.attention_groups[0]
        if isinstance(first_group.spec, FullAttentionSpec):
            n = cdiv(hit_length, self.block_size)
            for gid in first_group.group_ids:
                if hit_blocks[gid] is not None:
                    del hit_blocks[gid][n:]  # type: ignore[index]
        return tuple(b if b is not None else [] for b in hit_blocks), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig, max_model_len: int, max_in_flight_tokens: int, enable_caching: bool
) -> KVCacheCoordinator:
    """No prefix caching → ``KVCacheCoordinatorNoPrefixCache``; one group → ``UnitaryKVCacheCoordinator``;
    several → ``HybridKVCacheCoordinator``. Mirrors ``get_kv_cache_coordinator``."""
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching)
    return HybridKVCacheCoordinator(kv_cache_config, max_model_len, max_in_flight_tokens, enable_caching)
