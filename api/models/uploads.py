"""Large files in parts (OpenAI's Uploads API): an `Upload` collects `UploadPart`s, then becomes
one `File` on completion.

An upload is `pending` until it is completed, cancelled or reaches `expires_at`; only a pending
upload takes parts. Each part's bytes live in `api.storage` under its `storage_key` until the
upload leaves `pending`, when the parts' rows go and their bytes are deleted after commit.
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from api.models.finetune import File, FilePurpose
from api.models.ids import PUBLIC_ID_MAX_LENGTH, new_upload_id, new_upload_part_id
from api.models.tenancy import Tenant


class UploadStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    COMPLETED = "completed", "Completed"
    CANCELLED = "cancelled", "Cancelled"
    EXPIRED = "expired", "Expired"


class Upload(models.Model):
    """A file being uploaded in parts. `bytes` is the size the tenant declared up front; the
    parts named on completion must add up to it. `file` is set when the upload completes."""

    id = models.CharField(primary_key=True, max_length=PUBLIC_ID_MAX_LENGTH, default=new_upload_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="uploads")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=32, choices=FilePurpose.choices)
    bytes = models.BigIntegerField()
    status = models.CharField(
        max_length=16, choices=UploadStatus.choices, default=UploadStatus.PENDING
    )
    file = models.OneToOneField(
        File, null=True, blank=True, on_delete=models.SET_NULL, related_name="upload"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["status", "expires_at"])]

    def __str__(self) -> str:
        return self.id


class UploadPart(models.Model):
    """One chunk of an upload's bytes, stored under `storage_key`; `bytes` is its size."""

    id = models.CharField(
        primary_key=True, max_length=PUBLIC_ID_MAX_LENGTH, default=new_upload_part_id
    )
    upload = models.ForeignKey(Upload, on_delete=models.CASCADE, related_name="parts")
    bytes = models.BigIntegerField()
    storage_key = models.CharField(max_length=255, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return self.id
