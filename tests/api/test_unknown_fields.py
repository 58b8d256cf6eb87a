"""A body field a route does not take is refused (400 naming it, `unknown_parameter`) on every
body route of both APIs, before anything is written; the schema says so
(`additionalProperties: false`)."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from api.models import (
    ApiKey,
    BaseModel,
    Deployment,
    File,
    FinetuneJob,
    GpuHost,
    Tenant,
    Upload,
    UploadPart,
)
from tests.api.conftest import VALID_JSONL, ApiClient, assert_error

pytestmark = pytest.mark.django_db


def counts() -> tuple[int, ...]:
    models = (ApiKey, BaseModel, Deployment, File, FinetuneJob, GpuHost, Tenant, Upload, UploadPart)
    return tuple(model.objects.count() for model in models)


def assert_refused(response: Any, before: tuple[int, ...]) -> None:
    error = assert_error(response, 400, param="bogus")
    assert error["code"] == "unknown_parameter"
    assert "'bogus'" in error["message"]
    assert counts() == before


def test_job_create(api: ApiClient, tiny: Any, training_file: File) -> None:
    before = counts()
    body = {"model": "tiny", "training_file": training_file.id, "bogus": 1}
    assert_refused(api.post("/v1/fine_tuning/jobs", body), before)


UPLOAD = {"filename": "t.jsonl", "purpose": "fine-tune", "bytes": 10, "mime_type": "text/jsonl"}


def test_upload_create(api: ApiClient) -> None:
    before = counts()
    assert_refused(api.post("/v1/uploads", {**UPLOAD, "bogus": "x"}), before)


def test_upload_complete_and_part(api: ApiClient) -> None:
    upload = api.post("/v1/uploads", UPLOAD).json()
    before = counts()
    complete = f"/v1/uploads/{upload['id']}/complete"
    assert_refused(api.post(complete, {"part_ids": [], "bogus": True}), before)
    part = api.client.post(
        f"/v1/uploads/{upload['id']}/parts",
        {"data": SimpleUploadedFile("p", b"0123456789"), "bogus": "x"},
        headers=api.headers,
    )
    assert_refused(part, before)
    assert Upload.objects.get().status == "pending"


def test_file_create(api: ApiClient) -> None:
    before = counts()
    response = api.client.post(
        "/v1/files",
        {"file": SimpleUploadedFile("t.jsonl", VALID_JSONL), "purpose": "fine-tune", "bogus": "x"},
        headers=api.headers,
    )
    assert_refused(response, before)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/api/ops/tenants", {"name": "initech"}),
        ("patch", "/api/ops/tenants/acme", {"requests_per_minute": 5}),
        ("post", "/api/ops/apikeys", {"tenant": "acme"}),
        ("post", "/api/ops/basemodels", {"name": "small", "preset": "tiny"}),
        (
            "post",
            "/api/ops/deployments",
            {"name": "d", "base_model": "tiny", "tpot_slo_ms": 1, "ttft_slo_ms": 1},
        ),  # fmt: skip
        ("post", "/api/ops/hosts", {"name": "h", "gpu_kind": "H200", "gpu_memory_bytes": 1}),
    ],
)
def test_operator_routes(
    ops: ApiClient, tenant: Tenant, tiny: Any, method: str, path: str, body: dict[str, Any]
) -> None:
    before = counts()
    assert_refused(ops.request(method, path, {**body, "bogus": 1}), before)
    # The same body without the unknown field is taken.
    assert ops.request(method, path, body).status_code in {200, 201}


def test_the_schema_closes_every_request_body() -> None:
    document = Client().get("/api/schema/?format=json").json()
    components = document["components"]["schemas"]
    bodies = 0
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                name = media["schema"]["$ref"].rpartition("/")[2]
                assert components[name]["additionalProperties"] is False, (method, path)
                bodies += 1
    assert bodies >= 11
