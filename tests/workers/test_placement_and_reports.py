"""Placement, report ingestion and reconciliation against the real database and broker client."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from api.models import (
    Adapter,
    Deployment,
    DeploymentMetric,
    FinetuneJob,
    GpuHost,
    HostMetric,
    HostStatus,
    JobCheckpoint,
    JobMetric,
    JobStatus,
    MetricRollup,
    Placement,
    PlacementDecision,
    PlacementState,
)
from api.services.fleet import base_model_register, deployment_create
from api.services.jobs import finetune_job_cancel, finetune_job_pause
from api.services.placement import job_place
from api.services.reconcile import fleet_reconcile
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import report
from tests.workers.conftest import GIB, drain_host_queue, heartbeat, make_host

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(deployment: Deployment) -> dict[str, GpuHost]:
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


def _place(job: FinetuneJob, capture: Any) -> Placement | None:
    with capture(execute=True):
        return job_place(job_id=job.id)


def test_placement_chooses_by_throughput_share_and_headroom(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = _place(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"
    reasons = PlacementDecision.objects.get(placement=placement).reasons
    why = {row["host"]: row["why"] for row in reasons["candidates"]}
    assert why["h1"] == why["h2"] == "eligible"
    assert why["h3"] == "does not serve tiny"
    assert why["h4"].startswith("free 1024 B < needed")
    assert reasons["chosen"] == "h2"
    (command,) = drain_host_queue("h2")
    assert command["command"] == "apply_placement"
    assert command["placement_id"] == placement.pk
    assert command["job"]["id"] == job.id
    assert command["job"]["training_file_key"] == job.training_file.storage_key
    assert command["job"]["training_file"] == job.training_file_id
    assert command["job"]["max_seq_len"] == 512  # the tiny preset's context length
    assert command["job"]["resume_from"] is None
    assert drain_host_queue("h1") == []
    # Placing again is a no-op: one open placement per job.
    assert _place(job, django_capture_on_commit_callbacks) is None
    assert drain_host_queue("h2") == []
    assert job.events.filter(message="Placed on host h2").count() == 1


def test_predicted_throughput_within_tolerance_goes_to_the_most_headroom(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    predicted = {
        "source": "predictor",
        "finetune_fraction": 0.8,
        "solo_tokens_per_s": 1200.0,
        "solo_source": "prior",
        "mode": "spatial 0.75",
        "measured_tokens_per_s": 0.0,
    }
    heartbeat("h1", harvestable_tokens_per_s=960.0, harvest=predicted, free_bytes=4 * GIB,
              predictor_version="v1", predictor_mape=0.03)  # fmt: skip
    heartbeat("h2", harvestable_tokens_per_s=900.0, harvest=predicted, free_bytes=12 * GIB,
              predictor_version="v1", predictor_mape=0.03)  # fmt: skip
    placement = _place(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"  # 900 is within 10% of 960
    reasons = PlacementDecision.objects.get(placement=placement).reasons
    rows = {row["host"]: row for row in reasons["candidates"]}
    assert rows["h1"]["throughput_tier"] == rows["h2"]["throughput_tier"] == "best"
    assert rows["h2"]["headroom_bytes"] > rows["h1"]["headroom_bytes"]
    assert rows["h2"]["harvest"]["source"] == "predictor"
    assert rows["h2"]["predictor_version"] == "v1"
    assert "memory headroom" in reasons["policy"]
    # A clearly better predicted throughput wins over headroom; open placements share it.
    Placement.objects.filter(pk=placement.pk).delete()
    job.refresh_from_db()
    heartbeat("h1", harvestable_tokens_per_s=2000.0, harvest=predicted, free_bytes=4 * GIB)
    second = _place(job, django_capture_on_commit_callbacks)
    assert second is not None and second.host.name == "h1"
    rows = {r["host"]: r for r in PlacementDecision.objects.get(placement=second).reasons[
        "candidates"]}  # fmt: skip
    assert rows["h2"]["throughput_tier"] == "below"


def test_heartbeats_record_the_hosts_predictor(fleet: dict[str, GpuHost]) -> None:
    heartbeat("h1", predictor_version="v20261130T095333Z", predictor_mape=0.032)
    host = GpuHost.objects.get(name="h1")
    assert (host.predictor_version, host.predictor_mape) == ("v20261130T095333Z", 0.032)
    heartbeat("h1", predictor_version=None, predictor_mape=None)  # the agent lost it
    host.refresh_from_db()
    assert (host.predictor_version, host.predictor_mape) == (None, None)
    heartbeat("h1")  # an older agent that does not report it: left alone
    host.refresh_from_db()
    assert host.predictor_version is None


def test_no_eligible_host_waits_with_one_event(
    deployment: Deployment, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    make_host("h1", deployment)  # registered, never heartbeated: offline
    assert _place(job, django_capture_on_commit_callbacks) is None
    assert _place(job, django_capture_on_commit_callbacks) is None
    waiting = job.events.filter(message__startswith="Waiting for a host")
    assert [e.message for e in waiting] == ["Waiting for a host (h1: host is offline)"]


def _started(placement: Placement, **fields: Any) -> dict[str, Any]:
    ids = {"placement_id": placement.pk, "job_id": placement.job_id}
    return report("job_started", placement.host.name, resumed_from_step=0, total_steps=4,
                  **ids, **fields)  # fmt: skip


def test_reports_apply_once_and_success_registers_the_adapter(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = _place(job, django_capture_on_commit_callbacks)
    assert placement is not None
    assert [c["command"] for c in drain_host_queue("h2")] == ["apply_placement"]
    started = _started(placement)
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
    placement = _place(job, django_capture_on_commit_callbacks)
    assert placement is not None
    assert host_report_apply(message=_started(placement)) == "applied"
    ids = {"placement_id": placement.pk, "job_id": job.id}

    def progress(step: int) -> dict[str, Any]:
        return report("job_progress", "h2", step=step, total_steps=4,
                      train_loss=3.0 - step / 10, tokens_per_s=50.0, **ids)  # fmt: skip

    late = progress(2)  # lost in the broker... for now
    for step in (1, 3):
        assert host_report_apply(message=progress(step)) == "applied"
    recent = [{"step": s, "train_loss": 3.0 - s / 10, "learning_rate": 1e-4} for s in (1, 2, 3)]
    checkpoint = report("checkpoint", "h2", step=3, total_steps=4, storage_key="checkpoints/x",
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
    placement = _place(job, django_capture_on_commit_callbacks)
    assert placement is not None
    host_report_apply(message=_started(placement))
    drain_host_queue("h2")
    ids = {"placement_id": placement.pk, "job_id": job.id}
    finetune_job_pause(job=job)
    with django_capture_on_commit_callbacks(execute=True):
        # Until the host reaches its batch boundary, its steps and pause checkpoint count.
        progress = report("job_progress", "h2", step=1, train_loss=1.0, **ids)
        assert host_report_apply(message=progress) == "applied"
        assert heartbeat("h2", placements=[placement.pk]) == "applied"
    assert [c["command"] for c in drain_host_queue("h2")] == ["pause"]
    ckpt = report("checkpoint", "h2", step=1, storage_key="checkpoints/x/step-000001",
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
        outcome = report("job_succeeded", "h2", trained_tokens=9, adapter_key="adapters/x", **ids)
        assert host_report_apply(message=outcome) == "stale"
    assert [c["command"] for c in drain_host_queue("h2")] == ["cancel", "cancel"]
    assert list(JobMetric.objects.filter(job=job).values_list("step", flat=True)) == [1]
    job.refresh_from_db()
    assert job.status == JobStatus.CANCELLED and job.fine_tuned_model is None


def test_reconcile_requeues_a_silent_hosts_job_and_resumes_it_elsewhere(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = _place(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"
    host_report_apply(message=_started(placement))
    ids = {"placement_id": placement.pk, "job_id": job.id}
    host_report_apply(message=report("checkpoint", "h2", step=4, storage_key="ck/4",
                                     metrics={"train_loss": 1.5}, **ids))  # fmt: skip
    drain_host_queue("h2")
    stale = timezone.now() - timedelta(seconds=120)
    GpuHost.objects.filter(name__in=["h2", "h3", "h4"]).update(last_heartbeat_at=stale)
    with django_capture_on_commit_callbacks(execute=True):
        result = fleet_reconcile()
    assert sorted(result.lost_hosts) == ["h2", "h3", "h4"]
    assert result.requeued_jobs == [job.id] and result.placed_jobs == [job.id]
    placement.refresh_from_db()
    assert placement.state == PlacementState.LOST
    assert GpuHost.objects.get(name="h2").status == HostStatus.LOST
    new = Placement.objects.get(job=job, state=PlacementState.PENDING)
    assert new.host.name == "h1"
    (command,) = drain_host_queue("h1")
    assert command["job"]["resume_from"] == {"step": 4, "storage_key": "ck/4"}
    messages = list(job.events.order_by("created_at", "id").values_list("message", flat=True))
    assert any(m.startswith("Host h2 lost (no heartbeat for 12") for m in messages)
    assert "Placed on host h1, resuming from step 4" in messages
    # The lost host comes back: it is online again and told to drop the moved placement.
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h2", placements=[placement.pk])
    assert GpuHost.objects.get(name="h2").status == HostStatus.ONLINE
    assert [c["command"] for c in drain_host_queue("h2")] == ["cancel"]


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


def test_a_drained_host_is_told_to_drain_and_gets_no_new_jobs(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    from api.services.fleet import host_drain

    for name in ("h1", "h2"):
        host_drain(host=fleet[name])
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h2", harvestable_tokens_per_s=300.0)
    assert [c["command"] for c in drain_host_queue("h2")] == ["drain"]
    heartbeat("h2", harvestable_tokens_per_s=300.0, draining=True)
    assert _place(job, django_capture_on_commit_callbacks) is None
    assert job.events.filter(message__contains="h2: host is draining").exists()


def test_reconcile_resends_a_placement_its_host_never_started(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=False):  # the send is lost
        placement = job_place(job_id=job.id)
    assert placement is not None and drain_host_queue("h2") == []
    assert fleet_reconcile().redispatched == []  # too recent to resend
    Placement.objects.filter(pk=placement.pk).update(
        created_at=timezone.now() - timedelta(seconds=60)
    )
    for name in ("h1", "h2"):  # keep the hosts fresh
        heartbeat(name)
    assert fleet_reconcile().redispatched == [placement.pk]
    (command,) = drain_host_queue("h2")
    assert command["placement_id"] == placement.pk
    decision = PlacementDecision.objects.get(placement=placement)
    assert decision.dispatch_count == 1
    assert fleet_reconcile().redispatched == []  # sent just now


def test_a_host_serving_another_model_is_told_to_load_its_deployments(
    fleet: dict[str, GpuHost], django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", base_model="something-else")
        heartbeat("h2")
    (command,) = drain_host_queue("h1")
    assert command["command"] == "load_base_model"
    assert (command["base_model"], command["model_dir"], command["preset"]) == (
        "tiny",
        None,
        "tiny",
    )
    assert drain_host_queue("h2") == []
