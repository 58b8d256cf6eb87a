"""Liveness and readiness probes of the web process, for load balancers, systemd and Kubernetes.

`GET /healthz` (liveness) answers 200 `{"status": "ok"}` from the process alone: it touches
neither the database nor the broker, so a dependency's outage never gets a healthy process
restarted. `GET /readyz` (readiness) answers 200 `{"status": "ready", "checks": {...}}` when the
database and the Celery broker both answer, else 503 with each failing check's short reason
(never a URL, a path or a credential: the full error goes to the `harli.health` log).

Both take no authentication and are plain Django views (not in the OpenAPI schema); Django's
`ALLOWED_HOSTS` still applies, so a probe must send an allowed `Host` header. Readiness answers
within `READY_TIMEOUT_S` whatever a dependency does: the checks run side by side in threads of
their own, a check still running at the deadline is reported as timed out, and each check's own
connect and read timeouts (`CHECK_TIMEOUT_S`) end its thread soon after.

* database: `SELECT 1` on a fresh connection built from the default alias's settings (with
  connect and statement timeouts, closed afterwards), so an abandoned check never leaves the
  request's own connection mid-query. A SQLite file that does not exist is reported missing
  rather than created empty.
* broker: a `filesystem://` broker (the embedded default) is ready when each of its folders
  exists and takes a file; any other URL gets a kombu connection (`ensure_connection`, one
  attempt). `memory://` (no broker configured) is in-process and always answers.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connections
from django.db.utils import load_backend
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe
from kombu import Connection

from config.database import SQLITE_ENGINE
from gpu_runtime.contract.broker import FILESYSTEM_FOLDER_OPTIONS

logger = logging.getLogger("harli.health")

READY_TIMEOUT_S = 2.0
"""Longest a readiness probe takes to answer."""
CHECK_TIMEOUT_S = 1.5
"""Connect and read timeout of each check's own connection."""


class NotReady(Exception):
    """A dependency that does not answer; the message is the short reason the probe shows."""


@require_safe
@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@require_safe
@never_cache
def readyz(request: HttpRequest) -> JsonResponse:
    checks = readiness_checks(
        {
            "database": lambda: database_check(dict(connections.settings["default"])),
            "broker": lambda: broker_check(
                url=settings.CELERY_BROKER_URL,
                transport=settings.CELERY_BROKER_TRANSPORT,
                transport_options=settings.CELERY_BROKER_TRANSPORT_OPTIONS,
            ),
        },
        timeout_s=READY_TIMEOUT_S,
    )
    ready = all(result == "ok" for result in checks.values())
    return JsonResponse(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status=200 if ready else 503,
    )


def readiness_checks(checks: dict[str, Callable[[], None]], *, timeout_s: float) -> dict[str, str]:
    """Each check's result, `"ok"` or its short reason, all within `timeout_s`: the checks run
    side by side, and one still running at the deadline is `"timed out"` (its thread is left to
    end on its own timeouts)."""
    executor = ThreadPoolExecutor(max_workers=len(checks), thread_name_prefix="readyz")
    futures = {name: executor.submit(check) for name, check in checks.items()}
    wait(futures.values(), timeout=timeout_s)
    executor.shutdown(wait=False)
    return {name: _result(name, future, timeout_s) for name, future in futures.items()}


def _result(name: str, future: Future[None], timeout_s: float) -> str:
    if not future.done():
        logger.warning("readiness check %s: no answer within %s s", name, timeout_s)
        return "timed out"
    error = future.exception()
    if error is None:
        return "ok"
    logger.warning("readiness check %s failed: %r", name, error)
    if isinstance(error, NotReady):
        return str(error)
    return f"unavailable ({_cause(error)})"


def _cause(error: BaseException) -> str:
    """The OS's words for the innermost socket or file error behind `error` (`Connection
    refused`, `timed out`), else the error's type: never its message, which can name hosts."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, TimeoutError):
            return "timed out"
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return type(error).__name__


def database_check(settings_dict: dict[str, Any]) -> None:
    """`SELECT 1` on a new connection to the database of `settings_dict` (a Django
    `DATABASES` entry with its defaults filled in), closed afterwards."""
    settings_dict = {**settings_dict, "CONN_MAX_AGE": 0, "CONN_HEALTH_CHECKS": False}
    options = {**settings_dict.get("OPTIONS", {})}
    options.pop("pool", None)  # one connection of its own, not a pool of them
    if settings_dict["ENGINE"] == SQLITE_ENGINE:
        if not Path(settings_dict["NAME"]).is_file():
            raise NotReady("unavailable (database file missing)")
        options["timeout"] = CHECK_TIMEOUT_S
    else:
        timeout_ms = int(CHECK_TIMEOUT_S * 1000)
        options["connect_timeout"] = max(2, round(CHECK_TIMEOUT_S))  # libpq: whole seconds
        options["options"] = f"{options.get('options', '')} -c statement_timeout={timeout_ms}"
    settings_dict["OPTIONS"] = options
    wrapper = load_backend(settings_dict["ENGINE"]).DatabaseWrapper(settings_dict, "readyz")
    try:
        with wrapper.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        wrapper.close()


def broker_check(*, url: str, transport: str | None, transport_options: dict[str, Any]) -> None:
    """The Celery broker answers: see the module docstring."""
    if url.startswith("filesystem://"):
        _filesystem_broker_check(transport_options)
        return
    options = {**transport_options}
    if url.startswith(("redis://", "rediss://")):
        options.update(socket_timeout=CHECK_TIMEOUT_S, socket_connect_timeout=CHECK_TIMEOUT_S)
    with Connection(
        url, transport=transport, transport_options=options, connect_timeout=CHECK_TIMEOUT_S
    ) as connection:
        connection.ensure_connection(
            max_retries=1, interval_start=0, interval_step=0, timeout=CHECK_TIMEOUT_S
        )


def _filesystem_broker_check(transport_options: dict[str, Any]) -> None:
    for option, folder_name in FILESYSTEM_FOLDER_OPTIONS.items():
        folder = transport_options.get(option)
        if folder is None:
            raise NotReady(f"filesystem broker: no {folder_name} folder configured")
        try:
            with tempfile.TemporaryFile(dir=folder, prefix=".readyz-"):
                pass  # an unnamed file (O_TMPFILE) where possible, never seen by a consumer
        except FileNotFoundError as exc:
            raise NotReady(f"filesystem broker: the {folder_name} folder is missing") from exc
        except OSError as exc:
            raise NotReady(
                f"filesystem broker: the {folder_name} folder takes no file ({_cause(exc)})"
            ) from exc
