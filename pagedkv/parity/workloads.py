"""The random workloads both sides run, and the loops that drive a side through them.

Nothing here imports vLLM or the lab's classes: a *side* is any object with the methods below, and the loops
record, after every operation or step, what that side did (block ids, hit lengths, free counts; scheduled
tokens, preemptions, block tables, kept outputs) as plain JSON data. The same seed gives the same operations
on both sides for as long as their observations agree (a choice that depends on the state, such as "free a
request that holds blocks", is made from the side's own observations), so two traces can be compared entry
by entry and the first entry that differs is the first divergence.

Side interfaces:

- manager side (driver ``"manager"``): ``admit(rid, tokens, num_new) -> obs`` (look up the prefix cache,
  allocate slots for the hits and ``num_new`` tokens, mark them computed), ``decode(rid, token) -> obs``
  (append one token and allocate its slot), ``free(rid) -> obs``, ``reset() -> obs``;
- scheduler side (driver ``"scheduler"``): ``add(rid, prompt, max_tokens)``, ``step(sample) -> obs`` (one
  ``schedule()`` then ``update_from_output()`` with ``sample(tokens)`` for every request whose chunk reached
  the end of its tokens), ``has_unfinished() -> bool``;
- hybrid manager side (driver ``"hybrid_manager"``, lesson 8: KV cache groups of full and sliding-window
  attention on one pool): ``admit(rid, tokens, chunk, full_sequence_must_fit) -> obs`` (look up the prefix
  cache, allocate the hits and ``chunk`` tokens), ``grow(rid, new_tokens, num_new) -> obs`` (append
  ``new_tokens``, then allocate ``num_new`` more tokens: a prefill chunk or decodes), ``free(rid)``,
  ``reset()``; block ids per group (``tables`` keyed ``"rid.gG"``), hit lengths and free counts;
- hybrid scheduler side (driver ``"hybrid_scheduler"``): as the scheduler side, over a hybrid config;
- async scheduler side (driver ``"async_scheduler"``, :func:`run_async_scheduler`): ``schedule()`` and
  ``update()`` called apart, in ``step_with_batch_queue``'s order, two batches in flight;
- hybrid async scheduler side (driver ``"hybrid_async_scheduler"``, :func:`run_hybrid_async_scheduler`): as the
  async scheduler side, over a hybrid config (tables per group), where a sliding group's admission cap counts
  both batches in flight (``VllmConfig.max_in_flight_tokens``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

VOCAB = 64


def sample_token(token_ids: Sequence[int]) -> int:
    """The fake model's next token: a hash of every token so far (never depends on the batch or the step)."""
    h = 0x9E3779B97F4A7C15
    for t in token_ids:
        h = ((h ^ (int(t) + 0x632BE5AB)) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % VOCAB


@dataclass(frozen=True)
class ManagerConfig:
    num_blocks: int
    block_size: int
    enable_caching: bool


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_caching: bool


def error_obs(exc: BaseException) -> dict[str, Any]:
    """The observation a side returns when an operation raised: the driver stops there, and the first trace
    entry that differs is the divergence."""
    return {"error": f"{type(exc).__name__}: {exc}"}


class ManagerSideBase:
    """What every manager side does alike, on ``self.manager`` (the lab's, a learner's or vLLM's
    ``KVCacheManager``: ``free(request)``, ``reset_prefix_cache()`` and ``block_pool.get_num_free_blocks()``
    are called and answer the same on each) and ``self.requests`` (request id -> request): ``free`` and
    ``reset``. ``admit`` and ``decode`` stay with each side (their block lists differ in shape)."""

    manager: Any
    requests: dict[str, Any]

    def _free_count(self) -> int:
        return int(self.manager.block_pool.get_num_free_blocks())

    def free(self, rid: str) -> dict[str, Any]:
        try:
            self.manager.free(self.requests.pop(rid))
            return {"num_free": self._free_count()}
        except Exception as exc:
            return error_obs(exc)

    def reset(self) -> dict[str, Any]:
        try:
            return {"reset": bool(self.manager.reset_prefix_cache()), "num_free": self._free_count()}
        except Exception as exc:
            return error_obs(exc)

def manager_config(seed: int, enable_caching: bool) -> ManagerConfig:
    rng = random.Random(f"manager-config-{seed}")
    return ManagerConfig(rng.randint(6, 24), rng.choice([1, 2, 4, 8]), enable_caching)


def scheduler_config(seed: int) -> SchedulerConfig:
    rng = random.Random(f"scheduler-config-{seed}")
    max_num_seqs = rng.randint(1, 6)
    return SchedulerConfig(
        num_blocks=rng.randint(6, 24),
        block_size=rng.choice([2, 4, 8]),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max(4, max_num_seqs), 48),  # vLLM requires >= max_num_seqs
        enable_caching=rng.random() < 0.75,
    )


