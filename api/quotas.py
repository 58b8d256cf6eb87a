"""Per-tenant quotas on fine-tuning: what each one limits, its fleet default, how its use counts.

- `running_jobs`: the tenant's jobs with an open placement (on a host, or sent to one).
  Enforced by placement: a job past it stays queued until one of the tenant's jobs leaves
  its host.
- `queued_jobs`: the tenant's jobs validating files or queued without a host. Job creation
  and resume answer 429 at the quota.
- `stored_bytes`: bytes of the tenant's files. An upload that would pass it is refused (413)
  before the file is stored (from its declared size first, exactly before its row commits).
- `trained_tokens_per_month`: tokens trained this UTC calendar month (`TenantTrainedTokens`).
  Job creation answers 429 once the month's count reaches the quota (jobs already admitted
  run to the end).

Defaults are fleet-wide settings (`HARLI_QUOTA_*`); a `TenantQuota` row overrides any of them
for one tenant (null: the default). A quota of 0 refuses everything it counts. The checks that
admit work run under the tenant's row lock (`api.services.quotas`), so concurrent requests
cannot pass a quota together.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Literal

from django.conf import settings
from django.db.models import Sum
from rest_framework import status

from api.errors import HarliError
from api.models import (
    OPEN_PLACEMENT_STATES,
    File,
    FinetuneJob,
    JobStatus,
    Placement,
    Tenant,
    TenantQuota,
    TenantTrainedTokens,
)

QuotaName = Literal["running_jobs", "queued_jobs", "stored_bytes", "trained_tokens_per_month"]
QUOTA_NAMES: tuple[QuotaName, ...] = (
    "running_jobs",
    "queued_jobs",
    "stored_bytes",
    "trained_tokens_per_month",
)
QUOTA_DESCRIPTIONS: dict[QuotaName, str] = {
    "running_jobs": "fine-tuning jobs on a host at once",
    "queued_jobs": "fine-tuning jobs waiting for a host",
    "stored_bytes": "bytes of stored files",
    "trained_tokens_per_month": "tokens trained this calendar month (UTC)",
}
_SETTINGS: dict[QuotaName, str] = {
    "running_jobs": "HARLI_QUOTA_RUNNING_JOBS",
    "queued_jobs": "HARLI_QUOTA_QUEUED_JOBS",
    "stored_bytes": "HARLI_QUOTA_STORED_BYTES",
    "trained_tokens_per_month": "HARLI_QUOTA_TRAINED_TOKENS_PER_MONTH",
}
# Jobs that wait for a host and count against `queued_jobs`.
WAITING_STATUSES = (JobStatus.VALIDATING_FILES, JobStatus.QUEUED)
# The largest quota each column holds on every database.
QUOTA_MAX: dict[QuotaName, int] = {
    "running_jobs": 2**31 - 1,
    "queued_jobs": 2**31 - 1,
    "stored_bytes": 2**63 - 1,
    "trained_tokens_per_month": 2**63 - 1,
}


class QuotaExceededError(HarliError):
    """A request that would take the tenant past one of its quotas (OpenAI's 429 shape:
    type `insufficient_quota`, code `quota_exceeded`, `param` the quota's name)."""

    http_status = status.HTTP_429_TOO_MANY_REQUESTS
    error_type = "insufficient_quota"

    def __init__(
        self,
        *,
        quota: QuotaName,
        limit: int,
        used: int,
        adding: int,
        http_status: int | None = None,
    ) -> None:
        what = QUOTA_DESCRIPTIONS[quota]
        message = (
            f"Quota {quota} exceeded: {used} {what} in use, this request adds {adding}, "
            f"the quota is {limit}. Ask an operator to raise it"
            + (", or wait until work finishes." if quota.endswith("jobs") else ".")
        )
        if quota == "stored_bytes":
            message = (
                f"Quota stored_bytes exceeded: the tenant stores {used} bytes, this file has "
                f"{adding}, the quota is {limit}. Delete files or ask an operator to raise it."
            )
        if quota == "trained_tokens_per_month":
            message = (
                f"Quota trained_tokens_per_month exceeded: {used} tokens trained this month "
                f"(UTC), the quota is {limit}. New jobs are accepted again next month or when "
                "an operator raises it."
            )
        super().__init__(message, code="quota_exceeded", param=quota, http_status=http_status)
        self.quota, self.limit, self.used, self.adding = quota, limit, used, adding


def quota_default(name: QuotaName) -> int:
    return int(getattr(settings, _SETTINGS[name]))


def month_start(at: datetime | date) -> date:
    """The first day of the UTC calendar month of `at` (an aware datetime, or a date)."""
    if isinstance(at, datetime):
        if at.tzinfo is None:
            raise ValueError(f"month_start needs an aware datetime, got {at!r}")
        at = at.astimezone(UTC).date()
    return at.replace(day=1)


@dataclass(frozen=True)
class QuotaState:
    """One quota of one tenant: its limit (the override, else the default) and current use."""

    name: QuotaName
    limit: int
    default: int
    override: int | None
    used: int

    @property
    def remaining(self) -> int:
        return max(self.limit - self.used, 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": QUOTA_DESCRIPTIONS[self.name],
            "limit": self.limit,
            "used": self.used,
            "remaining": self.remaining,
            "default": self.default,
            "override": self.override,
        }


def quota_overrides(*, tenant: Tenant) -> dict[QuotaName, int | None]:
    row = TenantQuota.objects.filter(tenant=tenant).first()
    return {name: (getattr(row, name) if row is not None else None) for name in QUOTA_NAMES}


def quota_limit(*, name: QuotaName, overrides: dict[QuotaName, int | None]) -> int:
    override = overrides.get(name)
    return quota_default(name) if override is None else override


def running_jobs_used(*, tenant_id: int) -> int:
    return (
        Placement.objects.filter(job__tenant_id=tenant_id, state__in=OPEN_PLACEMENT_STATES)
        .values("job_id")
        .distinct()
        .count()
    )


def queued_jobs_used(*, tenant_id: int) -> int:
    """Jobs waiting for a host: validating or queued, without an open placement."""
    open_jobs = Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES).values("job_id")
    return (
        FinetuneJob.objects.filter(tenant_id=tenant_id, status__in=WAITING_STATUSES)
        .exclude(pk__in=open_jobs)
        .count()
    )


