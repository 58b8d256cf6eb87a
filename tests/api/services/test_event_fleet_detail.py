"""A tenant's job events name no host and state no fleet capacity; operators see that detail
(`fleet_detail`) at `/api/ops/jobs/{id}/events`. Existing events are rewritten by the
migration that added it."""

from __future__ import annotations

import importlib
import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.apps import apps
from django.utils import timezone

from api.models import FinetuneJob, GpuHost, JobEvent
from api.services.apikeys import api_key_issue, api_key_issue_for_tenant
from api.services.jobs import finetune_job_pause, finetune_job_resume, job_event_record
from api.services.reconcile import fleet_reconcile
from api.services.reports import host_report_apply
from api.services.tenants import operator_create
from gpu_runtime.contract.protocol import checkpoint_key, report
from tests.api.conftest import ApiClient
from tests.api.services.conftest import GIB, drain_host_queue, heartbeat, place_now, started_report

pytestmark = pytest.mark.django_db

HOSTS = ("h1", "h2", "h3", "h4")
# A memory figure in any of the forms the fleet's messages use: "1024 B", "8 GiB", "free_bytes".
MEMORY = re.compile(r"\b\d+\s*(?:B|KiB|MiB|GiB|bytes)\b|free_bytes|headroom|free \d")


def _assert_no_fleet_detail(body: str) -> None:
    for host in HOSTS:
        assert not re.search(rf"\b{host}\b", body), (host, body)
    assert not MEMORY.search(body), body
    for word in ("offline", "eligible", "candidates", "reasons", "placement"):
        assert word not in body.lower(), (word, body)


