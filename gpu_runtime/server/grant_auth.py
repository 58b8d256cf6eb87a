"""A host behind the gateway: requests carry the gateway's signed grant
(`gpu_runtime.contract.grants`), checked with the host's own key on the request path (one
HMAC, no network)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from gpu_runtime.contract.grants import GRANT_HEADER, GrantError, grant_verify
from gpu_runtime.server.auth import AccessDenied, ModelAccess, RequestAuth


class GatewayGrants:
    """The `RequestAuth` of a host: a request with a `GRANT_HEADER` is accepted when its grant
    verifies with `key` for `host` now, and may call exactly the grant's models (base model,
    adapter or checkpoint names; a checkpoint named there is loaded without asking the control
    plane). A request without one goes to `tenant_keys` when given (tenants calling the host
    directly, the way before the gateway), and is refused otherwise. Without a `key` every
    grant is refused."""

    def __init__(
        self,
        *,
        host: str,
        key: str | None,
        tenant_keys: RequestAuth | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self._key = key
        self.tenant_keys = tenant_keys
        self._clock = clock

    async def access(self, headers: Mapping[str, str]) -> ModelAccess:
        token = headers.get(GRANT_HEADER)
        if token is None:
            if self.tenant_keys is not None:
                return await self.tenant_keys.access(headers)
            raise AccessDenied(f"no {GRANT_HEADER} header")
        if self._key is None:
            raise AccessDenied("this host has no host key to verify grants with")
        try:
            grant = grant_verify(token, self._key, host=self.host, now=self._clock())
        except GrantError as exc:
            raise AccessDenied(str(exc)) from None
        return ModelAccess(
            models=frozenset(grant.models), tenant=grant.tenant, request_id=grant.request_id
        )
