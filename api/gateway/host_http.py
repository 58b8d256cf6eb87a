"""The gateway's HTTP/1.1 client to the hosts: pooled keep-alive connections over asyncio
streams, for the one kind of exchange it makes (a JSON POST answered with a JSON body or a
chunked stream of server-sent events).

A general client (httpx) spends more CPU per relayed chunk than the rest of the gateway together
(`docs/decisions/0021-gateway-beside-django.md`), and on a host machine that CPU is the engine's.

Errors: `HostUnreachable` when the connection or the request fails, or the response's head does
not arrive within the read timeout (nothing reached the client yet: another host may be tried);
`HostStreamError` when the body breaks off or stalls afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

IDLE_LIMIT_S = 4.0
"""An idle connection older than this is closed, not reused (uvicorn, the hosts' server, drops
idle connections after 5 s)."""
MAX_IDLE_PER_HOST = 512
MAX_HEAD_BYTES = 64 * 1024


class HostError(Exception):
    pass


class HostUnreachable(HostError):
    pass


class HostStreamError(HostError):
    pass


class _StaleConnection(HostUnreachable):
    """A reused connection the host had closed: the request never reached it."""


class _Connection:
    __slots__ = ("reader", "writer", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        return (
            not self.reader.at_eof()
            and not self.writer.is_closing()
            and now - self.idle_since < IDLE_LIMIT_S
        )

    def close(self) -> None:
        self.writer.close()


class HostResponse:
    """One response; `aclose()` it (the connection goes back to the pool only when the body was
    read to its end)."""

    def __init__(
        self,
        pool: HostPool,
        origin: tuple[str, int],
        connection: _Connection,
        status_code: int,
        headers: dict[str, str],
        read_timeout_s: float,
    ) -> None:
        self._pool = pool
        self._origin = origin
        self._connection: _Connection | None = connection
        self.status_code = status_code
        self.headers = headers
        self._read_timeout_s = read_timeout_s
        self._complete = False
        self.content = b""
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        self._chunked = chunked
        length = headers.get("content-length")
        self._length = int(length) if length is not None and not chunked else None

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)

    async def aread(self) -> bytes:
        parts = [chunk async for chunk in self.aiter_raw()]
        self.content = b"".join(parts)
        return self.content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (a chunked body chunk by chunk)."""
        connection = self._connection
        if connection is None or self._complete:
            return
        reader = connection.reader
        try:
            if self._chunked:
                while True:
                    async with asyncio.timeout(self._read_timeout_s):
                        size_line = await reader.readuntil(b"\r\n")
                        size = int(size_line.split(b";", 1)[0], 16)
                        if size == 0:
                            await reader.readuntil(b"\r\n")  # no trailers from our hosts
                            break
                        data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._length is not None:
                left = self._length
                while left:
                    async with asyncio.timeout(self._read_timeout_s):
                        data = await reader.read(min(left, 65536))
                    if not data:
                        raise HostStreamError("the host closed the connection mid-body")
                    left -= len(data)
                    yield data
            else:  # delimited by the connection's end
                while True:
                    async with asyncio.timeout(self._read_timeout_s):
                        data = await reader.read(65536)
                    if not data:
                        break
                    yield data
                connection.close()
                self._connection = None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                TimeoutError) as exc:  # fmt: skip
            self._drop()
            raise HostStreamError(f"the host's response broke off: {exc!r}") from exc
        self._complete = True

    async def aclose(self) -> None:
        connection = self._connection
        self._connection = None
        if connection is None:
            return
        if self._complete and self.headers.get("connection", "").lower() != "close":
            self._pool.release(self._origin, connection)
        else:
            connection.close()

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class HostPool:
    """Keep-alive connections per host origin. Used from one event loop."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> HostResponse:
        """POST `body` (JSON) to `url`; the response once its head arrived."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise HostUnreachable(f"not an http:// URL: {url!r}")
        origin = (parts.hostname, parts.port or 80)
        path = parts.path or "/"
        head = [f"POST {path} HTTP/1.1", f"host: {parts.netloc}",
                "content-type: application/json", f"content-length: {len(body)}"]  # fmt: skip
        head += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        connection = self._idle_connection(origin)
        if connection is not None:
            try:
                return await self._exchange(origin, connection, request)
            except _StaleConnection:
                pass  # the host closed the idle connection meanwhile: once more on a new one
        return await self._exchange(origin, await self._connect(origin), request)

    def release(self, origin: tuple[str, int], connection: _Connection) -> None:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= MAX_IDLE_PER_HOST:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()

    def _idle_connection(self, origin: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable(now):
                return connection
            connection.close()
        return None

    async def _connect(self, origin: tuple[str, int]) -> _Connection:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection(*origin, limit=MAX_HEAD_BYTES)
        except (OSError, TimeoutError) as exc:
            raise HostUnreachable(f"cannot connect to {origin[0]}:{origin[1]}: {exc!r}") from exc
        return _Connection(reader, writer)

    async def _exchange(
        self, origin: tuple[str, int], connection: _Connection, request: bytes
    ) -> HostResponse:
        try:
            connection.writer.write(request)
            async with asyncio.timeout(self.read_timeout_s):
                await connection.writer.drain()
                raw = await connection.reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                TimeoutError) as exc:  # fmt: skip
            connection.close()
            closed = isinstance(exc, ConnectionResetError | BrokenPipeError) or (
                isinstance(exc, asyncio.IncompleteReadError) and not exc.partial
            )
            error = _StaleConnection if closed else HostUnreachable
            raise error(f"no answer from {origin[0]}:{origin[1]}: {exc!r}") from exc
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            connection.close()
            raise HostUnreachable(f"not an HTTP response: {lines[0][:80]!r}") from None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return HostResponse(self, origin, connection, status, headers, self.read_timeout_s)
