"""Usage accounting: the recorder's sums, the batch write, concurrent flushes from threads and
processes, a flush while the database is down, and the bucketed reads with exact numbers."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from api.models import Tenant, TenantUsage
from api.services.tenants import tenant_create
from api.services.usage import BATCH_ROWS, UsageRow, usage_record_batch
from api.usage_recorder import UsageRecorder
from api.usage_selectors import UsageBucket, UsageSum, usage_buckets, usage_sums

ROOT = Path(__file__).resolve().parents[2]
# 2026-03-04 05:06:00 UTC, a Wednesday: minute, hour and day buckets all start before it.
T0 = int(datetime(2026, 3, 4, 5, 6, tzinfo=UTC).timestamp())


def at(offset_s: int) -> datetime:
    return datetime.fromtimestamp(T0 + offset_s, tz=UTC)


def totals(tenant: Tenant) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(model, minute offset from T0) -> (requests, prompt, completion), from the table."""
    return {
        (u.model, int(u.minute.timestamp()) - T0): (
            u.requests,
            u.prompt_tokens,
            u.completion_tokens,
        )
        for u in TenantUsage.objects.filter(tenant=tenant)
    }


def test_the_recorder_sums_calls_by_tenant_model_and_minute() -> None:
    recorder = UsageRecorder(clock=lambda: T0 + 125.5)
    recorder.record(1, "tiny", 10, 5, at=T0 + 0.0)
    recorder.record(1, "tiny", 20, 1, at=T0 + 59.999)
    recorder.record(1, "tiny", 7, 0, at=T0 + 60.0)
    recorder.record(1, "ft:tiny:acme::ftjob-1", 3, 3, at=T0 + 1)
    recorder.record(2, "tiny", 1, 1, at=T0 + 2)
    recorder.record(1, "tiny", 4, 4)  # now: minute T0 + 120
    assert recorder.pending() == {
        (1, "tiny", at(0)): (2, 30, 6),
        (1, "tiny", at(60)): (1, 7, 0),
        (1, "ft:tiny:acme::ftjob-1", at(0)): (1, 3, 3),
        (2, "tiny", at(0)): (1, 1, 1),
        (1, "tiny", at(120)): (1, 4, 4),
    }
    for bad in (
        lambda: recorder.record(1, "tiny", -1, 0),
        lambda: recorder.record(1, "", 1, 0),
        lambda: recorder.record(True, "tiny", 1, 0),
        lambda: recorder.record(1, "tiny", 1, 0, at=float("nan")),
        lambda: recorder.record(1, "tiny", 1, 0, at=1e20),
    ):
        with pytest.raises(ValueError):
            bad()
    assert len(recorder.pending()) == 5


