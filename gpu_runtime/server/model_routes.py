"""Routes that describe what the host serves: ``/health`` (no credential) and ``/v1/models``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gpu_runtime.server.auth import ModelAccess
from gpu_runtime.server.inference import Inference, inference_of, require_access

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, Any]:
    """Liveness, no credential, so it says only that the server answers: what a host serves
    reaches the control plane in heartbeats, and a request's access shows it in
    `/v1/models`."""
    return {"status": "ok"}


@router.get("/v1/models")
async def list_models(
    access: ModelAccess = Depends(require_access), inference: Inference = Depends(inference_of)
) -> dict[str, Any]:
    """The base model, then each adapter (`parent` = the base model), as far as the request's
    access reaches."""
    name = inference.base_name()
    base: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "harli"}
    entries = [base] + [base | {"id": a, "parent": name} for a in inference.served_adapters()]
    return {"object": "list", "data": [m for m in entries if access.allows(str(m["id"]))]}
