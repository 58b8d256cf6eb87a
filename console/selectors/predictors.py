"""Latency predictor accuracy: predicted against observed decode iteration latency."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from api.models import DeploymentMetric, GpuHost
from gpu_runtime.contract.statistics import percentile

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
    """MAPE and p95 absolute percentage error (the contract's percentile,
    `gpu_runtime.contract.statistics`) per (host, version), in percent;
    observations of 0 ms are skipped. `GpuHost.predictor_mape` is read as a fraction 0..1."""
    reported = dict(GpuHost.objects.values_list("name", "predictor_mape"))
    result = []
    for (host, version), (predicted, observed) in predictor_pairs(since=since).items():
        errors = [100.0 * abs(p - o) / o for p, o in zip(predicted, observed, strict=True) if o > 0]
        p95 = percentile(errors, 95.0)
        if p95 is None:
            continue
        mape = reported.get(host)
        result.append(
            PredictorAccuracy(
                host=host,
                version=version or "unknown",
                samples=len(errors),
                mape_pct=sum(errors) / len(errors),
                p95_ape_pct=p95,
                reported_mape_pct=None if mape is None else 100.0 * mape,
            )
        )
    return result
