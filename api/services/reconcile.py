"""Reconciliation, run by beat every `HARLI_RECONCILE_INTERVAL_S` seconds (the
`workers.reconcile` task).

1. A host `online` or `draining` whose last heartbeat is older than `HARLI_HOST_LOST_AFTER_S`
   is `lost`: its open placements become `lost`, and each of their running jobs goes back to
   `queued` with an event naming the host and the checkpoint step it will resume from.
1b. A pending placement its host never acknowledged within `HARLI_PLACEMENT_ACK_TIMEOUT_S`,
   and an active one a stalled job's host no longer lists, are given up
   (`api.services.stranded`): their jobs are queued without a placement, so step 2 places them.
2. Queued jobs without an open placement are placed, the oldest first, at most
   `HARLI_PLACEMENTS_PER_PASS` per pass (`api.services.placement.placement_pass`).
3. A pending placement its host has not started within `HARLI_REDISPATCH_AFTER_S` is sent
   again (a lost broker message); the agent drops duplicates by placement id.
4. A running job whose host has sent no progress (step or checkpoint report) for
   `HARLI_JOB_STALL_AFTER_S`, counted from its start on that host, is flagged: `stalled_at`,
   and one warning event naming the host and the time of its last progress. The host may
   still heartbeat: this is about the job, not the host. Its next progress report, or a
   status change, clears the flag (`api.services.reports.jobs`, `api.services.jobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import transaction
from django.db.models import OuterRef, Q, Subquery
from django.utils import timezone

from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    EventLevel,
    EventType,
    FinetuneJob,
    GpuHost,
    HostStatus,
    JobEvent,
    JobStatus,
    Placement,
    PlacementState,
)
from api.selectors import job_checkpoint_latest
from api.services.jobs import finetune_job_transition, host_detail, job_event_record
from api.services.placement import placement_pass
from api.services.placement_dispatch import placements_send
from api.services.stranded import stranded_placements_recover


@dataclass
class ReconcileResult:
    lost_hosts: list[str] = field(default_factory=list)
    requeued_jobs: list[str] = field(default_factory=list)
    placed_jobs: list[str] = field(default_factory=list)
    redispatched: list[int] = field(default_factory=list)
    stalled_jobs: list[str] = field(default_factory=list)
    abandoned_placements: list[int] = field(default_factory=list)


def host_mark_lost(*, host_id: int, silent_s: float) -> list[str]:
    """Declare a host lost and queue its running jobs again; returns the requeued job ids."""
    requeued: list[str] = []
    with transaction.atomic():
        host = GpuHost.objects.select_for_update().get(pk=host_id)
        if host.status not in (HostStatus.ONLINE, HostStatus.DRAINING):
            return requeued
        host.status = HostStatus.LOST
        host.save(update_fields=["status"])
        now = timezone.now()
        # The jobs' rows before their placements' (the order every writer of both keeps).
        open_placements = Placement.objects.filter(host=host, state__in=OPEN_PLACEMENT_STATES)
        job_ids = sorted(open_placements.values_list("job_id", flat=True))
        list(FinetuneJob.objects.select_for_update().filter(pk__in=job_ids).order_by("pk"))
        for placement in open_placements.select_for_update():
            placement.state = PlacementState.LOST
            placement.ended_at = now
            placement.save(update_fields=["state", "ended_at"])
            job = FinetuneJob.objects.select_for_update().get(pk=placement.job_id)
            latest = job_checkpoint_latest(job=job)
            step = latest.step if latest else 0
            text = f"Training interrupted; the job resumes from checkpoint step {step}"
            detail = host_detail(
                f"Host {host.name} lost (no heartbeat for {silent_s:.0f} s); the job "
                f"resumes from checkpoint step {step} on another host",
                host=host.name,
                placement_id=placement.pk,
                silent_s=round(silent_s),
            )
            if job.status == JobStatus.RUNNING:
                finetune_job_transition(
                    job=job,
                    to=JobStatus.QUEUED,
                    message=text,
                    level=EventLevel.WARN,
                    fleet_detail=detail,
                )
                requeued.append(job.id)
            elif job.status == JobStatus.QUEUED:
                job_event_record(
                    job=job, message=text, level=EventLevel.WARN, fleet_detail=detail
                )
                requeued.append(job.id)
    return requeued


def fleet_reconcile() -> ReconcileResult:
    """One reconciliation pass (see the module docstring)."""
    conf = fleet_settings()
    result = ReconcileResult()
    now = timezone.now()
    cutoff = now - timedelta(seconds=conf.host_lost_after_s)
    silent = GpuHost.objects.filter(status__in=(HostStatus.ONLINE, HostStatus.DRAINING)).filter(
        Q(last_heartbeat_at__lt=cutoff) | Q(last_heartbeat_at__isnull=True)
    )
    for host in silent:
        since = host.last_heartbeat_at or host.created_at
        result.requeued_jobs += host_mark_lost(
            host_id=host.pk, silent_s=(now - since).total_seconds()
        )
        result.lost_hosts.append(host.name)
    abandoned, requeued = stranded_placements_recover(
        now=now, ack_timeout_s=conf.placement_ack_timeout_s
    )
    result.abandoned_placements += abandoned
    result.requeued_jobs += requeued
    result.placed_jobs += [p.job_id for p in placement_pass()]
    resend_before = now - timedelta(seconds=conf.redispatch_after_s)
    # Pending and unstarted since the last send, or never sent (the broker was away at commit).
    stuck = Placement.objects.filter(
        state=PlacementState.PENDING, host__status=HostStatus.ONLINE
    ).filter(
        Q(decision__last_dispatched_at__lt=resend_before)
        | Q(decision__last_dispatched_at__isnull=True, created_at__lt=resend_before)
    )
    result.redispatched += placements_send(placement_ids=list(stuck.values_list("pk", flat=True)))
    stall_before = now - timedelta(seconds=conf.job_stall_after_s)
    # One query finds the placements whose last progress is old; each is checked again, and
    # flagged, under its job's lock (a few per pass: a stall is flagged once).
    running = Placement.objects.filter(
        state=PlacementState.ACTIVE,
        job__status=JobStatus.RUNNING,
        job__stalled_at__isnull=True,
        started_at__lt=stall_before,
    ).annotate(
        last_metrics_at=Subquery(
            JobEvent.objects.filter(
                job_id=OuterRef("job_id"),
                type=EventType.METRICS,
                created_at__gte=OuterRef("started_at"),
            )
            .order_by("-created_at")
            .values("created_at")[:1]
        )
    )
    quiet = running.filter(Q(last_metrics_at__isnull=True) | Q(last_metrics_at__lt=stall_before))
    for placement_id, job_id in quiet.values_list("pk", "job_id"):
        if job_flag_stall(placement_id=placement_id, before=stall_before):
            result.stalled_jobs.append(job_id)
    return result


def _last_progress(placement: Placement) -> datetime | None:
    """When the placement's host last showed progress: its start, or its latest step or
    checkpoint report after that (the control plane's clock, not the host's)."""
    started = placement.started_at
    if started is None:
        return None
    latest = (
        JobEvent.objects.filter(job_id=placement.job_id, type=EventType.METRICS,
                                created_at__gte=started)
        .order_by("-created_at")
        .values_list("created_at", flat=True)
        .first()
    )  # fmt: skip
    return latest or started


def job_flag_stall(*, placement_id: int, before: datetime) -> bool:
    """Flag the placement's running job as stalled when its host's last progress is older than
    `before`; True when it did. Checked again under the job's row lock."""
    with transaction.atomic():
        placement = Placement.objects.select_related("host").get(pk=placement_id)
        job = FinetuneJob.objects.select_for_update().get(pk=placement.job_id)
        if job.status != JobStatus.RUNNING or job.stalled_at is not None:
            return False
        placement.refresh_from_db(fields=["state"])
        if placement.state != PlacementState.ACTIVE:
            return False
        last = _last_progress(placement)
        if last is None or last >= before:
            return False
        job.stalled_at = timezone.now()
        job.save(update_fields=["stalled_at"])
        since = last.isoformat(timespec="seconds")
        job_event_record(
            job=job,
            message=f"No training progress since {since}",
            level=EventLevel.WARN,
            data={"last_progress_at": last.isoformat()},
            fleet_detail=host_detail(
                f"No progress from host {placement.host.name} since {since}",
                host=placement.host.name,
                placement_id=placement.pk,
            ),
        )
    return True
