"""API-key checks: a callable so the control plane can plug in its own."""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable

ApiKeyChecker = Callable[[str | None], bool]
"""Returns True when the bearer key (None when absent) may use the server."""

API_KEYS_ENV = "HARLI_INFERENCE_API_KEYS"


def static_key_checker(keys: Iterable[str]) -> ApiKeyChecker:
    """Accept exactly `keys` (compared in constant time). An empty set accepts nobody."""
    allowed = tuple(k.encode() for k in keys if k)

    def check(key: str | None) -> bool:
        if key is None:
            return False
        raw = key.encode()
        return any(hmac.compare_digest(raw, k) for k in allowed)

    return check


def keys_from_env(variable: str = API_KEYS_ENV) -> ApiKeyChecker:
    """Static checker over the comma-separated keys in an environment variable."""
    return static_key_checker(k.strip() for k in os.environ.get(variable, "").split(","))
