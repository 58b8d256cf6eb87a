"""Why a queued job waits before placement looks at hosts, read in batched queries: the
queued jobs with their previous placement, latest checkpoint and latest event; the tenant's
`running_jobs` quota; a previous host still training it or a checkpoint still in flight; and
the events that record the reasons (once per distinct reason)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db.models import JSONField, OuterRef, Subquery
from django.utils import timezone

from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    BaseModel,
    EventLevel,
    FinetuneJob,
    HostAgentState,
    HostStatus,
    JobCheckpoint,
    JobEvent,
    JobStatus,
    Placement,
    PlacementState,
)
from api.services.jobs import host_detail


@dataclass
class Waiting:
    """A queued job the pass considers, with what it read about it in batched queries."""

    job: FinetuneJob
    previous: Placement | None
    latest_step: int | None
    last_message: str | None
    last_detail_text: str | None
    """The operator's text (`fleet_detail["text"]`) of the job's latest event."""


def waiting_jobs(job_ids: list[str] | None) -> list[Waiting]:
    """Queued jobs without an open placement, oldest first, each with its previous placement
    (host and agent state), its latest stored checkpoint's step and its latest event's message:
    three queries whatever their number."""
    open_jobs = Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES).values("job_id")
    jobs = FinetuneJob.objects.filter(status=JobStatus.QUEUED).exclude(pk__in=open_jobs)
    if job_ids is not None:
        jobs = jobs.filter(pk__in=job_ids)
    # Plain rows of only what placement reads (no model instances for 10,000 waiting jobs);
    # the base models come in one query of their own.
    last_event = JobEvent.objects.filter(job=OuterRef("pk")).order_by("-created_at", "-id")
    rows = list(
        jobs.annotate(
            last_message=Subquery(last_event.values("message")[:1]),
            last_detail=Subquery(last_event.values("fleet_detail")[:1], output_field=JSONField()),
            previous_id=Subquery(
                Placement.objects.filter(job=OuterRef("pk"))
                .order_by("-created_at", "-id")
                .values("pk")[:1]
            ),
            latest_step=Subquery(
                JobCheckpoint.objects.filter(job=OuterRef("pk"))
                .exclude(path="")
                .order_by("-step")
                .values("step")[:1]
            ),
        )
        .order_by("created_at", "id")
        .values_list(
            "id",
            "tenant_id",
            "base_model_id",
            "hyperparameters",
            "method",
            "lora_rank",
            "lora_target_modules",
            "last_message",
            "previous_id",
            "latest_step",
            "last_detail",
        )
    )
    models = {m.pk: m for m in BaseModel.objects.filter(pk__in={r[2] for r in rows})}
    previous_ids = [r[8] for r in rows if r[8] is not None]
    previous = {
        p.pk: p
        for p in Placement.objects.filter(pk__in=previous_ids).select_related(
            "host", "host__agent_state"
        )
    }
    waiting = []
    for row in rows:
        job_id, tenant_id, model_id, hyper, method, rank, modules, message, prev, step, detail = row
        job = FinetuneJob(
            id=job_id,
            tenant_id=tenant_id,
            base_model=models[model_id],
            status=JobStatus.QUEUED,
            hyperparameters=hyper,
            method=method,
            lora_rank=rank,
            lora_target_modules=modules,
        )
        job._state.adding = False  # a partial copy for the estimate; never saved or returned
        waiting.append(
            Waiting(
                job=job,
                previous=previous.get(prev),
                latest_step=step,
                last_message=message,
                last_detail_text=(detail or {}).get("text") if isinstance(detail, dict) else None,
            )
        )
    return waiting


@dataclass
class Note:
    """Why a job waits: the tenant's `message` and the operator's `fleet_detail`."""

    item: Waiting
    message: str
    level: str
    fleet_detail: dict[str, Any] | None = None


def wait_reason(
    item: Waiting, fresh_after: Any, running: dict[int, int], limits: dict[int, int]
) -> Note | None:
    """Why the job waits before any host is looked at, or None."""
    tenant_id = item.job.tenant_id
    if running.get(tenant_id, 0) >= limits[tenant_id]:
        return Note(
            item,
            f"Waiting: the tenant has {running.get(tenant_id, 0)} jobs on hosts, its "
            f"running_jobs quota is {limits[tenant_id]}",
            EventLevel.INFO,
        )
    stopping = _still_training(previous=item.previous, fresh_after=fresh_after)
    if stopping is not None:
        return Note(
            item,
            "Waiting for the previous run to stop (it checkpoints at its batch boundary first)",
            EventLevel.INFO,
            host_detail(
                f"Waiting for host {stopping.host.name} to stop placement {stopping.pk}",
                host=stopping.host.name,
                placement_id=stopping.pk,
            ),
        )
    awaited = _checkpoint_in_flight(previous=item.previous, latest_step=item.latest_step)
    if awaited is not None:
        return Note(
            item,
            f"Waiting for the checkpoint of step {awaited.stopped_step}",
            EventLevel.INFO,
            host_detail(
                f"Waiting for the checkpoint of step {awaited.stopped_step} that host "
                f"{awaited.host.name} stopped at",
                host=awaited.host.name,
                placement_id=awaited.pk,
            ),
        )
    return None


def notes_record(notes: list[Note]) -> None:
    """Record each waiting job's reason unless it is the job's latest event already, with the
    same operator text (passes repeat often): one insert for all."""
    fresh = [
        JobEvent(
            job_id=note.item.job.pk,
            message=note.message,
            level=note.level,
            fleet_detail=note.fleet_detail,
        )
        for note in notes
        if note.item.last_message != note.message
        or note.item.last_detail_text != (note.fleet_detail or {}).get("text")
    ]
    if fresh:
        JobEvent.objects.bulk_create(fresh)


def _still_training(*, previous: Placement | None, fresh_after: Any) -> Placement | None:
    """The job's `previous` placement while its host may still train it: released (a pause),
    its host heartbeating recently, no stop from it applied yet, and either the host's latest
    heartbeat names it or no heartbeat has been applied since the host started it (so none
    could have). A resumed job waits for that host's stop (`job_stopped`, or a later heartbeat
    without it), so it never trains on two hosts at once and resumes from the checkpoint its
    pause writes. A host gone silent is not waited for."""
    if previous is None or previous.state != PlacementState.RELEASED:
        return None
    if previous.stopped_at is not None:
        return None
    host = previous.host
    state: HostAgentState | None = getattr(host, "agent_state", None)
    if host.status not in (HostStatus.ONLINE, HostStatus.DRAINING) or state is None:
        return None
    if state.reported_at is None or state.reported_at < fresh_after:
        return None
    if previous.pk in state.placements:
        return previous
    started = previous.started_at
    return previous if started is not None and state.reported_at <= started else None


def _checkpoint_in_flight(
    *, previous: Placement | None, latest_step: int | None
) -> Placement | None:
    """The job's `previous` placement when its host reported stopping at a step whose
    checkpoint is not recorded yet (`latest` is the job's latest recorded one): the checkpoint
    report was sent first but may be applied later (a report retried after a transient error
    runs behind the ones sent after it). The job waits for it at most HARLI_REDISPATCH_AFTER_S
    after the stop, then resumes from `latest_step` (a report the broker lost never comes)."""
    if previous is None or previous.stopped_step is None or previous.stopped_at is None:
        return None
    waited = timezone.now() - previous.stopped_at
    if waited > timedelta(seconds=fleet_settings().redispatch_after_s):
        return None
    recorded = latest_step if latest_step is not None else 0
    return previous if recorded < previous.stopped_step else None
