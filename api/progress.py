"""Reads: how far a fine-tuning job is and when it will finish, the one computation behind the
API's `estimated_finish` and the console's progress bar and ETA.

The rate is measured from the job's progress reports (`JobMetric` rows, one per optimizer step):
steps per second between the first and the last of its latest ETA_WINDOW_REPORTS reports. The
step count is the one the job's host counted when it started the job (`FinetuneJob.total_steps`),
else the estimate from the job's settings. Only a running job has an ETA; it is the remaining
steps at that rate, counted from the last report, so `estimated_finish` does not drift while no
report arrives.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import F, Window
from django.db.models.functions import RowNumber

from api.models import File, FinetuneJob, JobMetric, JobStatus
from gpu_runtime.contract.hparams import HyperparameterError, resolve_hyperparameters

# The ETA's rate is measured over this many latest reports, so a pause long ago or a change of
# host (and speed) weighs no more than the recent pace.
ETA_WINDOW_REPORTS = 20


@dataclass(frozen=True)
class JobProgress:
    """How far a job is: `step` of `total_steps` (None when unknown), the ETA in seconds from
    `last_report_at` (None when unknown or the job is not running)."""

    step: int
    total_steps: int | None
    eta_seconds: float | None
    last_report_at: datetime | None = None

    @property
    def fraction(self) -> float | None:
        if not self.total_steps:
            return None
        return min(1.0, self.step / self.total_steps)

    @property
    def percent(self) -> int | None:
        fraction = self.fraction
        return None if fraction is None else round(100 * fraction)

    @property
    def estimated_finish(self) -> datetime | None:
        """When the job should finish at the measured rate (None without an ETA)."""
        if self.eta_seconds is None or self.last_report_at is None:
            return None
        return self.last_report_at + timedelta(seconds=self.eta_seconds)


def estimated_total_steps(*, job: FinetuneJob) -> int | None:
    """Optimizer steps the runtime takes: as its host counted them, else epochs x
    ceil(examples / batch size) with "auto" resolved by the runtime's own rule
    (`gpu_runtime.contract.hparams`). None if unknowable."""
    if job.total_steps:
        return job.total_steps
    try:
        examples = job.training_file.line_count
    except File.DoesNotExist:  # deleted after the job ended (no database constraint)
        return None
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
    return JobProgress(
        step=last_step, total_steps=total_steps, eta_seconds=eta, last_report_at=last_ts
    )


def job_progress_map(*, jobs: Sequence[FinetuneJob]) -> dict[str, JobProgress]:
    """Progress of each job (one query for all): its latest ETA_WINDOW_REPORTS metric rows and
    its step count; a succeeded job is complete, a job that is not running has no ETA."""
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
    result = {}
    for job in jobs:
        total = estimated_total_steps(job=job)
        progress = progress_from(points=points[job.pk], total_steps=total)
        if job.status == JobStatus.SUCCEEDED and total is not None:
            progress = JobProgress(step=total, total_steps=total, eta_seconds=0.0)
        elif job.status != JobStatus.RUNNING:
            progress = JobProgress(step=progress.step, total_steps=total, eta_seconds=None)
        result[job.pk] = progress
    return result
