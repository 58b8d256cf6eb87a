"""Suite-wide fixtures and markers; on SQLite (HARLI_TEST_DB=sqlite), the tests that use the
database and the test database's files."""

from __future__ import annotations

from pathlib import Path

import pytest


def _on_sqlite() -> bool:
    """Whether the test database is SQLite; False where Django is not installed (a GPU
    machine runs the runtime's tests, which need neither Django nor a database)."""
    try:
        from django.conf import settings
    except ImportError:
        return False
    return bool(settings.DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3")


def _sqlite_test_files() -> list[Path]:
    """The SQLite test database of this process and its WAL files ([] on PostgreSQL)."""
    if not _on_sqlite():
        return []
    from django.conf import settings

    name = Path(settings.DATABASES["default"]["TEST"]["NAME"])
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


# The tests that use the database; `HARLI_TEST_DB=sqlite pytest` runs only these (the rest
# run once, in the PostgreSQL pass).
DATABASE_TEST_DIRS = ("api", "cli", "workers", "console", "e2e")
TESTS = Path(__file__).resolve().parent


def _uses_the_database(item: pytest.Item) -> bool:
    parts = item.path.resolve().relative_to(TESTS).parts
    return len(parts) > 1 and parts[0] in DATABASE_TEST_DIRS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _on_sqlite():
        deselected = [item for item in items if not _uses_the_database(item)]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if _uses_the_database(item)]
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
