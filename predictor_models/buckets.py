"""0/1 step boundaries of the latency model: batch and token buckets, decode SM-share splits.

The log of a step's bucket is a sum of 0/1 steps, one per bucket boundary, so any bucket list
is exact; the chunk network reads one 0/1 step per boundary between profiled share splits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""``EngineConfig``'s default decode buckets (profiles without an ``engine`` record)."""
DEFAULT_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Token buckets assumed for profiles without an ``engine`` record (no mixed-step graphs)."""
STEP_SCALE = 1.0 / math.log(1e6)
"""Scales ``log(value / threshold)`` into (0, 1] for values up to 1e6 x the threshold."""


def step_thresholds(buckets: Sequence[int]) -> tuple[list[float], list[float]]:
    """(log thresholds, log increments) of ``log bucket(v) = log b0 + sum_i inc_i [v > b_i]``:
    one boundary per bucket but the last, at ``b_i + 0.5`` (values are integers)."""
    sizes = sorted(set(int(b) for b in buckets))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"buckets {buckets} must be positive integers")
    logs = [math.log(b) for b in sizes]
    thresholds = [math.log(b + 0.5) for b in sizes[:-1]]
    return thresholds, [logs[i + 1] - logs[i] for i in range(len(sizes) - 1)]


def share_thresholds(splits: Sequence[float]) -> list[float]:
    """Log decode-SM-share boundaries halfway in log between consecutive profiled splits
    (fractions of the device, e.g. 48/132 .. 1): a share above boundary i gets step i. The
    geometric mean of two SM counts (55.4 between 48 and 64) is no whole SM count, so no
    share a green context can have sits on a boundary (where float32 rounding could flip it)."""
    shares = sorted(set(float(s) for s in splits))
    if shares and not 0.0 < shares[0] <= shares[-1] <= 1.0:
        raise ValueError(f"share splits {splits} must lie in (0, 1]")
    return [(math.log(a) + math.log(b)) / 2.0 for a, b in zip(shares, shares[1:], strict=False)]
