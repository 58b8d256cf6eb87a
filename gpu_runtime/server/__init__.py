"""OpenAI-compatible inference server over the decode engine."""

from gpu_runtime.server.app import AdapterLookup, create_app
from gpu_runtime.server.auth import ApiKeyChecker, KeyGrant, keys_from_env, static_key_checker
from gpu_runtime.server.engine_loop import EngineDriver, EngineLoop, StepDriver
from gpu_runtime.server.metrics import MetricsCollector, RequestMetrics

__all__ = [
    "AdapterLookup",
    "ApiKeyChecker",
    "EngineDriver",
    "EngineLoop",
    "KeyGrant",
    "MetricsCollector",
    "RequestMetrics",
    "StepDriver",
    "create_app",
    "keys_from_env",
    "static_key_checker",
]
