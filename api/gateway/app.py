"""The gateway's ASGI application: authenticate the tenant, resolve the model, charge the rate
limit, route to a host (`upstream.Upstream`), relay its answer, account the usage.

Streams pass through event by event as the host sends them (no buffering); a host that fails
after the first byte ends the stream with an error event in OpenAI's shape. When the client
disconnects, the request's task is cancelled, which closes the connection to the host, and the
host aborts the request and frees its KV blocks. Every response carries `x-request-id` (the
client's own when valid, `gpu_runtime.contract.request_id`; also sent to the host, in the
`x-request-id` header and inside its grant, and on every log line of the request) and the
tenant's `x-ratelimit-*` headers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from api.errors import HarliError, error_body
from api.gateway.asgi_io import (
    JSON_HEADERS,
    SSE_HEADERS,
    BodyTooLarge,
    ClientGone,
    Headers,
    Message,
    Receive,
    Scope,
    Send,
    cancel_on_disconnect,
    header,
    read_body,
    send_json,
    send_whole,
)
from api.gateway.callers import Caller, Callers
from api.gateway.host_http import HostResponse, HostStreamError
from api.gateway.relay import StreamRelay, Usage, error_event
from api.gateway.requests import ROUTES, InferenceRequest, parse_inference_request
from api.gateway.selectors import InferenceTarget
from api.gateway.upstream import Upstream
from api.metrics import http_observe, inference_observe
from api.rate_limits import RateLimiter
from api.usage_recorder import UsageRecorder
from gpu_runtime.contract.grants import PROMPT_TOKENS_HEADER
from gpu_runtime.contract.request_id import (
    REQUEST_ID_HEADER,
    bind_log_context,
    bound_log_context,
    request_id_or_new,
)

logger = logging.getLogger("harli.gateway")


class Gateway:
    def __init__(
        self,
        *,
        callers: Callers,
        upstream: Upstream,
        limiter: RateLimiter,
        usage: UsageRecorder,
        max_body_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.callers = callers
        self.upstream = upstream
        self.limiter = limiter
        self.usage = usage
        self.max_body_bytes = max_body_bytes
        self._clock = clock

    @staticmethod
    def handles(path: str) -> bool:
        return path in ROUTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        seen = Seen()
        rid = request_id_or_new(header(scope, REQUEST_ID_HEADER.encode()))

        async def observed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen.status = int(message["status"])
            await send(message)

        try:
            with bound_log_context(request_id=rid):
                await self._handle(scope, receive, observed_send, seen, rid)
        finally:
            http_observe(scope["path"], scope["method"], seen.status,
                         time.perf_counter() - started)  # fmt: skip
            inference_observe(tenant=seen.tenant, model=seen.model, outcome=seen.outcome(),
                              prompt_tokens=seen.prompt_tokens,
                              completion_tokens=seen.completion_tokens)  # fmt: skip

    async def _handle(
        self, scope: Scope, receive: Receive, send: Send, seen: Seen, rid: str
    ) -> None:
        base: Headers = [(REQUEST_ID_HEADER.encode(), rid.encode())]
        if scope["method"] != "POST":
            body = error_body(f"Use POST for {scope['path']}.", type_="invalid_request_error",
                              param=None, code="method_not_allowed")  # fmt: skip
            await send_json(send, 405, body, base + [(b"allow", b"POST")])
            return
        try:
            raw = await read_body(receive, self.max_body_bytes)
        except BodyTooLarge:
            message = f"The request body is larger than {self.max_body_bytes} bytes."
            body = error_body(message, type_="invalid_request_error", param=None,
                              code="request_too_large")  # fmt: skip
            await send_json(send, 413, body, base)
            return
        except ClientGone:
            seen.cancelled = True
            return
        started = [False]

        async def tracked_send(message: Message) -> None:
            started[0] = True
            await send(message)

        watcher = cancel_on_disconnect(receive)
        try:
            await self._serve(scope, raw, tracked_send, rid, base, seen)
        except asyncio.CancelledError:
            if not watcher.done():
                raise
            seen.cancelled = True
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            logger.info("request %s: the client disconnected", rid)
        except HarliError as exc:
            if started[0]:
                raise
            extra = exc.headers if isinstance(exc, GatewayError) else []
            await send_json(send, exc.http_status, exc.body(), base + extra)
        finally:
            watcher.cancel()

    async def _serve(
        self, scope: Scope, raw: bytes, send: Send, rid: str, base: Headers, seen: Seen
    ) -> None:
        caller = await self._authenticate(scope)
        seen.tenant = caller.tenant
        bind_log_context(tenant=caller.tenant)
        request = parse_inference_request(scope["path"], raw)
        target = await self.callers.target(caller, request.model)
        if target is None:
            raise HarliError(f"The model '{request.model}' does not exist.", param="model",
                             code="model_not_found", http_status=404)  # fmt: skip
        decision = await self.limiter.acquire(caller.tenant, caller.limits,
                                              request.estimated_tokens)  # fmt: skip
        limit_headers = [(k.encode(), v.encode()) for k, v in decision.headers().items()]
        if not decision.allowed:
            raise _rate_limited(decision.message(), decision.kind, base + limit_headers,
                                decision.retry_after_s)  # fmt: skip
        seen.model = target.model
        outcome = Outcome()
        try:
            await self._forward(request, target, caller, rid, send, base + limit_headers, outcome)
        finally:
            usage = outcome.usage()
            seen.upstream_failed = outcome.upstream_failed
            if usage is not None:
                seen.prompt_tokens, seen.completion_tokens = (
                    usage.prompt_tokens, usage.completion_tokens)  # fmt: skip
            await self._account(caller, target, request, usage)

    async def _authenticate(self, scope: Scope) -> Caller:
        authorization = header(scope, b"authorization") or ""
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _unauthenticated(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        caller = await self.callers.caller(key)
        if caller is None:
            raise _unauthenticated(f"Incorrect API key provided: {key[:7]}...")
        return caller

    async def _forward(
        self,
        request: InferenceRequest,
        target: InferenceTarget,
        caller: Caller,
        rid: str,
        send: Send,
        headers: Headers,
        outcome: Outcome,
    ) -> None:
        host, response = await self.upstream.open(request, target, caller, rid)
        try:
            if response.status_code != 200:
                await response.aread()
                await send_whole(send, response.status_code, response.content,
                                 JSON_HEADERS + headers)  # fmt: skip
            elif request.stream:
                outcome.relay = StreamRelay(forward_usage=request.client_wants_usage)
                outcome.prompt_tokens = response.headers.get(PROMPT_TOKENS_HEADER)
                outcome.upstream_failed = not await self._relay_stream(
                    response, outcome.relay, host.name, rid, send, headers
                )
            else:
                await response.aread()
                await send_whole(send, 200, response.content, JSON_HEADERS + headers)
                outcome.whole = _usage_of(response)
        finally:
            await response.aclose()
            self.upstream.fleet.closed(host.name)

    async def _relay_stream(
        self,
        response: HostResponse,
        relay: StreamRelay,
        host: str,
        rid: str,
        send: Send,
        headers: Headers,
    ) -> bool:
        """Relay the host's stream; False when the host failed or ended it early."""
        ok = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": SSE_HEADERS + headers})  # fmt: skip
        try:
            async for chunk in response.aiter_raw():
                out = relay.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            if not relay.done:
                ok = False
                logger.warning("request %s: host %s ended the stream early", rid, host)
                await send({"type": "http.response.body", "more_body": True,
                            "body": error_event("The host ended the stream early.",
                                                "upstream_error")})  # fmt: skip
        except HostStreamError as exc:
            logger.warning("request %s: host %s failed mid-stream: %r", rid, host, exc)
            self.upstream.fleet.eject(host)
            ok = False
            event = error_event("The host serving this request failed; retry the request.",
                                "upstream_error")  # fmt: skip
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return ok

    async def _account(
        self, caller: Caller, target: InferenceTarget, request: InferenceRequest,
        usage: Usage | None,
    ) -> None:  # fmt: skip
        """Settle the rate limit's up-front charge against what was used, and record it."""
        used = usage.prompt_tokens + usage.completion_tokens if usage is not None else 0
        if not request.generates:
            used = 0  # nothing generated: the up-front charge is given back
        try:
            await self.limiter.settle(caller.tenant, caller.limits,
                                      used - request.estimated_tokens)  # fmt: skip
        except Exception:
            logger.exception("cannot settle the rate limit of %s", caller.tenant)
        if usage is not None and request.generates:
            self.usage.record(caller.tenant_id, target.model, usage.prompt_tokens,
                              usage.completion_tokens)  # fmt: skip


