"""Checking where a command will write before it does the work (every ``pagedkv bench``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["output_path_problem"]


def output_path_problem(files: dict[str, str | Path | None] | None = None,
                        folders: dict[str, str | Path | None] | None = None) -> str | None:
    """The first output path a command cannot write, as one line that names its option and the path (``--json
    /nope/x.json: the folder /nope does not exist``); None when every one can be written. ``files``: option ->
    a file to write (not a folder; its folder must exist and take a new file); ``folders``: option -> a folder to
    write in, made later if need be (the nearest folder of it or above it that exists must take a new file).
    Options given None (or "") are skipped. Every benchmark calls it before its work, so that a mistyped path
    costs nothing and leaves nothing behind: it makes no file or folder (the probe is a nameless temporary
    file, gone when closed)."""

    def unwritable(folder: Path) -> str | None:
        try:
            with tempfile.TemporaryFile(dir=folder):  # what os.access cannot tell: /proc, a read-only mount, root
                pass
        except OSError as exc:
            return f"cannot write in the folder {folder} ({exc.strerror or exc})"
        return None

    for option, value in (files or {}).items():
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            return f"{option} {value} is a folder; give a file name"
        folder = path.resolve().parent
        if not folder.is_dir():
            return f"{option} {value}: the folder {path.parent} does not exist"
        if path.exists() and not os.access(path, os.W_OK):
            return f"{option} {value}: the file is not writable"
        problem = unwritable(folder)
        if problem:
            return f"{option} {value}: {problem}"
    for option, value in (folders or {}).items():
        if not value:
            continue
        nearest = Path(value).resolve()
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        if not nearest.is_dir():
            return f"{option} {value}: {nearest} is a file, not a folder"
        problem = unwritable(nearest)
        if problem:
            return f"{option} {value}: {problem}"
    return None