def _prompt(rng: random.Random, roots: list[list[int]]) -> list[int]:
    prompt = list(rng.choice(roots)) if rng.random() < 0.6 else []
    return prompt + [rng.randrange(VOCAB) for _ in range(rng.randint(0 if prompt else 1, 12))]


def run_manager(side: Any, seed: int, cfg: ManagerConfig, num_ops: int = 60) -> list[dict[str, Any]]:
    """Drive a manager side through ``num_ops`` random operations; one record per operation."""
    rng = random.Random(f"manager-ops-{seed}")
    roots = [[rng.randrange(VOCAB) for _ in range(rng.randint(cfg.block_size, 4 * cfg.block_size))] for _ in range(3)]
    held: dict[str, list[int]] = {}  # requests holding blocks (as this side's observations say) -> tokens
    trace: list[dict[str, Any]] = []
    next_id = 0
    for _ in range(num_ops):
        r = rng.random()
        if not held or r < 0.35:
            rid = f"m{next_id}"
            next_id += 1
            tokens = _prompt(rng, roots)
            op = {"op": "admit", "rid": rid, "tokens": tokens}
            obs = side.admit(rid, tokens)
            if obs.get("new_blocks") is not None:
                held[rid] = tokens
        elif r < 0.75:
            rid = rng.choice(sorted(held))
            token = rng.randrange(VOCAB)
            op = {"op": "decode", "rid": rid, "token": token}
            obs = side.decode(rid, token)
        else:
            op, obs = _free_or_reset(side, rng, held, r < 0.95)
        trace.append({"op": op, "obs": obs})
        if "error" in obs:
            break
    return trace


def _free_or_reset(side: Any, rng: random.Random, held: dict[str, Any], free: bool) -> tuple[dict, dict]:
    """The manager drivers' last two operations: free a request that holds blocks (chosen with ``rng``), or
    reset the prefix cache (refused, ``False``, while requests hold blocks, on both sides)."""
    if not free:
        return {"op": "reset"}, side.reset()
    rid = rng.choice(sorted(held))
    obs = side.free(rid)
    del held[rid]
    return {"op": "free", "rid": rid}, obs


def scheduler_requests(seed: int, cfg: SchedulerConfig) -> list[tuple[int, str, list[int], int]]:
    """``(arrival_step, request_id, prompt, max_tokens)`` for the scheduler driver; every request fits alone."""
    rng = random.Random(f"scheduler-requests-{seed}")
    usable_tokens = (cfg.num_blocks - 1) * cfg.block_size
    roots = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3 * cfg.block_size))] for _ in range(2)]
    out = []
    for i in range(rng.randint(4, 14)):
        prompt = _prompt(rng, roots)
        max_tokens = rng.randint(1, 16)
        while len(prompt) + max_tokens > usable_tokens and len(prompt) > 1:
            prompt.pop()
        max_tokens = max(1, min(max_tokens, usable_tokens - len(prompt)))
        out.append((rng.randint(0, 6), f"s{i}", prompt, max_tokens))
    return sorted(out, key=lambda x: x[0])


def run_scheduler(
    side: Any,
    seed: int,
    cfg: SchedulerConfig | HybridSchedulerConfig,
    max_steps: int = 400,
    requests: list[tuple[int, str, list[int], int]] | None = None,
) -> list[dict[str, Any]]:
    """Drive a scheduler side step by step until every request finished; one record per step. ``requests``
    defaults to ``scheduler_requests(seed, cfg)``."""
    if requests is None:
        requests = scheduler_requests(seed, cfg)  # type: ignore[arg-type]
    trace: list[dict[str, Any]] = []
    last_arrival = max(a for a, *_ in requests)
    for step in range(max_steps):
        arrived = [(rid, prompt, max_tokens) for a, rid, prompt, max_tokens in requests if a == step]
        for rid, prompt, max_tokens in arrived:
            side.add(rid, prompt, max_tokens)
        if step > last_arrival and not side.has_unfinished():
            break
        obs = side.step(sample_token)
        obs["arrived"] = [rid for rid, *_ in arrived]
        trace.append({"op": {"op": "step", "step": step}, "obs": obs})
        if "error" in obs:
            break
    return trace


