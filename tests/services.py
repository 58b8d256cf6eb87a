"""The test suite's credentials on this machine's shared Redis and RabbitMQ.

`scripts/services.sh` gives the suite its own users there (as production has, nothing runs as
Redis's passwordless `default` or RabbitMQ's `guest`) and writes their URLs to
$HARLI_TEST_SERVICES_ENV (default `${XDG_STATE_HOME:-~/.local/state}/harli/test-services.env`).
The environment's own `HARLI_TEST_REDIS_URL` / `HARLI_TEST_AMQP_URL` win over the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REDIS_URL_ENV = "HARLI_TEST_REDIS_URL"
AMQP_URL_ENV = "HARLI_TEST_AMQP_URL"


def services_env_path() -> Path:
    explicit = os.environ.get("HARLI_TEST_SERVICES_ENV")
    if explicit:
        return Path(explicit)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "harli" / "test-services.env"


def _from_file(name: str) -> str:
    try:
        lines = services_env_path().read_text(encoding="utf-8").splitlines()
    except OSError:
        return ""
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == name:
            return value.strip()
    return ""


def service_url(name: str) -> str:
    """The URL `name` (REDIS_URL_ENV or AMQP_URL_ENV) with the suite's credentials; fails the
    test (or its module's collection) with the fix when services.sh has not been run."""
    url = os.environ.get(name) or _from_file(name)
    if not url:
        pytest.fail(
            f"{name} is not set and {services_env_path()} does not name it: run "
            "`bash scripts/services.sh` (it starts Redis and RabbitMQ and adds the suite's users)",
            pytrace=False,
        )
    return url
