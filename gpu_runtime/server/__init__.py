"""OpenAI-compatible inference server over the decode engine.

`EngineLoop`, the step drivers, the request authorities and metrics import without FastAPI (a
host agent's engine thread needs only them); `create_app` loads the web stack on first use.
"""

from typing import TYPE_CHECKING, Any

from gpu_runtime.server.auth import AccessDenied, ApiKeyChecker, ModelAccess, RequestAuth
from gpu_runtime.server.bearer_keys import BearerKeys, keys_from_env, static_key_checker
from gpu_runtime.server.engine_loop import EngineDriver, EngineLoop, StepDriver
from gpu_runtime.server.grant_auth import GatewayGrants
from gpu_runtime.server.metrics import MetricsCollector, RequestMetrics

if TYPE_CHECKING:
    from gpu_runtime.server.app import AdapterLookup, create_app

__all__ = [
    "AccessDenied",
    "AdapterLookup",
    "ApiKeyChecker",
    "BearerKeys",
    "EngineDriver",
    "EngineLoop",
    "GatewayGrants",
    "MetricsCollector",
    "ModelAccess",
    "RequestAuth",
    "RequestMetrics",
    "StepDriver",
    "create_app",
    "keys_from_env",
    "static_key_checker",
]


def __getattr__(name: str) -> Any:
    if name in ("create_app", "AdapterLookup"):
        from gpu_runtime.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'gpu_runtime.server' has no attribute {name!r}")
