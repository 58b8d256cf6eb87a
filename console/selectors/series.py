"""Time windows and index-aligned metric series, with bucketed downsampling for charts."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from api.errors import HarliError

RANGES: dict[str, timedelta] = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
}
DEFAULT_RANGE = "1h"
# A chart never gets more points per trace than this; longer series are averaged in buckets.
MAX_POINTS = 720
# A host's latest metric older than this is not shown as its current state.
FRESHNESS = timedelta(minutes=5)

Aggregate = Literal["mean", "max"]


def parse_range(value: str | None) -> timedelta:
    """The time window named by `value` (None or "" means the default); else a HarliError."""
    if not value:
        return RANGES[DEFAULT_RANGE]
    if value not in RANGES:
        raise HarliError(
            f"Unknown time range {value!r}; use one of {', '.join(RANGES)}.",
            param="range",
            code="invalid_range",
        )
    return RANGES[value]


@dataclass(frozen=True)
class Columns:
    """Index-aligned time series: `ts[i]` with `values[name][i]` for every column."""

    ts: list[datetime]
    values: dict[str, list[float | None]]

    def __len__(self) -> int:
        return len(self.ts)


def downsample(
    columns: Columns, *, max_points: int = MAX_POINTS, aggregate: dict[str, Aggregate] | None = None
) -> Columns:
    """At most `max_points` rows: consecutive rows are merged in equal-count buckets.

    A bucket's time is its middle row's; each value is the mean (or, per `aggregate`, the max)
    of the bucket's non-null values, or None when all are null. Short series come back as given.
    """
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    n = len(columns)
    if n <= max_points:
        return columns
    size = math.ceil(n / max_points)
    ts: list[datetime] = []
    values: dict[str, list[float | None]] = {name: [] for name in columns.values}
    for start in range(0, n, size):
        stop = min(start + size, n)
        ts.append(columns.ts[(start + stop - 1) // 2])
        for name, column in columns.values.items():
            present = [v for v in column[start:stop] if v is not None]
            if not present:
                values[name].append(None)
            elif (aggregate or {}).get(name) == "max":
                values[name].append(max(present))
            else:
                values[name].append(sum(present) / len(present))
    return Columns(ts=ts, values=values)


def columns_from_rows(rows: Sequence[tuple[object, ...]], names: Sequence[str]) -> Columns:
    """Rows of `(ts, *values)` into Columns named `names` (order kept)."""
    ts = [row[0] for row in rows]
    values = {name: [as_float(row[i + 1]) for row in rows] for i, name in enumerate(names)}
    return Columns(ts=ts, values=values)  # type: ignore[arg-type]


def as_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
