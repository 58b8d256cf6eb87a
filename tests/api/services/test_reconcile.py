"""Reconciliation: a silent host's jobs move elsewhere, a placement never started is sent again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from api.models import (
    FinetuneJob,
    GpuHost,
    HostStatus,
    Placement,
    PlacementDecision,
    PlacementState,
)
from api.services.placement import job_place
from api.services.reconcile import fleet_reconcile
from api.services.reports import host_report_apply
from gpu_runtime.contract.protocol import report
from tests.api.services.conftest import drain_host_queue, heartbeat, place_now, started_report

pytestmark = pytest.mark.django_db


def test_reconcile_requeues_a_silent_hosts_job_and_resumes_it_elsewhere(
    fleet: dict[str, GpuHost], job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    placement = place_now(job, django_capture_on_commit_callbacks)
    assert placement is not None and placement.host.name == "h2"
    host_report_apply(message=started_report(placement))
    ids = {"placement_id": placement.pk, "job_id": job.id}
    key = f"checkpoints/{job.id}/step-000004"
    host_report_apply(message=report("checkpoint", "h2", step=4, storage_key=key,
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
    assert command["job"]["resume_from"] == {
        "step": 4,
        "storage_key": f"checkpoints/{job.id}/step-000004",
    }
    events = list(job.events.order_by("created_at", "id"))
    messages = [e.message for e in events]
    details = [(e.fleet_detail or {}).get("text", "") for e in events]
    assert "Training interrupted; the job resumes from checkpoint step 4" in messages
    assert "Placed for training, resuming from step 4" in messages
    assert any(t.startswith("Host h2 lost (no heartbeat for 12") for t in details)
    assert "Placed on host h1, resuming from step 4" in details
    # The lost host comes back: it is online again and told to drop the moved placement.
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h2", placements=[placement.pk])
    assert GpuHost.objects.get(name="h2").status == HostStatus.ONLINE
    assert [c["command"] for c in drain_host_queue("h2")] == ["cancel"]


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
