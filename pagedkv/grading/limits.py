"""The grading limits, defined once: ``pagedkv grade``'s options, the worker and the sandbox all read them here.

A :class:`Limits` travels whole (the command line fills one, :func:`pagedkv.grading.grade.grade_paths` hands it
to each notebook's worker as JSON, the worker to each sandbox) instead of four keyword arguments through four
layers. Every limit is a ceiling that a correct notebook stays far below: time limits decide only what happens
to code that hangs, never whether correct code passes, so no verdict depends on how loaded the machine is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

__all__ = ["DEFAULT_LIMITS", "Limits"]

GIB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What one notebook may use while it is graded."""

    timeout: float = 300.0  # seconds per notebook: past it the notebook is stopped, every exercise failed
    cell_timeout: float = 60.0  # seconds per notebook cell before the cell is interrupted and left out
    case_timeout: float = 60.0  # seconds one test case may spend in the learner's code, all its calls together
    memory: int = 4 * GIB  # bytes of memory for a whole sandbox (every process in it together, where a cgroup
    #                        can be made; otherwise the address space of each process: see the grading README)
    processes: int = 256  # processes and threads in a sandbox
    tmpfs: int = 512 << 20  # bytes of each private tmpfs in a sandbox (/tmp, /var/tmp, /dev/shm, the home)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"grading limit {f.name} must be a positive number, got {value!r}")

    @property
    def cpu_seconds(self) -> int:
        """CPU seconds for a sandbox process: the notebook's wall-clock limit and a margin."""
        return int(self.timeout) + 60

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Limits:
        data = json.loads(text)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


#: The limits ``pagedkv grade`` uses unless its options say otherwise.
DEFAULT_LIMITS = Limits()
