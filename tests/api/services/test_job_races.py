"""The control plane's side of pause, resume and cancel at the awkward moments: a resume
waits for the paused host's stop and resumes from the checkpoint that pause wrote; a success
that raced a pause leaves the job paused with its final checkpoint; the heartbeats' safety net
pauses (not cancels) a placement a resumed job waits on; reports of an older placement never
count; and a running job whose host stops reporting progress is flagged, then cleared."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from api.models import (
    FinetuneJob,
    HostAgentState,
    JobCheckpoint,
    JobEvent,
    JobStatus,
    Placement,
    PlacementDecision,
    PlacementState,
)
from api.services.jobs import finetune_job_cancel, finetune_job_pause, finetune_job_resume
from api.services.placement import job_place
from api.services.reconcile import fleet_reconcile
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import report
from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(deployment: Any, job: FinetuneJob, django_capture_on_commit_callbacks: Any) -> Placement:
    """`job` placed on h1 (the only host serving its model) and started; queues empty."""
    make_host("h1", deployment)
    heartbeat("h1", harvestable_tokens_per_s=100.0)
    with django_capture_on_commit_callbacks(execute=True):
        placement = job_place(job_id=job.id)
    assert placement is not None
    assert host_report_apply(message=_report("job_started", placement, resumed_from_step=0,
                                             total_steps=8)) == "applied"  # fmt: skip
    drain_host_queue("h1")
    return placement


def _report(kind: str, placement: Placement, **fields: Any) -> dict[str, Any]:
    return report(kind, placement.host.name, placement_id=placement.pk,
                  job_id=placement.job_id, **fields)  # fmt: skip


def _checkpoint(placement: Placement, step: int) -> dict[str, Any]:
    key = f"checkpoints/{placement.job_id}/step-{step:06d}"
    return _report("checkpoint", placement, step=step, storage_key=key,
                   metrics={"train_loss": 1.0})  # fmt: skip


def _progress(placement: Placement, step: int) -> dict[str, Any]:
    return _report("job_progress", placement, step=step, total_steps=8, train_loss=1.0)


def test_a_resume_waits_for_the_paused_host_and_resumes_from_its_pause_checkpoint(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    assert host_report_apply(message=_progress(placed, 1)) == "applied"
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
    assert [c["command"] for c in drain_host_queue("h1")] == ["pause"]
    # The host is still on its way to the batch boundary: its heartbeat names the placement.
    heartbeat("h1", placements=[placed.pk])
    with django_capture_on_commit_callbacks(execute=True):
        assert job_place(job_id=job.id) is None
        assert fleet_reconcile().placed_jobs == []
    (waiting,) = job.events.filter(
        message="Waiting for the previous run to stop (it checkpoints at its batch boundary "
        "first)"
    )
    assert waiting.fleet_detail == {
        "text": f"Waiting for host h1 to stop placement {placed.pk}",
        "host": "h1",
        "placement_id": placed.pk,
    }
    drain_host_queue("h1")  # the heartbeat's safety net: pause again (ignored by the host)
    # Its last step, the pause's checkpoint and its stop arrive while the job is queued.
    assert host_report_apply(message=_progress(placed, 2)) == "applied"
    assert host_report_apply(message=_checkpoint(placed, 2)) == "applied"
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        stopped = _report("job_stopped", placed, reason="paused", step=2)
        assert host_report_apply(message=stopped) == "applied"
    assert callbacks, "the stop places the resumed job at once"
    assert HostAgentState.objects.get(host__name="h1").placements == []
    with django_capture_on_commit_callbacks(execute=True):
        second = job_place(job_id=job.id)
    assert second is not None and second.pk != placed.pk
    assert PlacementDecision.objects.get(placement=second).resume_step == 2
    (command,) = drain_host_queue("h1")
    assert command["command"] == "apply_placement"
    assert command["job"]["resume_from"] == {
        "step": 2,
        "storage_key": f"checkpoints/{job.id}/step-000002",
    }


def test_a_resume_waits_even_before_a_heartbeat_names_the_started_placement(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    """The host started the placement, but no heartbeat applied since says so (the worker
    runs behind): the resumed job still waits for the host's stop."""
    assert HostAgentState.objects.get(host__name="h1").placements == []  # sent before start
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
        assert job_place(job_id=job.id) is None
    drain_host_queue("h1")
    heartbeat("h1", placements=[])  # applied after the start: the host no longer trains it
    with django_capture_on_commit_callbacks(execute=True):
        assert job_place(job_id=job.id) is not None


