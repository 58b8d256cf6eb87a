"""`Idempotency-Key` on the tenant API's writes (`api.idempotency`): a retry is done once."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.test import Client
from django.utils import timezone

from api.idempotency import Claim, IdempotencyClaimLost, idempotency_complete
from api.models import BaseModel, File, FinetuneJob, IdempotencyKey, JobEvent, Tenant
from tests.api.conftest import VALID_JSONL, ApiClient, assert_error
from tests.threads import run_threads

THREADS = 6


def job_body(training_file: File, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "training_file": training_file.id, **extra}


def keyed(key: str) -> dict[str, Any]:
    return {"HTTP_IDEMPOTENCY_KEY": key}


def multipart(data: bytes, boundary: str) -> bytes:
    return (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="train.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )


def upload_with_boundary(api: ApiClient, key: str, boundary: str) -> Any:
    return api.client.post(
        "/v1/files",
        multipart(VALID_JSONL, boundary),
        content_type=f"multipart/form-data; boundary={boundary}",
        headers={**api.headers, "Idempotency-Key": key},
    )


def test_a_retried_job_create_is_done_once_and_answers_the_same_body(
    api: ApiClient, tiny: BaseModel, training_file: File
) -> None:
    first = api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("job-1"))
    assert first.status_code == 200, first.content
    assert "Idempotent-Replayed" not in first.headers
    again = api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("job-1"))
    assert again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert FinetuneJob.objects.count() == 1
    # The same body under a new key is a new job; without a key, as before, too.
    assert (
        api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("job-2")).json()["id"]
        != first.json()["id"]
    )
    assert FinetuneJob.objects.count() == 2


def test_a_retried_upload_with_a_new_multipart_boundary_is_the_same_request(
    api: ApiClient,
) -> None:
    first = upload_with_boundary(api, "file-1", "boundaryAAAA")
    assert first.status_code == 200, first.content
    again = upload_with_boundary(api, "file-1", "boundaryBBBB")
    assert again.status_code == 200, again.content
    assert again.json() == first.json()
    assert File.objects.count() == 1


def test_the_same_key_for_another_request_is_refused(
    api: ApiClient, tiny: BaseModel, training_file: File
) -> None:
    assert (
        api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("k")).status_code == 200
    )
    other_body = job_body(training_file, suffix="other")
    error = assert_error(
        api.post("/v1/fine_tuning/jobs", other_body, **keyed("k")), 422, param="Idempotency-Key"
    )
    assert error["code"] == "idempotency_key_reused"
    job_id = FinetuneJob.objects.get().id
    error = assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", **keyed("k")), 422)
    assert error["code"] == "idempotency_key_reused"
    assert FinetuneJob.objects.count() == 1
    assert FinetuneJob.objects.get().status == "queued"


def test_another_tenants_same_key_is_independent(
    api: ApiClient, other_key: str, other_tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    first = api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("shared"))
    assert first.status_code == 200
    other = ApiClient(other_key)
    # The other tenant cannot see the first tenant's file: its request is its own (a 400),
    # not a replay of the first tenant's response, and not a 422 either.
    error = assert_error(
        other.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("shared")), 400
    )
    assert error["param"] == "training_file"
    uploaded = other.client.post(
        "/v1/files",
        multipart(VALID_JSONL, "b1"),
        content_type="multipart/form-data; boundary=b1",
        headers={**other.headers, "Idempotency-Key": "shared"},
    )
    assert uploaded.status_code == 200, uploaded.content
    assert File.objects.filter(tenant=other_tenant).count() == 1


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "naïve", "a\tb"])
def test_a_malformed_key_is_refused_before_any_work(
    api: ApiClient, tiny: BaseModel, training_file: File, key: str
) -> None:
    error = assert_error(
        api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed(key)), 400
    )
    assert error["code"] == "invalid_idempotency_key"
    assert FinetuneJob.objects.count() == 0
    assert IdempotencyKey.objects.count() == 0


def test_a_refused_request_frees_its_key(
    api: ApiClient, tiny: BaseModel, training_file: File
) -> None:
    bad = api.post("/v1/fine_tuning/jobs", job_body(training_file, seed="x"), **keyed("fix-me"))
    assert_error(bad, 400, param="seed")
    assert IdempotencyKey.objects.count() == 0
    fixed = api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("fix-me"))
    assert fixed.status_code == 200
    assert FinetuneJob.objects.count() == 1


def test_a_replayed_cancel_answers_its_first_response(
    api: ApiClient, tiny: BaseModel, training_file: File
) -> None:
    job_id = api.post("/v1/fine_tuning/jobs", job_body(training_file)).json()["id"]
    first = api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", **keyed("cancel-1"))
    assert first.status_code == 200 and first.json()["status"] == "cancelled"
    again = api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel", **keyed("cancel-1"))
    assert again.status_code == 200 and again.json() == first.json()
    assert JobEvent.objects.filter(job_id=job_id, message="Job cancelled").count() == 1
    # Without the key, cancelling a cancelled job is the usual conflict.
    assert_error(api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel"), 409)


def test_a_key_in_flight_is_409_and_a_dead_claim_is_taken_over(
    api: ApiClient, tenant: Tenant, tiny: BaseModel, training_file: File, settings: Any
) -> None:
    body = job_body(training_file)
    first = api.post("/v1/fine_tuning/jobs", body, **keyed("held"))
    fingerprint = IdempotencyKey.objects.get(key="held").fingerprint
    now = timezone.now()
    # A request with this key is in flight (claimed just now, no response yet).
    IdempotencyKey.objects.create(
        tenant=tenant, key="busy", method="POST", path="/v1/fine_tuning/jobs",
        fingerprint=fingerprint, claim="someone", claimed_at=now, created_at=now,
        expires_at=now + timedelta(hours=1),
    )  # fmt: skip
    error = assert_error(api.post("/v1/fine_tuning/jobs", body, **keyed("busy")), 409)
    assert error["code"] == "idempotency_key_in_use"
    assert FinetuneJob.objects.count() == 1
    # Its web process died: after HARLI_IDEMPOTENCY_LOCK_S a retry does the work.
    IdempotencyKey.objects.filter(key="busy").update(
        claimed_at=now - timedelta(seconds=settings.HARLI_IDEMPOTENCY_LOCK_S + 1)
    )
    taken = api.post("/v1/fine_tuning/jobs", body, **keyed("busy"))
    assert taken.status_code == 200
    assert taken.json()["id"] != first.json()["id"]
    assert FinetuneJob.objects.count() == 2
    # The dead request, had it still run, cannot store its response (and so rolls back).
    row = IdempotencyKey.objects.get(key="busy")
    with pytest.raises(IdempotencyClaimLost):
        idempotency_complete(claim=Claim(pk=row.pk, token="someone"), status=200, body={})


def test_an_expired_key_is_claimed_afresh(
    api: ApiClient, tiny: BaseModel, training_file: File
) -> None:
    first = api.post("/v1/fine_tuning/jobs", job_body(training_file), **keyed("old"))
    IdempotencyKey.objects.filter(key="old").update(expires_at=timezone.now())
    again = api.post("/v1/fine_tuning/jobs", job_body(training_file, suffix="x"), **keyed("old"))
    assert again.status_code == 200
    assert again.json()["id"] != first.json()["id"]


def _race(path: str, key: str, make_request: Any) -> list[Any]:
    """THREADS clients send the same keyed request at once, each on its own connection."""
    responses: list[Any] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def client() -> None:
        try:
            start.wait()
            response = make_request(Client())
            with lock:
                responses.append(response)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    assert run_threads(client, THREADS)
    assert errors == []
    return responses


def _check_race(responses: list[Any]) -> str:
    """Every answer is the one success (first or replayed) or 409 in use; returns the id."""
    ok = [r for r in responses if r.status_code == 200]
    assert ok, [r.content for r in responses]
    assert len({r.json()["id"] for r in ok}) == 1
    for response in responses:
        if response.status_code != 200:
            assert response.status_code == 409, response.content
            assert response.json()["error"]["code"] == "idempotency_key_in_use"
            assert response.headers["Retry-After"]
    return str(ok[0].json()["id"])


@pytest.mark.django_db(transaction=True)
def test_concurrent_job_creates_with_one_key_create_one_job(
    tenant_key: str, tiny: BaseModel, training_file: File
) -> None:
    import json

    body = json.dumps(job_body(training_file))

    def send(client: Client) -> Any:
        return client.post(
            "/v1/fine_tuning/jobs", body, content_type="application/json",
            headers={"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "race"},
        )  # fmt: skip

    job_id = _check_race(_race("/v1/fine_tuning/jobs", "race", send))
    assert list(FinetuneJob.objects.values_list("id", flat=True)) == [job_id]
    # Once it finished, every retry is a replay.
    assert send(Client()).json()["id"] == job_id


@pytest.mark.django_db(transaction=True)
def test_concurrent_uploads_with_one_key_create_one_file(
    tenant_key: str, tenant: Tenant, storage_dir: Any
) -> None:
    def send(client: Client) -> Any:
        boundary = f"b{threading.get_ident()}"
        return client.post(
            "/v1/files", multipart(VALID_JSONL, boundary),
            content_type=f"multipart/form-data; boundary={boundary}",
            headers={"Authorization": f"Bearer {tenant_key}", "Idempotency-Key": "race-file"},
        )  # fmt: skip

    file_id = _check_race(_race("/v1/files", "race-file", send))
    assert list(File.objects.filter(tenant=tenant).values_list("id", flat=True)) == [file_id]


def test_the_schema_documents_the_header_on_every_tenant_write() -> None:
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    writes = {
        path: operation
        for path, item in schema["paths"].items()
        if path.startswith("/v1/")
        for method, operation in item.items()
        if method == "post"
    }
    assert "/v1/files" in writes and "/v1/fine_tuning/jobs" in writes
    for path, operation in writes.items():
        headers = [p for p in operation.get("parameters", []) if p["in"] == "header"]
        assert [p["name"] for p in headers] == ["Idempotency-Key"], path
