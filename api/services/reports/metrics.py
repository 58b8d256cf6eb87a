"""Metrics reports: host memory and throughput samples (with per-GPU figures), and per engine
group its memory and finetune figures and its deployment's latency and SLO samples, each
written as a row and the host's and deployments' added to their per-minute rollups.

A report from an agent of the one-engine shape (no `engine_groups`) is its host's group 0
(`api.services.reports.engine_groups`). Decode rows are keyed by group: `DeploymentMetric`
with `engine_group`, rollup key `<deployment>@<host>` (`#<index>` appended for groups other
than 0)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from api.models import (
    DeploymentMetric,
    EngineGroup,
    EngineGroupMetric,
    GpuHost,
    HostMetric,
    RollupSeries,
)
from api.services.reports.common import report_time
from api.services.reports.engine_groups import gpu_figures, host_engine_groups, reported_groups
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
        gpus=gpu_figures(message.get("gpus")),
    )
    rollup_add(series=RollupSeries.HOST, key=host.name, ts=ts, values=hm)
    groups = host_engine_groups(host)
    pairs = reported_groups("metrics", host, message, groups)
    EngineGroupMetric.objects.bulk_create(
        [
            EngineGroupMetric(
                engine_group=group,
                ts=ts,
                kv_used_bytes=int(entry.get("kv_used_bytes", 0)),
                finetune_lent_bytes=int(entry.get("finetune_lent_bytes", 0)),
                free_bytes=int(entry.get("free_bytes", 0)),
                finetune_tokens_per_s=float(entry.get("finetune_tokens_per_s", 0.0)),
                gpus=gpu_figures(entry.get("gpus")),
            )
            for group, entry in pairs
        ]
    )
    for group, entry in pairs:
        dm = entry.get("deployment_metrics")
        if dm:
            _decode_apply(host, group, dict(dm), ts)
    return "applied"


def _decode_apply(host: GpuHost, group: EngineGroup, dm: dict[str, Any], ts: datetime) -> None:
    DeploymentMetric.objects.create(
        deployment_id=group.deployment_id,
        host=host,
        engine_group=group,
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
    key = f"{group.deployment.name}@{host.name}" + (f"#{group.index}" if group.index else "")
    numeric: dict[str, float | None] = {
        str(k): float(v) for k, v in dm.items() if isinstance(v, (int, float))
    }
    rollup_add(series=RollupSeries.DEPLOYMENT, key=key, ts=ts, values=numeric)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
