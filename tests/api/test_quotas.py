"""Per-tenant quotas (`api.quotas`): overrides set by operators, refusals at the API (429 for
jobs, 413 for files) that leave nothing written, the monthly trained-token count, the
tenant's own read, and admissions that hold when requests race on separate connections."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import (
    BaseModel,
    File,
    FinetuneJob,
    JobEvent,
    JobStatus,
    Tenant,
    TenantTrainedTokens,
    Upload,
)
from api.quotas import QuotaExceededError, month_start, tenant_quota_states
from api.services.files import UploadSource, file_create
from api.services.jobs import (
    finetune_job_create,
    finetune_job_pause,
    finetune_job_resume,
    finetune_job_start,
    finetune_job_succeed,
)
from api.services.quotas import tenant_quotas_set, trained_tokens_record
from tests.api.conftest import VALID_JSONL, ApiClient, assert_error
from tests.threads import run_threads

pytestmark = pytest.mark.django_db


def states(tenant: Tenant) -> dict[str, dict[str, Any]]:
    return {s.name: s.as_dict() for s in tenant_quota_states(tenant=tenant, now=datetime.now(UTC))}


def create_job(api: ApiClient, file: File) -> Any:
    return api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": file.id})


def test_defaults_come_from_settings_and_overrides_replace_them(
    tenant: Tenant, settings: SettingsWrapper
) -> None:
    settings.HARLI_QUOTA_QUEUED_JOBS = 7
    shown = states(tenant)
    assert (shown["queued_jobs"]["limit"], shown["queued_jobs"]["override"]) == (7, None)
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": 2, "stored_bytes": 0})
    shown = states(tenant)
    assert (shown["queued_jobs"]["limit"], shown["queued_jobs"]["default"]) == (2, 7)
    assert shown["stored_bytes"]["limit"] == 0
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": None})
    shown = states(tenant)
    assert (shown["queued_jobs"]["limit"], shown["stored_bytes"]["limit"]) == (7, 0)


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"queued_jobs": -1}, "quotas.queued_jobs"),
        ({"queued_jobs": True}, "quotas.queued_jobs"),
        ({"queued_jobs": "3"}, "quotas.queued_jobs"),
        ({"running_jobs": 2**31}, "quotas.running_jobs"),
        ({"gpus": 3}, "quotas.gpus"),
        ([1], "quotas"),
    ],
)
def test_bad_overrides_are_refused_and_nothing_written(
    tenant: Tenant, changes: Any, param: str
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": 3})
    with pytest.raises(Exception) as refused:
        tenant_quotas_set(tenant=tenant, changes=changes)
    assert getattr(refused.value, "param", None) == param
    assert states(tenant)["queued_jobs"]["override"] == 3


def test_job_create_past_the_queued_quota_is_a_429_naming_it(
    api: ApiClient, tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": 2})
    for _ in range(2):
        assert create_job(api, training_file).status_code == 200
    jobs, events = FinetuneJob.objects.count(), JobEvent.objects.count()
    error = assert_error(create_job(api, training_file), 429, param="queued_jobs")
    assert (error["type"], error["code"]) == ("insufficient_quota", "quota_exceeded")
    assert "2 fine-tuning jobs waiting for a host in use" in error["message"]
    assert "the quota is 2" in error["message"]
    assert (FinetuneJob.objects.count(), JobEvent.objects.count()) == (jobs, events)
    # A job that leaves the queue frees its place.
    finetune_job_start(job=FinetuneJob.objects.filter(tenant=tenant).first())  # type: ignore[arg-type]
    assert create_job(api, training_file).status_code == 200


def test_a_quota_of_zero_refuses_every_job(
    api: ApiClient, tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": 0})
    assert_error(create_job(api, training_file), 429, param="queued_jobs")
    assert not FinetuneJob.objects.exists()


def test_resume_counts_against_the_queued_quota(
    tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    job = finetune_job_pause(job=job)
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": 1})
    finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    with pytest.raises(QuotaExceededError):
        finetune_job_resume(job=job)
    assert FinetuneJob.objects.get(pk=job.pk).status == JobStatus.PAUSED


def test_trained_tokens_count_per_utc_month_and_refuse_new_jobs(
    api: ApiClient, tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    job = finetune_job_start(job=job)
    finetune_job_succeed(job=job, trained_tokens=600, adapter_path="adapters/x")
    this_month = month_start(datetime.now(UTC))
    row = TenantTrainedTokens.objects.get(tenant=tenant, month=this_month)
    assert row.trained_tokens == 600
    # Last month's tokens do not count this month.
    trained_tokens_record(
        tenant_id=tenant.pk, increase=10_000, at=datetime(2001, 1, 31, 23, 59, tzinfo=UTC)
    )
    assert states(tenant)["trained_tokens_per_month"]["used"] == 600
    tenant_quotas_set(tenant=tenant, changes={"trained_tokens_per_month": 601})
    assert create_job(api, training_file).status_code == 200
    tenant_quotas_set(tenant=tenant, changes={"trained_tokens_per_month": 600})
    error = assert_error(create_job(api, training_file), 429, param="trained_tokens_per_month")
    assert "600 tokens trained this month" in error["message"]


def test_a_progress_report_adds_only_the_increase(
    tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    from api.services.job_results import finetune_job_trained_tokens_update

    job = finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    for count in (100, 250, 250, 200, 300):  # 200: a resume from an earlier checkpoint
        finetune_job_trained_tokens_update(job=job, trained_tokens=count)
    assert states(tenant)["trained_tokens_per_month"]["used"] == 100 + 150 + 100
    assert FinetuneJob.objects.get(pk=job.pk).trained_tokens == 300


def test_upload_past_stored_bytes_is_refused_before_anything_is_stored(
    api: ApiClient, tenant: Tenant, storage_dir: Any
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"stored_bytes": len(VALID_JSONL) * 2})
    assert api.upload(VALID_JSONL).status_code == 200
    assert api.upload(VALID_JSONL).status_code == 200
    keys = sorted(p.name for p in storage_dir.rglob("*") if p.is_file())
    error = assert_error(api.upload(VALID_JSONL), 413, param="stored_bytes")
    assert error["code"] == "quota_exceeded"
    assert f"the tenant stores {len(VALID_JSONL) * 2} bytes" in error["message"]
    assert File.objects.count() == 2
    assert sorted(p.name for p in storage_dir.rglob("*") if p.is_file()) == keys
    # Deleting a file makes room.
    api.delete(f"/v1/files/{File.objects.first().pk}")  # type: ignore[union-attr]
    assert api.upload(VALID_JSONL).status_code == 200


def test_an_upload_whose_declared_length_cannot_fit_is_refused_unread(
    tenant: Tenant, tenant_key: str
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"stored_bytes": 1000})
    response = Client().generic(
        "POST",
        "/v1/files",
        b"",  # the body is never read: the declared length decides
        content_type="multipart/form-data; boundary=x",
        headers={"Authorization": f"Bearer {tenant_key}"},
        CONTENT_LENGTH=str(200_000),
    )
    assert_error(response, 413, param="stored_bytes")
    assert not File.objects.exists()


def test_an_upload_declared_past_stored_bytes_is_refused_at_create(
    api: ApiClient, tenant: Tenant
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"stored_bytes": 100})
    response = api.post(
        "/v1/uploads",
        {"filename": "a.jsonl", "purpose": "fine-tune", "bytes": 101, "mime_type": "text/jsonl"},
    )
    assert_error(response, 413, param="stored_bytes")
    assert not Upload.objects.exists()


def test_the_tenant_reads_its_own_quotas_and_use(
    api: ApiClient, tenant: Tenant, other_tenant: Tenant, training_file: File, tiny: BaseModel
) -> None:
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": 5})
    tenant_quotas_set(tenant=other_tenant, changes={"queued_jobs": 9})
    finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    body = api.get("/v1/organization/limits").json()
    assert body["object"] == "organization.limits"
    quotas = {q["name"]: q for q in body["quotas"]}
    assert set(quotas) == {
        "running_jobs",
        "queued_jobs",
        "stored_bytes",
        "trained_tokens_per_month",
    }
    assert (quotas["queued_jobs"]["limit"], quotas["queued_jobs"]["used"]) == (5, 1)
    assert quotas["queued_jobs"]["remaining"] == 4
    assert quotas["stored_bytes"]["used"] == training_file.bytes


def test_ops_patch_sets_quotas_and_get_shows_them_with_use(
    ops: ApiClient, tenant: Tenant, training_file: File
) -> None:
    response = ops.request(
        "patch", "/api/ops/tenants/acme", {"quotas": {"queued_jobs": 3, "stored_bytes": 10**9}}
    )
    assert response.status_code == 200, response.content
    quotas = {q["name"]: q for q in response.json()["quotas"]}
    assert quotas["queued_jobs"]["limit"] == 3 and quotas["queued_jobs"]["override"] == 3
    assert quotas["stored_bytes"]["used"] == training_file.bytes
    shown = {q["name"]: q for q in ops.get("/api/ops/tenants/acme").json()["quotas"]}
    assert shown["queued_jobs"]["limit"] == 3
    # A rate limit alone keeps the quotas; a bad quota writes nothing (not the rate limit either).
    ops.request("patch", "/api/ops/tenants/acme", {"requests_per_minute": 10})
    refused = ops.request(
        "patch",
        "/api/ops/tenants/acme",
        {"requests_per_minute": 20, "quotas": {"queued_jobs": 1, "nope": 1}},
    )
    assert_error(refused, 400, param="quotas.nope")
    fresh = ops.get("/api/ops/tenants/acme").json()
    assert fresh["requests_per_minute"] == 10
    assert {q["name"]: q["limit"] for q in fresh["quotas"]}["queued_jobs"] == 3
    assert_error(
        ops.request("patch", "/api/ops/tenants/acme", {"quotas": {"queued_jobs": -2}}), 400
    )


THREADS = 8
QUOTA = 3


@pytest.mark.django_db(transaction=True)
def test_concurrent_job_creates_never_pass_the_queued_quota(
    tenant: Tenant, tiny: BaseModel
) -> None:
    file = file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="t.jsonl", data=VALID_JSONL),
    )
    tenant_quotas_set(tenant=tenant, changes={"queued_jobs": QUOTA})
    start = threading.Barrier(THREADS)
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            start.wait()
            finetune_job_create(tenant=tenant, model="tiny", training_file=file.id)
            outcomes.append("created")
        except QuotaExceededError:
            outcomes.append("refused")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    assert run_threads(create, THREADS)
    assert errors == []
    assert sorted(outcomes) == ["created"] * QUOTA + ["refused"] * (THREADS - QUOTA)
    assert FinetuneJob.objects.filter(tenant=tenant).count() == QUOTA
    # Nothing half-written by a refusal: every event belongs to one of the created jobs.
    assert set(JobEvent.objects.values_list("job_id", flat=True)) <= set(
        FinetuneJob.objects.values_list("pk", flat=True)
    )


@pytest.mark.django_db(transaction=True)
def test_concurrent_uploads_never_pass_stored_bytes(tenant: Tenant, storage_dir: Any) -> None:
    tenant_quotas_set(tenant=tenant, changes={"stored_bytes": len(VALID_JSONL) * QUOTA})
    start = threading.Barrier(THREADS)
    refused: list[int] = []
    errors: list[BaseException] = []

    def upload() -> None:
        try:
            start.wait()
            file_create(
                tenant=tenant,
                purpose="fine-tune",
                upload=UploadSource.from_bytes(filename="t.jsonl", data=VALID_JSONL),
            )
        except QuotaExceededError:
            refused.append(1)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    run_threads(upload, THREADS)
    assert errors == []
    assert File.objects.filter(tenant=tenant).count() == QUOTA
    assert len(refused) == THREADS - QUOTA
    # The refused uploads' bytes were removed: only the kept files are in storage.
    on_disk = {str(p.relative_to(storage_dir)) for p in storage_dir.rglob("*") if p.is_file()}
    assert on_disk == set(File.objects.values_list("storage_key", flat=True))


def test_the_schema_documents_the_limits_route_and_the_quotas_patch() -> None:
    schema = Client().get("/api/schema/?format=json").json()
    paths = schema["paths"]
    assert "200" in paths["/v1/organization/limits"]["get"]["responses"]
    patch = schema["components"]["schemas"]["PatchedTenantLimitsRequest"]["properties"]
    assert "quotas" in patch
    assert "429" in paths["/v1/fine_tuning/jobs"]["post"]["responses"]
    assert "413" in paths["/v1/files"]["post"]["responses"]
