"""OpenAI-compatible HTTP API over an `EngineLoop`: /v1/models, /v1/completions,
/v1/chat/completions (SSE streaming with `stream: true`, usage, logprobs, system_fingerprint),
/tokenize and /detokenize, and the operator's /v1/load_lora_adapter and
/v1/unload_lora_adapter."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gpu_runtime.server import (
    adapter_routes,
    completion_routes,
    metrics_routes,
    model_routes,
    tokenize_routes,
)
from gpu_runtime.server.adapter_admin import AdapterAdmin
from gpu_runtime.server.auth import RequestAuth
from gpu_runtime.server.engine_loop import EngineLoop
from gpu_runtime.server.inference import AdapterLookup, AdapterNames, Inference, ModelLoader
from gpu_runtime.server.limits import RequestLimits
from gpu_runtime.server.metrics import MetricsCollector
from gpu_runtime.server.prometheus import ServerMetrics
from gpu_runtime.server.protocol import REQUEST_FIELD_ERROR, OpenAIError
from gpu_runtime.server.request_ids import RequestIdMiddleware

__all__ = ["AdapterLookup", "AdapterNames", "ModelLoader", "RequestLimits", "create_app"]


def create_app(
    engine_loop: EngineLoop,
    model_name: str | Callable[[], str],
    auth: RequestAuth,
    metrics: MetricsCollector | None = None,
    adapter_lookup: AdapterLookup | None = None,
    adapter_names: AdapterNames | None = None,
    model_loader: ModelLoader | None = None,
    limits: RequestLimits | None = None,
    prometheus: ServerMetrics | None = None,
    metrics_token: str | None = None,
    adapter_admin: AdapterAdmin | None = None,
) -> FastAPI:
    """The FastAPI app. `engine_loop` must be started by the caller. `model_name` is the base
    model's name (or a callable giving it now, for a host that may load another base model).
    `auth` turns each request's headers into its `ModelAccess` (refused: 401; `/health` asks
    for nothing); models outside it read as nonexistent. `adapter_lookup` routes model names
    to adapters and `adapter_names` lists them; both default to the engine's LoRA runtime
    (`engine.lora`, read per request: an adapter is served under its own name), and to no
    adapters without one. A `model` that is neither the base model nor an adapter gets a 404
    `model_not_found`, unless `model_loader` claims it, the access allows it by name
    (`ModelAccess.allows_unlisted`) and the loader can serve it (a checkpoint, loaded on its
    first request). The engine (tokenizer, limits) is read from the loop per request too.
    `limits` caps each request's prompts and prompt tokens (default `RequestLimits()`: 256
    prompts, 32 contexts of tokens); past one the request is a 400 and reaches no engine.
    `prometheus` (default: a new `ServerMetrics`) is what `GET /metrics` serves, to a scrape
    bearing `metrics_token` (`metrics_routes`; without a token the route is off).
    `adapter_admin` opens the operator's adapter routes (`adapter_routes`: load and unload
    adapters at run time, behind its token); without it they answer 404.

    Each request's log lines carry its `x-request-id` (`request_ids`)."""
    if engine_loop.engine.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer")
    collector = metrics or MetricsCollector()
    app = FastAPI(title="Harli inference", version="1")
    app.state.metrics = collector
    app.state.engine_loop = engine_loop
    app.state.prometheus = prometheus = prometheus or ServerMetrics()
    app.state.metrics_token = metrics_token
    app.state.adapter_admin = adapter_admin
    app.state.inference = Inference(
        engine_loop,
        model_name,
        auth,
        collector,
        adapter_lookup,
        adapter_names,
        model_loader,
        limits or RequestLimits(),
        prometheus,
    )
    app.exception_handler(OpenAIError)(_openai_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.include_router(model_routes.router)
    app.include_router(completion_routes.router)
    app.include_router(metrics_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(adapter_routes.router)
    app.add_middleware(RequestIdMiddleware)
    return app


async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """The first error as OpenAI's 400: `param` is the field's path in the body (for a
    refused field, `protocol.REQUEST_FIELD_ERROR`, the field its context names); an
    undeclared field reads as OpenAI words it."""
    first = exc.errors()[0] if exc.errors() else {}
    path = [str(p) for p in first.get("loc", ())[1:]]
    kind = first.get("type")
    if kind == REQUEST_FIELD_ERROR:
        path.append(str(first.get("ctx", {}).get("field")))
    param = ".".join(path) or None
    if kind == REQUEST_FIELD_ERROR:
        message = str(first.get("msg"))
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = (
            f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg"))
        )
    return JSONResponse(OpenAIError(400, message, param=param).body(), status_code=400)
