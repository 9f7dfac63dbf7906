"""The grading limits, defined once: ``pagedkv grade``'s options, the worker and the sandbox all read them here.

A :class:`Limits` travels whole (the command line fills one, :func:`pagedkv.grading.grade.grade_paths` hands it
to each notebook's worker as JSON, the worker to each sandbox) instead of four keyword arguments through four
layers. Every limit is a ceiling that a correct notebook stays far below: time limits decide only what happens
to code that hangs, never whether correct code passes, so no verdict depends on how loaded the machine is.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

__all__ = ["DEFAULT_LIMITS", "WALL_FACTOR", "Limits"]

GIB = 1 << 30
#: Time limits on the learner's code count its CPU seconds; code that waits instead of computing (a sleep) is
#: stopped after this many times the limit in wall-clock seconds.
WALL_FACTOR = 5.0


@dataclass(frozen=True)
class Limits:
    """What one notebook may use while it is graded."""

    timeout: float = 600.0  # seconds per notebook: past it the notebook is stopped, every exercise failed (a
    #                         backstop: the cell and case limits stop a hang long before)
    cell_timeout: float = 60.0  # seconds per notebook cell before the cell is interrupted and left out
    case_timeout: float = 60.0  # CPU seconds one test case may spend in the learner's code, all its calls
    #                             together (and 5 times that in wall-clock seconds, for code that sleeps)
    memory: int = 4 * GIB  # bytes of memory for a whole sandbox (every process in it together, where a cgroup
    #                        can be made; otherwise the address space of each process: see the grading README)
    processes: int = 256  # processes and threads in a sandbox
    tmpfs: int = 512 << 20  # bytes of each private tmpfs in a sandbox (/tmp, /var/tmp, /dev/shm, the home)
    cpus: float = 1.0  # CPUs a sandbox may keep busy at once (its cgroup's CPU quota, where one can be made)
    message_timeout: float = 20.0  # seconds a message from a sandbox may take to arrive whole once it has begun
    #                                (an honest one takes milliseconds); past it the sandbox is killed
    worker_memory: int = 2 * GIB  # bytes of data (RLIMIT_DATA) for the trusted worker that grades a notebook:
    #                               it parses what the sandboxes send (honest peak 0.35 GiB, set 07)
    notebook_size: int = 16 << 20  # bytes of a notebook file: a bigger one is refused unread (a learner's is
    #                                well under 1 MiB)

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
