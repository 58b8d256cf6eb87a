"""The janitor's beat task: scheduled, thin, idempotent (`api.services.janitor` does the work)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.conf import settings
from pytest_django.fixtures import Settings as SettingsWrapper

from api.storage import get_storage
from config.celery import app
from workers.tasks import janitor

pytestmark = pytest.mark.django_db


def test_beat_runs_the_janitor() -> None:
    entry = app.conf.beat_schedule["janitor"]
    assert entry["task"] == janitor.name == "workers.janitor"
    assert entry["schedule"] == float(settings.HARLI_JANITOR_INTERVAL_S)
    assert janitor.acks_late and janitor.max_retries


def test_the_task_sweeps_and_a_second_run_finds_nothing(
    settings: SettingsWrapper, tmp_path: Path
) -> None:
    settings.HARLI_STORAGE_DIR = tmp_path / "storage"
    settings.HARLI_UPLOAD_SPOOL_DIR = tmp_path / "spool"
    (tmp_path / "spool").mkdir()
    litter = tmp_path / "spool" / "tmpabc.upload.jsonl"
    litter.write_bytes(b"x" * 1024)
    get_storage().save("files/1/file-gone.jsonl", [b"{}\n"])
    old = time.time() - 2 * 3600
    for path in (litter, tmp_path / "storage" / "files" / "1" / "file-gone.jsonl"):
        os.utime(path, (old, old))
    swept = janitor.apply().get()
    assert swept["spool_files"] == ["tmpabc.upload.jsonl"]
    assert swept["orphan_objects"] == ["files/1/file-gone.jsonl"]
    again = janitor.apply().get()
    assert again["spool_files"] == [] and again["orphan_objects"] == []
