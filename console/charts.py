"""Chart payloads: read with `console.selectors`, draw with `console.figures`.

A payload is what a chart's JSON endpoint answers and `frontend/src/console.js` draws:
`{"figure": {...} | None, "empty": bool, "message": str, "points": {trace: count}}`.
An empty chart carries a sentence telling the operator what is missing instead of a blank plot.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from api import selectors as api_selectors
from api.models import Deployment, FinetuneJob, GpuHost, Tenant
from api.usage_selectors import usage_buckets
from console import figures
from console import selectors as console_selectors
from console.figures import LatencyPairs, MemorySplit, TimeSeries

NO_METRICS = (
    "No metrics in this time range yet. Hosts report every few seconds once their agent runs."
)


@dataclass(frozen=True)
class ChartPayload:
    """A figure, or an empty state with the reason."""

    figure: figures.Figure | None
    message: str = ""
    points: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, figure: figures.Figure) -> ChartPayload:
        return cls(figure=figure, points=figures.point_counts(figure))

    @classmethod
    def empty(cls, message: str) -> ChartPayload:
        return cls(figure=None, message=message)

    def as_json(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "empty": self.figure is None,
            "message": self.message,
            "points": self.points,
        }


def _series(name: str, columns: console_selectors.Columns, column: str) -> TimeSeries:
    return TimeSeries(name=name, ts=columns.ts, values=columns.values[column])


# Fleet


def fleet_memory(*, since: datetime) -> ChartPayload:
    """Each host's newest GPU memory split (hosts with no fresh report are left out)."""
    del since  # the split is the current state; the window does not apply
    latest = console_selectors.host_memory_latest()
    hosts = [h for h in api_selectors.host_list() if h.pk in latest]
    if not hosts:
        return ChartPayload.empty(
            "No host has reported its memory in the last few minutes."
            if api_selectors.host_list().exists()
            else "No hosts registered yet."
        )
    splits = [
        MemorySplit(
            host=h.name,
            weights_bytes=latest[h.pk].weights_bytes,
            kv_used_bytes=latest[h.pk].kv_used_bytes,
            finetune_lent_bytes=latest[h.pk].finetune_lent_bytes,
            free_bytes=latest[h.pk].free_bytes,
        )
        for h in hosts
    ]
    return ChartPayload.of(figures.memory_split_figure(hosts=splits))


def fleet_finetune(*, since: datetime) -> ChartPayload:
    """Harvested finetune tokens/s per host, stacked to the fleet-wide total."""
    series = console_selectors.host_finetune_series(since=since)
    hosts = [h for h in api_selectors.host_list() if h.pk in series]
    if not hosts:
        return ChartPayload.empty(NO_METRICS)
    per_host = [_series(h.name, series[h.pk], "finetune_tokens_per_s") for h in hosts]
    return ChartPayload.of(figures.finetune_throughput_figure(per_host=per_host))


def fleet_attainment(*, since: datetime) -> ChartPayload:
    """SLO attainment of every deployment; the target line is drawn when all share one target."""
    series = console_selectors.attainment_series(since=since)
    deployments = [d for d in api_selectors.deployment_list() if d.pk in series]
    if not deployments:
        return ChartPayload.empty(NO_METRICS)
    targets = {d.slo_attainment_target_pct for d in deployments}
    return ChartPayload.of(
        figures.attainment_figure(
            series=[_series(d.name, series[d.pk], "slo_attainment") for d in deployments],
            target_pct=targets.pop() if len(targets) == 1 else None,
        )
    )


# One host


def host_memory(*, host: GpuHost, since: datetime) -> ChartPayload:
    """The host's GPU memory split over time, stacked."""
    columns = console_selectors.host_series(host=host, since=since)
    if not len(columns):
        return ChartPayload.empty(NO_METRICS)
    return ChartPayload.of(
        figures.memory_over_time_figure(
            weights=_series("Weights", columns, "weights_bytes"),
            kv_used=_series("KV cache in use", columns, "kv_used_bytes"),
            lent=_series("Lent to finetuning", columns, "finetune_lent_bytes"),
            free=_series("Free", columns, "free_bytes"),
        )
    )


def host_finetune(*, host: GpuHost, since: datetime) -> ChartPayload:
    """The host's harvested finetune tokens/s over time."""
    columns = console_selectors.host_series(host=host, since=since)
    if not len(columns):
        return ChartPayload.empty(NO_METRICS)
    return ChartPayload.of(
        figures.throughput_figure(
            tokens_per_s=_series("finetune tokens/s", columns, "finetune_tokens_per_s")
        )
    )


# One deployment


def _deployment_columns(
    deployment: Deployment, since: datetime
) -> console_selectors.Columns | None:
    columns = console_selectors.deployment_series(deployment=deployment, since=since)
    return columns if len(columns) else None


