"""The console shows what the control plane ingests: reports applied by `api.services.reports` (as a
host agent sends them) appear in the console's charts, tables and progress bars."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import Client

from api.models import HostStatus, JobStatus, Placement, PlacementState
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.jobs import finetune_job_create
from api.services.reports import host_report_apply
from api.services.tenants import operator_create, tenant_create
from gpu_runtime.contract.protocol import report

pytestmark = pytest.mark.django_db
GIB = 1024**3


def _apply(kind: str, **fields: Any) -> None:
    assert host_report_apply(message=report(kind, "gpu-x", **fields)) == "applied"


def test_reports_from_a_host_fill_the_console() -> None:
    operator_create(username="ops", password="pw-ops-1")
    tenant = tenant_create(name="acme")
    base = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(
        name="chat", base_model=base, tpot_slo_ms=50.0, ttft_slo_ms=900.0
    )
    host = host_register(
        name="gpu-x", gpu_kind="H200", gpu_memory_bytes=141 * GIB, deployment=deployment
    )
    data = b'{"prompt": "a", "completion": "b"}\n' * 4
    training = file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="t.jsonl", data=data),
    )
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=training.id)
    placement = Placement.objects.create(job=job, host=host, state=PlacementState.PENDING)
    client = Client()
    assert client.login(username="ops", password="pw-ops-1")

    _apply("heartbeat", free_bytes=60 * GIB, total_bytes=141 * GIB, placements=[placement.pk])
    _apply("job_started", placement_id=placement.pk, job_id=job.pk, resumed_from_step=0)
    for step in (1, 2, 3, 4):
        _apply(
            "job_progress",
            placement_id=placement.pk,
            job_id=job.pk,
            step=step,
            total_steps=40,
            train_loss=2.0 - 0.1 * step,
            tokens_per_s=900.0,
            sent_at=time.time() - 10 * (4 - step),
        )
    _apply(
        "metrics",
        window_s=5.0,
        host_metrics={
            "weights_bytes": 16 * GIB,
            "kv_used_bytes": 40 * GIB,
            "finetune_lent_bytes": 25 * GIB,
            "free_bytes": 60 * GIB,
            "finetune_tokens_per_s": 900.0,
        },
        deployment_metrics={
            "tpot_p50_ms": 21.0,
            "tpot_p99_ms": 44.0,
            "ttft_p50_ms": 120.0,
            "ttft_p99_ms": 300.0,
            "slo_attainment": 0.995,
            "goodput_tokens_per_s": 5200.0,
            "request_rate": 11.0,
            "predicted_iter_ms": 20.0,
            "observed_iter_ms": 21.0,
            "predictor_version": "v3",
        },
    )

    host.refresh_from_db()
    job.refresh_from_db()
    assert host.status == HostStatus.ONLINE and job.status == JobStatus.RUNNING
    memory = client.get("/console/charts/fleet/memory").json()
    assert memory["figure"]["data"][2]["x"] == [25.0]  # lent to finetuning, GiB
    tpot = client.get("/console/charts/deployments/chat/tpot").json()
    assert tpot["points"] == {"TPOT p50": 1, "TPOT p99": 1}
    scatter = client.get("/console/charts/predictors/scatter").json()
    assert scatter["points"] == {"gpu-x (v3)": 1}
    loss = client.get(f"/console/charts/jobs/{job.pk}/loss").json()
    assert loss["points"] == {"train loss": 4, "validation loss": 0}
    # The host's own step count (40) wins over the estimate from the settings.
    jobs_page = client.get("/console/jobs/").content.decode()
    assert 'aria-valuenow="10"' in jobs_page and "step 4/40" in jobs_page
    job_page = client.get(f"/console/jobs/{job.pk}/").content.decode()
    assert "Step 4/40" not in job_page and "4 progress and checkpoint reports" in job_page
    assert "Fine-tuning started on host gpu-x" in job_page
    fleet = client.get("/console/").content.decode()
    assert "gpu-x" in fleet and "Online" in fleet
    page = client.get("/console/deployments/chat/").content.decode()
    assert 'id="kpi-ttft"><span class="good">300 ms</span>' in page
