"""`/v1/files`: upload with validation, list, retrieve, content, delete; nothing half-written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import File
from tests.api.conftest import CHAT_LINE, VALID_JSONL, ApiClient, assert_error, jsonl

pytestmark = pytest.mark.django_db


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_upload_list_retrieve_content_delete(
    api: ApiClient, storage_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    response = api.upload(VALID_JSONL)
    assert response.status_code == 200, response.content
    created = response.json()
    assert created["object"] == "file"
    assert created["purpose"] == "fine-tune"
    assert created["bytes"] == len(VALID_JSONL)
    assert created["status"] == "processed"
    assert created["id"].startswith("file-")
    row = File.objects.get(pk=created["id"])
    assert row.line_count == 3 and row.format == "chat"

    listing = api.get("/v1/files").json()
    assert [f["id"] for f in listing["data"]] == [created["id"]]
    assert api.get(f"/v1/files/{created['id']}").json() == created
    content = api.get(f"/v1/files/{created['id']}/content")
    assert content.status_code == 200
    assert b"".join(content.streaming_content) == VALID_JSONL

    with django_capture_on_commit_callbacks(execute=True):
        deleted = api.delete(f"/v1/files/{created['id']}")
    assert deleted.json() == {"id": created["id"], "object": "file", "deleted": True}
    assert not File.objects.exists()
    assert stored_files(storage_dir) == []
    assert_error(api.get(f"/v1/files/{created['id']}"), 404)


def test_prompt_completion_format_is_accepted(api: ApiClient) -> None:
    data = jsonl({"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"})
    response = api.upload(data)
    assert response.status_code == 200, response.content
    assert File.objects.get().format == "prompt_completion"


def test_malformed_lines_are_reported_with_numbers(api: ApiClient, storage_dir: Path) -> None:
    data = (
        jsonl(CHAT_LINE)
        + b"{not json\n"
        + jsonl({"messages": [{"role": "user", "content": "hi"}]})
        + jsonl({"messages": [{"role": "robot", "content": "x"}]})
        + jsonl(CHAT_LINE)
    )
    error = assert_error(api.upload(data), 400, param="file")
    assert error["code"] == "invalid_file_format"
    assert "line 2: not valid JSON" in error["message"]
    assert "line 3: a chat example needs at least one assistant message" in error["message"]
    assert "line 4: messages[0].role must be one of" in error["message"]
    assert "line 1" not in error["message"] and "line 5" not in error["message"]
    assert not File.objects.exists()
    assert stored_files(storage_dir) == []


def test_mixed_formats_are_rejected(api: ApiClient) -> None:
    data = jsonl(CHAT_LINE, {"prompt": "a", "completion": "b"})
    error = assert_error(api.upload(data), 400, param="file")
    assert "line 2: format prompt_completion differs" in error["message"]


@pytest.mark.parametrize(
    ("data", "code"),
    [(b"", "empty_file"), (b"\n\n", "invalid_file_format")],
    ids=["zero-bytes", "only-blank-lines"],
)
def test_empty_files_are_rejected(api: ApiClient, data: bytes, code: str) -> None:
    assert assert_error(api.upload(data), 400, param="file")["code"] == code
    assert not File.objects.exists()


def test_oversize_file_is_rejected(
    api: ApiClient, settings: SettingsWrapper, storage_dir: Path
) -> None:
    settings.HARLI_MAX_UPLOAD_BYTES = len(VALID_JSONL) - 1
    error = assert_error(api.upload(VALID_JSONL), 413, param="file")
    assert error["code"] == "file_too_large"
    assert str(len(VALID_JSONL)) in error["message"]
    assert not File.objects.exists()
    assert stored_files(storage_dir) == []


def test_wrong_purpose_and_missing_parts(api: ApiClient) -> None:
    assert_error(api.upload(VALID_JSONL, purpose="assistants"), 400, param="purpose")
    response = api.client.post("/v1/files", {"purpose": "fine-tune"}, headers=api.headers)
    assert_error(response, 400, param="file")


def test_storage_failure_leaves_no_row(
    api: ApiClient, settings: SettingsWrapper, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the storage directory should be")
    settings.HARLI_STORAGE_DIR = blocker
    with pytest.raises(OSError):
        api.upload(VALID_JSONL)
    assert not File.objects.exists()


def test_file_in_use_by_unfinished_job_cannot_be_deleted(
    api: ApiClient, training_file: File, tiny: object
) -> None:
    job = api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": training_file.id})
    assert job.status_code == 200, job.content
    assert assert_error(api.delete(f"/v1/files/{training_file.id}"), 409)["code"] == "file_in_use"
    api.post(f"/v1/fine_tuning/jobs/{job.json()['id']}/cancel")
    assert api.delete(f"/v1/files/{training_file.id}").status_code == 200
    # The finished job still names its (now deleted) training file.
    assert api.get(f"/v1/fine_tuning/jobs/{job.json()['id']}").json()["training_file"] == (
        training_file.id
    )
