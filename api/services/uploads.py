"""The Uploads API's writes: create an upload, add parts, complete it into a File, cancel it.

Rules:
- Only a `pending` upload takes parts or completes; an upload past `expires_at` is expired on
  first access (and by the periodic sweep, `upload_expire_due`), so it never takes a part late.
- A part's bytes are stored (streamed from the request's spooled upload) before its row is
  inserted; if the insert fails, or the upload left `pending` meanwhile, the bytes are removed.
- Completion streams the named parts, in the order given, into the final file's storage key
  while hashing them, checks the total against the declared size and the optional md5, runs the
  same content validation as `POST /v1/files`, then in one transaction inserts the File, marks
  the upload completed and drops its parts. Any failure removes the assembled bytes and leaves
  no File row; the upload stays pending (its parts kept) so the tenant may fix and retry.
- Leaving `pending` (completed, cancelled, expired) deletes the part rows now and every stored
  byte under the upload's part prefix after commit.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from api.errors import ConflictError, HarliError
from api.models import Tenant, Upload, UploadPart, UploadStatus
from api.models.ids import new_file_id, new_upload_part_id
from api.services.files import (
    UploadSource,
    clean_filename,
    file_purpose_check,
    file_row_create,
    file_storage_key,
    file_stored_check,
    storage_save_exactly,
)
from api.services.quotas import quota_stored_bytes_check
from api.storage import Storage, get_storage

# MIME types a JSONL training file may be declared as (the media type, parameters ignored).
JSONL_MIME_TYPES = frozenset(
    {
        "application/jsonl",
        "application/jsonlines",
        "application/x-jsonlines",
        "application/x-ndjson",
        "text/jsonl",
        "text/plain",
    }
)
_MD5_HEX = re.compile(r"^[0-9a-fA-F]{32}$")


def _parts_prefix(upload: Upload) -> str:
    return f"uploads/{upload.tenant_id}/{upload.pk}"


def upload_create(
    *,
    tenant: Tenant,
    filename: object,
    purpose: object,
    declared_bytes: object,
    mime_type: object,
    expires_after: object = None,
) -> Upload:
    """A pending upload of `declared_bytes` bytes, expiring `HARLI_UPLOAD_EXPIRES_S` from now."""
    file_purpose_check(purpose=purpose)
    if not isinstance(filename, str) or not filename.strip():
        raise HarliError("'filename' must be a non-empty string.", param="filename")
    if not isinstance(declared_bytes, int) or isinstance(declared_bytes, bool):
        raise HarliError("'bytes' must be an integer.", param="bytes")
    if declared_bytes < 1:
        raise HarliError("'bytes' must be at least 1.", param="bytes", code="empty_file")
    limit = int(settings.HARLI_UPLOAD_MAX_BYTES)
    if declared_bytes > limit:
        raise HarliError(
            f"An upload may hold at most {limit} bytes; {declared_bytes} were declared.",
            param="bytes",
            code="upload_too_large",
        )
    quota_stored_bytes_check(tenant=tenant, adding=declared_bytes, lock=False)
    media_type = mime_type.split(";", 1)[0].strip().lower() if isinstance(mime_type, str) else None
    if media_type not in JSONL_MIME_TYPES:
        raise HarliError(
            f"Unsupported mime_type {mime_type!r} for purpose 'fine-tune'; use one of "
            f"{', '.join(sorted(JSONL_MIME_TYPES))}.",
            param="mime_type",
            code="unsupported_mime_type",
        )
    if expires_after is not None:
        raise HarliError(
            "'expires_after' is not supported: files on this server are kept until deleted.",
            param="expires_after",
            code="unsupported_parameter",
        )
    now = timezone.now()
    with transaction.atomic():
        return Upload.objects.create(
            tenant=tenant,
            filename=clean_filename(filename),
            purpose=str(purpose),
            bytes=declared_bytes,
            created_at=now,
            expires_at=now + timedelta(seconds=int(settings.HARLI_UPLOAD_EXPIRES_S)),
        )


def _end(upload: Upload, status: UploadStatus) -> None:
    """Move a locked pending upload to `status`; drop its parts (bytes after commit)."""
    upload.status = status
    upload.save(update_fields=["status", "file"])
    upload.parts.all().delete()
    prefix = _parts_prefix(upload)

    def delete_part_bytes() -> None:
        storage = get_storage()
        for key in storage.list_keys(prefix):
            storage.delete(key)

    transaction.on_commit(delete_part_bytes)


def _expire(*, upload_id: str, now: datetime) -> bool:
    """Expire the upload if it is still pending and due; True when this call expired it."""
    with transaction.atomic():
        upload = (
            Upload.objects.select_for_update()
            .filter(pk=upload_id, status=UploadStatus.PENDING, expires_at__lte=now)
            .first()
        )
        if upload is None:
            return False
        _end(upload, UploadStatus.EXPIRED)
        return True


def upload_expire_due(*, now: datetime | None = None) -> list[str]:
    """Expire every pending upload past its `expires_at`; returns their ids. Idempotent."""
    now = now or timezone.now()
    due = Upload.objects.filter(status=UploadStatus.PENDING, expires_at__lte=now)
    return [
        upload_id
        for upload_id in due.values_list("pk", flat=True)
        if _expire(upload_id=upload_id, now=now)
    ]


def _current(upload: Upload) -> Upload:
    """The upload as stored now, expired first if it is due (committed before any refusal)."""
    _expire(upload_id=upload.pk, now=timezone.now())
    return Upload.objects.select_related("tenant").get(pk=upload.pk)


def _require_pending(upload: Upload, action: str) -> None:
    if upload.status == UploadStatus.PENDING:
        return
    if upload.status == UploadStatus.EXPIRED:
        reason = f"expired at {upload.expires_at.isoformat()}; create a new upload"
    else:
        reason = f"is {upload.status}"
    raise ConflictError(
        f"Cannot {action} upload {upload.pk}: it {reason}.",
        param="upload_id",
        code=f"upload_{upload.status}",
    )


def _lock_pending(upload: Upload, action: str) -> Upload:
    """Lock the upload's row (inside a transaction) and check it is still pending."""
    locked = Upload.objects.select_for_update().get(pk=upload.pk)
    _require_pending(locked, action)
    return locked


