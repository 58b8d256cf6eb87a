"""A pause or cancel reaches the job's host when its transaction commits: one command on
`host.<name>`, sent only after the commit, from the tenant API, the operator API and the CLI
alike; the heartbeats' stale-placement check stays the safety net for a lost message."""

from __future__ import annotations

import logging
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import transaction
from kombu import Connection
from kombu.exceptions import OperationalError as BrokerOperationalError

from api.models import FinetuneJob, GpuHost, JobStatus, Placement, PlacementState, Tenant
from api.services.apikeys import api_key_issue, api_key_issue_for_tenant
from api.services.jobs import finetune_job_pause, finetune_job_resume
from api.services.placement import job_place
from api.services.reports import host_report_apply
from api.services.tenants import operator_create
from gpu_runtime.contract.protocol import report
from tests.api.conftest import ApiClient
from tests.api.services.conftest import drain_host_queue, heartbeat, make_host

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(deployment: Any, job: FinetuneJob, django_capture_on_commit_callbacks: Any) -> Placement:
    """`job` placed on h1 (the only host) and started there; the host queues are empty."""
    for name in ("h1", "h2"):
        make_host(name, deployment if name == "h1" else None)
        heartbeat(name, harvestable_tokens_per_s=100.0)
    with django_capture_on_commit_callbacks(execute=True):
        placement = job_place(job_id=job.id)
    assert placement is not None and placement.host.name == "h1"
    started = report("job_started", "h1", placement_id=placement.pk, job_id=job.id,
                     resumed_from_step=0, total_steps=40)  # fmt: skip
    assert host_report_apply(message=started) == "applied"
    assert [c["command"] for c in drain_host_queue("h1")] == ["apply_placement"]
    return placement


def _tenant_api(tenant: Tenant) -> ApiClient:
    return ApiClient(api_key_issue_for_tenant(tenant=tenant).key)


def test_a_tenants_pause_reaches_the_host_when_it_commits(
    placed: Placement, tenant: Tenant, django_capture_on_commit_callbacks: Any
) -> None:
    api = _tenant_api(tenant)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = api.post(f"/v1/fine_tuning/jobs/{placed.job_id}/pause")
        assert response.status_code == 200 and response.json()["status"] == "paused"
    assert drain_host_queue("h1") == []  # nothing before the commit
    assert len(callbacks) == 1
    callbacks[0]()
    (command,) = drain_host_queue("h1")
    assert command["command"] == "pause"
    assert (command["placement_id"], command["job_id"]) == (placed.pk, placed.job_id)
    assert drain_host_queue("h2") == []
    placed.refresh_from_db()
    assert placed.state == PlacementState.RELEASED
    # A second pause is refused by the state machine and sends nothing.
    with django_capture_on_commit_callbacks(execute=True):
        assert api.post(f"/v1/fine_tuning/jobs/{placed.job_id}/pause").status_code == 409
    assert drain_host_queue("h1") == []


def test_resume_goes_through_placement_again(
    placed: Placement, tenant: Tenant, django_capture_on_commit_callbacks: Any
) -> None:
    job = FinetuneJob.objects.get(pk=placed.job_id)
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
    drain_host_queue("h1")
    with django_capture_on_commit_callbacks(execute=True):
        assert finetune_job_resume(job=job).status == JobStatus.QUEUED
    assert drain_host_queue("h1") == []  # no stop, and no placement before place_job runs
    with Connection("memory://") as connection:  # the in-memory broker's control queue
        control = connection.SimpleQueue("control")
        tasks = []
        while control.qsize():
            message = control.get(timeout=1)
            tasks.append((message.headers["task"], message.decode()[0]))
            message.ack()
        control.close()
    assert ("workers.place_job", [job.id]) in tasks
    heartbeat("h1", placements=[])  # the host has stopped the paused placement
    with django_capture_on_commit_callbacks(execute=True):
        again = job_place(job_id=job.id)
    assert again is not None and again.pk != placed.pk
    assert [c["command"] for c in drain_host_queue("h1")] == ["apply_placement"]


