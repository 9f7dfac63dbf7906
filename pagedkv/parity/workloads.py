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
- async scheduler side (driver ``"async_scheduler"``, :func:`run_async_scheduler`): ``schedule()`` and
  ``update()`` called apart, in ``step_with_batch_queue``'s order, two batches in flight.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
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
        elif r < 0.95:
            rid = rng.choice(sorted(held))
            op = {"op": "free", "rid": rid}
            obs = side.free(rid)
            del held[rid]
        else:  # refused (False) while requests hold blocks, on both sides
            op = {"op": "reset"}
            obs = side.reset()
        trace.append({"op": op, "obs": obs})
        if "error" in obs:
            break
    return trace


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


def run_scheduler(side: Any, seed: int, cfg: SchedulerConfig, max_steps: int = 400) -> list[dict[str, Any]]:
    """Drive a scheduler side step by step until every request finished; one record per step."""
    requests = scheduler_requests(seed, cfg)
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


def run_async_scheduler(side: Any, seed: int, cfg: SchedulerConfig, max_calls: int = 800) -> list[dict[str, Any]]:
    """Drive an async scheduler side as ``EngineCore.step_with_batch_queue`` drives vLLM 0.26's ``AsyncScheduler``
    (two batches in flight): each call schedules a batch when there are requests, and returns at once while the
    queue holds fewer than two and something was scheduled or is left; otherwise it takes the oldest batch's
    samples (``update``). One record per call; the same requests and arrivals (counted in calls) as
    :func:`run_scheduler`, about half of them with an EOS token they reach (:func:`stop_token`). Side interface:
    ``add(rid, prompt, max_tokens, eos_token_id)``, ``has_requests() -> bool``,
    ``schedule() -> (handle, obs)`` (``obs["num_tokens"]``: tokens scheduled), ``update(handle, sample) -> obs``
    (``sample(all_token_ids)`` for every request the batch samples)."""
    requests = scheduler_requests(seed, cfg)
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


def config_dict(cfg: ManagerConfig | SchedulerConfig) -> dict[str, Any]:
    return asdict(cfg)

