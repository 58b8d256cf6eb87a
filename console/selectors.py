"""Console-only reads: metric time series, job progress, predictor accuracy, filtered job lists.

Reads that the APIs share live in `api.selectors`; this module holds what only the console needs.
Metric rows are written by the control plane's metrics ingestion (models `HostMetric`,
`DeploymentMetric`, `JobMetric`); the console only reads them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone

from api import selectors as api_selectors
from api.errors import HarliError
from api.models import (
    Deployment,
    DeploymentMetric,
    FinetuneJob,
    GpuHost,
    HostMetric,
    JobMetric,
    JobStatus,
    Placement,
    PlacementState,
)
from gpu_runtime.finetune.hparams import HyperparameterError, resolve_hyperparameters

RANGES: dict[str, timedelta] = {
    "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1),
    "6h": timedelta(hours=6),
    "24h": timedelta(hours=24),
}
DEFAULT_RANGE = "1h"
# A chart never gets more points per trace than this; longer series are averaged in buckets.
MAX_POINTS = 720
# A host's latest metric older than this is not shown as its current state.
FRESHNESS = timedelta(minutes=5)

Aggregate = Literal["mean", "max"]


def parse_range(value: str | None) -> timedelta:
    """The time window named by `value` (None or "" means the default); else a HarliError."""
    if not value:
        return RANGES[DEFAULT_RANGE]
    if value not in RANGES:
        raise HarliError(
            f"Unknown time range {value!r}; use one of {', '.join(RANGES)}.",
            param="range",
            code="invalid_range",
        )
    return RANGES[value]


@dataclass(frozen=True)
class Columns:
    """Index-aligned time series: `ts[i]` with `values[name][i]` for every column."""

    ts: list[datetime]
    values: dict[str, list[float | None]]

    def __len__(self) -> int:
        return len(self.ts)


def downsample(
    columns: Columns, *, max_points: int = MAX_POINTS, aggregate: dict[str, Aggregate] | None = None
) -> Columns:
    """At most `max_points` rows: consecutive rows are merged in equal-count buckets.

    A bucket's time is its middle row's; each value is the mean (or, per `aggregate`, the max)
    of the bucket's non-null values, or None when all are null. Short series come back as given.
    """
    if max_points < 1:
        raise ValueError(f"max_points must be >= 1, got {max_points}")
    n = len(columns)
    if n <= max_points:
        return columns
    size = math.ceil(n / max_points)
    ts: list[datetime] = []
    values: dict[str, list[float | None]] = {name: [] for name in columns.values}
    for start in range(0, n, size):
        stop = min(start + size, n)
        ts.append(columns.ts[(start + stop - 1) // 2])
        for name, column in columns.values.items():
            present = [v for v in column[start:stop] if v is not None]
            if not present:
                values[name].append(None)
            elif (aggregate or {}).get(name) == "max":
                values[name].append(max(present))
            else:
                values[name].append(sum(present) / len(present))
    return Columns(ts=ts, values=values)


def _columns(rows: Sequence[tuple[object, ...]], names: Sequence[str]) -> Columns:
    """Rows of `(ts, *values)` into Columns named `names` (order kept)."""
    ts = [row[0] for row in rows]
    values = {name: [_float(row[i + 1]) for row in rows] for i, name in enumerate(names)}
    return Columns(ts=ts, values=values)  # type: ignore[arg-type]


def _float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


# Hosts


def host_memory_latest(*, now: datetime | None = None) -> dict[int, HostMetric]:
    """Each host's newest metric row, if it is fresher than FRESHNESS; keyed by host id."""
    now = now or timezone.now()
    newest = HostMetric.objects.filter(host=OuterRef("host")).order_by("-ts").values("pk")[:1]
    rows = HostMetric.objects.filter(pk=Subquery(newest), ts__gte=now - FRESHNESS)
    return {row.host_id: row for row in rows}


def host_finetune_series(*, since: datetime) -> dict[int, Columns]:
    """Harvested finetune tokens/s of every host since `since`, keyed by host id."""
    rows = (
        HostMetric.objects.filter(ts__gte=since)
        .order_by("host_id", "ts")
        .values_list("host_id", "ts", "finetune_tokens_per_s")
    )
    grouped: dict[int, list[tuple[object, ...]]] = defaultdict(list)
    for host_id, ts, tokens in rows:
        grouped[host_id].append((ts, tokens))
    return {
        host_id: downsample(_columns(items, ["finetune_tokens_per_s"]))
        for host_id, items in grouped.items()
    }


# Deployments

DEPLOYMENT_COLUMNS = (
    "tpot_p50_ms",
    "tpot_p99_ms",
    "slo_attainment",
    "goodput_tokens_per_s",
    "request_rate",
    "predicted_iter_ms",
    "observed_iter_ms",
)


def deployment_series(*, deployment: Deployment, since: datetime) -> Columns:
    """The deployment's metrics since `since`, all hosts together, oldest first.

    When several hosts serve a deployment, each reports its own rows; they are interleaved by
    time here (the chart shows every report).
    """
    rows = (
        DeploymentMetric.objects.filter(deployment=deployment, ts__gte=since)
        .order_by("ts", "pk")
        .values_list("ts", *DEPLOYMENT_COLUMNS)
    )
    return downsample(_columns(list(rows), DEPLOYMENT_COLUMNS), aggregate={"tpot_p99_ms": "max"})


