"""Per-minute rollups of the metric time series, updated as each sample is ingested."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db.models import QuerySet

from api.models import MetricRollup


def minute_of(ts: datetime) -> datetime:
    return ts.replace(second=0, microsecond=0)


def rollup_add(*, series: str, key: str, ts: datetime, values: dict[str, Any]) -> None:
    """Add one sample to the minute of `ts` (sums and maxima per field; None fields skipped).

    Must run inside a transaction: the minute's row is locked while it is updated, so
    concurrent workers add up correctly.
    """
    numbers = {k: float(v) for k, v in values.items() if v is not None}
    minute = minute_of(ts)
    MetricRollup.objects.get_or_create(series=series, key=key, minute=minute)
    row = MetricRollup.objects.select_for_update().get(series=series, key=key, minute=minute)
    sums: dict[str, Any] = dict(row.sums)
    maxima: dict[str, Any] = dict(row.maxima)
    for name, value in numbers.items():
        sums[name] = sums.get(name, 0.0) + value
        maxima[name] = max(maxima.get(name, value), value)
    row.samples += 1
    row.sums = sums
    row.maxima = maxima
    row.save(update_fields=["samples", "sums", "maxima"])


def rollup_means(*, series: str, key: str) -> QuerySet[MetricRollup]:
    """The minutes of one series, oldest first (mean of a field = sums[field] / samples)."""
    return MetricRollup.objects.filter(series=series, key=key).order_by("minute")
