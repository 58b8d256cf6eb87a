"""The command line of ``bench/sharing/run.py`` (its options and defaults)."""

from __future__ import annotations

import argparse
import os

from bench.common.cli_types import positive_ints

MEASURED_GROUPS = (6, 7, 9)
"""Groups the measurements use (48, 56 and 72 SMs: the 48-SM check, the 48/84 and 72/60 splits,
the 48 <-> 56 switching); a ``--groups`` list must hold them, except with ``--probe``."""
WARMUP_CALLS = 3
"""Timed calls each figure drops before its median (``times[3:]`` in ``bench.sharing.measure``)."""


def _decode_groups(text: str) -> tuple[int, ...] | None:
    """``--groups``: comma-separated positive ints (``2,4,6``); empty means every group."""
    return tuple(positive_ints("--groups")(text)) if text.strip() else None


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``bench/sharing/run.py``'s options; ``description`` is its module docstring. ``groups`` is a
    tuple of ints or None (the partitioner's default); a bad value is the parser's error."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--groups",
        type=_decode_groups,
        default=None,
        help="decode SM groups k (k*8 SMs), e.g. 2,4,6,7,9; a full run needs 6, 7 and 9",
    )
    parser.add_argument("--probe", action="store_true", help="only check creation + a bf16 GEMM")
    args = parser.parse_args(argv)
    measured = args.groups is None or args.probe  # the partitioner's default holds them all
    missing = [] if measured else [k for k in MEASURED_GROUPS if k not in args.groups]
    if missing:
        parser.error(
            f"--groups must include {', '.join(map(str, MEASURED_GROUPS))} (48, 56 and 72 SMs, "
            f"which the measurements use); missing {','.join(map(str, missing))}"
        )
    if args.reps <= WARMUP_CALLS:
        parser.error(
            f"--reps must exceed the {WARMUP_CALLS} warm-up calls a figure drops; got {args.reps}"
        )
    return args
