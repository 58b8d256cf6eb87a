"""Reads of finetune jobs for the console: filtered lists, current hosts, progress and ETA (the
latter computed in `api.progress`, which the API's `estimated_finish` shares)."""

from __future__ import annotations

from collections.abc import Sequence

from django.db.models import QuerySet

from api import selectors as api_selectors
from api.models import (
    FinetuneJob,
    GpuHost,
    JobMetric,
    Placement,
    PlacementState,
)
from api.progress import (
    ETA_WINDOW_REPORTS,
    JobProgress,
    estimated_total_steps,
    job_progress_map,
    progress_from,
)

__all__ = [
    "ETA_WINDOW_REPORTS",
    "JobProgress",
    "current_hosts",
    "estimated_total_steps",
    "job_list",
    "job_progress_map",
    "job_series",
    "progress_from",
]

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
