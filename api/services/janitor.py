"""The janitor: sweeps what a crash left, and prunes what is kept only for a while.

Run by beat every `HARLI_JANITOR_INTERVAL_S` (the `workers.janitor` task) and once by
`manage.py janitor`. Each pass, idempotent and safe beside live requests:

1. **Spool files**: files in `HARLI_UPLOAD_SPOOL_DIR` (where uploads above 2.5 MB are spooled
   while a request is read; a killed web process leaves them) untouched for
   `HARLI_JANITOR_STALE_FILE_AGE_S`. A request still receiving its body keeps touching its file.
2. **Partial writes** in storage (a process killed while storing, `Storage.partial_writes_remove`)
   untouched for the same age.
3. **Orphans**: stored training files (`files/`) and upload parts (`uploads/`) that no row names,
   written more than `HARLI_JANITOR_ORPHAN_GRACE_S` ago (the bytes are stored before their row
   commits, and a deletion removes the row before the bytes). Checkpoints, adapters and
   tokenizers are written by hosts before their report arrives, possibly much later (an agent's
   outbox), so they are left alone.
4. **Expired idempotency keys** (`api.idempotency`).
5. **Host and deployment metric samples** older than `HARLI_METRICS_RAW_RETENTION_H` (at least
   :data:`CONSOLE_LONGEST_RANGE`, the console's longest chart, which reads them), and per-minute
   rollups older than `HARLI_METRICS_ROLLUP_RETENTION_D`. A job's step metrics are kept while
   the job is (its loss curve and result file read every step) and go with it.
6. **ProcessedReport** rows (host reports' dedupe record) older than
   `HARLI_PROCESSED_REPORT_RETENTION_H`. Deduplication stays exact: a report is applied only if
   it was sent less than that retention minus :data:`CLOCK_SKEW_ALLOWANCE` ago
   (:func:`report_expired`, checked before its dedupe row), so any copy that can still be
   applied finds its row. The retention must also exceed the broker's redelivery window (twice
   the visibility timeout, checked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import models, transaction
from django.utils import timezone

from api.models import (
    DeploymentMetric,
    File,
    HostMetric,
    IdempotencyKey,
    MetricRollup,
    ProcessedReport,
    UploadPart,
)
from api.storage import Storage, get_storage

CONSOLE_LONGEST_RANGE = timedelta(hours=24)
"""The longest time range the console charts from raw samples (`console.selectors.series`)."""
CLOCK_SKEW_ALLOWANCE = timedelta(hours=1)
"""How far a host's clock (a report's `sent_at`) may run behind the control plane's."""
DELETE_BATCH = 2000
"""Rows deleted per transaction (SQLite holds its write lock for each)."""
ORPHAN_PREFIXES: dict[str, type[models.Model]] = {"files": File, "uploads": UploadPart}


@dataclass
class JanitorResult:
    spool_files: list[str] = field(default_factory=list)
    partial_writes: list[str] = field(default_factory=list)
    orphan_objects: list[str] = field(default_factory=list)
    idempotency_keys: int = 0
    host_metrics: int = 0
    deployment_metrics: int = 0
    metric_rollups: int = 0
    processed_reports: int = 0


def raw_metrics_retention() -> timedelta:
    retention = timedelta(hours=int(settings.HARLI_METRICS_RAW_RETENTION_H))
    if retention < CONSOLE_LONGEST_RANGE:
        raise ImproperlyConfigured(
            f"HARLI_METRICS_RAW_RETENTION_H={settings.HARLI_METRICS_RAW_RETENTION_H} is shorter "
            f"than the console's longest chart ({CONSOLE_LONGEST_RANGE}), which reads them."
        )
    return retention


def processed_report_retention() -> timedelta:
    """How long a report's dedupe row is kept; at least twice the broker's visibility timeout
    (a task redelivered after its worker died) and more than the clock skew allowance."""
    retention = timedelta(hours=int(settings.HARLI_PROCESSED_REPORT_RETENTION_H))
    options: dict[str, Any] = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    visibility_s = int(options.get("visibility_timeout", 3600))
    floor = max(timedelta(seconds=2 * visibility_s), 2 * CLOCK_SKEW_ALLOWANCE)
    if retention < floor:
        raise ImproperlyConfigured(
            f"HARLI_PROCESSED_REPORT_RETENTION_H={settings.HARLI_PROCESSED_REPORT_RETENTION_H} "
            f"is shorter than {floor} (twice HARLI_BROKER_VISIBILITY_TIMEOUT_S={visibility_s}, "
            "within which a report may be delivered again)."
        )
    return retention


