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
MAX_POINTS = 2160
# Deployment series are combined across hosts in time buckets at least this wide (hosts report
# every few seconds, unaligned): 15m, 1h and 6h use it; 24h uses 24h / MAX_POINTS = 40 s.
MIN_BUCKET = timedelta(seconds=10)
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


def bucket_width(window: timedelta) -> timedelta:
    """The time bucket for combining hosts' reports over a window of this length."""
    return max(MIN_BUCKET, window / MAX_POINTS)


def combine_hosts(
    rows: Sequence[tuple[object, ...]],
    names: Sequence[str],
    *,
    width: timedelta,
    summed: frozenset[str] = frozenset(),
    maxed: frozenset[str] = frozenset(),
    weighted: frozenset[str] = frozenset(),
    weight: str | None = None,
) -> Columns:
    """Combine several hosts' reports of one deployment into one series, bucket by bucket.

    `rows` are `(ts, host key, *values)` with values named `names`, oldest first. Buckets are
    `width` wide, aligned to the Unix epoch; a bucket's time is its newest report's. Within a
    bucket each host's reports are averaged first (`maxed` columns take the maximum); then the
    hosts are combined: `summed` columns add up (rates of the whole deployment), `maxed` take the
    maximum, `weighted` columns are averaged weighted by the hosts' `weight` column (when every
    host has a positive weight), and the rest are plain means. Nulls are skipped; a column with
    no value in a bucket is None.
    """
    seconds = width.total_seconds()
    if seconds <= 0:
        raise ValueError(f"width must be positive, got {width}")
    index = {name: i + 2 for i, name in enumerate(names)}
    buckets: dict[int, dict[object, list[tuple[object, ...]]]] = {}
    newest: dict[int, datetime] = {}
    for row in rows:
        ts = row[0]
        if not isinstance(ts, datetime):
            raise TypeError(f"a row starts with its datetime, got {ts!r}")
        key = math.floor(ts.timestamp() / seconds)
        buckets.setdefault(key, {}).setdefault(row[1], []).append(row)
        newest[key] = max(newest.get(key, ts), ts)

    def per_host(host_rows: list[tuple[object, ...]], name: str) -> float | None:
        values = [v for v in (as_float(r[index[name]]) for r in host_rows) if v is not None]
        if not values:
            return None
        return max(values) if name in maxed else sum(values) / len(values)

    ts_out: list[datetime] = []
    out: dict[str, list[float | None]] = {name: [] for name in names}
    for key in sorted(buckets):
        hosts = buckets[key]
        host_values = {name: [per_host(r, name) for r in hosts.values()] for name in names}
        weights = host_values[weight] if weight is not None else []
        ts_out.append(newest[key])
        for name in names:
            values = host_values[name]
            present = [v for v in values if v is not None]
            if not present:
                out[name].append(None)
            elif name in summed:
                out[name].append(sum(present))
            elif name in maxed:
                out[name].append(max(present))
            elif (
                name in weighted
                and weights
                and all(w is not None and w > 0 for w in weights)
                and all(v is not None for v in values)
            ):
                total = sum(w for w in weights if w is not None)
                out[name].append(
                    sum(
                        v * w
                        for v, w in zip(values, weights, strict=True)
                        if v is not None and w is not None
                    )
                    / total
                )
            else:
                out[name].append(sum(present) / len(present))
    return Columns(ts=ts_out, values=out)
