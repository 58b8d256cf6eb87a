"""Reads of finetune jobs for the console: filtered lists, current hosts, progress and ETA."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.db.models import F, OuterRef, QuerySet, Subquery, Window
from django.db.models.functions import RowNumber

from api import selectors as api_selectors
from api.models import (
    EventType,
    FinetuneJob,
    GpuHost,
    JobEvent,
    JobMetric,
    JobStatus,
    Placement,
    PlacementState,
)
from gpu_runtime.finetune.hparams import HyperparameterError, resolve_hyperparameters

# Jobs


def job_list(
    *, tenant: str | None = None, status: str | None = None, host: str | None = None
) -> QuerySet[FinetuneJob]:
    """Every tenant's jobs (operator view), filtered by tenant name, status, and a host the job
    has ever been placed on."""
    jobs = api_selectors.finetune_job_list(tenant=None, status=status or None)
    if tenant:
        jobs = jobs.filter(tenant__name=tenant)
    if host:
        jobs = jobs.filter(placements__host__name=host).distinct()
    return jobs


def current_hosts(*, job_ids: Sequence[str]) -> dict[str, GpuHost]:
    """The host of each job's open (pending or active) placement."""
    placements = Placement.objects.filter(
        job_id__in=list(job_ids), state__in=[PlacementState.PENDING, PlacementState.ACTIVE]
    ).select_related("host")
    return {p.job_id: p.host for p in placements}


def job_series(*, job: FinetuneJob) -> list[JobMetric]:
    """Every metric row of the job, oldest first (a job's history is short enough to plot)."""
    return list(JobMetric.objects.filter(job=job).order_by("ts", "step"))


@dataclass(frozen=True)
class JobProgress:
    """How far a job is: `step` of `total_steps` (None when unknown), and an ETA in seconds."""

    step: int
    total_steps: int | None
    eta_seconds: float | None

    @property
    def fraction(self) -> float | None:
        if not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)

    @property
    def percent(self) -> int | None:
        fraction = self.fraction
        return None if fraction is None else round(100 * fraction)


def estimated_total_steps(*, job: FinetuneJob) -> int | None:
    """Optimizer steps the runtime will take: epochs x ceil(examples / batch size), with "auto"
    resolved by the runtime's own rule (`gpu_runtime.finetune.hparams`). None if unknowable."""
    examples = job.training_file.line_count if job.training_file_id else 0
    if examples < 1:
        return None
    hyper = job.hyperparameters or {}
    try:
        resolved = resolve_hyperparameters(
            n_train_examples=examples,
            n_epochs=hyper.get("n_epochs", "auto"),
            batch_size=hyper.get("batch_size", "auto"),
        )
    except HyperparameterError:
        return None
    return resolved.n_epochs * math.ceil(examples / resolved.batch_size)


# The ETA's rate is measured over this many latest reports, so a pause long ago or a change of
# host (and speed) weighs no more than the recent pace.
ETA_WINDOW_REPORTS = 20


def progress_from(
    *, points: Sequence[tuple[datetime, int]], total_steps: int | None
) -> JobProgress:
    """Progress from `(ts, step)` reports (oldest first): the rate is steps per second between
    the first and the last of the latest ETA_WINDOW_REPORTS reports; the ETA is the remaining
    steps at that rate."""
    if not points:
        return JobProgress(step=0, total_steps=total_steps, eta_seconds=None)
    recent = points[-ETA_WINDOW_REPORTS:]
    (first_ts, first_step), (last_ts, last_step) = recent[0], recent[-1]
    eta = None
    elapsed = (last_ts - first_ts).total_seconds()
    if total_steps is not None and elapsed > 0 and last_step > first_step:
        rate = (last_step - first_step) / elapsed
        eta = max(0.0, (total_steps - last_step) / rate)
    return JobProgress(step=last_step, total_steps=total_steps, eta_seconds=eta)


def reported_total_steps(*, job_ids: Sequence[str]) -> dict[str, int]:
    """The step count each job's host announced (the newest progress event's `total_steps`).

    Hosts count the steps of the data they actually load, so this beats the estimate. The
    subquery picks each job's newest progress event by its id only; the JSON is decoded here,
    from whole `data` values (a JSON key extracted inside a subquery comes back as a native
    value on SQLite, which Django then fails to decode)."""
    newest = (
        JobEvent.objects.filter(
            job=OuterRef("pk"), type=EventType.METRICS, data__has_key="total_steps"
        )
        .order_by("-created_at", "-id")
        .values("pk")[:1]
    )
    event_ids = (
        FinetuneJob.objects.filter(pk__in=list(job_ids))
        .annotate(event_id=Subquery(newest))
        .filter(event_id__isnull=False)
        .values_list("event_id", flat=True)
    )
    rows = JobEvent.objects.filter(pk__in=list(event_ids)).values_list("job_id", "data")
    result = {}
    for job_id, data in rows:
        total = data.get("total_steps") if isinstance(data, dict) else None
        if isinstance(total, int) and not isinstance(total, bool) and total > 0:
            result[job_id] = total
    return result


def job_progress_map(*, jobs: Sequence[FinetuneJob]) -> dict[str, JobProgress]:
    """Progress of each job: its latest ETA_WINDOW_REPORTS metric rows, and its step count as
    its host reported it, else as estimated from its settings."""
    ids = [j.pk for j in jobs]
    points: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    latest_first = (
        JobMetric.objects.filter(job_id__in=ids)
        .annotate(rank=Window(RowNumber(), partition_by=[F("job_id")], order_by=F("ts").desc()))
        .filter(rank__lte=ETA_WINDOW_REPORTS)
        .values_list("job_id", "ts", "step")
    )
    for job_id, ts, step in sorted(latest_first, key=lambda row: (row[0], row[1])):
        points[job_id].append((ts, step))
    reported = reported_total_steps(job_ids=ids)
    result = {}
    for job in jobs:
        total = reported.get(job.pk) or estimated_total_steps(job=job)
        progress = progress_from(points=points[job.pk], total_steps=total)
        if job.status == JobStatus.SUCCEEDED and total is not None:
            progress = JobProgress(step=total, total_steps=total, eta_seconds=0.0)
        result[job.pk] = progress
    return result
