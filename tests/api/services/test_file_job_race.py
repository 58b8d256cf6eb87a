"""Deleting a training file while jobs are being created from it, each on its own database
connection: the file's row lock orders them, so every job created is on a file that exists (and
the deletion is then refused as the file is in use), or the creation sees the file gone."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from api.errors import ConflictError, HarliError, NotFoundError
from api.models import BaseModel, File, FinetuneJob, JobStatus, Tenant
from api.services.files import UploadSource, file_create, file_delete
from api.services.jobs import finetune_job_create
from tests.api.conftest import VALID_JSONL

ROUNDS = 6
CREATORS = 2


def new_file(tenant: Tenant) -> File:
    return file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename="train.jsonl", data=VALID_JSONL),
    )


@pytest.mark.django_db(transaction=True)
def test_a_job_is_never_created_on_a_deleted_file(tenant: Tenant, tiny: BaseModel) -> None:
    errors: list[BaseException] = []
    # One job first, on this thread: the tokenizer's lazy imports are then done.
    finetune_job_create(tenant=tenant, model="tiny", training_file=new_file(tenant).id)
    for _ in range(ROUNDS):
        file = new_file(tenant)
        start = threading.Barrier(CREATORS + 1)

        def create(file_id: str = file.id, start: threading.Barrier = start) -> None:
            try:
                start.wait()
                finetune_job_create(tenant=tenant, model="tiny", training_file=file_id)
            except HarliError:
                pass
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        def delete(file: File = file, start: threading.Barrier = start) -> None:
            try:
                start.wait()
                file_delete(file=file)
            except (ConflictError, NotFoundError):
                pass
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        threads = [threading.Thread(target=create) for _ in range(CREATORS)]
        threads.append(threading.Thread(target=delete))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
    assert errors == []
    file_ids = set(File.objects.values_list("id", flat=True))
    for job in FinetuneJob.objects.all():
        assert job.training_file_id in file_ids, job.id
        assert job.status != JobStatus.VALIDATING_FILES