def stored_bytes_used(*, tenant_id: int) -> int:
    total = File.objects.filter(tenant_id=tenant_id).aggregate(total=Sum("bytes"))["total"]
    return int(total or 0)


def trained_tokens_used(*, tenant_id: int, month: date) -> int:
    row = TenantTrainedTokens.objects.filter(tenant_id=tenant_id, month=month).first()
    return row.trained_tokens if row is not None else 0


def quota_used(*, name: QuotaName, tenant_id: int, now: datetime) -> int:
    if name == "running_jobs":
        return running_jobs_used(tenant_id=tenant_id)
    if name == "queued_jobs":
        return queued_jobs_used(tenant_id=tenant_id)
    if name == "stored_bytes":
        return stored_bytes_used(tenant_id=tenant_id)
    return trained_tokens_used(tenant_id=tenant_id, month=month_start(now))


def tenant_quota_states(*, tenant: Tenant, now: datetime) -> list[QuotaState]:
    """Every quota of `tenant` with its limit and current use, in `QUOTA_NAMES` order."""
    overrides = quota_overrides(tenant=tenant)
    return [
        QuotaState(
            name=name,
            limit=quota_limit(name=name, overrides=overrides),
            default=quota_default(name),
            override=overrides[name],
            used=quota_used(name=name, tenant_id=tenant.pk, now=now),
        )
        for name in QUOTA_NAMES
    ]


def running_jobs_limits(*, tenant_ids: set[int]) -> dict[int, int]:
    """The `running_jobs` quota of each tenant in `tenant_ids` (one query; placement's)."""
    default = quota_default("running_jobs")
    limits = dict.fromkeys(tenant_ids, default)
    rows = TenantQuota.objects.filter(tenant_id__in=tenant_ids, running_jobs__isnull=False)
    for tenant_id, running_jobs in rows.values_list("tenant_id", "running_jobs"):
        limits[tenant_id] = int(running_jobs or 0)
    return limits
