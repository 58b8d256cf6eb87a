"""The operator's adapter routes, in vLLM's shape: ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``.

Guarded by the app's `AdapterAdmin` (`create_app(adapter_admin=...)`): without one both routes
are off (404, as `/metrics` without its token); with one, a request must bear its token
(`Authorization: Bearer <token>`), else 401 — tenants' keys and the gateway's grants never
open them. A load resolves `lora_path` under the admin's roots (`AdapterAdmin.resolve`), then
registers the adapter on the engine loop thread between two steps (the adapter is read and
checked there), so it is served at once: `/v1/models` lists it and requests may name it, with
no restart. Success answers 200 with vLLM's plain-text sentence. Errors answer OpenAI's shape:
400 naming `lora_name` (empty or malformed, the base model's name, already served) or
`lora_path` (outside the roots, not a directory, not an adapter this server can serve: code
`unsupported_adapter` when the LoRA runtime refuses its config; other adapters are untouched),
404 `model_not_found` for unloading a name not served. An unload refuses new requests for the
name at once (404); requests already running with it finish.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from gpu_runtime.contract.metrics_scrape import bearer_matches
from gpu_runtime.lora.errors import AdapterConfigError
from gpu_runtime.server.adapter_admin import (
    ADAPTER_LOAD_ERRORS,
    AdapterAdmin,
    AdapterExistsError,
)
from gpu_runtime.server.inference import app_inference
from gpu_runtime.server.protocol import OpenAIError

router = APIRouter()
MAX_LORA_NAME = 256


class LoadLoraAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter body (vLLM's `LoadLoRAAdapterRequest`)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter body (vLLM's `UnloadLoRAAdapterRequest`; its optional
    `lora_int_id` is vLLM's internal id, which this server does not have)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str


async def require_admin(request: Request) -> AdapterAdmin:
    """The app's `AdapterAdmin` when the request bears its token (a dependency: checked
    before the body is read); 404 when the routes are off, 401 otherwise."""
    admin: AdapterAdmin | None = request.app.state.adapter_admin
    if admin is None:
        raise OpenAIError(404, "Not found.", code="not_found")
    if not bearer_matches(request.headers.get("authorization"), admin.token):
        raise OpenAIError(401, "Incorrect or missing admin token.", code="invalid_api_key")
    return admin


def _check_name(name: str, base_name: str) -> None:
    if not name or len(name) > MAX_LORA_NAME:
        raise OpenAIError(
            400, f"lora_name must be 1 to {MAX_LORA_NAME} characters", param="lora_name"
        )
    if any(ch.isspace() or not ch.isprintable() for ch in name):
        raise OpenAIError(
            400, "lora_name must not hold spaces or control characters", param="lora_name"
        )
    if name == base_name:
        raise OpenAIError(400, f"lora_name {name!r} is the base model's name", param="lora_name")


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(
    body: LoadLoraAdapterRequest, request: Request, admin: AdapterAdmin = Depends(require_admin)
) -> str:
    inference = app_inference(request)
    _check_name(body.lora_name, inference.base_name())
    if not body.lora_path:
        raise OpenAIError(400, "lora_path must not be empty", param="lora_path")
    try:
        directory: Path = await asyncio.to_thread(admin.resolve, body.lora_path)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="lora_path") from exc
    name = body.lora_name
    future = inference.engine_loop.run_in_loop(lambda: admin.registry.load(name, directory))
    try:
        await asyncio.wrap_future(future)
    except AdapterExistsError as exc:
        raise OpenAIError(400, str(exc), param="lora_name", code="adapter_exists") from exc
    except AdapterConfigError as exc:  # the runtime's refusal names the option
        raise OpenAIError(
            400,
            f"cannot load lora_path {body.lora_path!r}: {exc}",
            param="lora_path",
            code="unsupported_adapter",
        ) from exc
    except ADAPTER_LOAD_ERRORS as exc:
        raise OpenAIError(
            400, f"cannot load lora_path {body.lora_path!r}: {exc}", param="lora_path"
        ) from exc
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest,
    request: Request,
    admin: AdapterAdmin = Depends(require_admin),
) -> str:
    inference = app_inference(request)
    name = body.lora_name
    served = await asyncio.wrap_future(
        inference.engine_loop.run_in_loop(lambda: admin.registry.unload(name))
    )
    if not served:
        raise OpenAIError(
            404,
            f"The lora adapter '{name}' cannot be found.",
            param="lora_name",
            code="model_not_found",
        )
    return f"Success: LoRA adapter '{name}' removed successfully."
