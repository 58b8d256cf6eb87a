"""Placements a host will never run, given up so their jobs are placed again (reconciliation
steps 1b and 1c, `api.services.reconcile`).

A job waits on its open placement; if the host is alive (heartbeating, so never declared lost)
but will not run that placement, nothing else moves the job. Two such cases:

* **Never acknowledged**: a pending placement its host has not started, nor listed in any
  heartbeat, `HARLI_PLACEMENT_ACK_TIMEOUT_S` after it was made. The agent dropped it (its
  process was killed after receiving it but before starting, then it restarted and dropped
  the resend as seen; or it refused it), or the host is draining, where reconciliation does not
  send it again. The placement becomes `lost` and the queued job is placed anew.
* **Forgotten while running**: an active placement of a running job flagged as stalled (no
  progress for `HARLI_JOB_STALL_AFTER_S`) whose host's latest heartbeat, applied after the
  flag, does not list it: the agent restarted (kill -9) and runs it no more. The placement
  becomes `lost` and the job goes back to `queued`, resuming from its latest checkpoint.

If the host does start a given-up placement after all, its report is stale and the host is told
to stop it (`api.services.reports`), so a job never trains on two hosts.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from api.models import (
    EventLevel,
    FinetuneJob,
    HostAgentState,
    HostStatus,
    JobStatus,
    Placement,
    PlacementState,
)
from api.selectors import job_checkpoint_latest
from api.services.jobs import finetune_job_transition, host_detail, job_event_record


def _listed(placement: Placement, *, after: datetime) -> bool | None:
    """Whether the host's latest heartbeat lists the placement; None when no heartbeat was
    applied after `after` (nothing to judge by)."""
    state = HostAgentState.objects.filter(host_id=placement.host_id).first()
    if state is None or state.reported_at is None or state.reported_at <= after:
        return None
    return placement.pk in {int(p) for p in state.placements}


def _lose(placement: Placement, now: datetime) -> None:
    placement.state = PlacementState.LOST
    placement.ended_at = now
    placement.save(update_fields=["state", "ended_at"])


def placement_unacknowledged_give_up(*, placement_id: int, before: datetime) -> bool:
    """Give up a pending placement made before `before` that its host never acknowledged;
    True when it did. Checked again under the job's row lock."""
    with transaction.atomic():
        placement = Placement.objects.select_related("host", "decision").get(pk=placement_id)
        job = FinetuneJob.objects.select_for_update().get(pk=placement.job_id)
        placement.refresh_from_db(fields=["state"])
        if placement.state != PlacementState.PENDING or placement.created_at >= before:
            return False
        if _listed(placement, after=placement.created_at):
            return False  # the agent holds it (setting it up)
        now = timezone.now()
        _lose(placement, now)
        sends = getattr(getattr(placement, "decision", None), "dispatch_count", 0)
        waited = (now - placement.created_at).total_seconds()
        job_event_record(
            job=job,
            message=f"Training did not start within {waited:.0f} s; placing the job again",
            level=EventLevel.WARN,
            fleet_detail=host_detail(
                f"Host {placement.host.name} did not start placement {placement.pk} "
                f"within {waited:.0f} s (sent {sends} time(s)); placing the job again",
                host=placement.host.name,
                placement_id=placement.pk,
            ),
        )
    return True


def placement_forgotten_requeue(*, placement_id: int) -> bool:
    """Requeue a stalled running job whose host's heartbeat no longer lists its placement;
    True when it did. Checked again under the job's row lock."""
    with transaction.atomic():
        placement = Placement.objects.select_related("host").get(pk=placement_id)
        job = FinetuneJob.objects.select_for_update().get(pk=placement.job_id)
        placement.refresh_from_db(fields=["state"])
        if placement.state != PlacementState.ACTIVE or job.status != JobStatus.RUNNING:
            return False
        if job.stalled_at is None or _listed(placement, after=job.stalled_at) is not False:
            return False
        _lose(placement, timezone.now())
        step = job_checkpoint_latest(job=job)
        resume = f"the job resumes from checkpoint step {step.step if step else 0}"
        finetune_job_transition(
            job=job,
            to=JobStatus.QUEUED,
            message=f"Training interrupted; {resume}",
            level=EventLevel.WARN,
            fleet_detail=host_detail(
                f"Host {placement.host.name} no longer runs placement {placement.pk} "
                f"(its agent restarted); {resume} on a host",
                host=placement.host.name,
                placement_id=placement.pk,
            ),
        )
    return True


def stranded_placements_recover(
    *, now: datetime, ack_timeout_s: int
) -> tuple[list[int], list[str]]:
    """Both recoveries of the module docstring; returns the given-up placement ids and the
    requeued job ids."""
    before = now - timedelta(seconds=ack_timeout_s)
    unacknowledged = Placement.objects.filter(
        state=PlacementState.PENDING, created_at__lt=before
    ).exclude(host__status=HostStatus.LOST)
    given_up = [
        pk
        for pk in unacknowledged.values_list("pk", flat=True)
        if placement_unacknowledged_give_up(placement_id=pk, before=before)
    ]
    forgotten = Placement.objects.filter(
        state=PlacementState.ACTIVE, job__status=JobStatus.RUNNING, job__stalled_at__isnull=False
    )
    requeued = [
        job_id
        for pk, job_id in forgotten.values_list("pk", "job_id")
        if placement_forgotten_requeue(placement_id=pk)
    ]
    return given_up, requeued
