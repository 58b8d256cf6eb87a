"""What the report handlers share: a report's time stamp, and the stop for a placement that is
no longer open."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from api.dispatch import host_dispatch
from api.models import GpuHost, JobStatus, Placement, PlacementState


def report_time(message: dict[str, Any]) -> datetime:
    sent = message.get("sent_at")
    if isinstance(sent, (int, float)):
        return datetime.fromtimestamp(float(sent), tz=UTC)
    return timezone.now()


def pausing(placement: Placement) -> bool:
    """Whether a closed placement is one a pause released and the job still waits on: the
    job's latest placement, released, the job paused or resumed and queued (not placed
    anywhere since). Its host pauses it at a batch boundary, and the steps and checkpoint it
    reports until then count (`api.services.reports.jobs`)."""
    if placement.state != PlacementState.RELEASED or placement.job.status not in (
        JobStatus.PAUSED,
        JobStatus.QUEUED,
    ):
        return False
    latest = Placement.objects.filter(job_id=placement.job_id).order_by("-created_at", "-id")
    return latest.values_list("pk", flat=True).first() == placement.pk


def stop_on_commit(host: GpuHost, placement: Placement) -> None:
    """Tell the host to stop a placement that is no longer open: pause when the job waits on
    it (:func:`pausing`: the host checkpoints first), cancel otherwise. The safety net behind
    the stop that a pause or cancel sends at its own commit (`api.services.jobs`); the host
    ignores a stop for a placement it no longer trains."""
    stop = partial(
        host_dispatch().placement_stop_send,
        host_name=host.name,
        placement_id=placement.pk,
        job_id=placement.job_id,
        command="pause" if pausing(placement) else "cancel",
    )
    transaction.on_commit(stop, robust=True)
