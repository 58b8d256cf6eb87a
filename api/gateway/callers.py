"""Who is calling and what they may call: tenants' API keys and model names, cached briefly.

A key's tenant (and the tenant's rate limits) is cached for `ttl_s` seconds by the key's
SHA-256, a refused key for `negative_ttl_s`; a model name's resolution per tenant for `ttl_s`.
So a revoked key, a deleted model or a changed limit takes effect within `ttl_s` seconds, and
the database sees at most one lookup per key (and per model) per interval.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from api.gateway.db import db_call
from api.gateway.selectors import InferenceTarget, inference_target_get
from api.models import Tenant
from api.rate_limits import Limits
from api.services.apikeys import api_key_authenticate

K = TypeVar("K")
V = TypeVar("V")
MAX_ENTRIES = 50_000


@dataclass(frozen=True)
class Caller:
    tenant_id: int
    tenant: str
    limits: Limits


class _TtlCache(Generic[K, V]):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._entries: dict[K, tuple[float, V]] = {}
        self._clock = clock

    def get(self, key: K) -> tuple[bool, V | None]:
        entry = self._entries.get(key)
        if entry is None or entry[0] <= self._clock():
            return False, None
        return True, entry[1]

    def put(self, key: K, value: V, ttl_s: float) -> None:
        now = self._clock()
        if len(self._entries) >= MAX_ENTRIES:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
        self._entries[key] = (now + ttl_s, value)


def _caller_of(key: str) -> Caller | None:
    api_key = api_key_authenticate(key=key)
    if api_key is None:
        return None
    tenant: Tenant | None = api_key.user.tenant
    if tenant is None:
        return None
    limits = Limits(tenant.requests_per_minute, tenant.tokens_per_minute)
    return Caller(tenant.pk, tenant.name, limits)


def _target_of(tenant_id: int, model: str) -> InferenceTarget | None:
    tenant = Tenant.objects.filter(pk=tenant_id).first()
    if tenant is None:
        return None
    return inference_target_get(tenant=tenant, model_id=model)


class Callers:
    """See the module docstring. One per gateway process, used from its event loop."""

    def __init__(
        self,
        ttl_s: float = 5.0,
        negative_ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.negative_ttl_s = min(ttl_s, negative_ttl_s)
        self._keys: _TtlCache[str, Caller | None] = _TtlCache(clock)
        self._targets: _TtlCache[tuple[int, str], InferenceTarget | None] = _TtlCache(clock)

    async def caller(self, key: str) -> Caller | None:
        """The tenant calling with `key`, or None (unknown, revoked, or not a tenant's key)."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        hit, caller = self._keys.get(digest)
        if not hit:
            caller = await db_call(_caller_of, key=key)
            self._keys.put(digest, caller, self.ttl_s if caller else self.negative_ttl_s)
        return caller

    async def target(self, caller: Caller, model: str) -> InferenceTarget | None:
        """What `model` is for the caller's tenant, or None when it may not call it."""
        entry = (caller.tenant_id, model)
        hit, target = self._targets.get(entry)
        if not hit:
            target = await db_call(_target_of, tenant_id=caller.tenant_id, model=model)
            self._targets.put(entry, target, self.ttl_s if target else self.negative_ttl_s)
        return target