def test_the_recorder_is_thread_safe() -> None:
    recorder = UsageRecorder(clock=lambda: T0)

    def calls() -> None:
        for _ in range(2000):
            recorder.record(1, "tiny", 3, 2)

    threads = [threading.Thread(target=calls) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert recorder.pending() == {(1, "tiny", at(0)): (16_000, 48_000, 32_000)}


@pytest.mark.django_db
def test_flush_writes_sums_and_later_flushes_add_to_them() -> None:
    acme = tenant_create(name="acme")
    recorder = UsageRecorder()
    for _ in range(1000):
        recorder.record(acme.pk, "tiny", 10, 2, at=T0 + 5)
    recorder.record(acme.pk, "tiny", 1, 1, at=T0 + 65)
    with CaptureQueriesContext(connection) as first_queries:
        assert recorder.flush() == 2
    assert recorder.pending() == {} and recorder.flush() == 0
    assert totals(acme) == {("tiny", 0): (1000, 10_000, 2000), ("tiny", 60): (1, 1, 1)}
    recorder.record(acme.pk, "tiny", 5, 5, at=T0 + 30)
    recorder.record(acme.pk, "other", 5, 5, at=T0 + 30)
    assert recorder.flush() == 2
    assert totals(acme) == {
        ("tiny", 0): (1001, 10_005, 2005),
        ("tiny", 60): (1, 1, 1),
        ("other", 0): (1, 5, 5),
    }
    # A thousand calls were a handful of statements, not a row each.
    assert len(first_queries) <= 8, [q["sql"] for q in first_queries]


@pytest.mark.django_db
def test_a_large_batch_is_written_in_bounded_statements() -> None:
    acme = tenant_create(name="acme")
    keys = 2 * BATCH_ROWS + 50
    rows = [
        UsageRow(
            tenant_id=acme.pk,
            model=f"m{index % 5}",
            minute=at(60 * (index // 5)),
            requests=1,
            prompt_tokens=index,
            completion_tokens=1,
        )
        for index in range(keys)
    ]
    with CaptureQueriesContext(connection) as queries:
        assert usage_record_batch(rows=rows + rows) == keys  # duplicates are summed first
    # Per batch of BATCH_ROWS keys: the INSERT (which Django may split in two on SQLite),
    # the SELECT ... FOR UPDATE and the UPDATE; around them the tenants' read and the
    # transaction's begin and end.
    assert len(queries) <= 3 * 4 + 3, [q["sql"][:60] for q in queries]
    assert TenantUsage.objects.count() == keys
    row = TenantUsage.objects.get(model="m3", minute=at(60 * 7))
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 2 * 38, 2)


@pytest.mark.django_db
def test_rows_are_checked() -> None:
    def row(minute: datetime, completion_tokens: int) -> UsageRow:
        return UsageRow(
            tenant_id=1,
            model="tiny",
            minute=minute,
            requests=1,
            prompt_tokens=1,
            completion_tokens=completion_tokens,
        )

    with pytest.raises(ValueError, match="whole minute"):
        row(at(1), 0)
    with pytest.raises(ValueError, match="aware UTC"):
        row(datetime(2026, 1, 1), 0)
    with pytest.raises(ValueError, match="completion_tokens"):
        row(at(0), -1)


@pytest.mark.django_db
def test_usage_of_a_deleted_tenant_is_dropped_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    acme, gone = tenant_create(name="acme"), tenant_create(name="gone")
    recorder = UsageRecorder()
    recorder.record(acme.pk, "tiny", 1, 1, at=T0)
    recorder.record(gone.pk, "tiny", 1, 1, at=T0)
    gone_id = gone.pk
    gone.delete()
    with caplog.at_level(logging.WARNING, logger="api.services.usage"):
        assert recorder.flush() == 1
    assert f"deleted tenants [{gone_id}]" in caplog.text
    assert recorder.pending() == {}
    assert totals(acme) == {("tiny", 0): (1, 1, 1)}


@contextmanager
def database_down() -> Iterator[None]:
    """The default database cannot be reached: its name points nowhere until the block ends."""
    settings = connections["default"].settings_dict
    name = settings["NAME"]
    connections["default"].close()
    settings["NAME"] = (
        "/nonexistent-dir/harli.sqlite3" if connection.vendor == "sqlite" else "harli_no_such_db"
    )
    try:
        yield
    finally:
        connections["default"].close()
        settings["NAME"] = name


@pytest.mark.django_db(transaction=True)
def test_a_failed_flush_keeps_the_sums_for_the_next(caplog: pytest.LogCaptureFixture) -> None:
    acme = tenant_create(name="acme")
    recorder = UsageRecorder()
    recorder.record(acme.pk, "tiny", 10, 1, at=T0)
    with database_down(), caplog.at_level(logging.ERROR, logger="api.usage_recorder"):
        assert recorder.flush() == 0
        recorder.record(acme.pk, "tiny", 5, 1, at=T0 + 1)  # recorded while it was down
    assert "writing 1 rows failed; kept for the next flush" in caplog.text
    assert recorder.pending() == {(acme.pk, "tiny", at(0)): (2, 15, 2)}
    assert recorder.flush() == 1
    assert totals(acme) == {("tiny", 0): (2, 15, 2)}


@pytest.mark.django_db(transaction=True)
def test_concurrent_flushes_from_threads_all_land() -> None:
    """Each thread is one gateway process's recorder on its own connection, flushing the same
    keys at the same moments."""
    acme, globex = tenant_create(name="acme"), tenant_create(name="globex")
    threads_n, rounds = 4, 10
    barrier = threading.Barrier(threads_n)
    failures: list[BaseException] = []

    def gateway() -> None:
        recorder = UsageRecorder()
        try:
            for _ in range(rounds):
                for tenant in (acme, globex):
                    for model in ("tiny", "big"):
                        recorder.record(tenant.pk, model, 3, 1, at=T0)
                        recorder.record(tenant.pk, model, 3, 1, at=T0 + 60)
                barrier.wait(timeout=60)
                recorder.flush()
                if recorder.pending():
                    failures.append(RuntimeError("a flush failed"))
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=gateway) for _ in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert failures == []
    calls = threads_n * rounds
    for tenant in (acme, globex):
        assert totals(tenant) == {
            (model, minute): (calls, 3 * calls, calls)
            for model in ("tiny", "big")
            for minute in (0, 60)
        }


WORKER = """
import json, sys, time
import django
django.setup()
from api.usage_recorder import UsageRecorder

tenant_ids, t0 = json.loads(sys.argv[1]), int(sys.argv[2])
start_at, rounds = float(sys.argv[3]), int(sys.argv[4])
recorder = UsageRecorder()
failed = 0
while time.time() < start_at:
    time.sleep(0.001)
for _ in range(rounds):
    for tenant_id in tenant_ids:
        for model in ("tiny", "big"):
            recorder.record(tenant_id, model, 3, 1, at=t0)
    recorder.flush()
    failed += bool(recorder.pending())
print(json.dumps({"failed": failed}))
"""


@pytest.mark.django_db(transaction=True)
def test_concurrent_flushes_from_processes_all_land() -> None:
    from config.database import database_url

    tenants = [tenant_create(name="acme"), tenant_create(name="globex")]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings.test",
        "DATABASE_URL": database_url(connection.settings_dict),
    }
    rounds, start_at = 15, time.time() + 4.0
    args = [json.dumps([t.pk for t in tenants]), str(T0), str(start_at), str(rounds)]
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"failed": 0}, err
    calls = 2 * rounds
    for tenant in tenants:
        assert totals(tenant) == {
            ("tiny", 0): (calls, 3 * calls, calls),
            ("big", 0): (calls, 3 * calls, calls),
        }


