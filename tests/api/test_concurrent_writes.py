"""Concurrent writers on one job, each on its own database connection, as the web server, the
worker and beat are. On SQLite a transaction that read and then writes while another
connection committed fails with "database is locked" unless transactions begin IMMEDIATE
(`config.database`); on PostgreSQL the job's row lock orders them. Either way every call ends
in a transition or a clear conflict, never a database error."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import DatabaseError, connections

from api.errors import ConflictError
from api.models import BaseModel, File, FinetuneJob, JobEvent, JobStatus, Tenant
from api.services.jobs import finetune_job_create, finetune_job_pause, finetune_job_resume
from tests.threads import run_threads

THREADS = 4
ROUNDS = 15


@pytest.mark.django_db(transaction=True)
def test_pause_and_resume_from_many_connections_at_once(
    tenant: Tenant, tiny: BaseModel, training_file: File
) -> None:
    job = finetune_job_create(tenant=tenant, model="tiny", training_file=training_file.id)
    done: dict[str, int] = {"paused": 0, "resumed": 0, "conflicts": 0}
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(THREADS)

    def writer() -> None:
        try:
            start.wait()
            for _ in range(ROUNDS):
                for name, action in (
                    ("paused", finetune_job_pause),
                    ("resumed", finetune_job_resume),
                ):
                    try:
                        action(job=job)
                    except ConflictError:
                        outcome = "conflicts"
                    else:
                        outcome = name
                    with lock:
                        done[outcome] += 1
        except DatabaseError as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    assert run_threads(writer, THREADS)
    assert errors == []
    assert done["paused"] >= 1 and done["resumed"] >= 1
    # Every transition that returned is recorded once, and they alternate: the final status
    # is the last one's.
    events: Any = JobEvent.objects.filter(job=job)
    assert events.filter(message="Job paused").count() == done["paused"]
    assert events.filter(message="Job resumed; queued").count() == done["resumed"]
    assert done["paused"] - done["resumed"] in (0, 1)
    final = FinetuneJob.objects.get(pk=job.pk).status
    assert final == (JobStatus.PAUSED if done["paused"] > done["resumed"] else JobStatus.QUEUED)


@pytest.mark.django_db
def test_a_sqlite_connection_runs_in_wal_mode_with_a_busy_timeout() -> None:
    from django.conf import settings
    from django.db import connection

    if connection.vendor != "sqlite":
        pytest.skip("SQLite only (HARLI_TEST_DB=sqlite)")
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        assert cursor.fetchone() == ("wal",)
        cursor.execute("PRAGMA busy_timeout")
        assert cursor.fetchone() == (settings.SQLITE_BUSY_TIMEOUT_MS,)
        cursor.execute("PRAGMA synchronous")
        assert cursor.fetchone() == (1,)  # NORMAL
    # Django begins every atomic block with this mode (the concurrency test above shows why).
    assert connection.transaction_mode == "IMMEDIATE"  # type: ignore[attr-defined]
