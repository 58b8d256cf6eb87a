"""The official `openai` client's Uploads API, unchanged, against a live server."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import openai
import pytest
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import File, UploadPart
from api.services.apikeys import api_key_issue_for_tenant
from api.services.fleet import base_model_register
from api.services.tenants import tenant_create
from tests.api.conftest import CHAT_LINE, jsonl


def line(n: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": f"What is {n} + {n}?"},
            {"role": "assistant", "content": str(2 * n)},
        ]
    }


@pytest.fixture
def client(live_server: Any) -> openai.OpenAI:
    base_model_register(name="tiny", preset="tiny")
    key = api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.django_db(transaction=True)
def test_upload_file_chunked_makes_a_file_a_job_can_train_on(
    client: openai.OpenAI, tmp_path: Path
) -> None:
    data = jsonl(*(line(n) for n in range(60)))
    path = tmp_path / "big.jsonl"
    path.write_bytes(data)
    upload = client.uploads.upload_file_chunked(
        file=path,
        mime_type="text/jsonl",
        purpose="fine-tune",
        part_size=1000,  # several parts, cut mid-line
        md5=hashlib.md5(data).hexdigest(),
    )
    assert len(data) > 3000
    assert upload.status == "completed" and upload.object == "upload"
    assert upload.bytes == len(data) and upload.filename == "big.jsonl"
    assert upload.expires_at == upload.created_at + 3600
    assert upload.file is not None and upload.file.status == "processed"
    assert client.files.content(upload.file.id).read() == data
    assert File.objects.get(pk=upload.file.id).line_count == 60
    assert not UploadPart.objects.exists()

    job = client.fine_tuning.jobs.create(model="tiny", training_file=upload.file.id)
    assert job.status == "queued" and job.training_file == upload.file.id

    in_memory = client.uploads.upload_file_chunked(
        file=jsonl(CHAT_LINE), filename="mem.jsonl", bytes=len(jsonl(CHAT_LINE)),
        mime_type="text/jsonl", purpose="fine-tune", part_size=40,
    )  # fmt: skip
    assert in_memory.file is not None and in_memory.file.filename == "mem.jsonl"


@pytest.mark.django_db(transaction=True)
def test_client_sees_openai_errors(client: openai.OpenAI, settings: SettingsWrapper) -> None:
    with pytest.raises(openai.BadRequestError) as bad_purpose:
        client.uploads.create(bytes=10, filename="t.jsonl", mime_type="text/jsonl", purpose="batch")
    assert bad_purpose.value.param == "purpose"

    upload = client.uploads.create(
        bytes=100, filename="t.jsonl", mime_type="text/jsonl", purpose="fine-tune"
    )
    assert upload.status == "pending" and upload.file is None
    part = client.uploads.parts.create(upload_id=upload.id, data=b"x" * 10)
    assert part.object == "upload.part" and part.upload_id == upload.id
    with pytest.raises(openai.BadRequestError) as short:
        client.uploads.complete(upload_id=upload.id, part_ids=[part.id])
    assert short.value.code == "upload_size_mismatch" and "100" in short.value.message

    settings.HARLI_UPLOAD_PART_MAX_BYTES = 20
    with pytest.raises(openai.APIStatusError) as too_big:
        client.uploads.parts.create(upload_id=upload.id, data=b"x" * 21)
    assert too_big.value.status_code == 413 and too_big.value.code == "part_too_large"

    assert client.uploads.cancel(upload.id).status == "cancelled"
    with pytest.raises(openai.ConflictError):
        client.uploads.cancel(upload.id)
    with pytest.raises(openai.NotFoundError):
        client.uploads.parts.create(upload_id="upload_missing", data=b"x")
    assert not File.objects.exists()
