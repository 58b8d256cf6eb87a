"""Django's ASGI handler with a bound on the requests it serves at once in one process.

Under ASGI every Django request runs its view in a thread of its own, and a request holds one
database connection from its first query until it ends, so a web process holds as many
connections as it has requests in flight: unbounded, 512 clients on 4 uvicorn workers ask
PostgreSQL for up to 512 (its default limit is 100), and the ones over the limit fail with 500.
uvicorn's `--limit-concurrency` is no such bound: it counts open connections, keep-alive ones
included, and answers 503 past it, so a few hundred idle keep-alive clients got 503s with the
database far from its limit (`python -m bench.api_load`).

`SlottedASGIHandler(slots)` lets at most `slots` requests of the process be past the reading of
their body; the others wait their turn in arrival order (asyncio's semaphore: FIFO) rather than
being refused, so load turns into latency, not errors. A slot is taken after the body has been
read (a slow upload holds none) and given back once the response is built and the request's
connections are closed (`close_old_connections`, in the request's own thread, as Django does at
the end of a request: with `HARLI_DB_CONN_MAX_AGE_S=0` it closes them), so connections per
process <= slots (+ what the process holds outside requests, README "Database connections").
The probes (`/healthz`, `/readyz`) take no slot: a busy process stays live and ready.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponseBase

UNSLOTTED_PATHS = frozenset({"/healthz", "/readyz"})


class SlottedASGIHandler(ASGIHandler):
    """See the module docstring."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        super().__init__()
        self.slots = slots
        self._semaphore: asyncio.Semaphore | None = None

    @property
    def semaphore(self) -> asyncio.Semaphore:
        # made on first use: inside the server's event loop
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.slots)
        return self._semaphore

    async def run_get_response(self, request: HttpRequest) -> HttpResponseBase:
        if request.path in UNSLOTTED_PATHS:
            return await super().run_get_response(request)
        async with self.semaphore:
            try:
                response: Any = await super().run_get_response(request)
            finally:
                await sync_to_async(close_old_connections)()
            return response