def test_no_tenant_event_mentions_a_host_or_a_memory_figure(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    # No host fits at first (too little free memory), then h2 does.
    for name in ("h1", "h2"):
        heartbeat(name, free_bytes=1024)
    assert place_now(job, django_capture_on_commit_callbacks) is None
    heartbeat("h1", harvestable_tokens_per_s=100.0, free_bytes=8 * GIB)
    heartbeat("h2", harvestable_tokens_per_s=300.0, free_bytes=8 * GIB)
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"
    ids = {"placement_id": placement.pk, "job_id": job.id}
    assert host_report_apply(message=started_report(placement)) == "applied"
    progress = report("job_progress", "h2", step=1, total_steps=4, train_loss=2.0,
                      tokens_per_s=50.0, **ids)  # fmt: skip
    assert host_report_apply(message=progress) == "applied"
    ckpt = report("checkpoint", "h2", step=1, storage_key=checkpoint_key(job.id, 1),
                  metrics={"train_loss": 2.0}, **ids)  # fmt: skip
    assert host_report_apply(message=ckpt) == "applied"
    # Paused and resumed: the host's stop, then a placement that waits for nothing.
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        stopped = report("job_stopped", "h2", reason="paused", step=1, **ids)
        assert host_report_apply(message=stopped) == "applied"
        finetune_job_resume(job=job)
    second = place_now(job, django_capture_on_commit_callbacks) or (
        job.placements.exclude(pk=placement.pk).get()
    )
    resumed = report("job_started", second.host.name, placement_id=second.pk, job_id=job.id,
                     resumed_from_step=1, total_steps=4)  # fmt: skip
    assert host_report_apply(message=resumed) == "applied"
    # Its host goes silent: the job is requeued (training interrupted).
    stale = timezone.now() - timedelta(seconds=600)
    GpuHost.objects.filter(name=second.host.name).update(last_heartbeat_at=stale)
    with django_capture_on_commit_callbacks(execute=True):
        fleet_reconcile()
    for name in HOSTS:
        drain_host_queue(name)

    tenant_api = ApiClient(api_key_issue_for_tenant(tenant=job.tenant).key)
    answer = tenant_api.get(f"/v1/fine_tuning/jobs/{job.id}/events?limit=100")
    assert answer.status_code == 200
    events = answer.json()["data"]
    messages = [e["message"] for e in events]
    assert "Fine-tuning started" in messages
    assert "Placed for training" in messages
    assert "Waiting for a host with room for this job" in messages
    assert "Training stopped (paused) at step 1" in messages
    assert "Fine-tuning resumed from checkpoint step 1" in messages
    assert "Training interrupted; the job resumes from checkpoint step 1" in messages
    assert all("fleet_detail" not in e for e in events)
    _assert_no_fleet_detail(json.dumps([[e["message"], e["data"]] for e in events]))

    operator = operator_create(username="ops", password="s3cret-pass")
    ops = ApiClient(api_key_issue(user=operator).key)
    seen = ops.get(f"/api/ops/jobs/{job.id}/events?limit=100")
    assert seen.status_code == 200
    detail = {e["message"]: e["fleet_detail"] for e in seen.json()["data"]}
    assert detail["Fine-tuning started"]["text"] == "Fine-tuning started on host h2"
    assert detail["Placed for training"]["host"] == "h2"
    assert "free 1024 B < needed" in detail["Waiting for a host with room for this job"]["text"]
    assert detail["Training stopped (paused) at step 1"]["host"] == "h2"
    lost = detail["Training interrupted; the job resumes from checkpoint step 1"]
    assert lost["text"].startswith(f"Host {second.host.name} lost (no heartbeat for ")
    step = next(e for e in seen.json()["data"] if e["message"].startswith("Step 1/4"))
    assert step["fleet_detail"]["host"] == "h2" and "host" not in step["data"]
    assert ops.get("/api/ops/jobs/ftjob-nope/events").status_code == 404
    assert tenant_api.get(f"/api/ops/jobs/{job.id}/events").status_code in (401, 403)


def test_the_migration_moves_host_detail_out_of_existing_events(job: FinetuneJob) -> None:
    old = {
        "Fine-tuning started on host gpu-a": ("Fine-tuning started", None),
        "Fine-tuning resumed on host gpu-a from checkpoint step 20": (
            "Fine-tuning resumed from checkpoint step 20",
            None,
        ),
        "Placed on host gpu-b, resuming from step 20": (
            "Placed for training, resuming from step 20",
            {"placement_id": 3, "host": "gpu-b", "reasons": {"candidates": []}},
        ),
        "Waiting for a host (gpu-a: free 1024 B < needed 2048 B)": (
            "Waiting for a host with room for this job",
            None,
        ),
        "Waiting for host gpu-a to stop placement 3 (it checkpoints at its batch boundary "
        "first)": (
            "Waiting for the previous run to stop (it checkpoints at its batch boundary first)",
            None,
        ),
        "Waiting for the checkpoint of step 18 that host gpu-a stopped at": (
            "Waiting for the checkpoint of step 18",
            None,
        ),
        "Host gpu-a lost (no heartbeat for 12 s); the job resumes from checkpoint step 4 on "
        "another host": ("Training interrupted; the job resumes from checkpoint step 4", None),
        "No progress from host gpu-a since 2026-01-01T00:00:00+00:00": (
            "No training progress since 2026-01-01T00:00:00+00:00",
            {"host": "gpu-a", "last_progress_at": "2026-01-01T00:00:00+00:00"},
        ),
        "Progress from host gpu-a again (stalled since 2026-01-01T00:00:00+00:00)": (
            "Training progress again (stalled since 2026-01-01T00:00:00+00:00)",
            None,
        ),
        "Host gpu-a stopped training (paused) at step 12": (
            "Training stopped (paused) at step 12",
            {"host": "gpu-a", "reason": "paused", "step": 12, "stopped_at": 1.5},
        ),
    }
    JobEvent.objects.filter(job=job).delete()
    for text, (_, data) in old.items():
        job_event_record(job=job, message=text, data=data)
    step = job_event_record(job=job, message="Step 1/4: training loss=2.0000", type="metrics",
                            data={"step": 1, "train_loss": 2.0, "host": "gpu-a"})  # fmt: skip
    plain = job_event_record(job=job, message="Job paused")
    migration = importlib.import_module("migrations.api.0013_job_event_fleet_detail")
    migration.forward(apps, None)

    rewritten = {e.fleet_detail["text"]: e for e in JobEvent.objects.filter(job=job)
                 if e.fleet_detail and e.type == "message"}  # fmt: skip
    assert sorted(rewritten) == sorted(old)
    for text, (wording, _) in old.items():
        event = rewritten[text]
        assert event.message == wording
        _assert_no_fleet_detail(json.dumps([event.message, event.data]).replace("gpu-a", "h1"))
        assert "gpu-" not in json.dumps([event.message, event.data])
        if "Waiting for a host" not in text:
            assert dict(event.fleet_detail or {})["host"] in ("gpu-a", "gpu-b")
    placed = rewritten["Placed on host gpu-b, resuming from step 20"]
    assert placed.data is None
    assert dict(placed.fleet_detail or {})["reasons"] == {"candidates": []}
    stopped = rewritten["Host gpu-a stopped training (paused) at step 12"]
    assert stopped.data == {"reason": "paused", "step": 12, "stopped_at": 1.5}
    step.refresh_from_db()
    assert step.data == {"step": 1, "train_loss": 2.0}
    assert step.fleet_detail == {
        "text": "Step 1/4: training loss=2.0000 on host gpu-a",
        "host": "gpu-a",
    }
    plain.refresh_from_db()
    assert plain.message == "Job paused" and plain.fleet_detail is None
    # Backwards: the old messages and data again.
    migration.backward(apps, None)
    restored = dict(JobEvent.objects.filter(job=job, type="message").values_list("message", "data"))
    for text, (_, data) in old.items():
        assert text in restored and restored[text] == (data or None)
