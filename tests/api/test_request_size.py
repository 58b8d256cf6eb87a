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
from api.models import File, UploadPart
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
