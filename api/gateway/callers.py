"""Who is calling and what they may call: tenants' API keys and model names, cached briefly.

A key's tenant (and the tenant's rate limits) is cached for `ttl_s` seconds by the key's
SHA-256, a refused key for `negative_ttl_s`; a model name's resolution per tenant for `ttl_s`.
So a revoked key, a deleted model or a changed limit takes effect within `ttl_s` seconds, and
the database sees one lookup per key (and per model) per interval, however many requests come
at once: they share the lookup, and a key in use is looked up again before its entry expires.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

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
    """Entries with an expiry, loaded once however many requests miss at the same moment
    (they await the one load), and reloaded in the background during the last
    `REFRESH_AHEAD` of their life, so steady traffic never waits for the database."""

    REFRESH_AHEAD = 0.2

    def __init__(self, clock: Callable[[], float]) -> None:
        self._entries: dict[K, tuple[float, float, V]] = {}  # key -> (loaded at, expiry, value)
        self._loading: dict[K, asyncio.Future[V]] = {}
        self._clock = clock

    async def get(self, key: K, load: Callable[[], Awaitable[V]], ttl: Callable[[V], float]) -> V:
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None and entry[1] > now:
            loaded_at, expiry, value = entry
            if now > expiry - (expiry - loaded_at) * self.REFRESH_AHEAD:
                self._load(key, load, ttl)  # the entry still answers meanwhile
            return value
        return await asyncio.shield(self._load(key, load, ttl))

    def _load(
        self, key: K, load: Callable[[], Awaitable[V]], ttl: Callable[[V], float]
    ) -> asyncio.Future[V]:
        pending = self._loading.get(key)
        if pending is not None:
            return pending

        async def run() -> V:
            try:
                value = await load()
                self._put(key, value, ttl(value))
                return value
            finally:
                del self._loading[key]

        future = asyncio.ensure_future(run())
        self._loading[key] = future
        future.add_done_callback(_retrieve_exception)
        return future

    def _put(self, key: K, value: V, ttl_s: float) -> None:
        now = self._clock()
        if len(self._entries) >= MAX_ENTRIES:
            self._entries = {k: v for k, v in self._entries.items() if v[1] > now}
            if len(self._entries) >= MAX_ENTRIES:
                self._entries.clear()
        self._entries[key] = (now, now + ttl_s, value)


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    """A background reload that failed is not an unhandled error (the next request retries)."""
    if not future.cancelled():
        future.exception()


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

    def _ttl(self, value: object) -> float:
        return self.ttl_s if value is not None else self.negative_ttl_s

    async def caller(self, key: str) -> Caller | None:
        """The tenant calling with `key`, or None (unknown, revoked, or not a tenant's key)."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        return await self._keys.get(digest, partial(db_call, _caller_of, key=key), self._ttl)

    async def target(self, caller: Caller, model: str) -> InferenceTarget | None:
        """What `model` is for the caller's tenant, or None when it may not call it."""
        load = partial(db_call, _target_of, tenant_id=caller.tenant_id, model=model)
        return await self._targets.get((caller.tenant_id, model), load, self._ttl)
