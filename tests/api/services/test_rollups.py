"""Metrics reports: their rows and the minute rollups."""

from __future__ import annotations

import pytest
from django.utils import timezone

from api.models import (
    DeploymentMetric,
    GpuHost,
    HostMetric,
    MetricRollup,
)
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import report
from tests.api.services.conftest import GIB

pytestmark = pytest.mark.django_db


def test_metrics_rows_and_minute_rollups(fleet: dict[str, GpuHost]) -> None:
    hm = {"weights_bytes": GIB, "kv_used_bytes": 10, "finetune_lent_bytes": 20,
          "free_bytes": 30, "finetune_tokens_per_s": 100.0}  # fmt: skip
    dm = {"tpot_p50_ms": 10.0, "tpot_p99_ms": 20.0, "ttft_p50_ms": 80.0, "ttft_p99_ms": None,
          "slo_attainment": 1.0, "goodput_tokens_per_s": 5.0, "request_rate": 1.0}  # fmt: skip
    now = timezone.now().replace(second=10).timestamp()
    for offset, rate in ((0.0, 100.0), (20.0, 300.0)):
        message = report("metrics", "h1", window_s=5, host_metrics={**hm,
                         "finetune_tokens_per_s": rate}, deployment_metrics=dm)  # fmt: skip
        message["sent_at"] = now + offset
        assert host_report_apply(message=message) == "applied"
    assert HostMetric.objects.filter(host__name="h1").count() == 2
    rollup = MetricRollup.objects.get(series="host", key="h1")
    assert rollup.samples == 2
    assert rollup.sums["finetune_tokens_per_s"] / rollup.samples == 200.0
    assert rollup.maxima["finetune_tokens_per_s"] == 300.0
    dep = MetricRollup.objects.get(series="deployment", key="tiny-chat@h1")
    assert dep.samples == 2 and dep.sums["tpot_p99_ms"] == 40.0
    row = DeploymentMetric.objects.filter(host__name="h1").first()
    assert row is not None and (row.ttft_p50_ms, row.ttft_p99_ms) == (80.0, None)