def upload_part_add(*, upload: Upload, data: UploadSource) -> UploadPart:
    """Store one part of a pending upload. Raises HarliError (4xx) on bad input."""
    upload = _current(upload)
    _require_pending(upload, "add a part to")
    if data.size == 0:
        raise HarliError("The part is empty.", param="data", code="empty_part")
    part_limit = int(settings.HARLI_UPLOAD_PART_MAX_BYTES)
    if data.size > part_limit:
        raise HarliError(
            f"The part has {data.size} bytes; a part may have at most {part_limit}.",
            param="data",
            code="part_too_large",
            http_status=413,
        )
    stored = upload.parts.aggregate(total=Sum("bytes"))["total"] or 0
    limit = int(settings.HARLI_UPLOAD_MAX_BYTES)
    if stored + data.size > limit:
        raise HarliError(
            f"Upload {upload.pk} holds {stored} bytes in parts; with this part of {data.size} "
            f"it would exceed the limit of {limit} bytes per upload.",
            param="data",
            code="upload_too_large",
        )
    part_id = new_upload_part_id()
    storage_key = f"{_parts_prefix(upload)}/{part_id}"
    storage = get_storage()
    try:
        written = storage_save_exactly(
            storage_key=storage_key, chunks=data.chunks(), size=data.size, what="part", param="data"
        )
        with transaction.atomic():
            locked = _lock_pending(upload, "add a part to")
            return UploadPart.objects.create(
                id=part_id, upload=locked, bytes=written, storage_key=storage_key
            )
    except BaseException:
        storage.delete(storage_key)
        raise


