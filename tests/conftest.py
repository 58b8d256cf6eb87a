"""Suite-wide fixtures and markers, and the SQLite test database's files."""

from __future__ import annotations

from pathlib import Path

import pytest


def _sqlite_test_files() -> list[Path]:
    """The SQLite test database of this process and its WAL files ([] on PostgreSQL)."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] != "django.db.backends.sqlite3":
        return []
    name = Path(database["TEST"]["NAME"])
    return [name, name.with_name(name.name + "-wal"), name.with_name(name.name + "-shm")]


def pytest_sessionstart(session: pytest.Session) -> None:
    # A file left by an earlier process with the same pid (killed before it cleaned up): a
    # stale -wal next to a new database would be replayed into it.
    for path in _sqlite_test_files():
        path.unlink(missing_ok=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Django removes the database file itself, not its -wal and -shm companions.
    for path in _sqlite_test_files():
        path.unlink(missing_ok=True)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