def test_a_stop_applied_before_its_checkpoint_waits_for_that_checkpoint(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    """The host sends the pause's checkpoint, then its stop; a retried checkpoint report is
    applied after the stop. The resumed job waits for it and resumes from it."""
    assert host_report_apply(message=_checkpoint(placed, 10)) == "applied"
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        stopped = _report("job_stopped", placed, reason="paused", step=18)
        assert host_report_apply(message=stopped) == "applied"
        assert job_place(job_id=job.id) is None  # step 18's checkpoint is not recorded yet
    assert job.events.filter(
        message="Waiting for the checkpoint of step 18",
        fleet_detail__text="Waiting for the checkpoint of step 18 that host h1 stopped at",
    ).exists()
    assert not Placement.objects.filter(job=job).exclude(pk=placed.pk).exists()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        assert host_report_apply(message=_checkpoint(placed, 18)) == "applied"
    assert callbacks, "the awaited checkpoint places the job at once"
    with django_capture_on_commit_callbacks(execute=True):
        second = job_place(job_id=job.id)
    assert second is not None
    assert PlacementDecision.objects.get(placement=second).resume_step == 18


def test_a_stop_whose_checkpoint_never_comes_resumes_from_the_latest_after_a_while(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    assert host_report_apply(message=_checkpoint(placed, 10)) == "applied"
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
        stopped = _report("job_stopped", placed, reason="paused", step=18)
        assert host_report_apply(message=stopped) == "applied"
        assert job_place(job_id=job.id) is None
    Placement.objects.filter(pk=placed.pk).update(stopped_at=timezone.now() - timedelta(seconds=60))
    with django_capture_on_commit_callbacks(execute=True):
        second = job_place(job_id=job.id)
    assert second is not None
    assert PlacementDecision.objects.get(placement=second).resume_step == 10


def test_a_success_that_raced_a_pause_leaves_the_job_paused_with_its_final_checkpoint(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    """The pause commits after the host's last step: the host finished (and ignores the
    pause). The job stays paused; its resume starts from the final checkpoint."""
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        assert host_report_apply(message=_progress(placed, 8)) == "applied"
        assert host_report_apply(message=_checkpoint(placed, 8)) == "applied"
        done = _report("job_succeeded", placed, trained_tokens=99, adapter_key=f"adapters/{job.id}")
        assert host_report_apply(message=done) == "stale"
    assert [c["command"] for c in drain_host_queue("h1")] == ["pause"]
    job.refresh_from_db()
    assert job.status == JobStatus.PAUSED and job.fine_tuned_model is None
    heartbeat("h1", placements=[])  # the host trains nothing: the resume places at once
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_resume(job=job)
        second = job_place(job_id=job.id)
    assert second is not None
    (command,) = drain_host_queue("h1")
    assert command["job"]["resume_from"]["step"] == 8


def test_the_safety_net_pauses_a_placement_a_resumed_job_waits_on_and_cancels_the_rest(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", placements=[placed.pk])
    # A cancel would throw the pause's checkpoint away, which the resumed job waits for.
    assert [c["command"] for c in drain_host_queue("h1")] == ["pause"]
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_cancel(job=job)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", placements=[placed.pk])
    assert [c["command"] for c in drain_host_queue("h1")] == ["cancel"]
    assert host_report_apply(message=_checkpoint(placed, 3)) == "stale"
    assert not JobCheckpoint.objects.filter(job=job).exists()


def test_reports_of_an_older_placement_never_count(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    """Paused, resumed elsewhere, paused again: the first placement's late steps (a host back
    from a network split) are not the job's, though the job is paused."""
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
    heartbeat("h1", placements=[])
    with django_capture_on_commit_callbacks(execute=True):
        second = job_place(job_id=job.id)
    assert second is not None
    started = _report("job_started", second, resumed_from_step=0, total_steps=8)
    assert host_report_apply(message=started) == "applied"
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
    assert host_report_apply(message=_progress(placed, 5)) == "stale"
    assert host_report_apply(message=_checkpoint(placed, 5)) == "stale"
    assert host_report_apply(message=_progress(second, 1)) == "applied"  # the latest counts
    assert not JobCheckpoint.objects.filter(job=job).exists()


def _age(job: FinetuneJob, placement: Placement, seconds: float) -> None:
    """Move the placement's start and the job's progress events `seconds` into the past."""
    past = timezone.now() - timedelta(seconds=seconds)
    Placement.objects.filter(pk=placement.pk).update(started_at=past)
    JobEvent.objects.filter(job=job, type="metrics").update(created_at=past)


def test_a_running_job_without_progress_is_flagged_once_and_cleared_by_progress(
    placed: Placement,
    job: FinetuneJob,
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setenv("HARLI_JOB_STALL_AFTER_S", "60")
    assert host_report_apply(message=_progress(placed, 1)) == "applied"
    _age(job, placed, 30)
    with django_capture_on_commit_callbacks(execute=True):
        assert fleet_reconcile().stalled_jobs == []
    _age(job, placed, 90)
    last = JobEvent.objects.filter(job=job, type="metrics").get().created_at
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", placements=[placed.pk])  # the host is alive; the job is not moving
        assert fleet_reconcile().stalled_jobs == [job.id]
        assert fleet_reconcile().stalled_jobs == []  # once
    job.refresh_from_db()
    assert job.status == JobStatus.RUNNING and job.stalled_at is not None
    (warning,) = JobEvent.objects.filter(job=job, level="warn")
    since = last.isoformat(timespec="seconds")
    assert warning.message == f"No training progress since {since}"
    assert warning.data == {"last_progress_at": last.isoformat()}
    assert warning.fleet_detail == {
        "text": f"No progress from host h1 since {since}",
        "host": "h1",
        "placement_id": placed.pk,
    }
    assert host_report_apply(message=_progress(placed, 2)) == "applied"
    job.refresh_from_db()
    assert job.stalled_at is None
    assert job.events.filter(message__startswith="Training progress again").count() == 1
    assert (
        job.events.filter(fleet_detail__text__startswith="Progress from host h1 again").count()
        == 1
    )
    # Stalled again, then paused: a job that is not running is not stalled.
    _age(job, placed, 90)
    with django_capture_on_commit_callbacks(execute=True):
        assert fleet_reconcile().stalled_jobs == [job.id]
        finetune_job_pause(job=job)
    job.refresh_from_db()
    assert job.status == JobStatus.PAUSED and job.stalled_at is None


def test_a_job_that_never_reported_a_step_is_flagged_from_its_start(
    placed: Placement, job: FinetuneJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARLI_JOB_STALL_AFTER_S", "60")
    _age(job, placed, 61)
    assert fleet_reconcile().stalled_jobs == [job.id]
    assert PlacementState.ACTIVE == Placement.objects.get(pk=placed.pk).state


def test_a_resume_does_not_wait_for_a_host_gone_silent(
    placed: Placement,
    job: FinetuneJob,
    deployment: Any,
    django_capture_on_commit_callbacks: Any,
) -> None:
    """The wait for the paused host's stop lasts while that host heartbeats: one silent for
    `HARLI_HOST_LOST_AFTER_S` is not waited for (its stale reports never count again)."""
    make_host("h2", deployment)
    heartbeat("h2", harvestable_tokens_per_s=100.0)
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
        finetune_job_resume(job=job)
    heartbeat("h1", placements=[placed.pk])
    assert job_place(job_id=job.id) is None
    silent = timezone.now() - timedelta(seconds=600)
    HostAgentState.objects.filter(host__name="h1").update(reported_at=silent)
    with django_capture_on_commit_callbacks(execute=True):
        second = job_place(job_id=job.id)
    assert second is not None and second.host.name == "h2"
    assert host_report_apply(message=_checkpoint(placed, 4)) == "stale"