def attainment_series(*, since: datetime) -> dict[int, Columns]:
    """SLO attainment (fraction) of every deployment since `since`, keyed by deployment id."""
    rows = (
        DeploymentMetric.objects.filter(ts__gte=since)
        .order_by("deployment_id", "ts", "pk")
        .values_list("deployment_id", "ts", "slo_attainment")
    )
    grouped: dict[int, list[tuple[object, ...]]] = defaultdict(list)
    for deployment_id, ts, attainment in rows:
        grouped[deployment_id].append((ts, attainment))
    return {key: downsample(_columns(items, ["slo_attainment"])) for key, items in grouped.items()}


@dataclass(frozen=True)
class DeploymentSummary:
    """A deployment's figures over a window (None when it has no metrics there)."""

    deployment: Deployment
    samples: int
    attainment_pct: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    goodput_tokens_per_s: float | None
    request_rate: float | None

    @property
    def meets_target(self) -> bool | None:
        if self.attainment_pct is None:
            return None
        return self.attainment_pct >= self.deployment.slo_attainment_target_pct


def deployment_summaries(*, since: datetime) -> list[DeploymentSummary]:
    """Per deployment over the window: mean attainment, mean goodput and request rate, and the
    newest TPOT percentiles."""
    series = {
        d.pk: (d, deployment_series(deployment=d, since=since))
        for d in api_selectors.deployment_list()
    }
    return [summarize(deployment=d, columns=c) for d, c in series.values()]


def summarize(*, deployment: Deployment, columns: Columns) -> DeploymentSummary:
    def mean(name: str) -> float | None:
        present = [v for v in columns.values.get(name, []) if v is not None]
        return sum(present) / len(present) if present else None

    def last(name: str) -> float | None:
        present = [v for v in columns.values.get(name, []) if v is not None]
        return present[-1] if present else None

    attainment = mean("slo_attainment")
    return DeploymentSummary(
        deployment=deployment,
        samples=len(columns),
        attainment_pct=None if attainment is None else 100.0 * attainment,
        tpot_p50_ms=last("tpot_p50_ms"),
        tpot_p99_ms=last("tpot_p99_ms"),
        goodput_tokens_per_s=mean("goodput_tokens_per_s"),
        request_rate=mean("request_rate"),
    )


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


def job_progress_map(*, jobs: Sequence[FinetuneJob]) -> dict[str, JobProgress]:
    """Progress of each job in `jobs` from its metric rows."""
    points: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    rows = (
        JobMetric.objects.filter(job_id__in=[j.pk for j in jobs])
        .order_by("job_id", "ts")
        .values_list("job_id", "ts", "step")
    )
    for job_id, ts, step in rows:
        points[job_id].append((ts, step))
    result = {}
    for job in jobs:
        total = estimated_total_steps(job=job)
        progress = progress_from(points=points[job.pk], total_steps=total)
        if job.status == JobStatus.SUCCEEDED and total is not None:
            progress = JobProgress(step=total, total_steps=total, eta_seconds=0.0)
        result[job.pk] = progress
    return result


# Predictors


@dataclass(frozen=True)
class PredictorAccuracy:
    """How well one host's predictor (one version) matched observed iteration latency."""

    host: str
    version: str
    samples: int
    mape_pct: float
    p95_ape_pct: float
    reported_mape_pct: float | None


def predictor_pairs(*, since: datetime) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """(predicted ms, observed ms) pairs since `since`, keyed by (host name, predictor version)."""
    rows = (
        DeploymentMetric.objects.filter(
            ts__gte=since,
            host__isnull=False,
            predicted_iter_ms__isnull=False,
            observed_iter_ms__isnull=False,
        )
        .order_by("host__name", "predictor_version", "ts")
        .values_list("host__name", "predictor_version", "predicted_iter_ms", "observed_iter_ms")
    )
    pairs: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for host, version, predicted, observed in rows:
        if predicted is None or observed is None:  # excluded by the filter; keeps types exact
            continue
        predicted_list, observed_list = pairs.setdefault((host, version or ""), ([], []))
        predicted_list.append(float(predicted))
        observed_list.append(float(observed))
    return pairs


def predictor_accuracy(*, since: datetime) -> list[PredictorAccuracy]:
    """MAPE and p95 absolute percentage error (nearest rank) per (host, version), in percent;
    observations of 0 ms are skipped. `GpuHost.predictor_mape` is read as a fraction 0..1."""
    reported = dict(GpuHost.objects.values_list("name", "predictor_mape"))
    result = []
    for (host, version), (predicted, observed) in predictor_pairs(since=since).items():
        errors = sorted(
            100.0 * abs(p - o) / o for p, o in zip(predicted, observed, strict=True) if o > 0
        )
        if not errors:
            continue
        p95_index = min(len(errors) - 1, math.ceil(0.95 * len(errors)) - 1)
        mape = reported.get(host)
        result.append(
            PredictorAccuracy(
                host=host,
                version=version or "unknown",
                samples=len(errors),
                mape_pct=sum(errors) / len(errors),
                p95_ape_pct=errors[p95_index],
                reported_mape_pct=None if mape is None else 100.0 * mape,
            )
        )
    return result
