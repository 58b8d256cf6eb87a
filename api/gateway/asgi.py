"""The control plane's ASGI application: the gateway's inference paths, Django for the rest.

`with_gateway(django_app)` wraps Django's ASGI handler. The gateway answers
`POST /v1/completions`, `POST /v1/chat/completions`, `POST /tokenize` and `POST /detokenize`
(`requests.ROUTES`) as a plain ASGI app (no Django request cycle per event of a stream); every
other path, `GET /v1/models` included, goes to Django,
except an upload whose declared size is too large for its route: it is refused from its
headers here, since Django reads a whole body before its middleware runs. The
wrapper owns the ASGI lifespan: at startup it starts the gateway's background work (usage
flushes), at shutdown it flushes the usage still in memory and closes the connections to the
hosts. Servers without lifespan events get the same start on the first request. Usage leaves
memory for the database every `HARLI_USAGE_FLUSH_INTERVAL_S` (one batch of rows per flush).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from django.conf import settings

from api.gateway.app import Gateway
from api.gateway.asgi_io import Receive, Scope, Send, header, send_whole
from api.gateway.callers import Callers
from api.gateway.fleet import FleetView
from api.gateway.host_http import HostPool
from api.gateway.upstream import Upstream
from api.middleware import declared_size_refusal
from api.rate_limits import rate_limiter_from_settings
from api.usage_recorder import UsageRecorder

logger = logging.getLogger("harli.gateway")


def build_gateway() -> Gateway:
    if not settings.GATEWAY_SECRET:
        raise RuntimeError("GATEWAY_SECRET is empty: set HARLI_GATEWAY_SECRET")
    client = HostPool(settings.GATEWAY_CONNECT_TIMEOUT_S, settings.GATEWAY_READ_TIMEOUT_S)
    fleet = FleetView()
    return Gateway(
        callers=Callers(ttl_s=settings.GATEWAY_KEY_CACHE_TTL_S),
        upstream=Upstream(secret=settings.GATEWAY_SECRET, fleet=fleet, client=client),
        limiter=rate_limiter_from_settings(),
        usage=UsageRecorder(),
        max_body_bytes=settings.GATEWAY_MAX_BODY_BYTES,
    )


class ControlPlaneApp:
    """See the module docstring."""

    def __init__(self, django_app: Any, gateway: Gateway) -> None:
        self.django_app = django_app
        self.gateway = gateway
        self._flusher: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" and Gateway.handles(scope["path"]):
            self.start()
            await self.gateway(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http" and (refusal := _declared_size_refusal(scope)) is not None:
            # Django reads the whole body before its middleware runs: refuse from the headers
            await send_whole(send, refusal.status_code, refusal.content,
                             [(b"content-type", b"application/json")])  # fmt: skip
        else:
            await self.django_app(scope, receive, send)

    def start(self) -> None:
        if self._flusher is None:
            self._flusher = asyncio.create_task(self.gateway.usage.flush_every())

    async def stop(self) -> None:
        """Flush the usage in memory (the flusher's last flush), close the connections."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        else:
            await self.gateway.usage.aflush()
        await self.gateway.upstream.client.aclose()
        await self.gateway.limiter.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _declared_size_refusal(scope: Scope) -> Any:
    return declared_size_refusal(
        str(scope.get("method", "")), scope["path"], header(scope, b"content-length")
    )


def with_gateway(django_app: Any) -> ControlPlaneApp:
    return ControlPlaneApp(django_app, build_gateway())
