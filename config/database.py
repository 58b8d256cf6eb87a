"""The `DATABASES["default"]` entry, from a URL or the embedded SQLite file.

SQLite is a first-class backend: the web server, the Celery worker and beat write to one file
concurrently. Every SQLite connection therefore runs in WAL mode (readers never block the
writer), waits up to `busy_timeout_ms` for the write lock instead of failing with "database is
locked", and starts every transaction with `BEGIN IMMEDIATE`: a transaction takes the write
lock when it begins, so two transactions that read and then write cannot both hold a read
snapshot and deadlock on the upgrade (SQLite answers that case with an immediate "database is
locked", whatever the timeout). `select_for_update()` is a no-op on SQLite; IMMEDIATE
transactions serialise every writer, which is at least the row lock PostgreSQL gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

import dj_database_url

SQLITE_ENGINE = "django.db.backends.sqlite3"


def sqlite_options(*, busy_timeout_ms: int) -> dict[str, Any]:
    """Connection options of every SQLite database (see the module docstring)."""
    if busy_timeout_ms < 0:
        raise ValueError(f"busy_timeout_ms must be >= 0, got {busy_timeout_ms}")
    return {
        "transaction_mode": "IMMEDIATE",
        "timeout": busy_timeout_ms / 1000,
        "init_command": (
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; "
            f"PRAGMA busy_timeout={busy_timeout_ms};"
        ),
    }


def database_settings(
    *, url: str, sqlite_path: Path | str, conn_max_age: int, busy_timeout_ms: int
) -> dict[str, Any]:
    """The database named by `url` (dj-database-url syntax), else SQLite at `sqlite_path`;
    a SQLite database, from either, gets `sqlite_options`."""
    if url:
        config: dict[str, Any] = dict(dj_database_url.parse(url, conn_max_age=conn_max_age))
    else:
        config = {"ENGINE": SQLITE_ENGINE, "NAME": sqlite_path}
    if config["ENGINE"] == SQLITE_ENGINE:
        config["OPTIONS"] = {
            **config.get("OPTIONS", {}),
            **sqlite_options(busy_timeout_ms=busy_timeout_ms),
        }
    return config


def database_url(settings_dict: dict[str, Any]) -> str:
    """A URL that `database_settings` reads back as this database (for processes started on
    the same database: the end-to-end tests' servers, a `manage.py` subprocess)."""
    if settings_dict["ENGINE"] == SQLITE_ENGINE:
        return f"sqlite:///{Path(settings_dict['NAME']).resolve()}"
    user = quote(settings_dict.get("USER") or "postgres", safe="")
    password = settings_dict.get("PASSWORD")
    auth = f"{user}:{quote(password, safe='')}" if password else user
    host, port, name = settings_dict["HOST"], settings_dict["PORT"], settings_dict["NAME"]
    return f"postgres://{auth}@{host}:{port}/{name}"