def stop_token(rng: random.Random, prompt: list[int], max_tokens: int) -> int | None:
    """An EOS for about half the requests: a token the fake model generates for this prompt before
    ``max_tokens`` (it does not depend on the schedule), so the request stops early, with a step in flight."""
    if max_tokens < 2 or rng.random() < 0.5:
        return None
    tokens = list(prompt)
    for _ in range(rng.randint(1, max_tokens - 1)):
        tokens.append(sample_token(tokens))
    return tokens[-1]


def run_async_scheduler(
    side: Any,
    seed: int,
    cfg: SchedulerConfig | HybridSchedulerConfig,
    max_calls: int = 800,
    requests: list[tuple[int, str, list[int], int]] | None = None,
) -> list[dict[str, Any]]:
    """Drive an async scheduler side as ``EngineCore.step_with_batch_queue`` drives vLLM 0.26's ``AsyncScheduler``
    (two batches in flight): each call schedules a batch when there are requests, and returns at once while the
    queue holds fewer than two and something was scheduled or is left; otherwise it takes the oldest batch's
    samples (``update``). One record per call; the same requests and arrivals (counted in calls) as
    :func:`run_scheduler`, about half of them with an EOS token they reach (:func:`stop_token`). Side interface:
    ``add(rid, prompt, max_tokens, eos_token_id)``, ``has_requests() -> bool``,
    ``schedule() -> (handle, obs)`` (``obs["num_tokens"]``: tokens scheduled), ``update(handle, sample) -> obs``
    (``sample(all_token_ids)`` for every request the batch samples). ``requests`` defaults to
    ``scheduler_requests(seed, cfg)``."""
    if requests is None:
        requests = scheduler_requests(seed, cfg)  # type: ignore[arg-type]
    rng = random.Random(f"async-eos-{seed}")
    trace: list[dict[str, Any]] = []
    last_arrival = max(a for a, *_ in requests)
    queue: list[Any] = []  # the batch queue, newest first
    for call in range(max_calls):
        arrived = [(rid, prompt, max_tokens) for a, rid, prompt, max_tokens in requests if a == call]
        for rid, prompt, max_tokens in arrived:
            side.add(rid, prompt, max_tokens, stop_token(rng, prompt, max_tokens))
        has_requests = side.has_requests()
        if call > last_arrival and not has_requests and not queue:
            break
        obs: dict[str, Any] = {"arrived": [rid for rid, *_ in arrived]}
        trace.append({"op": {"op": "step_with_batch_queue", "call": call}, "obs": obs})
        if has_requests:
            handle, obs["schedule"] = side.schedule()
            if "error" in obs["schedule"]:
                break
            queue.insert(0, handle)
            if len(queue) < 2 and (obs["schedule"]["num_tokens"] > 0 or side.has_requests()):
                continue  # don't block on the batch in flight
        elif not queue:
            continue
        obs["update"] = side.update(queue.pop(), sample_token)
        if "error" in obs["update"]:
            break
    return trace


def config_dict(cfg: Any) -> dict[str, Any]:
    return asdict(cfg)


# --------------------------------------------------------------------------------------------------------
# Lesson 8: KV cache groups (full attention and sliding window on one pool)
# --------------------------------------------------------------------------------------------------------
#: vLLM's ``max_model_len`` on both sides of the hybrid drivers (the workloads stay far below it).
HYBRID_MAX_MODEL_LEN = 4096
#: Group layouts the hybrid drivers draw from: each group ``("full", None)`` or ``("sliding", window)``;
#: ``W`` stands for the config's window. Two sliding groups of one spec is how vLLM groups a model with more
#: sliding than full layers (Gemma 3: one full group, several sliding groups of the same size).
HYBRID_LAYOUTS = {
    "full+sliding": [("full", None), ("sliding", "W")],
    "sliding": [("sliding", "W")],
    "full+sliding+sliding": [("full", None), ("sliding", "W"), ("sliding", "W")],
}


@dataclass(frozen=True)
class HybridManagerConfig:
    num_blocks: int
    block_size: int
    groups: tuple[tuple[str, int | None], ...]
    enable_caching: bool
    max_in_flight_tokens: int