def test_cancels_from_the_operator_api_and_the_cli_reach_the_host(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    ops = ApiClient(api_key_issue(user=operator_create(username="ops", password="pw-1234")).key)
    with django_capture_on_commit_callbacks(execute=True):
        response = ops.post(f"/api/ops/jobs/{job.id}/cancel")
    assert response.status_code == 200, response.content
    assert [(c["command"], c["placement_id"]) for c in drain_host_queue("h1")] == [
        ("cancel", placed.pk)
    ]
    # A job whose placement is still pending (sent, not started) is cancelled on its host too.
    second = FinetuneJob.objects.create(
        tenant=job.tenant, base_model=job.base_model, training_file=job.training_file,
        status=JobStatus.QUEUED, hyperparameters=job.hyperparameters, seed=1,
    )  # fmt: skip
    pending = Placement.objects.create(job=second, host=placed.host)
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("jobs", "cancel", second.id, stdout=out)
    assert out.getvalue().strip() == f"Job {second.id} is cancelled."
    assert [(c["command"], c["placement_id"]) for c in drain_host_queue("h1")] == [
        ("cancel", pending.pk)
    ]


def test_a_rolled_back_pause_tells_no_host(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            finetune_job_pause(job=job)
            raise RuntimeError("the caller's transaction fails after the pause")
    assert callbacks == []
    assert drain_host_queue("h1") == []
    job.refresh_from_db()
    placed.refresh_from_db()
    assert job.status == JobStatus.RUNNING and placed.state == PlacementState.ACTIVE


def test_a_pause_with_no_placement_sends_nothing(
    deployment: Any, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    make_host("h1", deployment)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        assert finetune_job_pause(job=job).status == JobStatus.PAUSED
    assert callbacks == []
    assert drain_host_queue("h1") == []


def test_a_pause_the_broker_refuses_is_logged_and_the_heartbeat_check_sends_it(
    placed: Placement,
    tenant: Tenant,
    django_capture_on_commit_callbacks: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from workers import commands

    def broker_down(*args: Any, **kwargs: Any) -> None:
        raise BrokerOperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    api = _tenant_api(tenant)
    with monkeypatch.context() as patch:
        patch.setattr(commands.app, "send_task", broker_down)
        with caplog.at_level(logging.WARNING, logger="workers.commands"):
            with django_capture_on_commit_callbacks(execute=True):
                response = api.post(f"/v1/fine_tuning/jobs/{placed.job_id}/pause")
    assert response.status_code == 200 and response.json()["status"] == "paused"
    assert drain_host_queue("h1") == []
    (record,) = [r for r in caplog.records if r.name == "workers.commands"]
    assert record.levelno == logging.WARNING
    assert f"pause of job {placed.job_id} (placement {placed.pk}) not sent to host h1" in (
        record.getMessage()
    )
    # The host still trains it and says so in its heartbeat: the safety net sends the pause.
    with django_capture_on_commit_callbacks(execute=True):
        assert heartbeat("h1", placements=[placed.pk]) == "applied"
    assert [c["command"] for c in drain_host_queue("h1")] == ["pause"]
    assert GpuHost.objects.get(name="h1").status == "online"


def test_a_drained_host_returns_to_service_and_its_agent_follows(
    deployment: Any, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    """Drain and undrain reach the agent at commit; heartbeats bring an agent that missed one
    in line; a lost host that comes back still draining stays drained; the CLI does it too."""
    from api.services.fleet import host_drain, host_undrain

    host = make_host("h1", deployment)
    heartbeat("h1")
    with django_capture_on_commit_callbacks(execute=True):
        host = host_drain(host=host)
        host_drain(host=host)  # idempotent: nothing more to tell
    assert [c["command"] for c in drain_host_queue("h1")] == ["drain"]
    heartbeat("h1", draining=True)
    with django_capture_on_commit_callbacks(execute=True):
        assert job_place(job_id=job.id) is None  # draining: no new jobs
    out = StringIO()
    with django_capture_on_commit_callbacks(execute=True):
        call_command("hosts", "undrain", "h1", stdout=out)
    assert out.getvalue().strip() == "Host h1 is online."
    assert [c["command"] for c in drain_host_queue("h1")] == ["undrain"]
    # The agent's next heartbeat predates the undrain: it is told again, then takes jobs.
    with django_capture_on_commit_callbacks(execute=True):
        assert heartbeat("h1", draining=True) == "applied"
    assert [c["command"] for c in drain_host_queue("h1")] == ["undrain"]
    heartbeat("h1", draining=False)
    with django_capture_on_commit_callbacks(execute=True):
        placement = job_place(job_id=job.id)
    assert placement is not None and placement.host.name == "h1"
    # Lost while draining, back with an agent that still drains: draining, not online.
    with django_capture_on_commit_callbacks(execute=True):
        host_drain(host=host)
    GpuHost.objects.filter(name="h1").update(status="lost")
    with django_capture_on_commit_callbacks(execute=True):
        heartbeat("h1", draining=True, placements=[placement.pk])
    assert GpuHost.objects.get(name="h1").status == "draining"
    with django_capture_on_commit_callbacks(execute=True):
        assert host_undrain(host=host).status == "online"
        assert host_undrain(host=host).status == "online"  # idempotent
    assert "undrain" in [c["command"] for c in drain_host_queue("h1")]


def test_the_hosts_stop_is_an_event_with_the_hosts_time(
    placed: Placement, job: FinetuneJob, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        finetune_job_pause(job=job)
    stopped = report("job_stopped", "h1", placement_id=placed.pk, job_id=job.id,
                     reason="paused", step=12)  # fmt: skip
    assert host_report_apply(message=stopped) == "applied"
    assert host_report_apply(message=stopped) == "duplicate"
    event = job.events.get(message="Training stopped (paused) at step 12")
    assert event.data == {"reason": "paused", "step": 12,
                          "stopped_at": stopped["sent_at"]}  # fmt: skip
    assert event.fleet_detail == {
        "text": "Host h1 stopped training (paused) at step 12",
        "host": "h1",
        "placement_id": placed.pk,
    }
