"""The command line of ``bench/sharing.py`` (its options and defaults)."""

from __future__ import annotations

import argparse
import os


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``bench/sharing.py``'s options; ``description`` is its module docstring."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--groups", default="", help="decode SM groups k (k*8 SMs), e.g. 2,4,6")
    parser.add_argument("--probe", action="store_true", help="only check creation + a bf16 GEMM")
    return parser.parse_args(argv)
