"""Reads of the hosts' and deployments' metric time series (`HostMetric`, `DeploymentMetric`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import OuterRef, Subquery
from django.utils import timezone

from api import selectors as api_selectors
from api.models import Deployment, DeploymentMetric, HostMetric
from console.selectors.series import FRESHNESS, Columns, columns_from_rows, downsample

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
        host_id: downsample(columns_from_rows(items, ["finetune_tokens_per_s"]))
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
    columns = columns_from_rows(list(rows), DEPLOYMENT_COLUMNS)
    return downsample(columns, aggregate={"tpot_p99_ms": "max"})


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
    return {
        key: downsample(columns_from_rows(items, ["slo_attainment"]))
        for key, items in grouped.items()
    }


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
