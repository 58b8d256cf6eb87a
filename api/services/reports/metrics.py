"""Metrics reports: host memory and throughput samples, and the deployment's latency and SLO
samples, each written as a row and added to its per-minute rollup."""

from __future__ import annotations

from typing import Any

from api.models import DeploymentMetric, GpuHost, HostMetric, RollupSeries
from api.services.reports.common import report_time
from api.services.rollups import rollup_add


def metrics_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    ts = report_time(message)
    hm = dict(message["host_metrics"])
    HostMetric.objects.create(
        host=host,
        ts=ts,
        weights_bytes=int(hm["weights_bytes"]),
        kv_used_bytes=int(hm["kv_used_bytes"]),
        finetune_lent_bytes=int(hm["finetune_lent_bytes"]),
        free_bytes=int(hm["free_bytes"]),
        finetune_tokens_per_s=float(hm.get("finetune_tokens_per_s", 0.0)),
    )
    rollup_add(series=RollupSeries.HOST, key=host.name, ts=ts, values=hm)
    dm = message.get("deployment_metrics")
    if dm and host.deployment_id is not None:
        DeploymentMetric.objects.create(
            deployment_id=host.deployment_id,
            host=host,
            ts=ts,
            tpot_p50_ms=float(dm["tpot_p50_ms"]),
            tpot_p99_ms=float(dm["tpot_p99_ms"]),
            ttft_p50_ms=_optional_float(dm.get("ttft_p50_ms")),
            ttft_p99_ms=_optional_float(dm.get("ttft_p99_ms")),
            slo_attainment=min(1.0, max(0.0, float(dm["slo_attainment"]))),
            goodput_tokens_per_s=float(dm.get("goodput_tokens_per_s", 0.0)),
            request_rate=float(dm.get("request_rate", 0.0)),
            predicted_iter_ms=dm.get("predicted_iter_ms"),
            observed_iter_ms=dm.get("observed_iter_ms"),
            predictor_version=dm.get("predictor_version"),
        )
        key = f"{host.deployment.name if host.deployment else host.deployment_id}@{host.name}"
        numeric: dict[str, float | None] = {
            str(k): float(v) for k, v in dm.items() if isinstance(v, (int, float))
        }
        rollup_add(series=RollupSeries.DEPLOYMENT, key=key, ts=ts, values=numeric)
    return "applied"


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
