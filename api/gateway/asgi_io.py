"""The few raw ASGI pieces the gateway needs: read a bounded body, send a whole response, and
notice the client leaving."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies in front must not buffer the stream either
]


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body; BodyTooLarge past `limit` bytes (read no further), ClientGone when the
    client disconnects first."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def send_whole(send: Send, status: int, body: bytes, headers: Headers) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, payload: Any, headers: Headers) -> None:
    await send_whole(send, status, json.dumps(payload).encode(), JSON_HEADERS + headers)


def cancel_on_disconnect(receive: Receive) -> asyncio.Task[None]:
    """A task that cancels the current task when the client disconnects (call it once the body
    is read; cancel the returned task when the response is done)."""
    handler = asyncio.current_task()
    assert handler is not None

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                handler.cancel("client disconnected")
                return

    return asyncio.create_task(watch())