def _part_ids(part_ids: object) -> list[str]:
    if not isinstance(part_ids, list) or not part_ids:
        raise HarliError("'part_ids' must be a non-empty list of part ids.", param="part_ids")
    if not all(isinstance(part_id, str) for part_id in part_ids):
        raise HarliError("'part_ids' must contain only strings.", param="part_ids")
    repeated = sorted(p for p, n in Counter(part_ids).items() if n > 1)
    if repeated:
        raise HarliError(
            f"'part_ids' names {', '.join(repeated)} more than once.",
            param="part_ids",
            code="duplicate_part_id",
        )
    return list(part_ids)


def _hashed(chunks: Iterable[bytes], digest: hashlib._Hash) -> Iterator[bytes]:
    for chunk in chunks:
        digest.update(chunk)
        yield chunk


def _concatenated(storage: Storage, parts: list[UploadPart]) -> Iterator[bytes]:
    for part in parts:
        yield from storage.read_chunks(part.storage_key, chunk_size=1 << 20)


def upload_complete(*, upload: Upload, part_ids: object, md5: object = None) -> Upload:
    """Assemble the named parts, in order, into a validated File; answer the completed upload."""
    upload = _current(upload)
    _require_pending(upload, "complete")
    ordered_ids = _part_ids(part_ids)
    if md5 is not None and (not isinstance(md5, str) or not _MD5_HEX.match(md5)):
        raise HarliError("'md5' must be 32 hexadecimal digits.", param="md5")
    parts = {part.pk: part for part in upload.parts.filter(pk__in=ordered_ids)}
    unknown = [part_id for part_id in ordered_ids if part_id not in parts]
    if unknown:
        raise HarliError(
            f"Not parts of upload {upload.pk}: {', '.join(unknown)}.",
            param="part_ids",
            code="invalid_part_id",
        )
    ordered = [parts[part_id] for part_id in ordered_ids]
    total = sum(part.bytes for part in ordered)
    if total != upload.bytes:
        raise HarliError(
            f"The parts named in part_ids hold {total} bytes; upload {upload.pk} was created "
            f"with bytes={upload.bytes}.",
            param="part_ids",
            code="upload_size_mismatch",
        )

    file_id = new_file_id()
    storage_key = file_storage_key(tenant=upload.tenant, file_id=file_id)
    storage = get_storage()
    digest = hashlib.md5(usedforsecurity=False)
    try:
        try:
            written = storage.save(storage_key, _hashed(_concatenated(storage, ordered), digest))
        except FileNotFoundError:
            written = -1
        if written != total:
            raise ConflictError(
                f"The parts of upload {upload.pk} changed while it was completing; retry.",
                param="upload_id",
                code="upload_parts_changed",
            )
        if isinstance(md5, str) and digest.hexdigest() != md5.lower():
            raise HarliError(
                f"The assembled file's md5 is {digest.hexdigest()}, not {md5.lower()}.",
                param="md5",
                code="md5_mismatch",
            )
        report = file_stored_check(storage_key=storage_key)
        with transaction.atomic():
            locked = _lock_pending(upload, "complete")
            locked.file = file_row_create(
                tenant=upload.tenant,
                file_id=file_id,
                purpose=upload.purpose,
                filename=upload.filename,
                size=total,
                report=report,
                storage_key=storage_key,
            )
            _end(locked, UploadStatus.COMPLETED)
        return locked
    except BaseException:
        storage.delete(storage_key)
        raise


def upload_cancel(*, upload: Upload) -> Upload:
    """Cancel a pending upload; its parts are dropped."""
    upload = _current(upload)
    with transaction.atomic():
        locked = _lock_pending(upload, "cancel")
        _end(locked, UploadStatus.CANCELLED)
    return locked
