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
from tests.services import REDIS_URL_ENV, service_url

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = service_url(REDIS_URL_ENV)


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


def test_filesystem_broker_uses_the_atomic_transport(tmp_path: Path) -> None:
    env = {**os.environ, "CELERY_BROKER_URL": "filesystem://", "HARLI_BROKER_DIR": str(tmp_path)}
    env["DJANGO_SETTINGS_MODULE"] = "config.settings.test"
    code = (
        "import django; django.setup(); from config.celery import app; "
        "c = app.connection_for_write(); "
        "print(type(c.transport).__module__, c.transport_options['failed_folder'])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["gpu_runtime.agent.fs_transport", str(tmp_path / "failed")]


@pytest.mark.e2e
def test_worker_on_the_filesystem_broker_sets_a_damaged_file_aside_and_goes_on(
    tmp_path: Path,
) -> None:
    """A damaged message file in the control queue no longer stops the worker's consumer."""
    from kombu.transport import filesystem

    from gpu_runtime.contract.broker import broker_transport, broker_transport_options

    env = {**os.environ, "CELERY_BROKER_URL": "filesystem://", "HARLI_BROKER_DIR": str(tmp_path)}
    env["DJANGO_SETTINGS_MODULE"] = "config.settings.test"
    queue = tmp_path / "queue"
    filesystem.Transport.global_state.clear()  # bindings of other brokers this process used
    client = Celery("harli-test-client", broker="filesystem://", set_as_current=False)
    client.conf.update(
        broker_transport=broker_transport("filesystem://"),
        broker_transport_options=broker_transport_options("filesystem://", tmp_path),
    )
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
            "-Q",
            "control",
            "--loglevel",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        (queue / f"{'0' * 20}_damaged.control.msg").write_bytes(b"")
        # no task of that name: the worker logs it as unregistered and discards the message
        client.send_task("harli.test.nothing", queue="control", routing_key="control")
        deadline = time.monotonic() + 60
        while os.listdir(queue) and time.monotonic() < deadline and worker.poll() is None:
            time.sleep(0.2)
        assert worker.poll() is None, worker.stdout.read() if worker.stdout else ""
        assert os.listdir(queue) == [], "the worker stopped consuming"
        assert os.listdir(tmp_path / "failed") == [f"{'0' * 20}_damaged.control.msg"]
    finally:
        worker.terminate()
        output = worker.communicate(timeout=20)[0]
        filesystem.Transport.global_state.clear()
    assert "harli.test.nothing" in output  # it received the task after the damaged file
