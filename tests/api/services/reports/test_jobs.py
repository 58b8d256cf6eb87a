"""A job's reports (started, progress, checkpoint, outcome): applied once, recovered, or stale."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import (
    Adapter,
    FinetuneJob,
    GpuHost,
    JobCheckpoint,
    JobMetric,
    JobStatus,
    MetricRollup,
    PlacementState,
)
from api.services.jobs import finetune_job_cancel, finetune_job_pause
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import adapter_key, checkpoint_key, report
from tests.api.services.conftest import drain_host_queue, heartbeat, place_now, started_report

pytestmark = pytest.mark.django_db


def test_reports_apply_once_and_success_registers_the_adapter(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None
    assert [c["command"] for c in drain_host_queue("h2")] == ["apply_placement"]
    started = started_report(placement)
    assert host_report_apply(message=started) == "applied"
    assert host_report_apply(message=started) == "duplicate"
    job.refresh_from_db()
    placement.refresh_from_db()
    assert job.status == JobStatus.RUNNING and placement.state == PlacementState.ACTIVE
    ids = {"placement_id": placement.pk, "job_id": job.id}
    for step, loss in ((1, 2.5), (2, 2.0)):
        progress = report("job_progress", "h2", step=step, total_steps=2, train_loss=loss,
                          tokens_per_s=50.0, **ids)  # fmt: skip
        assert host_report_apply(message=progress) == "applied"
    assert list(JobMetric.objects.filter(job=job).values_list("step", "train_loss")) == [
        (1, 2.5),
        (2, 2.0),
    ]
    assert job.events.filter(message="Step 2/2: training loss=2.0000").exists()
    rollup = MetricRollup.objects.get(series="job", key=job.id)
    assert rollup.samples == 2 and rollup.sums["train_loss"] == 4.5
    assert rollup.maxima["train_loss"] == 2.5
    ckpt = report("checkpoint", "h2", step=2, storage_key=f"checkpoints/{job.id}/step-000002",
                  metrics={"train_loss": 2.0}, **ids)  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        assert host_report_apply(message=ckpt) == "applied"
        done = report("job_succeeded", "h2", trained_tokens=123,
                      adapter_key=f"adapters/{job.id}", **ids)  # fmt: skip
        assert host_report_apply(message=done) == "applied"
    job.refresh_from_db()
    assert job.status == JobStatus.SUCCEEDED and job.trained_tokens == 123
    assert JobCheckpoint.objects.get(job=job).metrics == {"step": 2, "train_loss": 2.0}
    adapter = Adapter.objects.get(job=job)
    assert adapter.name == job.fine_tuned_model and adapter.path == f"adapters/{job.id}"
    # Every host serving the base model is told to load it; h3 serves another model.
    for name in ("h1", "h2", "h4"):
        (command,) = drain_host_queue(name)
        assert command == {**command, "command": "load_adapter", "name": adapter.name}
    assert drain_host_queue("h3") == []


def test_a_checkpoint_report_recovers_progress_the_broker_lost(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None
    assert host_report_apply(message=started_report(placement)) == "applied"
    ids = {"placement_id": placement.pk, "job_id": job.id}

    def progress(step: int) -> dict[str, Any]:
        return report("job_progress", "h2", step=step, total_steps=4,
                      train_loss=3.0 - step / 10, tokens_per_s=50.0, **ids)  # fmt: skip

    late = progress(2)  # lost in the broker... for now
    for step in (1, 3):
        assert host_report_apply(message=progress(step)) == "applied"
    recent = [{"step": s, "train_loss": 3.0 - s / 10, "learning_rate": 1e-4} for s in (1, 2, 3)]
    key = checkpoint_key(job.id, 3)
    checkpoint = report("checkpoint", "h2", step=3, total_steps=4, storage_key=key,
                        metrics={"train_loss": 2.7}, recent_steps=recent, **ids)  # fmt: skip
    assert host_report_apply(message=checkpoint) == "applied"
    assert host_report_apply(message=late) == "duplicate"  # redelivered after the recovery
    steps = list(JobMetric.objects.filter(job=job).order_by("step").values_list("step", flat=True))
    assert steps == [1, 2, 3]
    events = job.events.filter(message__startswith="Step ").order_by("created_at")
    data = [dict(e.data or {}) for e in events]
    assert [(d["step"], bool(d.get("recovered"))) for d in data] == [
        (1, False),
        (3, False),
        (2, True),
    ]


def test_stale_reports_are_ignored_and_the_host_told_to_stop(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None
    host_report_apply(message=started_report(placement))
    drain_host_queue("h2")
    ids = {"placement_id": placement.pk, "job_id": job.id}
    finetune_job_pause(job=job)
    with django_capture_on_commit_callbacks(execute=True):
        # Until the host reaches its batch boundary, its steps and pause checkpoint count.
        progress = report("job_progress", "h2", step=1, train_loss=1.0, **ids)
        assert host_report_apply(message=progress) == "applied"
        assert heartbeat("h2", placements=[placement.pk]) == "applied"
    assert [c["command"] for c in drain_host_queue("h2")] == ["pause"]
    ckpt = report("checkpoint", "h2", step=1, storage_key=checkpoint_key(job.id, 1),
                  metrics={"train_loss": 1.0}, **ids)  # fmt: skip
    assert host_report_apply(message=ckpt) == "applied"
    finetune_job_cancel(job=job)
    with django_capture_on_commit_callbacks(execute=True):
        for step in (2, 3):  # per-step reports the host sent before its stop arrived
            late = report("job_progress", "h2", step=step, train_loss=0.9, **ids)
            assert host_report_apply(message=late) == "stale"
    assert drain_host_queue("h2") == []  # not one stop per step: the heartbeat's check stops it
    with django_capture_on_commit_callbacks(execute=True):
        assert heartbeat("h2", placements=[placement.pk]) == "applied"
        outcome = report("job_succeeded", "h2", trained_tokens=9, adapter_key=adapter_key(job.id),
                         **ids)  # fmt: skip
        assert host_report_apply(message=outcome) == "stale"
    assert [c["command"] for c in drain_host_queue("h2")] == ["cancel", "cancel"]
    assert list(JobMetric.objects.filter(job=job).values_list("step", flat=True)) == [1]
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED and job.fine_tuned_model is None
