"""A small, fully known fleet for the console tests: every count a chart must show is here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from api.models import (
    Deployment,
    DeploymentMetric,
    EventType,
    FinetuneJob,
    GpuHost,
    HostMetric,
    HostStatus,
    JobMetric,
    Placement,
    PlacementState,
    Tenant,
)
from api.services.apikeys import api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.jobs import (
    finetune_job_cancel,
    finetune_job_create,
    finetune_job_start,
    job_checkpoint_record,
    job_event_record,
)
from api.services.tenants import operator_create, tenant_create

GIB = 1024**3
OPERATOR = ("ops", "ops-password-1")
TPOT_SLO_MS = 42.5
STEP = timedelta(seconds=10)

# Points per chart in the last hour (older rows lie outside the 1h and 15m windows).
HOST_A_POINTS = 30
HOST_B_POINTS = 20
DEPLOYMENT_POINTS = 24  # alternating gpu-a (v1) / gpu-b (v2): 12 each
DEPLOYMENT_OLD_POINTS = 6  # two hours ago: inside 6h, outside 1h
JOB_STEPS = 15  # steps 1..15, a metric row and a progress event each; valid loss at 5, 10, 15
JOB_TOTAL_STEPS = 30  # 3 examples, auto -> 10 epochs of batch 1


@dataclass(frozen=True)
class Seeded:
    now: datetime
    tenant: Tenant
    tenant_key: str
    deployment: Deployment
    idle_deployment: Deployment
    hosts: list[GpuHost]
    running_job: FinetuneJob
    queued_job: FinetuneJob
    cancelled_job: FinetuneJob


def _training_file(tenant: Tenant) -> str:
    line = {
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    }
    data = b"".join(json.dumps(line).encode() + b"\n" for _ in range(3))
    upload = UploadSource.from_bytes(filename="train.jsonl", data=data)
    return file_create(tenant=tenant, purpose="fine-tune", upload=upload).id


def seed_console() -> Seeded:
    """Create the operator, two tenants, a deployment with metrics, three hosts, three jobs
    (the running one with metric rows, progress events that announce its step count, and a
    checkpoint)."""
    now = timezone.now()
    operator_create(username=OPERATOR[0], password=OPERATOR[1])
    acme = tenant_create(name="acme")
    globex = tenant_create(name="globex")
    key = api_key_issue_for_tenant(tenant=acme, name="ci").key
    base = base_model_register(name="tiny", preset="tiny")
    deployment = deployment_create(
        name="chat-tiny", base_model=base, tpot_slo_ms=TPOT_SLO_MS, ttft_slo_ms=800.0
    )
    idle = deployment_create(name="chat-idle", base_model=base, tpot_slo_ms=30.0, ttft_slo_ms=500.0)
    hosts = [
        host_register(name=name, gpu_kind="H200", gpu_memory_bytes=141 * GIB, deployment=d)
        for name, d in (("gpu-a", deployment), ("gpu-b", deployment), ("gpu-c", idle))
    ]
    for host in hosts[:2]:
        GpuHost.objects.filter(pk=host.pk).update(
            status=HostStatus.ONLINE, last_heartbeat_at=now, predictor_version="v1"
        )
    for host, count, lent in ((hosts[0], HOST_A_POINTS, 20), (hosts[1], HOST_B_POINTS, 8)):
        HostMetric.objects.bulk_create(
            HostMetric(
                host=host,
                ts=now - (count - 1 - i) * STEP,
                weights_bytes=16 * GIB,
                kv_used_bytes=(60 + i % 5) * GIB,
                finetune_lent_bytes=lent * GIB,
                free_bytes=(141 - 16 - 60 - i % 5 - lent) * GIB,
                finetune_tokens_per_s=1000.0 + 10 * i,
            )
            for i in range(count)
        )
    rows = []
    for i in range(DEPLOYMENT_POINTS):
        on_a = i % 2 == 0
        rows.append(
            DeploymentMetric(
                deployment=deployment,
                host=hosts[0] if on_a else hosts[1],
                ts=now - (DEPLOYMENT_POINTS - 1 - i) * STEP,
                tpot_p50_ms=20.0 + i % 3,
                tpot_p99_ms=35.0 + i % 7,
                slo_attainment=0.995 if i % 4 else 0.985,
                goodput_tokens_per_s=5000.0 + 25 * i,
                request_rate=12.0 + i % 4,
                predicted_iter_ms=21.0 + i % 3,
                observed_iter_ms=20.0 + i % 3,
                predictor_version="v1" if on_a else "v2",
            )
        )
    for i in range(DEPLOYMENT_OLD_POINTS):
        rows.append(
            DeploymentMetric(
                deployment=deployment,
                host=None,
                ts=now - timedelta(hours=2) + i * STEP,
                tpot_p50_ms=22.0,
                tpot_p99_ms=38.0,
                slo_attainment=0.99,
                goodput_tokens_per_s=4000.0,
                request_rate=10.0,
            )
        )
    DeploymentMetric.objects.bulk_create(rows)

    running = finetune_job_create(
        tenant=acme, model="tiny", training_file=_training_file(acme), suffix="support"
    )
    running = finetune_job_start(job=running)
    Placement.objects.create(
        job=running, host=hosts[0], state=PlacementState.ACTIVE, started_at=now
    )
    JobMetric.objects.bulk_create(
        JobMetric(
            job=running,
            ts=now - (JOB_STEPS - step) * STEP,
            step=step,
            train_loss=2.5 - 0.1 * step,
            valid_loss=(2.6 - 0.1 * step) if step % 5 == 0 else None,
            tokens_per_s=800.0 + step,
        )
        for step in range(1, JOB_STEPS + 1)
    )
    for step in range(1, JOB_STEPS + 1):  # the progress events its host's reports leave
        job_event_record(
            job=running,
            message=f"Step {step}/{JOB_TOTAL_STEPS}: training loss={2.5 - 0.1 * step:.4f}",
            type=EventType.METRICS,
            data={
                "step": step,
                "total_steps": JOB_TOTAL_STEPS,
                "train_loss": 2.5 - 0.1 * step,
                "learning_rate": 1e-4,
                "tokens_per_s": 800.0 + step,
                "host": hosts[0].name,
            },
        )
    job_checkpoint_record(job=running, step=10, metrics={"train_loss": 1.5, "valid_loss": 1.6})
    queued = finetune_job_create(tenant=globex, model="tiny", training_file=_training_file(globex))
    cancelled = finetune_job_cancel(
        job=finetune_job_create(tenant=acme, model="tiny", training_file=_training_file(acme))
    )
    return Seeded(
        now=now,
        tenant=acme,
        tenant_key=key,
        deployment=deployment,
        idle_deployment=idle,
        hosts=hosts,
        running_job=running,
        queued_job=queued,
        cancelled_job=cancelled,
    )
