"""What ``pagedkv grade`` writes and prints, made safe against what a learner controls.

- :func:`write_replacing` writes the CSV and JSON reports: to a fresh temporary file in the target's folder
  (``mkstemp``: created, never opened through an existing name), then renamed over the target. A rename
  replaces a symlink planted at the target instead of following it, so the grader (root, for a class) never
  writes through one into a file it did not mean to write.
- :func:`escape_controls` makes learner text (exception messages, values, file names, learner names) printable:
  control characters become ``\\x1b``-style escapes, so a message cannot move the terminal's cursor, clear the
  table printed above it, or hide text with bidirectional overrides. Newlines and tabs are escaped too (a file
  named ``"x\\nalice  14 / 14"`` would otherwise print a line of its own in the table and the totals), and so are
  lone surrogates (a file name that is not UTF-8, ``os.fsdecode``'s ``"\\udcff"``, shows as ``\\xff``, the byte
  it stands for): they cannot be written as UTF-8, and the CSV, the JSON and the terminal would fail on them.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

__all__ = ["escape_controls", "write_replacing"]

# C0 controls (tab and newline too), DEL, C1 controls, Unicode's bidirectional marks, overrides and isolates, the
# line and paragraph separators, and lone surrogates
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as os.fsdecode keeps it: the byte
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character written as an escape (``"\\x1b[2K"`` -> ``"\\\\x1b[2K"``,
    ``"a\\nb"`` -> ``"a\\\\x0ab"``): one line, printable, and encodable as UTF-8."""
    return _CONTROLS.sub(lambda m: _escape(m.group()), text)


def write_replacing(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and a rename: a symlink
    at ``path`` is replaced, never followed; a reader never sees a half-written file. A lone surrogate that got
    past :func:`escape_controls` is written as its escape (``\\udcff``) rather than failing the report."""
    target = Path(path)
    folder = target.parent.resolve()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / target.name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
