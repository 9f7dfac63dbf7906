"""What ``pagedkv grade`` writes and prints, made safe against what a learner controls.

- :func:`write_replacing` writes the CSV and JSON reports: to a fresh temporary file in the target's folder
  (``mkstemp``: created, never opened through an existing name), then renamed over the target. A rename
  replaces a symlink planted at the target instead of following it, so the grader (root, for a class) never
  writes through one into a file it did not mean to write.
- :func:`escape_controls` makes learner text (exception messages, values, file names) printable: control
  characters become ``\\x1b``-style escapes, so a message cannot move the terminal's cursor, clear the table
  printed above it, or hide text with bidirectional overrides.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

__all__ = ["escape_controls", "write_replacing"]

# C0 controls but tab and newline, DEL, C1 controls, and Unicode's bidirectional overrides and isolates
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with every control character written as an escape (``"\\x1b[2K"`` -> ``"\\\\x1b[2K"``)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                         else f"\\u{ord(m.group()):04x}", text)


def write_replacing(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and a rename: a symlink
    at ``path`` is replaced, never followed; a reader never sees a half-written file."""
    target = Path(path)
    folder = target.parent.resolve()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / target.name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