def deployment_tpot(*, deployment: Deployment, since: datetime) -> ChartPayload:
    columns = _deployment_columns(deployment, since)
    if columns is None:
        return ChartPayload.empty(NO_METRICS)
    return ChartPayload.of(
        figures.tpot_figure(
            p50=_series("TPOT p50", columns, "tpot_p50_ms"),
            p99=_series("TPOT p99", columns, "tpot_p99_ms"),
            tpot_slo_ms=deployment.tpot_slo_ms,
        )
    )


def deployment_attainment(*, deployment: Deployment, since: datetime) -> ChartPayload:
    columns = _deployment_columns(deployment, since)
    if columns is None:
        return ChartPayload.empty(NO_METRICS)
    return ChartPayload.of(
        figures.attainment_figure(
            series=[_series("SLO attainment", columns, "slo_attainment")],
            target_pct=deployment.slo_attainment_target_pct,
        )
    )


def deployment_goodput(*, deployment: Deployment, since: datetime) -> ChartPayload:
    columns = _deployment_columns(deployment, since)
    if columns is None:
        return ChartPayload.empty(NO_METRICS)
    return ChartPayload.of(
        figures.goodput_figure(
            goodput=_series("goodput (tokens/s)", columns, "goodput_tokens_per_s"),
            request_rate=_series("requests/s", columns, "request_rate"),
        )
    )


def deployment_iteration(*, deployment: Deployment, since: datetime) -> ChartPayload:
    columns = _deployment_columns(deployment, since)
    if columns is None:
        return ChartPayload.empty(NO_METRICS)
    return ChartPayload.of(
        figures.iteration_latency_figure(
            predicted=_series("predicted", columns, "predicted_iter_ms"),
            observed=_series("observed", columns, "observed_iter_ms"),
        )
    )


# One job (its whole history: the time range does not apply)


def job_loss(*, job: FinetuneJob) -> ChartPayload:
    rows = console_selectors.job_series(job=job)
    if not rows:
        return ChartPayload.empty("No training steps reported for this job yet.")
    valid = [r for r in rows if r.valid_loss is not None]
    return ChartPayload.of(
        figures.loss_figure(
            train_steps=[r.step for r in rows],
            train_loss=[r.train_loss for r in rows],
            valid_steps=[r.step for r in valid],
            valid_loss=[float(r.valid_loss) for r in valid if r.valid_loss is not None],
        )
    )


def job_throughput(*, job: FinetuneJob) -> ChartPayload:
    rows = console_selectors.job_series(job=job)
    if not rows:
        return ChartPayload.empty("No training steps reported for this job yet.")
    return ChartPayload.of(
        figures.throughput_figure(
            tokens_per_s=TimeSeries(
                name="tokens/s", ts=[r.ts for r in rows], values=[r.tokens_per_s for r in rows]
            )
        )
    )


# One tenant's inference usage (the last day, whatever the page's range)

USAGE_WINDOW_S = 24 * 3600
NO_USAGE = "No inference calls by this tenant in the last 24 hours."


def tenant_tokens(*, tenant: Tenant, width: str, now: datetime) -> ChartPayload:
    """Prompt and completion tokens per `width` bucket ("1m" or "1h") over the 24 hours up to
    `now`; buckets without calls are zero."""
    end = int(now.timestamp()) + 1
    buckets = usage_buckets(tenant=tenant, start=end - USAGE_WINDOW_S, end=end, width=width)
    if not any(b.results for b in buckets):
        return ChartPayload.empty(NO_USAGE)
    ts = [datetime.fromtimestamp(b.start_time, tz=UTC) for b in buckets]
    prompt = [float(sum(r.prompt_tokens for r in b.results)) for b in buckets]
    completion = [float(sum(r.completion_tokens for r in b.results)) for b in buckets]
    return ChartPayload.of(
        figures.token_usage_figure(
            prompt=TimeSeries(name="prompt tokens", ts=ts, values=prompt),
            completion=TimeSeries(name="completion tokens", ts=ts, values=completion),
            per={"1m": "minute", "1h": "hour"}[width],
        )
    )


# Predictors


def predictor_scatter(*, since: datetime) -> ChartPayload:
    pairs = console_selectors.predictor_pairs(since=since)
    if not pairs:
        return ChartPayload.empty(
            "No predicted and observed iteration latencies in this time range yet."
        )
    return ChartPayload.of(
        figures.predictor_scatter_figure(
            per_host=[
                LatencyPairs(
                    # plotly.js reads a few HTML tags in names; a host-reported version is text.
                    label=f"{host} ({html.escape(version or 'unknown')})",
                    predicted_ms=predicted,
                    observed_ms=observed,
                )
                for (host, version), (predicted, observed) in pairs.items()
            ]
        )
    )
