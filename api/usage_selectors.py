"""Reads of inference usage (`TenantUsage`): sums per time bucket, per model, per tenant.

Times are Unix seconds. Buckets are 1m, 1h or 1d wide and aligned to UTC minutes, hours and
days; a bucket counts the minutes that start inside it and inside the asked range
[start, end). Tenant-facing reads take the tenant; `tenant=None` is every tenant, for the
operator's views only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour

from api.models import Tenant, TenantUsage

BUCKET_SECONDS = {"1m": 60, "1h": 3600, "1d": 86400}


@dataclass(frozen=True)
class UsageSum:
    """Counts summed over a bucket starting at `start_time`, for one model and one tenant
    when the read groups by them (None otherwise)."""

    start_time: int
    requests: int
    prompt_tokens: int
    completion_tokens: int
    model: str | None = None
    tenant: str | None = None


@dataclass(frozen=True)
class UsageBucket:
    """One time bucket [start_time, end_time) and its sums (empty when nothing was used)."""

    start_time: int
    end_time: int
    results: list[UsageSum] = field(default_factory=list)


def bucket_floor(unix_s: int, width: str) -> int:
    """The start of the `width` bucket that `unix_s` falls in."""
    seconds = BUCKET_SECONDS[width]
    return unix_s - unix_s % seconds


def bucket_starts(*, start: int, end: int, width: str) -> list[int]:
    """The starts of the buckets that overlap [start, end), oldest first."""
    seconds = BUCKET_SECONDS[width]
    return list(range(bucket_floor(start, width), end, seconds)) if end > start else []


def _time(unix_s: int) -> datetime:
    return datetime.fromtimestamp(unix_s, tz=UTC)


def _usage(
    *, tenant: Tenant | None, start: int, end: int, models: Sequence[str] | None
) -> QuerySet[TenantUsage]:
    rows = TenantUsage.objects.filter(minute__gte=_time(start), minute__lt=_time(end))
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    if models:
        rows = rows.filter(model__in=list(models))
    return rows


def usage_sums(
    *,
    tenant: Tenant | None,
    start: int,
    end: int,
    width: str | None,
    models: Sequence[str] | None = None,
    by_model: bool = False,
    by_tenant: bool = False,
) -> list[UsageSum]:
    """The non-empty sums over [start, end): per bucket of `width` (None: one sum over the
    whole range, with `start_time` = `start`), and per model / tenant when asked; ordered by
    bucket, then tenant, then model."""
    rows: QuerySet[Any] = _usage(tenant=tenant, start=start, end=end, models=models)
    group: list[str] = []
    if width is not None:
        if width not in BUCKET_SECONDS:
            raise ValueError(f"width must be one of {', '.join(BUCKET_SECONDS)}, got {width!r}")
        truncated = {
            "1m": F("minute"),
            "1h": TruncHour("minute", tzinfo=UTC),
            "1d": TruncDay("minute", tzinfo=UTC),
        }[width]
        rows = rows.annotate(bucket=truncated)
        group.append("bucket")
    if by_tenant:
        group.append("tenant__name")
    if by_model:
        group.append("model")
    if not group:
        total = rows.aggregate(
            sum_requests=Sum("requests"),
            sum_prompt=Sum("prompt_tokens"),
            sum_completion=Sum("completion_tokens"),
        )
        if not total["sum_requests"]:
            return []
        return [
            UsageSum(
                start_time=start,
                requests=int(total["sum_requests"]),
                prompt_tokens=int(total["sum_prompt"] or 0),
                completion_tokens=int(total["sum_completion"] or 0),
            )
        ]
    sums = (
        rows.values(*group)
        .annotate(
            sum_requests=Sum("requests"),
            sum_prompt=Sum("prompt_tokens"),
            sum_completion=Sum("completion_tokens"),
        )
        .order_by(*group)
    )
    return [
        UsageSum(
            start_time=int(row["bucket"].timestamp()) if width is not None else start,
            requests=int(row["sum_requests"] or 0),
            prompt_tokens=int(row["sum_prompt"] or 0),
            completion_tokens=int(row["sum_completion"] or 0),
            model=row.get("model"),
            tenant=row.get("tenant__name"),
        )
        for row in sums
    ]


def usage_buckets(
    *,
    tenant: Tenant | None,
    start: int,
    end: int,
    width: str,
    models: Sequence[str] | None = None,
    by_model: bool = False,
) -> list[UsageBucket]:
    """Every bucket of `width` overlapping [start, end), empty ones included, with its sums
    (one per model when `by_model`, else one in all, or none when nothing was used)."""
    seconds = BUCKET_SECONDS[width]
    buckets = {
        s: UsageBucket(start_time=s, end_time=s + seconds)
        for s in bucket_starts(start=start, end=end, width=width)
    }
    for one in usage_sums(
        tenant=tenant, start=start, end=end, width=width, models=models, by_model=by_model
    ):
        buckets[one.start_time].results.append(one)
    return list(buckets.values())
