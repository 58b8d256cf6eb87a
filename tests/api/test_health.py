"""The probes: `/healthz` answers from the process alone; `/readyz` answers 200 when the real
database and broker answer, 503 with a short, secret-free reason when one does not, and always
within its time bound."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connections
from django.test import Client
from pytest_django.fixtures import Settings as SettingsWrapper

from api.health import READY_TIMEOUT_S, NotReady, database_check, readiness_checks
from config.database import SQLITE_ENGINE
from gpu_runtime.contract.broker import broker_transport, broker_transport_options
from tests.services import AMQP_URL_ENV, REDIS_URL_ENV, service_url

CLOSED_REDIS = "redis://:hunter2-secret@127.0.0.1:1/0"
REDIS_URL = service_url(REDIS_URL_ENV)
AMQP_URL = service_url(AMQP_URL_ENV)
# Time for the test client and the thread start around the probe's own bound.
SLACK_S = 0.5


def use_broker(settings: SettingsWrapper, url: str, broker_dir: Path | None = None) -> None:
    settings.CELERY_BROKER_URL = url
    settings.CELERY_BROKER_TRANSPORT = broker_transport(url)
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = broker_transport_options(url, broker_dir)


def timed_readyz(client: Client) -> tuple[int, dict[str, object], float]:
    started = time.monotonic()
    response = client.get("/readyz")
    return response.status_code, response.json(), time.monotonic() - started


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never answers a byte."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as server:
        yield server.getsockname()[1]


def test_healthz_answers_without_the_database_or_a_key(client: Client) -> None:
    # No django_db mark: a database query here would fail the test.
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert "no-cache" in response["Cache-Control"]
    assert client.head("/healthz").status_code == 200
    assert client.post("/healthz").status_code == 405


def test_probes_still_need_an_allowed_host(client: Client) -> None:
    assert client.get("/healthz", headers={"Host": "evil.example"}).status_code == 400


@pytest.mark.django_db
def test_readyz_is_ready_on_the_test_database_and_the_default_broker(client: Client) -> None:
    status, body, elapsed = timed_readyz(client)
    assert (status, body) == (
        200,
        {"status": "ready", "checks": {"database": "ok", "broker": "ok"}},
    )
    assert elapsed < READY_TIMEOUT_S


@pytest.mark.django_db
def test_readyz_is_ready_on_redis(client: Client, settings: SettingsWrapper) -> None:
    use_broker(settings, REDIS_URL)
    status, body, _ = timed_readyz(client)
    assert (status, body["checks"]) == (200, {"database": "ok", "broker": "ok"})


@pytest.mark.django_db
def test_readyz_is_ready_on_rabbitmq_with_the_suites_user(
    client: Client, settings: SettingsWrapper
) -> None:
    use_broker(settings, AMQP_URL)
    status, body, _ = timed_readyz(client)
    assert (status, body["checks"]) == (200, {"database": "ok", "broker": "ok"})


@pytest.mark.django_db
def test_readyz_checks_the_filesystem_brokers_folders(
    client: Client, settings: SettingsWrapper, tmp_path: Path
) -> None:
    use_broker(settings, "filesystem://", tmp_path / "broker")
    status, body, _ = timed_readyz(client)
    assert (status, body["checks"]) == (200, {"database": "ok", "broker": "ok"})
    assert sorted(p.name for p in (tmp_path / "broker").iterdir()) == [
        "control", "failed", "processed", "queue",
    ]  # fmt: skip
    assert not any((tmp_path / "broker" / "queue").iterdir())  # the probe's file left no trace

    shutil.rmtree(tmp_path / "broker" / "processed")
    status, body, _ = timed_readyz(client)
    assert status == 503
    assert body == {
        "status": "not_ready",
        "checks": {
            "database": "ok",
            "broker": "filesystem broker: the processed folder is missing",
        },
    }


@pytest.mark.django_db
def test_readyz_is_503_when_the_broker_refuses(client: Client, settings: SettingsWrapper) -> None:
    use_broker(settings, CLOSED_REDIS)
    status, body, elapsed = timed_readyz(client)
    assert status == 503
    assert body == {
        "status": "not_ready",
        "checks": {"database": "ok", "broker": "unavailable (Connection refused)"},
    }
    assert elapsed < READY_TIMEOUT_S + SLACK_S
    assert "hunter2" not in str(body) and "127.0.0.1" not in str(body)


@pytest.mark.django_db
def test_readyz_answers_in_time_when_the_broker_never_answers(
    client: Client, settings: SettingsWrapper, silent_port: int
) -> None:
    use_broker(settings, f"redis://127.0.0.1:{silent_port}/0")
    status, body, elapsed = timed_readyz(client)
    assert status == 503
    assert body["checks"] == {"database": "ok", "broker": "unavailable (timed out)"}
    assert elapsed < READY_TIMEOUT_S + SLACK_S


def test_a_check_still_running_at_the_deadline_is_timed_out() -> None:
    release = threading.Event()

    def hung() -> None:
        release.wait(10)

    def ok() -> None:
        pass

    def refused() -> None:
        raise NotReady("not today")

    started = time.monotonic()
    checks = readiness_checks(
        {"hung": hung, "ok": ok, "refused": refused},
        timeout_s=0.2,
    )
    elapsed = time.monotonic() - started
    release.set()
    assert checks == {"hung": "timed out", "ok": "ok", "refused": "not today"}
    assert 0.2 <= elapsed < 0.2 + SLACK_S


@pytest.mark.django_db
def test_the_database_check_reports_a_database_it_cannot_reach(tmp_path: Path) -> None:
    default = dict(connections.settings["default"])
    database_check(default)  # the test database answers
    if default["ENGINE"] == SQLITE_ENGINE:
        unreachable = {**default, "NAME": str(tmp_path / "missing.sqlite3")}
        expected = "unavailable (database file missing)"
    else:
        unreachable = {**default, "HOST": "127.0.0.1", "PORT": 1, "PASSWORD": "hunter2-secret"}
        expected = "unavailable (OperationalError)"
    checks = readiness_checks({"database": lambda: database_check(unreachable)}, timeout_s=2)
    assert checks == {"database": expected}
    assert not (tmp_path / "missing.sqlite3").exists()  # reported, not created