@dataclass(frozen=True)
class HybridSchedulerConfig:
    num_blocks: int
    block_size: int
    groups: tuple[tuple[str, int | None], ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_caching: bool


def _layout(rng: random.Random, block_size: int) -> tuple[tuple[str, int | None], ...]:
    layout = HYBRID_LAYOUTS[rng.choice(sorted(HYBRID_LAYOUTS))]
    window = rng.randint(2, 4 * block_size + 3)
    return tuple((kind, window if w == "W" else None) for kind, w in layout)


def hybrid_group_specs(
    groups: Sequence[tuple[str, int | None]],
    block_size: int,
    full_cls: Any,
    sliding_cls: Any,
    group_cls: Any,
    dtype: Any,
) -> list[Any]:
    """One ``group_cls([layer], spec)`` per ``(kind, window)``, with the given spec classes: vLLM's on its
    side, the lab's on the other (one head of size 8; the managers never read the bytes)."""
    out = []
    for i, (kind, window) in enumerate(groups):
        common = {"block_size": block_size, "num_kv_heads": 1, "head_size": 8, "dtype": dtype}
        spec = full_cls(**common) if kind == "full" else sliding_cls(sliding_window=window, **common)
        out.append(group_cls([f"{kind}.{i}"], spec))
    return out


def hybrid_manager_config(seed: int) -> HybridManagerConfig:
    rng = random.Random(f"hybrid-manager-config-{seed}")
    block_size = rng.choice([1, 2, 4, 8])
    return HybridManagerConfig(
        num_blocks=rng.randint(8, 40),
        block_size=block_size,
        groups=_layout(rng, block_size),
        enable_caching=rng.random() < 0.85,
        max_in_flight_tokens=rng.randint(1, 16),
    )


def hybrid_scheduler_config(seed: int, name: str = "hybrid-scheduler") -> HybridSchedulerConfig:
    """The hybrid scheduler driver's config for ``seed``; ``name`` keys the draw (another driver, other configs)."""
    rng = random.Random(f"{name}-config-{seed}")
    block_size = rng.choice([2, 4, 8])
    max_num_seqs = rng.randint(1, 6)
    return HybridSchedulerConfig(
        num_blocks=rng.randint(10, 40),
        block_size=block_size,
        groups=_layout(rng, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.randint(max(4, max_num_seqs), 48),
        enable_caching=rng.random() < 0.75,
    )


def hybrid_blocks_needed(cfg: HybridSchedulerConfig, num_tokens: int) -> int:
    """The most blocks a request of ``num_tokens`` tokens holds at once over every group (a sliding group at
    most ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1``)."""
    bs = cfg.block_size
    total = 0
    for kind, window in cfg.groups:
        n = -(-num_tokens // bs)
        if kind == "sliding":
            assert window is not None
            n = min(n, -(-min(window - 1 + cfg.max_num_batched_tokens, HYBRID_MAX_MODEL_LEN) // bs) + 1)
        total += n
    return total


def _hybrid_roots(rng: random.Random, block_size: int, root_blocks: int = 6) -> list[list[int]]:
    """Three shared prefixes of one to ``root_blocks`` blocks."""
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(block_size, root_blocks * block_size))] for _ in range(3)]


def run_hybrid_manager(side: Any, seed: int, cfg: HybridManagerConfig, num_ops: int = 80) -> list[dict[str, Any]]:
    """Drive a hybrid manager side through ``num_ops`` random operations: admissions that share prefixes
    (some by chunks), prefill chunks and decodes that carry requests past their windows, frees (which make
    later admissions evict cached blocks) and resets; one record per operation."""
    rng = random.Random(f"hybrid-manager-ops-{seed}")
    roots = _hybrid_roots(rng, cfg.block_size)
    held: dict[str, int] = {}  # request -> tokens still to prefill (0: decoding), as this side observed
    trace: list[dict[str, Any]] = []
    next_id = 0
    for _ in range(num_ops):
        r = rng.random()
        if not held or r < 0.3:
            rid = f"h{next_id}"
            next_id += 1
            tokens = _prompt(rng, roots)
            chunk = len(tokens) if rng.random() < 0.5 else rng.randint(1, len(tokens))
            gate = rng.random() < 0.5
            op = {"op": "admit", "rid": rid, "tokens": tokens, "chunk": chunk, "gate": gate}
            obs = side.admit(rid, tokens, chunk, gate)
            if obs.get("new_blocks") is not None:
                held[rid] = len(tokens) - obs["hit_tokens"] - min(chunk, len(tokens) - obs["hit_tokens"])
        elif r < 0.78:
            rid = rng.choice(sorted(held))
            if held[rid] > 0:
                new_tokens: list[int] = []
                num_new = min(held[rid], rng.randint(1, 8))
            else:
                new_tokens = [rng.randrange(VOCAB) for _ in range(1 if rng.random() < 0.8 else rng.randint(2, 4))]
                num_new = len(new_tokens)
            op = {"op": "grow", "rid": rid, "new_tokens": new_tokens, "num_new": num_new}
            obs = side.grow(rid, new_tokens, num_new)
            if obs.get("new_blocks") is not None and held[rid] > 0:
                held[rid] -= num_new
        else:
            op, obs = _free_or_reset(side, rng, held, r < 0.96)
        trace.append({"op": op, "obs": obs})
        if "error" in obs:
            break
    return trace


def hybrid_scheduler_requests(
    seed: int,
    cfg: HybridSchedulerConfig,
    max_concurrent_batches: int = 1,
    num_requests: tuple[int, int] = (4, 12),
    last_arrival: int = 6,
    most_tokens: int = 24,
    root_blocks: int = 6,
) -> list[tuple[int, str, list[int], int]]:
    """``(arrival_step, request_id, prompt, max_tokens)``: ``num_requests`` (a range) prompts that share prefixes
    of up to ``root_blocks`` blocks and outgrow the window, arriving by step ``last_arrival``, up to
    ``most_tokens`` each; each fits alone (``hybrid_blocks_needed``, with ``max_concurrent_batches`` steps'
    tokens in flight, as vLLM's ``VllmConfig.max_in_flight_tokens`` counts them), some only because their
    sliding groups release blocks."""
    rng = random.Random(f"hybrid-scheduler-requests-{seed}")
    sizing = replace(cfg, max_num_batched_tokens=max_concurrent_batches * cfg.max_num_batched_tokens)
    roots = _hybrid_roots(rng, cfg.block_size, root_blocks)
    usable = cfg.num_blocks - 1
    out = []
    for i in range(rng.randint(*num_requests)):
        prompt = _prompt(rng, roots)
        max_tokens = rng.randint(1, most_tokens)
        while hybrid_blocks_needed(sizing, len(prompt) + max_tokens) > usable and max_tokens > 1:
            max_tokens -= 1
        while hybrid_blocks_needed(sizing, len(prompt) + max_tokens) > usable and len(prompt) > 1:
            prompt.pop()
        out.append((rng.randint(0, last_arrival), f"s{i}", prompt, max_tokens))
    return sorted(out, key=lambda x: x[0])


def run_hybrid_scheduler(side: Any, seed: int, cfg: HybridSchedulerConfig) -> list[dict[str, Any]]:
    """``run_scheduler`` over a hybrid config's requests."""
    return run_scheduler(side, seed, cfg, requests=hybrid_scheduler_requests(seed, cfg))


def hybrid_async_scheduler_config(seed: int) -> HybridSchedulerConfig:
    """Configs drawn as the hybrid scheduler driver's (tight pools of 10-40 blocks), from their own seed."""
    return hybrid_scheduler_config(seed, "hybrid-async-scheduler")


def run_hybrid_async_scheduler(side: Any, seed: int, cfg: HybridSchedulerConfig) -> list[dict[str, Any]]:
    """``run_async_scheduler`` over a hybrid config: requests sized so each fits alone with two steps' tokens in
    flight (vLLM 0.26's ``VllmConfig.max_concurrent_batches`` is 2 with async scheduling), which is what the
    sliding groups' admission cap (``SlidingWindowSpec.max_admission_blocks_per_request``) counts. More, longer
    requests, arriving sooner, than the sync driver's: prompts past window + budget against a full pool are
    where the cap decides admission (with one step counted, 22 of 200 seeds diverge; with the sync driver's
    mix, 5)."""
    requests = hybrid_scheduler_requests(
        seed, cfg, max_concurrent_batches=2, num_requests=(8, 16), last_arrival=3, most_tokens=32, root_blocks=12
    )
    return run_async_scheduler(side, seed, cfg, requests=requests)


def driver(name: str, seed: int, enable_caching: bool | None) -> tuple[Any, Any]:
    """Driver ``name``'s config for ``seed`` and the loop that runs a side through it: ``(cfg, run)``, called
    as ``run(side, seed, cfg)``."""
    if name == "manager":
        return manager_config(seed, bool(enable_caching)), run_manager
    if name == "scheduler":
        return scheduler_config(seed), run_scheduler
    if name == "hybrid_manager":
        return hybrid_manager_config(seed), run_hybrid_manager
    if name == "hybrid_scheduler":
        return hybrid_scheduler_config(seed), run_hybrid_scheduler
    if name == "async_scheduler":
        return scheduler_config(seed), run_async_scheduler
    if name == "hybrid_async_scheduler":
        return hybrid_async_scheduler_config(seed), run_hybrid_async_scheduler
    raise ValueError(f"unknown parity driver {name!r}")
