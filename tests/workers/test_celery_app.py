"""The Celery app's wiring: settings, the default transport, and a real worker on a real broker."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery import Celery

from config.celery import app

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/15"


def test_app_reads_django_settings() -> None:
    assert app.main == "harli"
    assert app.conf.task_acks_late is True
    assert app.conf.task_reject_on_worker_lost is True
    assert app.conf.worker_prefetch_multiplier == 1
    assert app.conf.task_default_queue == "control"
    assert app.conf.accept_content == ["json"]


def test_default_broker_is_in_memory_and_local_runs_eagerly() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CELERY_BROKER_URL"}
    env["DJANGO_SETTINGS_MODULE"] = "config.settings.local"
    env["DJANGO_DEBUG"] = "0"
    code = (
        "import django; django.setup(); from config.celery import app; "
        "print(app.conf.broker_url, app.conf.task_always_eager)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["memory://", "True"]
    env["CELERY_BROKER_URL"] = REDIS_URL
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == [REDIS_URL, "False"]


@pytest.mark.e2e
def test_worker_process_starts_on_redis_and_answers_ping() -> None:
    env = {**os.environ, "CELERY_BROKER_URL": REDIS_URL}
    env["DJANGO_SETTINGS_MODULE"] = "config.settings.test"
    # Other workers may share the broker (parallel runs): wait for this one by its own name.
    node = f"harli-test-{os.getpid()}"
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "--pool",
            "solo",
            "--hostname",
            f"{node}@%h",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = Celery("harli-test-client", broker=REDIS_URL)
    try:
        answered: list[str] = []
        deadline = time.monotonic() + 60
        while not answered and time.monotonic() < deadline and worker.poll() is None:
            replies = client.control.ping(timeout=1.0)
            answered = [name for reply in replies for name in reply if name.startswith(f"{node}@")]
        assert worker.poll() is None, worker.stdout.read() if worker.stdout else ""
        assert answered, f"no ping reply from {node} within 60 s"
    finally:
        worker.terminate()
        worker.wait(timeout=20)
        client.close()
