"""OpenAI-compatible inference server over the decode engine."""

from gpu_runtime.server.app import AdapterLookup, create_app
from gpu_runtime.server.auth import ApiKeyChecker, keys_from_env, static_key_checker
from gpu_runtime.server.engine_loop import EngineLoop
from gpu_runtime.server.metrics import MetricsCollector, RequestMetrics

__all__ = [
    "AdapterLookup",
    "ApiKeyChecker",
    "EngineLoop",
    "MetricsCollector",
    "RequestMetrics",
    "create_app",
    "keys_from_env",
    "static_key_checker",
]
