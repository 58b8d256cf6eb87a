"""The test suite: real PostgreSQL (default) or SQLite, fast password hashing.

`HARLI_TEST_DB` picks the backend: `postgres` (default) or `sqlite`. Each pytest process gets
its own test database, so concurrent runs on one machine do not collide: `test_harli_<pid>` on
PostgreSQL, the file `<tmp>/test_harli_<pid>.sqlite3` on SQLite (a file, not Django's in-memory
test database, so the processes the end-to-end tests start can share it; `tests/conftest.py`
removes its WAL files). A process started with DATABASE_URL (the end-to-end servers, a
`manage.py` subprocess) uses that database as it is.
"""

import os
import tempfile
from pathlib import Path

from config.database import SQLITE_ENGINE, database_settings
from config.env import EnvError, env_str
from config.settings.base import *  # noqa: F403
from config.settings.base import SQLITE_BUSY_TIMEOUT_MS

SECRET_KEY = "harli-test-only"
GATEWAY_SECRET = env_str("HARLI_GATEWAY_SECRET", "harli-test-gateway-secret")
HARLI_TEST_DB = env_str("HARLI_TEST_DB", "postgres")
if HARLI_TEST_DB not in {"postgres", "sqlite"}:
    raise EnvError(f"HARLI_TEST_DB={HARLI_TEST_DB!r} is not a test database (postgres or sqlite)")

_url = env_str("DATABASE_URL", "")
if not _url and HARLI_TEST_DB == "postgres":
    _url = "postgres://postgres@127.0.0.1:5432/test"
DATABASES = {
    "default": database_settings(
        url=_url,
        sqlite_path=Path(tempfile.gettempdir()) / "harli-test.sqlite3",  # never opened
        conn_max_age=0,
        busy_timeout_ms=SQLITE_BUSY_TIMEOUT_MS,
    )
}
if DATABASES["default"]["ENGINE"] == SQLITE_ENGINE:
    _test_name = env_str("HARLI_TEST_DATABASE", "") or str(
        Path(tempfile.gettempdir()) / f"test_harli_{os.getpid()}.sqlite3"
    )
else:
    _test_name = env_str("HARLI_TEST_DATABASE", f"test_harli_{os.getpid()}")
DATABASES["default"]["TEST"] = {"NAME": _test_name}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# WhiteNoise warns when the collected-static directory is missing; tests never collect static.
WHITENOISE_AUTOREFRESH = True
