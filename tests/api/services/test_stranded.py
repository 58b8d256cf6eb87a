"""Reconciliation recovers jobs whose live host will never run their placement
(`api.services.stranded`): without it they stay queued (or running) forever."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from api.models import FinetuneJob, GpuHost, JobStatus, Placement, PlacementState
from api.services.fleet import host_drain
from api.services.placement import job_place
from api.services.reconcile import fleet_reconcile
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import checkpoint_key, report
from tests.api.services.conftest import drain_host_queue, heartbeat, place_now, started_report

pytestmark = pytest.mark.django_db

ACK_TIMEOUT_S = 600  # HARLI_PLACEMENT_ACK_TIMEOUT_S's default


def made_ago(placement: Placement, seconds: float) -> None:
    Placement.objects.filter(pk=placement.pk).update(
        created_at=timezone.now() - timedelta(seconds=seconds)
    )


def test_a_placement_the_live_host_never_acknowledges_is_given_up_and_the_job_placed_again(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"
    drain_host_queue("h2")  # the agent got it, was killed, and its restart dropped the resends
    made_ago(placement, ACK_TIMEOUT_S - 30)
    heartbeat("h2")
    heartbeat("h1")
    with django_capture_on_commit_callbacks(execute=True):
        early = fleet_reconcile()
    assert early.abandoned_placements == []  # not yet: the host may be setting it up
    made_ago(placement, ACK_TIMEOUT_S + 30)
    heartbeat("h2")
    heartbeat("h1")
    with django_capture_on_commit_callbacks(execute=True):
        result = fleet_reconcile()
    assert result.abandoned_placements == [placement.pk]
    assert result.placed_jobs == [job.id]
    placement.refresh_from_db()
    assert placement.state == PlacementState.LOST
    fresh = Placement.objects.get(job=job, state=PlacementState.PENDING)
    assert fresh.pk != placement.pk
    assert [c["placement_id"] for c in drain_host_queue(fresh.host.name)] == [fresh.pk]
    events = list(job.events.all())
    assert any(e.message.startswith("Training did not start within ") for e in events)
    details = [str((e.fleet_detail or {}).get("text", "")) for e in events]
    assert any(
        t.startswith(f"Host h2 did not start placement {placement.pk} within") for t in details
    )
    assert not any(re.search(r"\bh2\b|placement", e.message) for e in events)
    # Should the host start the given-up placement after all, it is told to stop it.
    with django_capture_on_commit_callbacks(execute=True):
        assert host_report_apply(message=started_report(placement)) == "stale"
    stops = [c for c in drain_host_queue("h2") if c.get("placement_id") == placement.pk]
    assert [c["command"] for c in stops] == ["cancel"]


def test_a_placement_the_host_lists_is_kept(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None
    made_ago(placement, ACK_TIMEOUT_S + 30)
    heartbeat("h2", placements=[placement.pk])  # setting it up: a large file to tokenize
    heartbeat("h1")
    assert fleet_reconcile().abandoned_placements == []
    placement.refresh_from_db()
    assert placement.state == PlacementState.PENDING


def test_a_lost_send_to_a_host_drained_since_is_recovered_on_another_host(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=False):  # the broker lost the send
        placement = job_place(job_id=job.id)
    assert placement is not None and placement.host.name == "h2"
    with django_capture_on_commit_callbacks(execute=True):
        host_drain(host=GpuHost.objects.get(name="h2"))
    made_ago(placement, ACK_TIMEOUT_S + 30)
    heartbeat("h2", draining=True)
    heartbeat("h1")
    with django_capture_on_commit_callbacks(execute=True):
        result = fleet_reconcile()
    assert placement.pk not in result.redispatched  # a draining host is not sent it again
    assert result.abandoned_placements == [placement.pk]
    assert Placement.objects.get(job=job, state=PlacementState.PENDING).host.name == "h1"


def test_a_running_job_its_restarted_agent_forgot_resumes_elsewhere(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None
    host_report_apply(message=started_report(placement))
    ids = {"placement_id": placement.pk, "job_id": job.id}
    key = checkpoint_key(job.id, 2)
    host_report_apply(message=report("checkpoint", "h2", step=2, storage_key=key,
                                     metrics={"train_loss": 1.5}, **ids))  # fmt: skip
    drain_host_queue("h2")
    # No progress since: the job is flagged as stalled.
    stalled_at = timezone.now() - timedelta(seconds=5)
    FinetuneJob.objects.filter(pk=job.pk).update(stalled_at=stalled_at)
    heartbeat("h2", placements=[placement.pk])  # still listed: only stalled, kept
    heartbeat("h1")
    assert fleet_reconcile().requeued_jobs == []
    assert FinetuneJob.objects.get(pk=job.pk).status == JobStatus.RUNNING
    # The agent was killed and restarted: it heartbeats without the placement.
    heartbeat("h2")
    with django_capture_on_commit_callbacks(execute=True):
        result = fleet_reconcile()
    assert result.requeued_jobs == [job.id] and result.placed_jobs == [job.id]
    placement.refresh_from_db()
    assert placement.state == PlacementState.LOST
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.stalled_at is None
    fresh = Placement.objects.get(job=job, state=PlacementState.PENDING)
    (command,) = drain_host_queue(fresh.host.name)
    assert command["job"]["resume_from"] == {
        "step": 2,
        "storage_key": checkpoint_key(job.id, 2),
    }
    events = list(job.events.all())
    assert "Training interrupted; the job resumes from checkpoint step 2" in [
        e.message for e in events
    ]
    assert any(
        "no longer runs placement" in str((e.fleet_detail or {}).get("text", "")) for e in events
    )
