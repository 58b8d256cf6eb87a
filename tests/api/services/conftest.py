"""Fixtures for the services' tests: a fleet of hosts, a queued job, and the host queues.

Tests run with the test settings' in-memory broker, so messages the control plane publishes to
`host.<name>` can be read back in-process with a real kombu consumer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import BaseModel, Deployment, FinetuneJob, GpuHost, Placement, Tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.jobs import finetune_job_create
from api.services.placement import job_place
from api.services.reports import host_report_apply
from api.services.tenants import tenant_create
from gpu_runtime.agent.channel import decode_task_message, host_queue_declaration
from gpu_runtime.contract.protocol import report
from workers.message_keys import host_message_key

GIB = 2**30
LINE = b'{"prompt": "Q: hello", "completion": " A: world"}\n'


@pytest.fixture(autouse=True)
def storage_dir(settings: SettingsWrapper, tmp_path: Path) -> Path:
    settings.HARLI_STORAGE_DIR = tmp_path / "storage"
    return tmp_path / "storage"


@pytest.fixture
def tiny(db: None) -> BaseModel:
    return base_model_register(name="tiny", preset="tiny")


@pytest.fixture
def deployment(tiny: BaseModel) -> Deployment:
    return deployment_create(name="tiny-chat", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500)


@pytest.fixture
def tenant(db: None) -> Tenant:
    return tenant_create(name="acme")


@pytest.fixture(autouse=True)
def empty_host_queues() -> None:
    """Each test starts with empty host queues: the in-memory broker lives as long as the test
    process, so commands another test sent and never read would otherwise reach this one."""
    for host in ("h1", "h2", "h3", "h4"):
        drain_host_queue(host)


def make_host(name: str, deployment: Deployment | None) -> GpuHost:
    return host_register(name=name, gpu_kind="cpu", gpu_memory_bytes=16 * GIB,
                         deployment=deployment)  # fmt: skip


def heartbeat(host: str, **fields: Any) -> str:
    values: dict[str, Any] = {
        "base_model": "tiny",
        "server_url": f"http://{host}/v1",
        "total_bytes": 16 * GIB,
        "free_bytes": 8 * GIB,
        "harvestable_tokens_per_s": 0.0,
        "placements": [],
        "adapters": [],
    }
    values.update(fields)
    return host_report_apply(message=report("heartbeat", host, **values))


@pytest.fixture
def job(tenant: Tenant, tiny: BaseModel, django_capture_on_commit_callbacks: Any) -> FinetuneJob:
    upload = UploadSource.from_bytes(filename="train.jsonl", data=LINE * 4)
    file = file_create(tenant=tenant, purpose="fine-tune", upload=upload)
    with django_capture_on_commit_callbacks(execute=False):
        created = finetune_job_create(tenant=tenant, model="tiny", training_file=file.id)
    return created


def drain_host_queue(host: str) -> list[dict[str, Any]]:
    """Every command waiting on `host.<host>` in the in-memory broker, decoded."""
    commands: list[dict[str, Any]] = []
    with Connection("memory://") as connection:
        queue = host_queue_declaration(host)(connection.default_channel)
        queue.declare()
        while (message := queue.get(no_ack=True)) is not None:
            body, headers = message.decode(), dict(message.headers)
            commands.append(decode_task_message(body, headers, host_message_key(host)))
    return commands


@pytest.fixture
def fleet(deployment: Deployment) -> dict[str, GpuHost]:
    """h1, h2 and h4 serve `deployment` (h4 with 1 KiB free), h3 another model; all online."""
    other = base_model_register(name="other", preset="tiny")
    other_dep = deployment_create(name="other-chat", base_model=other, tpot_slo_ms=5,
                                  ttft_slo_ms=50)  # fmt: skip
    hosts = {
        "h1": make_host("h1", deployment),
        "h2": make_host("h2", deployment),
        "h3": make_host("h3", other_dep),
        "h4": make_host("h4", deployment),
    }
    heartbeat("h1", harvestable_tokens_per_s=100.0)
    heartbeat("h2", harvestable_tokens_per_s=300.0)
    heartbeat("h3", harvestable_tokens_per_s=900.0)
    heartbeat("h4", harvestable_tokens_per_s=900.0, free_bytes=1024)
    for name in hosts:
        drain_host_queue(name)
    return hosts


def place_now(job: FinetuneJob, capture: Any) -> Placement | None:
    """Place `job` and run its on-commit sends (`capture`: django_capture_on_commit_callbacks)."""
    with capture(execute=True):
        return job_place(job_id=job.id)


def started_report(placement: Placement, **fields: Any) -> dict[str, Any]:
    """The `job_started` report of `placement`'s host (step 0 of 4), with `fields` added."""
    ids = {"placement_id": placement.pk, "job_id": placement.job_id}
    return report("job_started", placement.host.name, resumed_from_step=0, total_steps=4,
                  **ids, **fields)  # fmt: skip
