"""Block hashes printed in lesson 3 are the same on every run (issue 21, item 5).

The lesson says so, and its printed keys were not: before Python 3.12 ``hash(None)`` (an unsalted block's
``extra``) comes from None's address, so ``builtin_hash`` chains changed from process to process. Now
``builtin_hash`` hashes ``None`` as a fixed int; a salted block (a string) still differs with PYTHONHASHSEED.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSON = ROOT / "notebooks" / "03_prefix_caching.ipynb"

PROBE = """
import random
from pagedkv import KVCacheManager, Request
from pagedkv.kv_cache_utils import NONE_HASH, builtin_hash, hash_request_tokens
rng = random.Random(7)
tokens = [rng.randrange(32_000) for _ in range(100)]
print(builtin_hash(None), builtin_hash((NONE_HASH, (1, 2), None)))
print(*hash_request_tokens(builtin_hash, 16, tokens))
print(*hash_request_tokens(builtin_hash, 16, tokens, (3,)))  # an adapter id: ints only
m = KVCacheManager(num_blocks=16, block_size=16)
r = Request("r", tokens)
m.get_computed_blocks(r)
print(*r.block_hashes)
print(*hash_request_tokens(builtin_hash, 16, tokens, ("tenant-b",)))  # a salt: differs per process
"""


def _run(code: str, seed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         check=True, cwd=ROOT)
    return out.stdout.splitlines()


def test_unsalted_builtin_hashes_are_the_same_in_every_process():
    a, b = _run(PROBE, "1"), _run(PROBE, "2")
    assert a[:4] == b[:4]  # None, unsalted chains, an adapter's chain, the manager's own hashes
    assert a[3] == a[1]  # the manager hashes the request as hash_request_tokens does
    assert a[4] != b[4]  # a string salt still hashes differently: such keys must never leave the process


def _lesson_cells() -> tuple[str, list[tuple[str, str]]]:
    """Lesson 3's set-up cell, and every code cell before section 2 that prints a hash, with its committed output."""
    nb = nbformat.read(LESSON, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    setup = next(c.source for c in code if "def random_tokens" in c.source)
    end = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## 2."))
    printed = []
    for c in nb.cells[:end]:
        if c.cell_type == "code" and "short_hash(" in c.source and "subprocess" not in c.source:
            text = "".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream")
            printed.append((c.source, text))
    return setup, printed


@pytest.mark.slow
def test_lesson_3s_printed_hashes_are_what_a_fresh_run_prints():
    """The committed outputs of lesson 3's hash cells, reproduced by new processes with other hash seeds."""
    setup, printed = _lesson_cells()
    assert len(printed) >= 3 and all(text for _, text in printed), printed
    marker = "\n# ---- next cell ----\n"
    script = setup + "".join(f"\nprint({marker!r}, end='')\n" + src for src, _ in printed)
    for seed in ("0", "12345"):
        out = "\n".join(_run(script, seed)) + "\n"
        got = out.split(marker)[1:]
        assert got == [text for _, text in printed], f"PYTHONHASHSEED={seed}"