@pytest.fixture
def used(db: None) -> tuple[Tenant, Tenant]:
    """acme: tiny in two minutes of one hour, ft in the next hour, tiny the next day;
    globex: tiny at T0."""
    acme, globex = tenant_create(name="acme"), tenant_create(name="globex")
    ft = "ft:tiny:acme::ftjob-1"

    def row(tenant: Tenant, model: str, offset: int, n: int, p: int, c: int) -> UsageRow:
        return UsageRow(
            tenant_id=tenant.pk,
            model=model,
            minute=at(offset),
            requests=n,
            prompt_tokens=p,
            completion_tokens=c,
        )

    usage_record_batch(
        rows=[
            row(acme, "tiny", 0, 2, 100, 10),
            row(acme, "tiny", 60, 1, 50, 5),
            row(acme, ft, 3600, 4, 400, 40),
            row(acme, "tiny", 86400, 1, 1, 1),
            row(globex, "tiny", 0, 9, 900, 90),
        ]
    )
    return acme, globex


def test_minute_buckets_include_empty_ones(used: tuple[Tenant, Tenant]) -> None:
    acme, _ = used
    buckets = usage_buckets(tenant=acme, start=T0, end=T0 + 180, width="1m")
    assert buckets == [
        UsageBucket(T0, T0 + 60, [UsageSum(T0, 2, 100, 10)]),
        UsageBucket(T0 + 60, T0 + 120, [UsageSum(T0 + 60, 1, 50, 5)]),
        UsageBucket(T0 + 120, T0 + 180, []),
    ]


def test_hour_and_day_buckets_are_aligned_to_utc(used: tuple[Tenant, Tenant]) -> None:
    acme, _ = used
    hour = T0 - 6 * 60  # 05:00
    by_hour = usage_buckets(tenant=acme, start=T0, end=T0 + 7200, width="1h", by_model=True)
    assert [(b.start_time, b.end_time) for b in by_hour] == [
        (hour, hour + 3600),
        (hour + 3600, hour + 7200),
        (hour + 7200, hour + 10800),
    ]
    assert by_hour[0].results == [UsageSum(hour, 3, 150, 15, model="tiny")]
    assert by_hour[1].results == [UsageSum(hour + 3600, 4, 400, 40, model="ft:tiny:acme::ftjob-1")]
    assert by_hour[2].results == []
    day = T0 - 5 * 3600 - 6 * 60  # 00:00
    by_day = usage_buckets(tenant=acme, start=day, end=day + 2 * 86400, width="1d")
    assert by_day == [
        UsageBucket(day, day + 86400, [UsageSum(day, 7, 550, 55)]),
        UsageBucket(day + 86400, day + 2 * 86400, [UsageSum(day + 86400, 1, 1, 1)]),
    ]


def test_a_range_counts_only_minutes_that_start_inside_it(used: tuple[Tenant, Tenant]) -> None:
    acme, _ = used
    # [T0 + 30, T0 + 3600): the minute at T0 starts before the range, the one at T0 + 3600 ends it.
    [bucket] = usage_buckets(tenant=acme, start=T0 + 30, end=T0 + 3600, width="1d")
    assert bucket.results == [UsageSum(bucket.start_time, 1, 50, 5)]


def test_model_filter_and_every_tenant(used: tuple[Tenant, Tenant]) -> None:
    acme, _ = used
    only_tiny = usage_sums(
        tenant=acme, start=T0, end=T0 + 2 * 86400, width=None, models=["tiny"], by_model=True
    )
    assert only_tiny == [UsageSum(T0, 4, 151, 16, model="tiny")]
    everyone = usage_sums(
        tenant=None, start=T0, end=T0 + 60, width="1m", by_model=True, by_tenant=True
    )
    assert everyone == [
        UsageSum(T0, 2, 100, 10, model="tiny", tenant="acme"),
        UsageSum(T0, 9, 900, 90, model="tiny", tenant="globex"),
    ]
    assert usage_sums(tenant=acme, start=T0 + 120, end=T0 + 180, width=None) == []


@pytest.mark.django_db(transaction=True)
def test_flush_every_writes_in_the_background_and_once_more_when_cancelled() -> None:
    import asyncio

    acme = tenant_create(name="acme")
    recorder = UsageRecorder()

    async def gateway() -> None:
        flusher = asyncio.create_task(recorder.flush_every(0.05))
        recorder.record(acme.pk, "tiny", 2, 1, at=T0)
        for _ in range(200):
            await asyncio.sleep(0.02)
            if not recorder.pending():
                break
        recorder.record(acme.pk, "tiny", 2, 1, at=T0 + 60)  # flushed by the cancellation
        flusher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flusher

    asyncio.run(gateway())
    assert recorder.pending() == {}
    assert totals(acme) == {("tiny", 0): (1, 2, 1), ("tiny", 60): (1, 2, 1)}
