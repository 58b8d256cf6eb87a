"""Database reads from the gateway's event loop, run in worker threads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

T = TypeVar("T")


def _run(fn: Callable[..., T], kwargs: dict[str, Any]) -> T:
    # As Django does around a request: a connection past its age (with the default
    # CONN_MAX_AGE 0, every one) is closed before and after, never left open in an idle thread.
    close_old_connections()
    try:
        return fn(**kwargs)
    finally:
        close_old_connections()


async def db_call(fn: Callable[..., T], /, **kwargs: Any) -> T:
    """`fn(**kwargs)` in a worker thread of its own (not Django's one thread for sync code, so
    gateway reads never queue behind the tenant API's views)."""
    result: T = await sync_to_async(_run, thread_sensitive=False)(fn, kwargs)
    return result
