"""Quota writes and admissions: set a tenant's overrides, admit a job or a file under the
tenant's row lock, count trained tokens per month (the rules are in `api.quotas`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from api.errors import HarliError
from api.middleware import MULTIPART_OVERHEAD_BYTES
from api.models import FinetuneJob, Tenant, TenantQuota, TenantTrainedTokens
from api.quotas import (
    QUOTA_MAX,
    QUOTA_NAMES,
    QuotaExceededError,
    QuotaName,
    month_start,
    queued_jobs_used,
    quota_limit,
    quota_overrides,
    stored_bytes_used,
    trained_tokens_used,
)


def tenant_quotas_set(*, tenant: Tenant, changes: Any) -> dict[QuotaName, int | None]:
    """Apply `changes` ({quota name: integer from 0, or None for the fleet default}) to the
    tenant's overrides; a quota left out keeps its override. Anything else raises HarliError
    naming the field, and nothing is written. Returns the overrides now in force."""
    if not isinstance(changes, dict):
        raise HarliError(
            "quotas must be an object of quota name to an integer or null.",
            param="quotas",
            code="invalid_value",
        )
    for name, value in changes.items():
        if name not in QUOTA_NAMES:
            raise HarliError(
                f"Unknown quota {name!r}; the quotas are {', '.join(QUOTA_NAMES)}.",
                param=f"quotas.{name}",
                code="unknown_field",
            )
        if value is None:
            continue
        top = QUOTA_MAX[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise HarliError(
                f"quotas.{name} must be an integer from 0 to {top}, or null for the fleet "
                f"default; got {value!r}.",
                param=f"quotas.{name}",
                code="invalid_value",
            )
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(pk=tenant.pk).exists()
        row, _ = TenantQuota.objects.get_or_create(tenant=tenant)
        for name, value in changes.items():
            setattr(row, name, value)
        row.save()
    return quota_overrides(tenant=tenant)


def _tenant_lock(tenant: Tenant) -> None:
    """Take the tenant's row lock (PostgreSQL; SQLite's transactions are serialized already):
    every admission of the tenant's work waits for the one before it to commit."""
    Tenant.objects.select_for_update().filter(pk=tenant.pk).exists()


def quota_job_admit(*, tenant: Tenant, now: datetime | None = None) -> None:
    """Admit one more waiting job for `tenant` (a new job, or a paused one resumed), or raise
    QuotaExceededError (429) for `queued_jobs` or `trained_tokens_per_month`. Must run inside
    the transaction that writes the job: the tenant's row lock it takes holds until then."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("quota_job_admit must run inside the job's transaction")
    _tenant_lock(tenant)
    overrides = quota_overrides(tenant=tenant)
    limit = quota_limit(name="queued_jobs", overrides=overrides)
    used = queued_jobs_used(tenant_id=tenant.pk)
    if used + 1 > limit:
        raise QuotaExceededError(quota="queued_jobs", limit=limit, used=used, adding=1)
    month = month_start(now or timezone.now())
    limit = quota_limit(name="trained_tokens_per_month", overrides=overrides)
    used = trained_tokens_used(tenant_id=tenant.pk, month=month)
    if used >= limit:
        raise QuotaExceededError(quota="trained_tokens_per_month", limit=limit, used=used, adding=0)


def quota_stored_bytes_check(*, tenant: Tenant, adding: int, lock: bool) -> None:
    """Raise QuotaExceededError (413) when `adding` more bytes would take the tenant's files
    past `stored_bytes`. With `lock` (inside the transaction that inserts the file's row) the
    tenant's row lock orders concurrent uploads; without it this is the early check made
    before any byte is stored."""
    if lock:
        if not transaction.get_connection().in_atomic_block:
            raise RuntimeError("a locked stored-bytes check must run inside the row's transaction")
        _tenant_lock(tenant)
    limit = quota_limit(name="stored_bytes", overrides=quota_overrides(tenant=tenant))
    used = stored_bytes_used(tenant_id=tenant.pk)
    if used + adding > limit:
        raise QuotaExceededError(
            quota="stored_bytes", limit=limit, used=used, adding=adding, http_status=413
        )


def trained_tokens_record(*, tenant_id: int, increase: int, at: datetime | None = None) -> None:
    """Add `increase` trained tokens (ignored unless positive) to the tenant's count for the
    UTC month of `at` (now by default)."""
    if increase <= 0:
        return
    month = month_start(at or timezone.now())
    rows = TenantTrainedTokens.objects.filter(tenant_id=tenant_id, month=month)
    with transaction.atomic():
        if rows.update(trained_tokens=F("trained_tokens") + increase):
            return
        try:
            with transaction.atomic():
                TenantTrainedTokens.objects.create(
                    tenant_id=tenant_id, month=month, trained_tokens=increase
                )
        except IntegrityError:  # created meanwhile by a concurrent report
            rows.update(trained_tokens=F("trained_tokens") + increase)


def job_trained_tokens_advance(*, job: FinetuneJob, trained_tokens: int) -> None:
    """Set the job's `trained_tokens` to its host's latest count and add the increase to the
    tenant's month (a count lower than before, a resume from an earlier checkpoint, adds
    nothing; the tokens trained again after it count as they are reported)."""
    with transaction.atomic():
        previous = (
            FinetuneJob.objects.select_for_update()
            .values_list("trained_tokens", flat=True)
            .get(pk=job.pk)
        )
        FinetuneJob.objects.filter(pk=job.pk).update(trained_tokens=trained_tokens)
        trained_tokens_record(tenant_id=job.tenant_id, increase=trained_tokens - (previous or 0))


def quota_declared_upload_check(*, tenant: Tenant, content_length: str | None) -> None:
    """Refuse (413) a `POST /v1/files` whose declared `Content-Length` already shows the file
    cannot fit the tenant's `stored_bytes`, before the body is read: the file has at least the
    body's bytes less `MULTIPART_OVERHEAD_BYTES` of framing."""
    try:
        declared = int(content_length or 0)
    except ValueError:
        return
    least = declared - MULTIPART_OVERHEAD_BYTES
    if least > 0:
        quota_stored_bytes_check(tenant=tenant, adding=least, lock=False)
