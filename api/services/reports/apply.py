"""Applying one host report: deduplication by message id, then the handler of its kind.

See the package docstring (`api.services.reports`) for the at-most-once and stale-report contracts.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from api.models import GpuHost, ProcessedReport
from api.services.janitor import report_expired
from api.services.reports.adapters import adapter_load_failed_apply
from api.services.reports.heartbeat import heartbeat_apply
from api.services.reports.jobs import (
    checkpoint_apply,
    job_failed_apply,
    job_progress_apply,
    job_started_apply,
    job_stopped_apply,
    job_succeeded_apply,
)
from api.services.reports.metrics import metrics_apply
from gpu_runtime.contract.protocol import check_report


def host_report_apply(*, message: dict[str, Any]) -> str:
    """Apply one report; returns "applied", "duplicate", "stale", "expired" or "unknown_host"."""
    check_report(message)
    if report_expired(message=message):
        return "expired"  # older than its dedupe row may live (`api.services.janitor`)
    if not GpuHost.objects.filter(name=message["host"]).exists():
        return "unknown_host"  # nothing to apply, so nothing to deduplicate
    with transaction.atomic():
        try:
            with transaction.atomic():
                ProcessedReport.objects.create(
                    message_id=message["message_id"], kind=message["kind"], host=message["host"]
                )
        except IntegrityError:
            return "duplicate"
        host = GpuHost.objects.select_for_update().filter(name=message["host"]).first()
        if host is None:
            return "unknown_host"
        handler = _HANDLERS[message["kind"]]
        return handler(host=host, message=message)


_HANDLERS = {
    "heartbeat": heartbeat_apply,
    "job_started": job_started_apply,
    "job_progress": job_progress_apply,
    "checkpoint": checkpoint_apply,
    "job_succeeded": job_succeeded_apply,
    "job_failed": job_failed_apply,
    "job_stopped": job_stopped_apply,
    "adapter_load_failed": adapter_load_failed_apply,
    "metrics": metrics_apply,
}
