"""Placement and reconciliation at queue scale: the queries of one pass do not grow with the
number of queued jobs, a pass places at most its bound, placements made in one pass take the
host's memory, and a tenant's `running_jobs` quota holds jobs back."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import (
    BaseModel,
    FinetuneJob,
    GpuHost,
    JobEvent,
    JobStatus,
    Placement,
    Tenant,
)
from api.services.placement import finetune_memory_estimate, placement_pass
from api.services.quotas import tenant_quotas_set
from api.services.reconcile import fleet_reconcile
from api.services.tenants import tenant_create
from tests.api.services.conftest import GIB, heartbeat

pytestmark = pytest.mark.django_db


def queue_copies(job: FinetuneJob, count: int, tenant: Tenant | None = None) -> None:
    """`count` more queued jobs like `job` (bulk-inserted, each with one event)."""
    rows = [
        FinetuneJob(
            tenant=tenant or job.tenant,
            base_model=job.base_model,
            training_file=job.training_file,
            status=JobStatus.QUEUED,
            hyperparameters=job.hyperparameters,
            method=job.method,
            seed=i,
        )
        for i in range(count)
    ]
    FinetuneJob.objects.bulk_create(rows, batch_size=1000)
    JobEvent.objects.bulk_create([JobEvent(job=r, message="queued") for r in rows])


def queries(fn: Any) -> int:
    """The queries `fn` makes; a bulk insert counts once (SQLite splits one into batches of
    its bound-parameter limit, PostgreSQL sends one statement)."""
    with CaptureQueriesContext(connection) as captured:
        fn()
    statements = [q["sql"] for q in captured.captured_queries]
    inserts = {s.split("(", 1)[0] for s in statements if s.startswith("INSERT")}
    return sum(1 for s in statements if not s.startswith("INSERT")) + len(inserts)


def test_a_pass_makes_the_same_number_of_queries_at_200_and_2000_jobs(
    job: FinetuneJob, fleet: dict[str, GpuHost], settings: SettingsWrapper
) -> None:
    need = finetune_memory_estimate(job=job)
    for name in ("h1", "h2", "h4"):
        heartbeat(name, free_bytes=need - 1)  # every job waits: the pass looks at each
    queue_copies(job, 199)
    small = {
        "first": queries(placement_pass),  # records a waiting event per job
        "steady": queries(placement_pass),
        "reconcile": queries(fleet_reconcile),
    }
    queue_copies(job, 1800)
    assert FinetuneJob.objects.filter(status=JobStatus.QUEUED).count() == 2000
    large = {
        "first": queries(placement_pass),
        "steady": queries(placement_pass),
        "reconcile": queries(fleet_reconcile),
    }
    assert large == small, (small, large)
    assert max(large.values()) <= 12
    assert not Placement.objects.exists()
    # One waiting event per job, not one per pass.
    assert JobEvent.objects.filter(message__startswith="Waiting for a host").count() == 2000


def test_a_pass_places_at_most_its_bound_with_a_bounded_number_of_queries(
    job: FinetuneJob,
    fleet: dict[str, GpuHost],
    monkeypatch: pytest.MonkeyPatch,
    django_capture_on_commit_callbacks: Any,
) -> None:
    monkeypatch.setenv("HARLI_PLACEMENTS_PER_PASS", "25")
    tenant_quotas_set(tenant=job.tenant, changes={"running_jobs": 1000})
    for name in ("h1", "h2"):
        heartbeat(name, free_bytes=1000 * GIB)
    queue_copies(job, 499)
    with django_capture_on_commit_callbacks(execute=True):
        count = queries(placement_pass)
    assert Placement.objects.count() == 25
    oldest = FinetuneJob.objects.order_by("created_at", "id").values_list("pk", flat=True)[:25]
    assert set(Placement.objects.values_list("job_id", flat=True)) == set(oldest)
    assert count <= 20, count


def test_jobs_placed_in_one_pass_take_the_hosts_memory(
    job: FinetuneJob, fleet: dict[str, GpuHost], django_capture_on_commit_callbacks: Any
) -> None:
    need = finetune_memory_estimate(job=job)
    heartbeat("h1", free_bytes=2 * need + need // 2)  # room for two
    heartbeat("h2", free_bytes=need - 1)
    queue_copies(job, 9)
    with django_capture_on_commit_callbacks(execute=True):
        placed = placement_pass()
    assert [p.host.name for p in placed] == ["h1", "h1"]


def test_the_running_jobs_quota_holds_a_tenants_jobs_back(
    job: FinetuneJob,
    tiny: BaseModel,
    fleet: dict[str, GpuHost],
    django_capture_on_commit_callbacks: Any,
) -> None:
    for name in ("h1", "h2"):
        heartbeat(name, free_bytes=1000 * GIB)
    other = tenant_create(name="other")
    tenant_quotas_set(tenant=job.tenant, changes={"running_jobs": 2})
    queue_copies(job, 4)
    queue_copies(job, 3, tenant=other)
    with django_capture_on_commit_callbacks(execute=True):
        placement_pass()
    placed = Placement.objects.values_list("job__tenant__name", flat=True)
    assert sorted(placed) == ["acme", "acme", "other", "other", "other"]
    waiting = FinetuneJob.objects.filter(tenant=job.tenant, placements__isnull=True)
    assert waiting.count() == 3
    event = JobEvent.objects.filter(job=waiting.first()).order_by("-created_at").first()
    assert event is not None and "running_jobs quota is 2" in event.message
    # A released placement makes room for the next job at the next pass.
    tenant_quotas_set(tenant=job.tenant, changes={"running_jobs": 3})
    with django_capture_on_commit_callbacks(execute=True):
        assert len(placement_pass()) == 1
