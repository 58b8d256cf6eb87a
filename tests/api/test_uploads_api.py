"""`/v1/uploads`: create, parts, complete (assembled in order, validated once, into a File),
cancel, expiry; every refusal leaves no File row and no stray bytes."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import File, Upload, UploadPart, UploadStatus
from tests.api.conftest import CHAT_LINE, VALID_JSONL, ApiClient, assert_error, jsonl

pytestmark = pytest.mark.django_db

UPLOAD_KEYS = {
    "id",
    "object",
    "bytes",
    "created_at",
    "expires_at",
    "filename",
    "purpose",
    "status",
    "file",
}


def stored_files(root: Path) -> list[str]:
    if not root.exists():
        return []
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def create_upload(api: ApiClient, size: int, **extra: Any) -> dict[str, Any]:
    body = {"filename": "train.jsonl", "purpose": "fine-tune", "bytes": size}
    body.update({"mime_type": "text/jsonl", **extra})
    response = api.post("/v1/uploads", body)
    assert response.status_code == 200, response.content
    return dict(response.json())


def add_part(api: ApiClient, upload_id: str, data: bytes) -> Any:
    return api.client.post(
        f"/v1/uploads/{upload_id}/parts",
        {"data": SimpleUploadedFile("blob", data)},
        headers=api.headers,
    )


def part_id(api: ApiClient, upload_id: str, data: bytes) -> str:
    response = add_part(api, upload_id, data)
    assert response.status_code == 200, response.content
    return str(response.json()["id"])


def split(data: bytes, *cuts: int) -> list[bytes]:
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def test_parts_completed_in_order_become_a_validated_file(
    api: ApiClient, storage_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    upload = create_upload(api, len(VALID_JSONL), filename="dir/big.jsonl")
    assert set(upload) == UPLOAD_KEYS
    assert upload["object"] == "upload" and upload["id"].startswith("upload_")
    assert upload["status"] == "pending" and upload["file"] is None
    assert upload["filename"] == "big.jsonl" and upload["bytes"] == len(VALID_JSONL)
    assert upload["expires_at"] == upload["created_at"] + 3600

    first, second, third = split(VALID_JSONL, 7, 60)  # cuts fall inside lines
    # Sent out of order; the order of part_ids is the file's order.
    third_id = part_id(api, upload["id"], third)
    part = add_part(api, upload["id"], first).json()
    assert set(part) == {"id", "object", "created_at", "upload_id"}
    assert part["object"] == "upload.part" and part["id"].startswith("part_")
    assert part["upload_id"] == upload["id"]
    second_id = part_id(api, upload["id"], second)
    spare_id = part_id(api, upload["id"], b"not named on completion")
    assert len(stored_files(storage_dir)) == 4

    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(
            f"/v1/uploads/{upload['id']}/complete",
            {
                "part_ids": [part["id"], second_id, third_id],
                "md5": hashlib.md5(VALID_JSONL).hexdigest(),
            },
        )
    assert response.status_code == 200, response.content
    completed = response.json()
    assert completed["status"] == "completed" and completed["id"] == upload["id"]
    nested = completed["file"]
    assert nested == api.get(f"/v1/files/{nested['id']}").json()
    assert nested["bytes"] == len(VALID_JSONL) and nested["status"] == "processed"
    assert nested["filename"] == "big.jsonl" and nested["purpose"] == "fine-tune"
    row = File.objects.get(pk=nested["id"])
    assert (row.line_count, row.format) == (3, "chat")
    content = api.get(f"/v1/files/{nested['id']}/content")
    assert b"".join(content.streaming_content) == VALID_JSONL
    # Every part's bytes are gone (the unnamed spare too); only the file is stored.
    assert not UploadPart.objects.exists()
    assert stored_files(storage_dir) == [row.storage_key]
    assert spare_id not in str(stored_files(storage_dir))

    for action, body in [("parts", None), ("complete", {"part_ids": [second_id]}), ("cancel", {})]:
        if action == "parts":
            refused = add_part(api, upload["id"], b"x")
        else:
            refused = api.post(f"/v1/uploads/{upload['id']}/{action}", body)
        assert assert_error(refused, 409, param="upload_id")["code"] == "upload_completed"
    assert File.objects.count() == 1


def test_completed_upload_file_trains_a_job(api: ApiClient, tiny: object) -> None:
    data = jsonl(*[CHAT_LINE] * 20)
    upload = create_upload(api, len(data))
    ids = [part_id(api, upload["id"], chunk) for chunk in split(data, 100, 900, 1500)]
    file = api.post(f"/v1/uploads/{upload['id']}/complete", {"part_ids": ids}).json()["file"]
    job = api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": file["id"]})
    assert job.status_code == 200, job.content
    assert job.json()["training_file"] == file["id"] and job.json()["status"] == "queued"


def test_failed_completions_leave_no_file_and_keep_the_upload_pending(
    api: ApiClient, storage_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    line = jsonl(CHAT_LINE)
    not_json = b"{" * (len(line) - 1) + b"\n"  # a bad line exactly as long as a good one
    upload = create_upload(api, 3 * len(line))
    first, bad, last = (part_id(api, upload["id"], data) for data in (line, not_json, line))
    other = create_upload(api, len(line))
    foreign = part_id(api, other["id"], line)
    url = f"/v1/uploads/{upload['id']}/complete"
    parts_stored = stored_files(storage_dir)

    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"part_ids": [first, last]}, "part_ids", "upload_size_mismatch"),
        ({"part_ids": [first, bad, bad]}, "part_ids", "duplicate_part_id"),
        ({"part_ids": [first, bad, "part_missing"]}, "part_ids", "invalid_part_id"),
        ({"part_ids": [first, bad, foreign]}, "part_ids", "invalid_part_id"),
        ({"part_ids": []}, "part_ids", None),
        ({"part_ids": "part_x"}, "part_ids", None),
        ({"part_ids": [first, 3]}, "part_ids", None),
        ({}, "part_ids", None),
        ({"part_ids": [first, bad, last], "md5": "0" * 32}, "md5", "md5_mismatch"),
        ({"part_ids": [first, bad, last], "md5": "not-hex"}, "md5", None),
        ({"part_ids": [first, bad, last]}, "file", "invalid_file_format"),
    ]
    for body, param, code in cases:
        error = assert_error(api.post(url, body), 400, param=param)
        if code is not None:
            assert error["code"] == code, (body, error)
    assert error["message"].count("line ") == 1 and "line 2: not valid JSON" in error["message"]
    assert "storage" not in error["message"] and "files/" not in error["message"]
    assert not File.objects.exists()
    assert Upload.objects.get(pk=upload["id"]).status == UploadStatus.PENDING
    assert stored_files(storage_dir) == parts_stored  # no assembled file left behind

    # The same upload completes once a good part replaces the bad one.
    replacement = part_id(api, upload["id"], line)
    with django_capture_on_commit_callbacks(execute=True):
        done = api.post(url, {"part_ids": [first, replacement, last]})
    assert done.status_code == 200, done.content
    assert File.objects.get().line_count == 3
    # The other upload's part is untouched; this upload's parts (the bad one too) are gone.
    assert [p.pk for p in UploadPart.objects.all()] == [foreign]
    assert len(stored_files(storage_dir)) == 2


def test_cancel_drops_parts_and_refuses_further_use(
    api: ApiClient, storage_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    upload = create_upload(api, len(VALID_JSONL))
    ids = [part_id(api, upload["id"], chunk) for chunk in split(VALID_JSONL, 50)]
    with django_capture_on_commit_callbacks(execute=True):
        cancelled = api.post(f"/v1/uploads/{upload['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled" and cancelled.json()["file"] is None
    assert not UploadPart.objects.exists() and stored_files(storage_dir) == []
    assert assert_error(add_part(api, upload["id"], b"x"), 409)["code"] == "upload_cancelled"
    completing = api.post(f"/v1/uploads/{upload['id']}/complete", {"part_ids": ids})
    assert assert_error(completing, 409)["code"] == "upload_cancelled"
    assert assert_error(api.post(f"/v1/uploads/{upload['id']}/cancel"), 409)
    assert not File.objects.exists()


def test_an_expired_upload_is_expired_on_access(
    api: ApiClient, storage_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    upload = create_upload(api, len(VALID_JSONL))
    ids = [part_id(api, upload["id"], VALID_JSONL)]
    Upload.objects.filter(pk=upload["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        response = api.post(f"/v1/uploads/{upload['id']}/complete", {"part_ids": ids})
    error = assert_error(response, 409, param="upload_id")
    assert error["code"] == "upload_expired" and "create a new upload" in error["message"]
    # The expiry was committed although the request was refused.
    assert Upload.objects.get(pk=upload["id"]).status == UploadStatus.EXPIRED
    assert not UploadPart.objects.exists() and stored_files(storage_dir) == []
    assert assert_error(add_part(api, upload["id"], b"x"), 409)["code"] == "upload_expired"
    assert not File.objects.exists()


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({"filename": None}, "filename", None),
        ({"filename": 7}, "filename", None),
        ({"purpose": "assistants"}, "purpose", "invalid_purpose"),
        ({"bytes": "12"}, "bytes", None),
        ({"bytes": True}, "bytes", None),
        ({"bytes": 0}, "bytes", None),
        ({"bytes": 1001}, "bytes", "upload_too_large"),
        ({"mime_type": "application/pdf"}, "mime_type", "unsupported_mime_type"),
        ({"mime_type": None}, "mime_type", None),
        ({"expires_after": {"anchor": "created_at", "seconds": 3600}}, "expires_after", None),
    ],
)
def test_create_refuses_bad_fields(
    api: ApiClient,
    settings: SettingsWrapper,
    change: dict[str, Any],
    param: str,
    code: str | None,
) -> None:
    settings.HARLI_UPLOAD_MAX_BYTES = 1000
    body = {"filename": "t.jsonl", "purpose": "fine-tune", "bytes": 10, "mime_type": "text/jsonl"}
    body.update(change)
    error = assert_error(api.post("/v1/uploads", {**body}), 400, param=param)
    if code is not None:
        assert error["code"] == code
    assert not Upload.objects.exists()


def test_mime_type_parameters_are_ignored(api: ApiClient) -> None:
    assert create_upload(api, 5, mime_type="Text/JSONL; charset=utf-8")["status"] == "pending"


def test_part_limits(api: ApiClient, settings: SettingsWrapper, storage_dir: Path) -> None:
    settings.HARLI_UPLOAD_PART_MAX_BYTES = 8
    settings.HARLI_UPLOAD_MAX_BYTES = 20
    upload = create_upload(api, 20)
    too_big = assert_error(add_part(api, upload["id"], b"123456789"), 413, param="data")
    assert too_big["code"] == "part_too_large" and "at most 8" in too_big["message"]
    assert assert_error(add_part(api, upload["id"], b""), 400, param="data")["code"] == (
        "empty_part"
    )
    missing = api.client.post(f"/v1/uploads/{upload['id']}/parts", {}, headers=api.headers)
    assert_error(missing, 400, param="data")
    part_id(api, upload["id"], b"12345678")
    part_id(api, upload["id"], b"12345678")
    over = assert_error(add_part(api, upload["id"], b"12345"), 400, param="data")
    assert over["code"] == "upload_too_large"
    assert UploadPart.objects.count() == 2 and len(stored_files(storage_dir)) == 2
    assert_error(add_part(api, "upload_missing", b"1"), 404, param="upload_id")
