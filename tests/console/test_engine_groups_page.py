"""The console shows a host's engine groups and GPUs: per group its deployment, GPUs, TP
degree, memory, finetune and decode figures and the jobs placed on it; per GPU its memory; the
fleet and deployment pages name the groups. Filled the way a host fills it: heartbeats and
metrics reports through the intake, the job placed by the placement service."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from api.services.engine_groups import engine_group_add
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register, deployment_create, host_register
from api.services.jobs import finetune_job_create
from api.services.placement import job_place
from api.services.reports import host_report_apply
from api.services.tenants import operator_create, tenant_create
from gpu_runtime.contract.protocol import report

pytestmark = pytest.mark.django_db
GIB = 2**30


def _apply(kind: str, **fields: Any) -> None:
    assert host_report_apply(message=report(kind, "big", **fields)) == "applied"


def _row(page: str, attribute: str, value: int) -> str:
    match = re.search(rf'<tr {attribute}="{value}">(.*?)</tr>', page, re.S)
    assert match is not None, f"no row {attribute}={value}"
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", match.group(1))).strip()


@pytest.fixture
def client_and_job(db: None) -> tuple[Client, str]:
    operator_create(username="ops", password="pw-ops-1")
    tiny = base_model_register(name="tiny", preset="tiny")
    tp2 = deployment_create(name="chat-tp2", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500,
                            tensor_parallel_size=2)  # fmt: skip
    tp1 = deployment_create(name="chat-tp1", base_model=tiny, tpot_slo_ms=50, ttft_slo_ms=500)
    host = host_register(name="big", gpu_kind="H200", gpu_memory_bytes=141 * GIB, gpu_count=4,
                         deployment=tp2)  # fmt: skip
    engine_group_add(host=host, deployment=tp1)  # GPU 2; GPU 3 stays idle
    group = {"base_model": "tiny", "placements": [], "harvest": {"source": "measured"}}
    _apply("heartbeat", base_model="tiny", free_bytes=150 * GIB, total_bytes=564 * GIB,
           placements=[], gpus=[{"index": g, "total_bytes": 141 * GIB,
                                 "free_bytes": (40 + g) * GIB} for g in range(4)],
           engine_groups=[{"index": 0, "tensor_parallel_size": 2, "gpu_indices": [0, 1],
                           "free_bytes": 81 * GIB, "free_bytes_per_gpu": 40 * GIB,
                           "harvestable_tokens_per_s": 100.0, **group},
                          {"index": 1, "tensor_parallel_size": 1, "gpu_indices": [2],
                           "free_bytes": 42 * GIB, "free_bytes_per_gpu": 42 * GIB,
                           "harvestable_tokens_per_s": 600.0, **group}])  # fmt: skip
    tenant = tenant_create(name="acme")
    data = b'{"prompt": "a", "completion": "b"}\n' * 4
    file = file_create(tenant=tenant, purpose="fine-tune",
                       upload=UploadSource.from_bytes(filename="t.jsonl", data=data))  # fmt: skip
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=file.id)
    placement = job_place(job_id=job.id)
    assert placement is not None and placement.engine_group is not None
    assert placement.engine_group.index == 1  # the higher harvest share
    decode = {"tpot_p50_ms": 21.0, "tpot_p99_ms": 43.5, "slo_attainment": 0.987}
    memory = {"kv_used_bytes": 30 * GIB, "finetune_lent_bytes": 6 * GIB, "free_bytes": 40 * GIB}
    _apply("metrics", window_s=5.0,
           host_metrics={"weights_bytes": 16 * GIB, "kv_used_bytes": 50 * GIB,
                         "finetune_lent_bytes": 9 * GIB, "free_bytes": 80 * GIB,
                         "finetune_tokens_per_s": 512.0},
           gpus=[{"index": g, "total_bytes": 141 * GIB, "free_bytes": (20 + g) * GIB,
                  "kv_used_bytes": 12 * GIB, "finetune_lent_bytes": (g + 1) * GIB}
                 for g in range(4)],
           engine_groups=[{"index": 0, "tensor_parallel_size": 2, "gpu_indices": [0, 1],
                           "finetune_tokens_per_s": 0.0, "deployment_metrics": decode,
                           **memory},
                          {"index": 1, "tensor_parallel_size": 1, "gpu_indices": [2],
                           "finetune_tokens_per_s": 512.0, "deployment_metrics": None,
                           **memory}])  # fmt: skip
    client = Client()
    assert client.login(username="ops", password="pw-ops-1")
    return client, job.id


def test_the_host_page_shows_groups_their_jobs_and_gpus(client_and_job: tuple[Client, str]) -> None:
    client, job_id = client_and_job
    page = client.get("/console/hosts/big/").content.decode()
    assert "2 engine groups" in page
    group0, group1 = _row(page, "data-engine-group", 0), _row(page, "data-engine-group", 1)
    assert group0.startswith("0 chat-tp2 GPUs 0-1 2 30.0 GiB 6.0 GiB 40.0 GiB 0 100 43.5 ms")
    assert "98.7%" in group0 and group0.endswith("none")
    assert group1.startswith("1 chat-tp1 GPU 2 1 30.0 GiB 6.0 GiB 42.0 GiB 512 600 — —")
    assert group1.endswith(job_id)
    assert _row(page, "data-gpu", 1) == "1 0 · chat-tp2 141.0 GiB 12.0 GiB 2.0 GiB 21.0 GiB"
    assert _row(page, "data-gpu", 3) == "3 idle 141.0 GiB 12.0 GiB 4.0 GiB 23.0 GiB"


def test_fleet_deployment_job_and_models_pages_name_the_groups(
    client_and_job: tuple[Client, str],
) -> None:
    client, job_id = client_and_job
    job = re.sub(r"\s+", " ", client.get(f"/console/jobs/{job_id}/").content.decode())
    assert 'big</a> <span class="muted small">group 1 · GPU 2</span>' in job
    fleet = re.sub(r"\s+", " ", client.get("/console/").content.decode())
    assert "GPUs 0-1 · TP 2</span>" in fleet and "GPU 2 · 1 job</span>" in fleet
    hosts = re.sub(r"\s+", " ", client.get("/console/hosts/").content.decode())
    assert 'chat-tp2</a> <span class="muted small">GPUs 0-1 · TP 2</span>' in hosts
    deployment = client.get("/console/deployments/chat-tp2/").content.decode()
    assert '<strong id="tensor-parallel">2</strong>' in deployment
    assert re.search(r"big</a> group 0 · GPUs 0-1", deployment)
    models = re.sub(r"\s+", " ", client.get("/console/models/").content.decode())
    assert '<td class="num">99.0%</td><td class="num">2</td>' in models
