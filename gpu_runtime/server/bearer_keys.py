"""Requests authenticated by their `Authorization: Bearer` key: the stand-alone server's static
keys, or a host's tenant keys checked against the control plane (`gpu_runtime.agent.auth`)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace

from gpu_runtime.server.auth import ALL_MODELS, AccessDenied, ApiKeyChecker, ModelAccess

API_KEYS_ENV = "HARLI_INFERENCE_API_KEYS"


class BearerKeys:
    """The `RequestAuth` of a bearer key, checked by `checker` in a worker thread (a checker
    may ask the control plane). An access that names no tenant gets the key's fingerprint
    (`ModelAccess.key_id`), so requests of different keys are admitted in turn."""

    def __init__(self, checker: ApiKeyChecker) -> None:
        self.checker = checker

    async def access(self, headers: Mapping[str, str]) -> ModelAccess:
        header = headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not key:
            raise AccessDenied("no bearer key")
        access = await asyncio.to_thread(self.checker, key)
        if access is None:
            raise AccessDenied("the bearer key was refused")
        if not access.tenant and not access.key_id:
            access = replace(access, key_id=key_fingerprint(key))
        return access


def key_fingerprint(key: str) -> str:
    """The first 16 hex digits of the key's SHA-256: tells keys apart, reveals nothing."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def static_key_checker(keys: Iterable[str]) -> ApiKeyChecker:
    """Accept exactly `keys` (compared in constant time) for every model. An empty set accepts
    nobody."""
    allowed = tuple(k.encode() for k in keys if k)

    def check(key: str | None) -> ModelAccess | None:
        if key is None:
            return None
        raw = key.encode()
        return ALL_MODELS if any(hmac.compare_digest(raw, k) for k in allowed) else None

    return check


def keys_from_env(variable: str = API_KEYS_ENV) -> ApiKeyChecker:
    """Static checker over the comma-separated keys in an environment variable."""
    return static_key_checker(k.strip() for k in os.environ.get(variable, "").split(","))
