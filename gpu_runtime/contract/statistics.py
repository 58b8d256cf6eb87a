"""The one definition of a percentile that the runtime's reports, the benchmarks' result files
and the console's figures share, so a "p99" means the same statistic everywhere.

A percentile here is linearly interpolated between the two nearest order statistics (the
definition numpy and the spreadsheet PERCENTILE.INC use): with ``n`` sorted values, ``q`` sits at
rank ``(n - 1) * q / 100``. ``q`` is in [0, 100]; no values give None (JSON null in reports and
result files), never NaN or zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (linear interpolation), or None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Iterable[float]) -> float | None:
    """The 50th percentile of ``values``, or None for no values."""
    return percentile(values, 50.0)
