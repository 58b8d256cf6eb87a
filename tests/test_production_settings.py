"""Production settings fail closed: each secret and service they need, missing, stops start-up
with its name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FULL = {
    "DJANGO_SETTINGS_MODULE": "config.settings.production",
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
