"""API-key checks: a callable so the control plane (or a host agent) can plug in its own."""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KeyGrant:
    """An accepted key. `models` are the model names it may call (None: every model the server
    serves); any other model reads as nonexistent to it (404, never 403), unless `unlisted`
    grants it by name."""

    models: frozenset[str] | None = None
    unlisted: Callable[[str], bool] | None = field(default=None, compare=False)
    """Whether the key may call a model its list leaves out (a job's checkpoint: the control
    plane lists none, as OpenAI's `/v1/models` does not), asked per name; may block."""

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    def allows_unlisted(self, model: str) -> bool:
        """`allows`, else the answer of `unlisted` (may block: call it from a worker thread)."""
        if self.allows(model):
            return True
        return self.unlisted is not None and self.unlisted(model)


ApiKeyChecker = Callable[[str | None], KeyGrant | None]
"""The bearer key's grant (the key is None when absent), or None to refuse it (401). May block
(it runs in a worker thread, not on the event loop)."""

API_KEYS_ENV = "HARLI_INFERENCE_API_KEYS"
ALL_MODELS = KeyGrant()


def static_key_checker(keys: Iterable[str]) -> ApiKeyChecker:
    """Accept exactly `keys` (compared in constant time) for every model. An empty set accepts
    nobody."""
    allowed = tuple(k.encode() for k in keys if k)

    def check(key: str | None) -> KeyGrant | None:
        if key is None:
            return None
        raw = key.encode()
        return ALL_MODELS if any(hmac.compare_digest(raw, k) for k in allowed) else None

    return check


def keys_from_env(variable: str = API_KEYS_ENV) -> ApiKeyChecker:
    """Static checker over the comma-separated keys in an environment variable."""
    return static_key_checker(k.strip() for k in os.environ.get(variable, "").split(","))
