"""`system_fingerprint`: one stable string per engine configuration, on every completion and
chat response and stream chunk (OpenAI's field: it changes when what produces the tokens
changes, so a client comparing outputs across requests can tell whether they came from the
same backend).

It is ``"fp_"`` + the first 12 hex digits of a SHA-256 over: the served base model's name, the
model's architecture figures and weights dtype, every `EngineConfig` field (KV layout, batch
limits, attention backend, kernels, device), and :data:`FINGERPRINT_VERSION`. Two servers with
the same model and settings give the same fingerprint; changing any of them changes it.
Adapters do not enter it (the request's `model` already names the adapter)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from gpu_runtime.engine import Engine

FINGERPRINT_VERSION = 1
"""Bump when a change to the runtime alters the tokens a configuration produces (sampling,
kernels' numerics), so fingerprints before and after differ."""


def system_fingerprint(engine: Engine, model_name: str) -> str:
    """The fingerprint of `engine` serving base model `model_name` (see the module docstring)."""
    weight = next(iter(engine.runner.model.parameters()), None)
    parts: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "model": model_name,
        "model_config": _plain(engine.model_config),
        "dtype": str(weight.dtype) if weight is not None else None,
        "engine": _plain(engine.config),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode())
    return "fp_" + digest.hexdigest()[:12]


def _plain(config: Any) -> Any:
    if config is not None and dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return repr(config)
