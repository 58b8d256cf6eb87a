"""`config.database`: every SQLite database gets WAL, a busy timeout and IMMEDIATE
transactions, from either the embedded default or a URL; a settings entry turns back into a URL
that names the same database."""

from __future__ import annotations

from pathlib import Path

import dj_database_url
import pytest

from config.database import SQLITE_ENGINE, database_settings, database_url


def _settings(url: str) -> dict[str, object]:
    return database_settings(
        url=url, sqlite_path=Path("/srv/harli.sqlite3"), conn_max_age=60, busy_timeout_ms=7000
    )


@pytest.mark.parametrize("url", ["", "sqlite:////srv/other.sqlite3"])
def test_every_sqlite_database_is_set_up_for_concurrent_writers(url: str) -> None:
    config = _settings(url)
    assert config["ENGINE"] == SQLITE_ENGINE
    options = config["OPTIONS"]
    assert isinstance(options, dict)
    assert options["transaction_mode"] == "IMMEDIATE"
    assert options["timeout"] == 7.0
    assert options["init_command"].split("; ") == [
        "PRAGMA journal_mode=WAL",
        "PRAGMA synchronous=NORMAL",
        "PRAGMA busy_timeout=7000;",
    ]


def test_a_postgres_url_is_taken_as_it_is() -> None:
    url = "postgres://harli:s3cret@db.internal:5433/harli"
    assert _settings(url) == dj_database_url.parse(url, conn_max_age=60)


def test_a_negative_busy_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="busy_timeout_ms must be >= 0, got -1"):
        database_settings(url="", sqlite_path="x", conn_max_age=0, busy_timeout_ms=-1)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////tmp/test_harli_1.sqlite3",
        "postgres://postgres@127.0.0.1:5432/test_harli_1",
        "postgres://harli:p%40ss@db:5432/harli",
    ],
)
def test_database_url_names_the_same_database(url: str) -> None:
    config = _settings(url)
    again = _settings(database_url(config))
    for key in ("ENGINE", "NAME", "USER", "PASSWORD", "HOST", "PORT"):
        assert again.get(key) == config.get(key), key