@dataclass
class Outcome:
    """What a request used, as far as it got (a stream cut off by either side still counts)."""

    whole: Usage | None = None
    relay: StreamRelay | None = None
    prompt_tokens: str | None = None
    """The host's `PROMPT_TOKENS_HEADER` of a stream."""
    upstream_failed: bool = False
    """The host failed or ended the stream after it started."""

    def usage(self) -> Usage | None:
        if self.relay is not None:
            return self.relay.account(self.prompt_tokens)
        return self.whole


@dataclass
class Seen:
    """What the metrics of one gateway request record (`api.metrics.inference_observe`)."""

    status: int = 500
    """The answer's status (500 when none was sent)."""
    tenant: str = ""
    model: str = ""
    cancelled: bool = False
    upstream_failed: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def outcome(self) -> str:
        if self.cancelled:
            return "cancelled"
        if self.upstream_failed or self.status >= 500:
            return "upstream_error"
        return {200: "ok", 401: "unauthenticated", 404: "model_not_found",
                429: "rate_limited"}.get(self.status, "invalid_request")  # fmt: skip


def _usage_of(response: HostResponse) -> Usage | None:
    try:
        usage = response.json().get("usage") or {}
    except (ValueError, AttributeError):
        return None
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 True)  # fmt: skip


class GatewayError(HarliError):
    """An error answered with extra response headers."""

    def __init__(self, message: str, *, headers: Headers, error_type: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers = headers
        self.error_type = error_type


def _unauthenticated(message: str) -> HarliError:
    return GatewayError(message, headers=[], error_type="invalid_request_error",
                        code="invalid_api_key", http_status=401)  # fmt: skip


def _rate_limited(message: str, kind: str, headers: Headers, retry_after_s: float) -> HarliError:
    retry = [(b"retry-after", str(max(1, math.ceil(retry_after_s))).encode())]
    return GatewayError(message, headers=headers + retry, error_type=kind,
                        code="rate_limit_exceeded", http_status=429)  # fmt: skip
