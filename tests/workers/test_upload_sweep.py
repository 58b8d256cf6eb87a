"""The beat sweep of expired uploads: thin, idempotent, and it frees the parts' bytes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from api.models import Tenant, Upload, UploadPart, UploadStatus
from api.services.files import UploadSource
from api.services.uploads import upload_cancel, upload_create, upload_part_add
from config.celery import app
from workers.tasks import expire_uploads

pytestmark = pytest.mark.django_db


def new_upload(tenant: Tenant, *, parts: int) -> Upload:
    upload = upload_create(
        tenant=tenant,
        filename="t.jsonl",
        purpose="fine-tune",
        declared_bytes=100,
        mime_type="text/jsonl",
    )
    for _ in range(parts):
        upload_part_add(upload=upload, data=UploadSource.from_bytes(filename="b", data=b"x" * 10))
    return upload


def stored(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_sweep_expires_only_due_pending_uploads(
    tenant: Tenant, storage_dir: Path, django_capture_on_commit_callbacks: Any
) -> None:
    due, fresh, cancelled_due = (new_upload(tenant, parts=2) for _ in range(3))
    with django_capture_on_commit_callbacks(execute=True):
        upload_cancel(upload=cancelled_due)
    past = timezone.now() - timedelta(seconds=1)
    Upload.objects.filter(pk__in=[due.pk, cancelled_due.pk]).update(expires_at=past)
    assert len(stored(storage_dir)) == 4

    with django_capture_on_commit_callbacks(execute=True):
        assert expire_uploads() == [due.pk]  # the task, run in-process
    statuses = dict(Upload.objects.values_list("pk", "status"))
    assert statuses == {
        due.pk: UploadStatus.EXPIRED,
        fresh.pk: UploadStatus.PENDING,
        cancelled_due.pk: UploadStatus.CANCELLED,
    }
    assert set(UploadPart.objects.values_list("upload_id", flat=True)) == {fresh.pk}
    assert len(stored(storage_dir)) == 2
    with django_capture_on_commit_callbacks(execute=True):
        assert expire_uploads() == []  # idempotent


def test_beat_runs_the_sweep() -> None:
    entry = app.conf.beat_schedule["expire-uploads"]
    assert entry["task"] == expire_uploads.name == "workers.expire_uploads"
    assert expire_uploads.acks_late and expire_uploads.max_retries
