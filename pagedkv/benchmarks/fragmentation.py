"""``pagedkv bench fragmentation``: lesson 1's numbers as tables (:func:`pagedkv.fragmentation.main`).

It takes no options; ``--help`` says so instead of running."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="pagedkv bench fragmentation",
        description="Lesson 1's numbers: the source card's example (contiguous vs paged admission and waste) and "
        "the block-size sweep on 10,000 synthetic ShareGPT-like lengths. No options.",
    ).parse_args(argv)
    from pagedkv.fragmentation import main as tables

    tables()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
