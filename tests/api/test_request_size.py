"""Oversize uploads are refused from `Content-Length` alone, before the body is read."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlparse

import pytest
from pytest_django.fixtures import Settings as SettingsWrapper

from api.middleware import MULTIPART_OVERHEAD_BYTES
from api.models import File, FinetuneJob, Tenant, Upload, UploadPart
from api.services.apikeys import api_key_issue_for_tenant
from api.services.tenants import tenant_create
from tests.api.conftest import VALID_JSONL, ApiClient, assert_error


class UnreadableBody:
    """A `wsgi.input` that fails the test if anything reads it."""

    def read(self, *args: Any) -> bytes:
        raise AssertionError("the request body was read")

    readline = read


def post_declaring(api: ApiClient, path: str, content_length: int) -> Any:
    environ: dict[str, Any] = {
        "CONTENT_LENGTH": str(content_length),
        "wsgi.input": UnreadableBody(),
    }
    return api.client.post(
        path, content_type="multipart/form-data; boundary=xyz", headers=api.headers, **environ
    )


@pytest.mark.django_db
def test_oversize_file_is_refused_without_reading_the_body(
    api: ApiClient, settings: SettingsWrapper
) -> None:
    settings.HARLI_MAX_UPLOAD_BYTES = 1000
    response = post_declaring(api, "/v1/files", 1000 + MULTIPART_OVERHEAD_BYTES + 1)
    error = assert_error(response, 413, param="file")
    assert error["code"] == "file_too_large"
    assert "at most 1000 bytes" in error["message"] and "POST /v1/uploads" in error["message"]
    # Refused before authentication too: the check needs no body and reveals nothing.
    anonymous = ApiClient(None)
    assert post_declaring(anonymous, "/v1/files", 10**12).status_code == 413
    assert not File.objects.exists()
    # Within the limit the request goes on to the view (the service checks the exact size).
    assert api.upload(VALID_JSONL).status_code == 200


@pytest.mark.django_db
def test_oversize_part_is_refused_without_reading_the_body(
    api: ApiClient, settings: SettingsWrapper
) -> None:
    settings.HARLI_UPLOAD_PART_MAX_BYTES = 10
    created = api.post(
        "/v1/uploads",
        {"filename": "t.jsonl", "purpose": "fine-tune", "bytes": 50, "mime_type": "text/jsonl"},
    ).json()
    response = post_declaring(
        api, f"/v1/uploads/{created['id']}/parts", 10 + MULTIPART_OVERHEAD_BYTES + 1
    )
    error = assert_error(response, 413, param="data")
    assert error["code"] == "part_too_large" and "at most 10 bytes" in error["message"]
    assert not UploadPart.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_live_server_answers_413_before_the_body_arrives(live_server: Any) -> None:
    """A raw client declares 10 GB, sends 11 bytes, and gets the 413 without sending more."""
    key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    address = urlparse(live_server.url)
    head = (
        "POST /v1/files HTTP/1.1\r\n"
        f"Host: {address.netloc}\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: multipart/form-data; boundary=xyz\r\n"
        f"Content-Length: {10 * 1024**3}\r\n\r\n"
    )
    started = time.monotonic()
    with socket.create_connection((str(address.hostname), address.port or 80), timeout=10) as conn:
        conn.sendall(head.encode() + b"--xyz\r\nabc")
        received = b""
        while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
    elapsed = time.monotonic() - started
    status_line, _, rest = received.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), received
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "file_too_large"
    assert "Uploads API" in body["error"]["message"]
    assert elapsed < 5, f"the server waited {elapsed:.1f}s for a body it does not need"


def send_declaring(client: ApiClient, method: str, path: str, content_length: int) -> Any:
    environ: dict[str, Any] = {
        "CONTENT_LENGTH": str(content_length),
        "wsgi.input": UnreadableBody(),
    }
    call = getattr(client.client, method)
    return call(path, content_type="application/json", headers=client.headers, **environ)


BODY_ROUTES = [
    ("post", "/v1/fine_tuning/jobs"),
    ("post", "/v1/uploads"),
    ("post", "/v1/uploads/upload-abc/complete"),
    ("post", "/api/ops/tenants"),
    ("patch", "/api/ops/tenants/acme"),
    ("post", "/api/ops/apikeys"),
    ("post", "/api/ops/basemodels"),
    ("post", "/api/ops/deployments"),
    ("post", "/api/ops/hosts"),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
def test_oversize_json_body_is_refused_without_reading_it(
    api: ApiClient, ops: ApiClient, settings: SettingsWrapper, method: str, path: str
) -> None:
    """Every other body route: Django's DATA_UPLOAD_MAX_MEMORY_SIZE, applied from the headers
    with the uniform body (Django itself answers an HTML 400 once the body is read)."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    client = ops if path.startswith("/api/ops/") else api
    tenants = Tenant.objects.count()
    error = assert_error(send_declaring(client, method, path, 1001), 413)
    assert error["code"] == "request_too_large"
    assert "at most 1000 bytes" in error["message"]
    assert Tenant.objects.count() == tenants
    assert not FinetuneJob.objects.exists() and not Upload.objects.exists()


@pytest.mark.django_db
def test_json_body_within_the_limit_goes_on(ops: ApiClient, settings: SettingsWrapper) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    assert ops.post("/api/ops/tenants", {"name": "initech"}).status_code == 201


@pytest.mark.django_db
def test_form_fields_past_the_memory_limit_are_a_413(
    api: ApiClient, settings: SettingsWrapper
) -> None:
    """Within the upload route's limit but with more form data than Django holds in memory:
    the parser's refusal, in the uniform body."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = api.client.post(
        "/v1/files",
        {"file": SimpleUploadedFile("t.jsonl", VALID_JSONL), "purpose": "f" * 200},
        headers=api.headers,
    )
    assert assert_error(response, 413)["code"] == "request_too_large"
    assert not File.objects.exists()


@pytest.mark.django_db
def test_too_many_form_fields_are_a_400(api: ApiClient, settings: SettingsWrapper) -> None:
    settings.DATA_UPLOAD_MAX_NUMBER_FIELDS = 3
    from django.core.files.uploadedfile import SimpleUploadedFile

    fields: dict[str, Any] = {f"x{i}": "1" for i in range(5)}
    response = api.client.post(
        "/v1/files",
        {"file": SimpleUploadedFile("t.jsonl", VALID_JSONL), "purpose": "fine-tune", **fields},
        headers=api.headers,
    )
    assert assert_error(response, 400)["code"] == "too_many_fields"
    assert not File.objects.exists()
