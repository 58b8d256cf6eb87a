"""What the report handlers share: a report's time stamp, and the stop for a placement that is
no longer open."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from api.models import GpuHost, JobStatus, Placement


def report_time(message: dict[str, Any]) -> datetime:
    sent = message.get("sent_at")
    if isinstance(sent, (int, float)):
        return datetime.fromtimestamp(float(sent), tz=UTC)
    return timezone.now()


def stop_on_commit(host: GpuHost, placement: Placement) -> None:
    """Tell the host to stop a placement that is no longer open: pause when the job is
    paused (the host checkpoints first), cancel otherwise. The safety net behind the stop that
    a pause or cancel sends at its own commit (`api.services.jobs`); the host ignores a stop
    for a placement it no longer trains."""
    from workers.commands import send_stop

    stop = partial(
        send_stop,
        host_name=host.name,
        placement_id=placement.pk,
        job_id=placement.job_id,
        command="pause" if placement.job.status == JobStatus.PAUSED else "cancel",
    )
    transaction.on_commit(stop, robust=True)
