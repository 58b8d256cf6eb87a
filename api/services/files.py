"""Training files: validated before any byte is stored, stored before the row commits.

Order in `file_create`: validate the upload (nothing written) -> store bytes under a fresh key ->
insert the row. If storing or the transaction fails, the stored bytes are removed, so neither a
row without bytes nor bytes without a row survive an error.

The Uploads API (`api.services.uploads`) assembles a file in storage first, then validates it
with `file_stored_check` (the same content check as `file_create`) and inserts its row with
`file_row_create`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from django.conf import settings
from django.core.files.uploadedfile import UploadedFile
from django.db import transaction
from django.db.models import Q

from api.errors import ConflictError, HarliError, NotFoundError
from api.models import File, FilePurpose, FileStatus, FinetuneJob, Tenant
from api.models.ids import new_file_id
from api.services.quotas import quota_stored_bytes_check
from api.storage import get_storage
from api.training_files import TrainingFileReport, check_training_lines
from api.transitions import TERMINAL_STATUSES

MAX_FILENAME_LENGTH = 255


class UploadSource:
    """What the service needs from an upload: its name, size and a way to read lines and chunks.

    Django's `UploadedFile` fits via `UploadSource.from_django`; tests and the CLI can pass bytes.
    """

    def __init__(
        self, *, filename: str, size: int, lines: Iterable[bytes], chunks: Iterable[bytes]
    ):
        self.filename = filename
        self.size = size
        self._lines = lines
        self._chunks = chunks

    @classmethod
    def from_bytes(cls, *, filename: str, data: bytes) -> UploadSource:
        return cls(filename=filename, size=len(data), lines=data.splitlines(), chunks=[data])

    @classmethod
    def from_django(cls, uploaded: UploadedFile) -> UploadSource:
        """Wrap an upload; each read starts from the beginning (Django's chunks() seeks to 0)."""

        def lines() -> Iterator[bytes]:
            yield from uploaded

        def chunks() -> Iterator[bytes]:
            yield from uploaded.chunks()

        return cls(
            filename=uploaded.name or "", size=uploaded.size or 0, lines=lines(), chunks=chunks()
        )

    def lines(self) -> Iterable[bytes]:
        return self._lines

    def chunks(self) -> Iterable[bytes]:
        return self._chunks


def clean_filename(name: str) -> str:
    """The base name, without path separators, quotes or control characters (it is echoed in
    a Content-Disposition header)."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = "".join("_" if ch in '"' or ord(ch) < 32 or ord(ch) == 127 else ch for ch in base)
    return cleaned.strip()[:MAX_FILENAME_LENGTH] or "upload.jsonl"


def file_purpose_check(*, purpose: object) -> None:
    """Raise HarliError unless `purpose` is one this server accepts."""
    if purpose != FilePurpose.FINE_TUNE:
        raise HarliError(
            f"Unsupported purpose {purpose!r}; this server accepts only 'fine-tune'.",
            param="purpose",
            code="invalid_purpose",
        )


def file_storage_key(*, tenant: Tenant, file_id: str) -> str:
    return f"files/{tenant.pk}/{file_id}.jsonl"


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a byte stream, each ending in its newline, as iterating a file yields them."""
    partial: list[bytes] = []  # the start of a line that spans chunks
    for chunk in chunks:
        *complete, rest = chunk.split(b"\n")
        for line in complete:
            partial.append(line)
            yield b"".join(partial) + b"\n"
            partial = []
        if rest:
            partial.append(rest)
    if partial:
        yield b"".join(partial)


def storage_save_exactly(
    *, storage_key: str, chunks: Iterable[bytes], size: int, what: str, param: str
) -> int:
    """Store `chunks` under `storage_key`; HarliError unless exactly `size` bytes (what the
    client declared for `what`) were written. The caller removes the bytes on any error."""
    written = get_storage().save(storage_key, chunks)
    if written != size:
        raise HarliError(
            f"Stored {written} bytes but the {what} declared {size}.",
            param=param,
            code="upload_size_mismatch",
        )
    return written


def file_stored_check(*, storage_key: str) -> TrainingFileReport:
    """Validate bytes already in storage as `file_create` validates an upload; raises the same
    TrainingFileError. Reads the bytes as a stream."""
    return check_training_lines(_split_lines(get_storage().read_chunks(storage_key)))


def file_row_create(
    *,
    tenant: Tenant,
    file_id: str,
    purpose: str,
    filename: str,
    size: int,
    report: TrainingFileReport,
    storage_key: str,
) -> File:
    """Insert the row of a validated file whose bytes are stored under `storage_key`."""
    with transaction.atomic():
        quota_stored_bytes_check(tenant=tenant, adding=size, lock=True)
        return File.objects.create(
            id=file_id,
            tenant=tenant,
            filename=filename,
            purpose=purpose,
            bytes=size,
            line_count=report.example_count,
            format=report.format or "",
            status=FileStatus.PROCESSED,
            storage_key=storage_key,
        )


def file_create(*, tenant: Tenant, purpose: str, upload: UploadSource) -> File:
    """Validate and store a training file for `tenant`. Raises HarliError (4xx) on bad input."""
    file_purpose_check(purpose=purpose)
    if upload.size == 0:
        raise HarliError("The uploaded file is empty.", param="file", code="empty_file")
    limit = int(settings.HARLI_MAX_UPLOAD_BYTES)
    if upload.size > limit:
        raise HarliError(
            f"The uploaded file has {upload.size} bytes; one request may carry at most "
            f"{limit}. Upload larger files in parts with the Uploads API (POST /v1/uploads).",
            param="file",
            code="file_too_large",
            http_status=413,
        )
    quota_stored_bytes_check(tenant=tenant, adding=upload.size, lock=False)
    filename = clean_filename(upload.filename)
    report = check_training_lines(upload.lines())

    file_id = new_file_id()
    storage_key = file_storage_key(tenant=tenant, file_id=file_id)
    storage = get_storage()
    try:
        written = storage_save_exactly(
            storage_key=storage_key,
            chunks=upload.chunks(),
            size=upload.size,
            what="upload",
            param="file",
        )
        return file_row_create(
            tenant=tenant,
            file_id=file_id,
            purpose=purpose,
            filename=filename,
            size=written,
            report=report,
            storage_key=storage_key,
        )
    except BaseException:
        storage.delete(storage_key)
        raise


def file_delete(*, file: File) -> None:
    """Delete the row now and the bytes after commit. Refused while an unfinished job uses it.

    The file's row is locked first, as `finetune_job_create` locks it: a job is created on a file
    that still exists, or the deletion sees that job and is refused.
    """
    storage_key = file.storage_key
    with transaction.atomic():
        if not File.objects.select_for_update().filter(pk=file.pk).exists():
            raise NotFoundError(f"No such file: {file.pk}.", param="file_id")
        in_use = (
            FinetuneJob.objects.filter(tenant=file.tenant)
            .exclude(status__in=TERMINAL_STATUSES)
            .filter(Q(training_file_id=file.pk) | Q(validation_file_id=file.pk))
        )
        if in_use.exists():
            raise ConflictError(
                f"File {file.pk} is used by an unfinished fine-tuning job; cancel it first.",
                param="file_id",
                code="file_in_use",
            )
        file.delete()
        transaction.on_commit(lambda: get_storage().delete(storage_key))


def file_content_chunks(*, file: File) -> Iterator[bytes]:
    """The stored bytes of `file`."""
    return get_storage().read_chunks(file.storage_key)