def report_expired(*, message: dict[str, Any], now: float | None = None) -> bool:
    """Whether a host report is too old to apply: sent (its `sent_at`, the host's clock) longer
    ago than the dedupe retention less the clock skew allowance, so its dedupe row, had it been
    applied before, may be gone. Such a report is dropped (its job was long since reconciled)."""
    sent = message.get("sent_at")
    if not isinstance(sent, (int, float)) or isinstance(sent, bool):
        return False
    limit = processed_report_retention() - CLOCK_SKEW_ALLOWANCE
    return ((now if now is not None else time.time()) - float(sent)) > limit.total_seconds()


def _delete_batched(queryset: models.QuerySet[Any]) -> int:
    """Delete the queryset's rows, DELETE_BATCH per transaction; returns how many."""
    total = 0
    while True:
        pks = list(queryset.values_list("pk", flat=True)[:DELETE_BATCH])
        if not pks:
            return total
        with transaction.atomic():
            queryset.model.objects.filter(pk__in=pks).delete()
        total += len(pks)


def spool_sweep(*, before: float) -> list[str]:
    """Remove the spool folder's files last touched before `before` (POSIX s); their names."""
    spool = Path(settings.HARLI_UPLOAD_SPOOL_DIR)
    if not spool.is_dir():
        return []
    removed = []
    for path in spool.iterdir():
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_mtime < before:
                path.unlink()
                removed.append(path.name)
        except FileNotFoundError:  # its request finished meanwhile
            continue
    return sorted(removed)


def orphans_sweep(*, storage: Storage, before: float) -> list[str]:
    """Remove stored objects under ORPHAN_PREFIXES that no row names, written before `before`."""
    removed: list[str] = []
    for prefix, model in ORPHAN_PREFIXES.items():
        keys = storage.list_keys(prefix)
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            owned = set(
                model._default_manager.filter(storage_key__in=batch).values_list(
                    "storage_key", flat=True
                )
            )
            for key in batch:
                if key in owned:
                    continue
                try:
                    if storage.modified_at(key) >= before:
                        continue
                except FileNotFoundError:
                    continue
                # Checked again just before deleting: a row may have committed meanwhile.
                if not model._default_manager.filter(storage_key=key).exists():
                    storage.delete(key)
                    removed.append(key)
    return removed


def janitor_sweep(*, now: datetime | None = None) -> JanitorResult:
    """One pass of the janitor (see the module docstring)."""
    now = now or timezone.now()
    stamp = now.timestamp()
    storage = get_storage()
    result = JanitorResult()
    stale_before = stamp - int(settings.HARLI_JANITOR_STALE_FILE_AGE_S)
    result.spool_files = spool_sweep(before=stale_before)
    result.partial_writes = storage.partial_writes_remove(before=stale_before)
    result.orphan_objects = orphans_sweep(
        storage=storage, before=stamp - int(settings.HARLI_JANITOR_ORPHAN_GRACE_S)
    )
    result.idempotency_keys = _delete_batched(IdempotencyKey.objects.filter(expires_at__lte=now))
    raw_before = now - raw_metrics_retention()
    result.host_metrics = _delete_batched(HostMetric.objects.filter(ts__lt=raw_before))
    result.deployment_metrics = _delete_batched(DeploymentMetric.objects.filter(ts__lt=raw_before))
    rollups_before = now - timedelta(days=int(settings.HARLI_METRICS_ROLLUP_RETENTION_D))
    result.metric_rollups = _delete_batched(MetricRollup.objects.filter(minute__lt=rollups_before))
    result.processed_reports = _delete_batched(
        ProcessedReport.objects.filter(processed_at__lt=now - processed_report_retention())
    )
    return result
