"""Reads of the hosts' and deployments' metric time series (`HostMetric`, `DeploymentMetric`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from django.db.models import OuterRef, Subquery
from django.utils import timezone

from api import selectors as api_selectors
from api.models import Deployment, DeploymentMetric, GpuHost, HostMetric
from console.selectors.series import (
    FRESHNESS,
    Columns,
    bucket_width,
    columns_from_rows,
    combine_hosts,
    downsample,
)

# Hosts


def host_memory_latest(*, now: datetime | None = None) -> dict[int, HostMetric]:
    """Each host's newest metric row, if it is fresher than FRESHNESS; keyed by host id."""
    now = now or timezone.now()
    newest = HostMetric.objects.filter(host=OuterRef("host")).order_by("-ts").values("pk")[:1]
    rows = HostMetric.objects.filter(pk=Subquery(newest), ts__gte=now - FRESHNESS)
    return {row.host_id: row for row in rows}


HOST_MEMORY_COLUMNS = ("weights_bytes", "kv_used_bytes", "finetune_lent_bytes", "free_bytes")


def host_series(*, host: GpuHost, since: datetime) -> Columns:
    """One host's memory split (bytes) and finetune tokens/s since `since`, oldest first."""
    names = (*HOST_MEMORY_COLUMNS, "finetune_tokens_per_s")
    rows = (
        HostMetric.objects.filter(host=host, ts__gte=since)
        .order_by("ts", "pk")
        .values_list("ts", *names)
    )
    return downsample(columns_from_rows(list(rows), names))


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
    "ttft_p50_ms",
    "ttft_p99_ms",
    "slo_attainment",
    "goodput_tokens_per_s",
    "request_rate",
    "predicted_iter_ms",
    "observed_iter_ms",
)


def deployment_series(
    *, deployment: Deployment, since: datetime, now: datetime | None = None
) -> Columns:
    """The deployment's metrics since `since`, oldest first, all its hosts combined per time
    bucket (see `combine_hosts`): goodput and request rate add up across hosts, TPOT and TTFT
    p99 are the worst host's, SLO attainment is weighted by each host's request rate, the rest
    are means."""
    now = now or timezone.now()
    rows = (
        DeploymentMetric.objects.filter(deployment=deployment, ts__gte=since)
        .order_by("ts", "pk")
        .values_list("ts", "host_id", *DEPLOYMENT_COLUMNS)
    )
    return combine_hosts(
        list(rows),
        DEPLOYMENT_COLUMNS,
        width=bucket_width(now - since),
        summed=frozenset({"goodput_tokens_per_s", "request_rate"}),
        maxed=frozenset({"tpot_p99_ms", "ttft_p99_ms"}),
        weighted=frozenset({"slo_attainment"}),
        weight="request_rate",
    )


def attainment_series(*, since: datetime) -> dict[int, Columns]:
    """SLO attainment (fraction) of every deployment that reported since `since`, by id."""
    reporting = set(
        DeploymentMetric.objects.filter(ts__gte=since).values_list("deployment_id", flat=True)
    )
    result = {}
    for deployment in api_selectors.deployment_list().filter(pk__in=reporting):
        columns = deployment_series(deployment=deployment, since=since)
        result[deployment.pk] = Columns(
            ts=columns.ts, values={"slo_attainment": columns.values["slo_attainment"]}
        )
    return result


@dataclass(frozen=True)
class DeploymentSummary:
    """A deployment's figures over a window (None when it has no metrics there)."""

    deployment: Deployment
    samples: int
    attainment_pct: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    ttft_p99_ms: float | None
    goodput_tokens_per_s: float | None
    request_rate: float | None

    @property
    def meets_ttft_slo(self) -> bool | None:
        if self.ttft_p99_ms is None:
            return None
        return self.ttft_p99_ms <= self.deployment.ttft_slo_ms

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
        ttft_p99_ms=last("ttft_p99_ms"),
        goodput_tokens_per_s=mean("goodput_tokens_per_s"),
        request_rate=mean("request_rate"),
    )
