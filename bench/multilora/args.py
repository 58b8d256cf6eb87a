"""The command line of ``bench/multilora/run.py`` (its options, defaults and their meaning). The
description is the first line of that module's docstring, passed in by its `main`, so ``--help``
says what the docstring says."""

from __future__ import annotations

import argparse
import os

from bench.multilora.setup import MODES


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``bench/multilora/run.py``'s options (the module docstring there says what a run does)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="llama3-8b", help="preset name or 'tiny'")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="qkvo,all")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="kernel times per step")
    parser.add_argument("--modes", default=",".join(MODES), help=f"subset of {MODES}")
    parser.add_argument(
        "--mixed-steps", action="store_true", help="also time decode+prefill-chunk steps once"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--commit", default=os.environ.get("GIT_COMMIT", "unknown"))
    return parser.parse_args(argv)
