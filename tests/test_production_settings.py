"""Production settings fail closed: each secret and service they need, missing, stops start-up
with its name. They are the default of every entry point (`manage.py`, `config.wsgi`,
`config.asgi`, `config.celery`), pass `check --deploy`, and serve over HTTPS only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION = "config.settings.production"
FULL = {
    "DJANGO_SETTINGS_MODULE": PRODUCTION,
    "DJANGO_SECRET_KEY": "s",
    "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/test",
    "HARLI_GATEWAY_SECRET": "g",
    "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
}


def start(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in FULL}
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, env={**clean, **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_production_starts_with_everything_set() -> None:
    assert start(FULL).returncode == 0


@pytest.mark.parametrize(
    "missing", ["DJANGO_SECRET_KEY", "DATABASE_URL", "HARLI_GATEWAY_SECRET", "CELERY_BROKER_URL"]
)
def test_production_refuses_to_start_without(missing: str) -> None:
    env = {k: v for k, v in FULL.items() if k != missing}
    result = start(env)
    assert result.returncode != 0
    assert f"{missing} must be set in production" in result.stderr


# --- Production is the default, and it is served over HTTPS only ---------------------------

STRONG_SECRET = "k" * 20 + "0123456789abcdefghijklmnopqrstuvwxyz"  # 56 characters, 36 distinct


def production_env(tmp_path: Path) -> dict[str, str]:
    """Everything production settings need, DJANGO_SETTINGS_MODULE left unset."""
    return {
        "DJANGO_SECRET_KEY": STRONG_SECRET,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'harli.sqlite3'}",
        "HARLI_GATEWAY_SECRET": "g",
        "CELERY_BROKER_URL": "redis://127.0.0.1:6379/0",
    }


def run_python(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python ARGS` with FULL's variables (DJANGO_SETTINGS_MODULE among them) only from `env`."""
    clean = {k: v for k, v in os.environ.items() if k not in FULL}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env={**clean, **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_manage_py_with_nothing_set_refuses_to_start_and_names_what_to_set() -> None:
    result = run_python(["manage.py", "check"], {})
    assert result.returncode == 1
    for name in ["DJANGO_SECRET_KEY", "DATABASE_URL", "HARLI_GATEWAY_SECRET", "CELERY_BROKER_URL"]:
        assert f"{name} must be set in production" in result.stderr
    assert "deploy/harli.env.example" in result.stderr
    assert "Traceback" not in result.stderr  # the message alone


@pytest.mark.parametrize(
    "code",
    [
        "import config.wsgi",
        "import config.asgi",
        "from config.celery import app; app.conf.broker_url",
    ],
)
def test_every_entry_point_defaults_to_production_settings(code: str) -> None:
    result = run_python(["-c", code], {})
    assert result.returncode != 0
    assert "DJANGO_SECRET_KEY must be set in production" in result.stderr


def test_check_deploy_passes_with_the_production_environment(tmp_path: Path) -> None:
    result = run_python(
        ["manage.py", "check", "--deploy", "--fail-level", "WARNING"], production_env(tmp_path)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


# Requests through Django's middleware under production settings, answered without a database.
REQUESTS = """
import json, django
django.setup()
from django.test import Client
client = Client(HTTP_HOST="localhost")
def seen(path, **extra):
    r = client.get(path, **extra)
    return {"status": r.status_code, "location": r.get("Location"), "headers": dict(r.headers)}
print(json.dumps({
    "plain": seen("/v1/models"),
    "probe": seen("/healthz"),
    "secure": seen("/healthz", secure=True),
    "forwarded": seen("/healthz", HTTP_X_FORWARDED_PROTO="https"),
    "forwarded_api": seen("/v1/models", HTTP_X_FORWARDED_PROTO="https"),
}))
"""


def serve(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    result = run_python(["-c", REQUESTS], {"DJANGO_SETTINGS_MODULE": PRODUCTION, **env})
    assert result.returncode == 0, result.stderr
    # production's logs are JSON lines on stdout too (an access line per request, each with
    # the request id it answered; the probes' at DEBUG); the script's answers are its last line
    *logs, last = result.stdout.splitlines()
    answers: dict[str, dict[str, Any]] = json.loads(last)
    lines = [json.loads(line) for line in logs]
    access = [line for line in lines if line["logger"] == "harli.request"]
    assert [line["request_id"] for line in access] == [
        answers[name]["headers"]["x-request-id"] for name in ("plain", "forwarded_api")
    ]
    assert all(
        set(line) >= {"timestamp", "level", "logger", "message", "request_id", "tenant"}
        for line in lines
    )
    return answers


def test_production_redirects_to_https_sends_hsts_and_pins_the_secure_headers(
    tmp_path: Path,
) -> None:
    answers = serve(production_env(tmp_path))
    assert answers["plain"]["status"] == 301
    assert answers["plain"]["location"] == "https://localhost/v1/models"
    assert answers["probe"]["status"] == 200  # the load balancer's probes are not redirected
    secure = answers["secure"]["headers"]
    assert secure["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
    assert secure["X-Frame-Options"] == "DENY"
    assert secure["X-Content-Type-Options"] == "nosniff"
    assert secure["Referrer-Policy"] == "same-origin"
    # No trusted proxy (HARLI_TRUSTED_PROXY_HOPS=0): a client's X-Forwarded-Proto is ignored.
    assert "Strict-Transport-Security" not in answers["forwarded"]["headers"]
    assert answers["forwarded_api"]["status"] == 301


def test_behind_a_trusted_proxy_its_x_forwarded_proto_counts(tmp_path: Path) -> None:
    answers = serve({**production_env(tmp_path), "HARLI_TRUSTED_PROXY_HOPS": "1"})
    assert "Strict-Transport-Security" in answers["forwarded"]["headers"]
    assert answers["forwarded_api"]["status"] != 301
    assert answers["plain"]["status"] == 301


def test_the_https_switches_turn_the_redirect_and_hsts_down(tmp_path: Path) -> None:
    answers = serve(
        {
            **production_env(tmp_path),
            "HARLI_SECURE_SSL_REDIRECT": "0",
            "HARLI_HSTS_SECONDS": "600",
            "HARLI_HSTS_INCLUDE_SUBDOMAINS": "0",
        }
    )
    assert answers["plain"]["status"] != 301
    assert answers["secure"]["headers"]["Strict-Transport-Security"] == "max-age=600"


def test_production_database_connections_close_after_each_request_and_are_checked() -> None:
    code = (
        "import django; django.setup(); from django.conf import settings; "
        "d = settings.DATABASES['default']; print(d['CONN_MAX_AGE'], d['CONN_HEALTH_CHECKS'])"
    )
    assert run_python(["-c", code], FULL).stdout.split() == ["0", "True"]
    with_age = {**FULL, "HARLI_DB_CONN_MAX_AGE_S": "30"}
    assert run_python(["-c", code], with_age).stdout.split() == ["30", "True"]
