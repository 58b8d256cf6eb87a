"""The janitor (`api.services.janitor`): litter made for real (files on disk, rows) is removed,
and only litter: fresh and owned things stay."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.files.uploadedfile import TemporaryUploadedFile
from django.core.management import call_command
from django.utils import timezone
from pytest_django.fixtures import Settings as SettingsWrapper

from api.models import (
    DeploymentMetric,
    FinetuneJob,
    GpuHost,
    HostMetric,
    IdempotencyKey,
    JobMetric,
    MetricRollup,
    ProcessedReport,
    Tenant,
    UploadPart,
)
from api.services.files import UploadSource
from api.services.janitor import CONSOLE_LONGEST_RANGE, janitor_sweep, report_expired
from api.services.reports import host_report_apply
from api.services.uploads import upload_create, upload_part_add
from api.storage import get_storage
from gpu_runtime.contract.protocol import report
from tests.api.services.conftest import LINE, heartbeat

pytestmark = pytest.mark.django_db

HOUR = 3600.0


@pytest.fixture(autouse=True)
def spool_dir(settings: SettingsWrapper, tmp_path: Path) -> Path:
    spool = tmp_path / "spool"
    spool.mkdir()
    settings.HARLI_UPLOAD_SPOOL_DIR = spool
    settings.FILE_UPLOAD_TEMP_DIR = str(spool)
    return spool


def age(path: Path, seconds: float) -> None:
    """Make `path` look last touched `seconds` ago."""
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def test_the_spool_folder_is_djangos_upload_temp_dir() -> None:
    from config.settings import base

    assert base.FILE_UPLOAD_TEMP_DIR == str(base.HARLI_UPLOAD_SPOOL_DIR)
    assert base.HARLI_UPLOAD_SPOOL_DIR.is_relative_to(base.BASE_DIR / "var")


def test_spooled_uploads_a_killed_request_left_are_swept_and_live_ones_kept(
    spool_dir: Path,
) -> None:
    # What a request spools its upload to (Django's TemporaryUploadedFile in
    # FILE_UPLOAD_TEMP_DIR); a killed process never closes it, so it stays.
    dead = TemporaryUploadedFile("train.jsonl", "application/jsonl", 0, None)
    dead.write(LINE * 1000)
    dead.flush()
    dead_path = Path(dead.temporary_file_path())
    assert dead_path.parent == spool_dir
    age(dead_path, 2 * HOUR)
    live = TemporaryUploadedFile("live.jsonl", "application/jsonl", 0, None)
    live.write(LINE)
    live.flush()
    live_path = Path(live.temporary_file_path())
    result = janitor_sweep()
    assert result.spool_files == [dead_path.name]
    assert not dead_path.exists() and live_path.exists()
    with contextlib.suppress(FileNotFoundError):  # what the killed request never did
        dead.close()
    live.close()
    assert janitor_sweep().spool_files == []


def test_partial_writes_in_storage_are_swept_when_stale(storage_dir: Path) -> None:
    folder = storage_dir / "files" / "1"
    folder.mkdir(parents=True)
    stale = folder / ".upload-abc123"
    stale.write_bytes(b"half a file")
    age(stale, 2 * HOUR)
    writing = folder / ".upload-def456"
    writing.write_bytes(b"being written")
    assert janitor_sweep().partial_writes == ["files/1/.upload-abc123"]
    assert not stale.exists() and writing.exists()


def test_stored_objects_without_a_row_are_swept_after_the_grace_period(
    storage_dir: Path, tenant: Tenant, job: FinetuneJob
) -> None:
    storage = get_storage()
    owned_file = job.training_file.storage_key
    upload = upload_create(
        tenant=tenant, filename="big.jsonl", purpose="fine-tune", declared_bytes=len(LINE) * 2,
        mime_type="text/jsonl",
    )  # fmt: skip
    part = upload_part_add(upload=upload, data=UploadSource.from_bytes(filename="p", data=LINE))
    keys = {
        "orphan_file": f"files/{tenant.pk}/file-gone.jsonl",
        "fresh_orphan": f"files/{tenant.pk}/file-being-created.jsonl",
        "orphan_part": f"uploads/{tenant.pk}/{upload.pk}/part-gone",
        "checkpoint": f"checkpoints/{job.id}/step-000004/adapter.safetensors",
    }
    for key in keys.values():
        storage.save(key, [LINE])
    for key in (owned_file, part.storage_key, keys["orphan_file"], keys["orphan_part"],
                keys["checkpoint"]):  # fmt: skip
        age(storage.path(key), 2 * HOUR)  # type: ignore[attr-defined]
    result = janitor_sweep()
    assert sorted(result.orphan_objects) == sorted([keys["orphan_file"], keys["orphan_part"]])
    assert not storage.exists(keys["orphan_file"]) and not storage.exists(keys["orphan_part"])
    for kept in (owned_file, part.storage_key, keys["fresh_orphan"], keys["checkpoint"]):
        assert storage.exists(kept), kept
    assert UploadPart.objects.filter(pk=part.pk).exists()


def test_rows_past_their_retention_are_pruned_and_the_rest_kept(
    settings: SettingsWrapper, tenant: Tenant, job: FinetuneJob, deployment: Any
) -> None:
    from tests.api.services.conftest import make_host

    host: GpuHost = make_host("h1", deployment)
    heartbeat("h1")
    now = timezone.now()
    raw = timedelta(hours=settings.HARLI_METRICS_RAW_RETENTION_H)
    old, recent = now - raw - timedelta(minutes=1), now - raw + timedelta(minutes=5)
    sizes = {"weights_bytes": 1, "kv_used_bytes": 1, "finetune_lent_bytes": 1, "free_bytes": 1}
    for ts in (old, recent):
        HostMetric.objects.create(host=host, ts=ts, **sizes)
        DeploymentMetric.objects.create(
            deployment=deployment, host=host, ts=ts, tpot_p50_ms=1, tpot_p99_ms=2,
            slo_attainment=1.0,
        )  # fmt: skip
        JobMetric.objects.create(job=job, ts=ts, step=1 if ts == old else 2, train_loss=1.0)
    rollup_age = timedelta(days=settings.HARLI_METRICS_ROLLUP_RETENTION_D)
    MetricRollup.objects.create(series="host", key="h1", minute=now - rollup_age - timedelta(1))
    MetricRollup.objects.create(series="host", key="h1", minute=old.replace(second=0))
    reports = timedelta(hours=settings.HARLI_PROCESSED_REPORT_RETENTION_H)
    ProcessedReport.objects.create(message_id="old", kind="heartbeat", host="h1")
    ProcessedReport.objects.filter(message_id="old").update(processed_at=now - reports - raw)
    IdempotencyKey.objects.create(
        tenant=tenant, key="expired", method="POST", path="/v1/files", fingerprint="f",
        claim="c", claimed_at=now, created_at=now - timedelta(days=1), expires_at=now,
    )  # fmt: skip
    IdempotencyKey.objects.create(
        tenant=tenant, key="live", method="POST", path="/v1/files", fingerprint="f",
        claim="c", claimed_at=now, created_at=now, expires_at=now + timedelta(hours=1),
    )  # fmt: skip
    kept_reports = ProcessedReport.objects.exclude(message_id="old").count()
    assert kept_reports >= 1  # the heartbeat's own

    result = janitor_sweep(now=now)
    assert (result.host_metrics, result.deployment_metrics) == (1, 1)
    assert list(HostMetric.objects.values_list("ts", flat=True)) == [recent]
    assert list(DeploymentMetric.objects.values_list("ts", flat=True)) == [recent]
    assert JobMetric.objects.filter(job=job).count() == 2  # a job's curve stays whole
    assert result.metric_rollups == 1 and MetricRollup.objects.count() == 1
    assert result.processed_reports == 1
    assert ProcessedReport.objects.count() == kept_reports
    assert result.idempotency_keys == 1
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["live"]
    # A second pass finds nothing.
    again = janitor_sweep(now=now)
    assert (again.host_metrics, again.metric_rollups, again.processed_reports) == (0, 0, 0)


def test_a_report_older_than_its_dedupe_row_lives_is_dropped(
    settings: SettingsWrapper, deployment: Any
) -> None:
    from tests.api.services.conftest import make_host

    make_host("h1", deployment)
    message = report("heartbeat", "h1", total_bytes=1, free_bytes=1, placements=[])
    retention_s = settings.HARLI_PROCESSED_REPORT_RETENTION_H * HOUR
    message["sent_at"] = time.time() - retention_s + 0.5 * HOUR  # within the skew allowance
    assert report_expired(message=message)
    assert host_report_apply(message=message) == "expired"
    assert not ProcessedReport.objects.filter(message_id=message["message_id"]).exists()
    assert GpuHost.objects.get(name="h1").last_heartbeat_at is None
    message["sent_at"] = time.time() - 10
    assert not report_expired(message=message)


def test_retentions_that_would_break_the_console_or_dedupe_are_refused(
    settings: SettingsWrapper,
) -> None:
    settings.HARLI_METRICS_RAW_RETENTION_H = 12
    with pytest.raises(ImproperlyConfigured, match="console"):
        janitor_sweep()
    settings.HARLI_METRICS_RAW_RETENTION_H = 48
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 100 * 3600}
    with pytest.raises(ImproperlyConfigured, match="VISIBILITY_TIMEOUT"):
        janitor_sweep()


def test_raw_samples_outlive_the_consoles_longest_chart() -> None:
    from console.selectors.series import RANGES

    assert max(RANGES.values()) <= CONSOLE_LONGEST_RANGE


def test_the_command_runs_one_pass(storage_dir: Path, tenant: Tenant) -> None:
    storage = get_storage()
    key = f"files/{tenant.pk}/file-gone.jsonl"
    storage.save(key, [LINE])
    age(storage.path(key), 2 * HOUR)  # type: ignore[attr-defined]
    out = StringIO()
    call_command("janitor", "--verbose-names", stdout=out)
    assert "orphan_objects: 1" in out.getvalue() and key in out.getvalue()
    assert not storage.exists(key)
