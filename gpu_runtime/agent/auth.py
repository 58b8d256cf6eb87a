"""Tenants' API keys, checked against the control plane and cached with a TTL: the way a host
took requests before the gateway, on only with `--allow-tenant-keys` (`agent.host_auth`).

The agent asks the control plane's public `GET /v1/models` with the tenant's key: 200 means
the key is active, and its list is exactly the models that tenant may call (base models and
its own adapters), so the same call authenticates and authorises. 401/403 means the key is
bad or revoked. Answers are cached by the key's SHA-256 for `ttl_s` seconds (failures for
`min(ttl_s, negative_ttl_s)`), so a revoked key stops working on a host at most `ttl_s` seconds
after revocation, and the control plane sees at most one check per key per TTL per host.
When the control plane cannot be reached, the key is refused (fail closed).

The list leaves out jobs' checkpoints (OpenAI's does too), so an access also answers for a
model it does not list by asking `GET /v1/models/{name}` with the same key
(`ModelAccess.unlisted`):
200 allows it, anything else refuses it. Those answers are cached per key and name with the
same TTLs, so a deleted or pruned checkpoint is refused within `ttl_s` seconds too.

A `KeyVerifier` is an `ApiKeyChecker` (`gpu_runtime.server.auth`): called with a key it returns
the key's access, or None to refuse it (401). `BearerKeys` calls it from a worker thread, so the
blocking lookup never stalls the event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from gpu_runtime.server.auth import ModelAccess

logger = logging.getLogger(__name__)


class KeyRejected(PermissionError):
    """The key is missing, unknown, revoked, or cannot be checked now."""


class KeyVerifier:
    """See the module docstring. Thread-safe."""

    def __init__(
        self,
        control_url: str,
        ttl_s: float = 10.0,
        negative_ttl_s: float = 2.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0 or negative_ttl_s < 0:
            raise ValueError(f"TTLs must be >= 0, got {ttl_s}, {negative_ttl_s}")
        self.control_url = control_url.rstrip("/")
        self.ttl_s = ttl_s
        self.negative_ttl_s = min(ttl_s, negative_ttl_s)
        self.timeout_s = timeout_s
        self.clock = clock
        self._cache: dict[str, tuple[float, ModelAccess | None]] = {}
        self._named: dict[tuple[str, str], tuple[float, bool]] = {}
        self._lock = threading.Lock()
        self.lookups = 0

    def __call__(self, key: str | None) -> ModelAccess | None:
        """The key's access, or None when it is refused (the server answers 401)."""
        try:
            return self.check(key or "")
        except KeyRejected as exc:
            logger.debug("API key refused: %s", exc)
            return None

    def check(self, key: str) -> ModelAccess:
        """The key's access, or KeyRejected."""
        if not key:
            raise KeyRejected("missing API key")
        digest = hashlib.sha256(key.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            access = cached[1]
        else:
            access = self._lookup(key)
            ttl = self.ttl_s if access is not None else self.negative_ttl_s
            with self._lock:
                self._cache[digest] = (now + ttl, access)
                if len(self._cache) > 10_000:
                    self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        if access is None:
            raise KeyRejected("Incorrect API key provided.")
        # Bound to the key per call: the cache keeps digests, never the key itself.
        return replace(access, unlisted=partial(self.allows_model, key))

    def _lookup(self, key: str) -> ModelAccess | None:
        self.lookups += 1
        request = urllib.request.Request(
            f"{self.control_url}/v1/models", headers={"Authorization": f"Bearer {key}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                return None
            raise KeyRejected(f"the control plane answered {exc.code}; try again") from exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise KeyRejected(f"cannot reach the control plane to check the key: {exc}") from exc
        models = frozenset(str(entry["id"]) for entry in body.get("data", []))
        return ModelAccess(models=models)

    def allows_model(self, key: str, model: str) -> bool:
        """Whether the control plane lets `key` retrieve `model` (cached, see the module
        docstring); False when it cannot be asked (fail closed)."""
        entry = (hashlib.sha256(key.encode()).hexdigest(), model)
        now = self.clock()
        with self._lock:
            cached = self._named.get(entry)
        if cached is not None and cached[0] > now:
            return cached[1]
        allowed = self._retrieve(key, model)
        ttl = self.ttl_s if allowed else self.negative_ttl_s
        with self._lock:
            self._named[entry] = (now + ttl, allowed)
            if len(self._named) > 10_000:
                self._named = {k: v for k, v in self._named.items() if v[0] > now}
        return allowed

    def _retrieve(self, key: str, model: str) -> bool:
        self.lookups += 1
        url = f"{self.control_url}/v1/models/{urllib.parse.quote(model, safe='')}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError:
            return False
        except (urllib.error.URLError, OSError, ValueError) as exc:
            logger.warning("cannot ask the control plane about model %s: %s", model, exc)
            return False
        return isinstance(body, dict) and body.get("id") == model
