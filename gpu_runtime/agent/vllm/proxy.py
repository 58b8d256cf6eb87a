"""The inference server of a vLLM host: the gateway's grant checked here, the request passed
through to vLLM on loopback.

vLLM listens on 127.0.0.1 with an API key only the agent knows, so this app is the host's only
way in and the heartbeat's `server_url` is this app's. Rules:

- `GET /health` answers vLLM's health (200, else 503); it needs nothing.
- Every other route needs a request the host's `RequestAuth` (`agent.host_auth`: the gateway's
  grant, tenants' keys with `--allow-tenant-keys`) accepts; refused: 401.
- `POST /v1/completions` and `/v1/chat/completions` need a `model` the access allows and the
  host serves (its base model or a loaded adapter); else 404 `model_not_found`, as the Harli
  server answers. The body goes to vLLM unchanged and its answer (streamed or not) comes back
  as vLLM sent it, with the request's `x-request-id`. While vLLM cannot be reached (it is
  restarting) the answer is 503 `engine_unavailable`.
- `GET /v1/models` lists vLLM's models the access allows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gpu_runtime.server.auth import AccessDenied, ModelAccess, RequestAuth
from gpu_runtime.server.protocol import OpenAIError

logger = logging.getLogger(__name__)
REQUEST_ID = "x-request-id"


def _error(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def create_proxy_app(
    upstream: str, api_key: str, auth: RequestAuth, served: Callable[[], set[str]]
) -> FastAPI:
    """The app over vLLM at `upstream` (its root), calling it with `api_key`; `served` gives
    the names the host serves now (base model and adapters)."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="harli vLLM host", lifespan=lifespan)
    secret = {"Authorization": f"Bearer {api_key}"}

    async def access(request: Request) -> ModelAccess:
        try:
            return await auth.access(request.headers)
        except AccessDenied as exc:
            logger.warning("refused %s %s: %s", request.method, request.url.path, exc)
            message = "Missing or invalid credentials."
            raise OpenAIError(401, message, code="invalid_api_key") from None

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return _error(exc)

    @app.get("/health")
    async def health() -> Response:
        try:
            answer = await client.get("/health")
        except httpx.HTTPError:
            return Response(status_code=503)
        return Response(status_code=200 if answer.status_code == 200 else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        granted = await access(request)
        try:
            answer = await client.get("/v1/models", headers=secret)
        except httpx.HTTPError:
            raise OpenAIError(503, "The engine is not available; retry.", "server_error",
                              code="engine_unavailable") from None  # fmt: skip
        listing = answer.json()
        listing["data"] = [m for m in listing.get("data", []) if granted.allows(str(m["id"]))]
        return JSONResponse(listing, status_code=answer.status_code)

    async def passed(route: str, request: Request) -> Response:
        granted = await access(request)
        body = await request.body()
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            raise OpenAIError(400, "The body must be a JSON object.") from None
        if not isinstance(model, str) or not granted.allows(model) or model not in served():
            raise OpenAIError(404, f"The model '{model}' does not exist.", param="model",
                              code="model_not_found")  # fmt: skip
        request_id = request.headers.get(REQUEST_ID) or granted.request_id
        headers = secret | {"Content-Type": "application/json"}
        if request_id:
            headers[REQUEST_ID] = request_id
        upstream_request = client.build_request("POST", f"/v1/{route}", content=body,
                                                headers=headers)  # fmt: skip
        try:
            answer = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            logger.warning("vLLM unreachable for %s: %s", request.url.path, exc)
            raise OpenAIError(503, "The engine is not available; retry.", "server_error",
                              code="engine_unavailable") from None  # fmt: skip
        passed_headers = {"content-type": answer.headers.get("content-type", "application/json")}
        if request_id:
            passed_headers[REQUEST_ID] = request_id

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()

        return StreamingResponse(chunks(), status_code=answer.status_code, headers=passed_headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await passed("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await passed("chat/completions", request)

    return app
