"""The request id of each inference request a host serves (`gpu_runtime.contract.request_id`).

An ASGI middleware: the id is the request's `x-request-id` (the gateway forwards its own there)
when valid, else a fresh one. Every log line of the request carries it, the response answers it
in `x-request-id`, and one access line (logger `gpu_runtime.server.access`) ends the request:
method, path, status, duration. `/health` is logged at DEBUG (load balancers poll it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gpu_runtime.contract.request_id import REQUEST_ID_HEADER, bound_log_context, request_id_or_new

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_logger = logging.getLogger("gpu_runtime.server.access")
_HEADER = REQUEST_ID_HEADER.encode()
QUIET_PATHS = frozenset({"/health"})


def scope_header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


class RequestIdMiddleware:
    """See the module docstring."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_or_new(scope_header(scope, _HEADER))
        status = [500]
        started = time.monotonic()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, request_id.encode())]}
            await send(message)

        with bound_log_context(request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                path = scope.get("path", "")
                access_logger.log(
                    logging.DEBUG if path in QUIET_PATHS else logging.INFO,
                    "%s %s %d",
                    scope.get("method"),
                    path,
                    status[0],
                    extra={
                        "method": scope.get("method"),
                        "path": path,
                        "status": status[0],
                        "duration_ms": round((time.monotonic() - started) * 1000, 1),
                    },
                )
