"""Argument types shared by the benchmarks' command lines."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_ints(option: str) -> Callable[[str], list[int]]:
    """argparse `type` of `option`: comma-separated positive integers (``1,8,64``); anything
    else is the parser's error, naming the option and the text given."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(
                f"{option}: {text!r} is not a comma list of ints"
            ) from exc
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{option}: needs positive integers, got {text!r}")
        return values

    return parse
