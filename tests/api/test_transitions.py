"""The job lifecycle table and the one service that applies it."""

from __future__ import annotations

import pytest

from api.errors import ConflictError
from api.models import (
    File,
    FinetuneJob,
    GpuHost,
    JobStatus,
    Placement,
    PlacementState,
    Tenant,
)
from api.services.fleet import host_register
from api.services.jobs import (
    finetune_job_create,
    finetune_job_fail,
    finetune_job_pause,
    finetune_job_start,
    finetune_job_transition,
)
from api.transitions import JOB_TRANSITIONS, TERMINAL_STATUSES, is_legal_transition


def test_table_covers_every_status_and_terminals_are_final() -> None:
    assert set(JOB_TRANSITIONS) == set(JobStatus.values)
    for status, targets in JOB_TRANSITIONS.items():
        assert targets <= set(JobStatus.values)
        assert status not in targets
    for status in TERMINAL_STATUSES:
        assert JOB_TRANSITIONS[status] == frozenset()


@pytest.mark.parametrize(
    ("current", "target", "legal"),
    [
        ("validating_files", "queued", True),
        ("validating_files", "running", False),
        ("queued", "running", True),
        ("running", "succeeded", True),
        ("running", "queued", True),
        ("queued", "succeeded", False),
        ("paused", "queued", True),
        ("paused", "running", False),
        ("succeeded", "cancelled", False),
        ("cancelled", "queued", False),
        ("nonsense", "queued", False),
    ],
)
def test_is_legal_transition(current: str, target: str, legal: bool) -> None:
    assert is_legal_transition(current, target) is legal


@pytest.fixture
def job(tenant: Tenant, training_file: File, tiny: object) -> FinetuneJob:
    return finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)


@pytest.mark.django_db
def test_illegal_transition_changes_nothing(job: FinetuneJob) -> None:
    events_before = job.events.count()
    with pytest.raises(ConflictError):
        finetune_job_transition(job=job, to=JobStatus.SUCCEEDED, message="x")
    job.refresh_from_db()
    assert job.status == JobStatus.QUEUED and job.finished_at is None
    assert job.events.count() == events_before


@pytest.mark.django_db
def test_timestamps_error_and_placement_release(job: FinetuneJob) -> None:
    host: GpuHost = host_register(name="h1", gpu_kind="H200", gpu_memory_bytes=141 * 2**30)
    placement = Placement.objects.create(job=job, host=host, state=PlacementState.ACTIVE)
    job = finetune_job_start(job=job)
    assert job.started_at is not None and job.finished_at is None
    job = finetune_job_pause(job=job)
    placement.refresh_from_db()
    assert placement.state == PlacementState.RELEASED and placement.ended_at is not None
    job = finetune_job_fail(job=job, code="oom", message="out of memory")
    assert job.status == JobStatus.FAILED and job.finished_at is not None
    assert job.error == {"code": "oom", "message": "out of memory", "param": None}
    assert job.events.first() is not None
    assert job.events.first().level == "error"  # type: ignore[union-attr]
