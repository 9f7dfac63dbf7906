"""A simulated serving engine: the scheduler driven by a fake model on shadow memory, timed by a cost model.

- :mod:`pagedkv.sim.model`: ``FakeModel``, the next token as a hash of all tokens so far.
- :mod:`pagedkv.sim.runner`: ``SimModelRunner``, swaps, copies, writes and read-back checks on a
  ``ShadowKVCache``, then sampling.
- :mod:`pagedkv.sim.cost`: ``CostModel``, a roofline estimate of a step on an H100-class GPU for a 7B model.
- :mod:`pagedkv.sim.engine`: ``run_to_completion`` and its metrics (``SimResult``).
- :mod:`pagedkv.sim.baseline`: ``ContiguousKVCacheManager``, max-length contiguous reservation.
- :mod:`pagedkv.sim.workload`: ShareGPT-shaped synthetic requests.
- :mod:`pagedkv.sim.targets`: ``python -m pagedkv.sim.targets`` prints lesson 4's target table.
- exercise set 04's pluggable scheduler and lockstep checks are in :mod:`pagedkv.grading.lessons.l04_scheduling`.
"""

from pagedkv.sim.baseline import ContiguousKVCacheManager
from pagedkv.sim.cost import H100_SXM, LLAMA2_7B, CostModel, GPUSpec, ModelSpec, StepCost
from pagedkv.sim.engine import SimResult, StepRecord, run_to_completion
from pagedkv.sim.model import FakeModel
from pagedkv.sim.runner import KVCacheCorruptionError, SimModelRunner
from pagedkv.sim.workload import WorkloadSpec, clone_requests, make_requests, sample_lengths

__all__ = [
    "H100_SXM",
    "LLAMA2_7B",
    "ContiguousKVCacheManager",
    "CostModel",
    "FakeModel",
    "GPUSpec",
    "KVCacheCorruptionError",
    "ModelSpec",
    "SimModelRunner",
    "SimResult",
    "StepCost",
    "StepRecord",
    "WorkloadSpec",
    "clone_requests",
    "make_requests",
    "run_to_completion",
    "sample_lengths",
]
