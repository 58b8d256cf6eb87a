"""Sending a request to the hosts that can serve it: the ranked hosts in order, each with a
grant signed for it, retrying one other host when the first refuses or fails before its first
byte. Every routing decision is logged (logger `harli.gateway`) with its reason."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from api.errors import HarliError
from api.gateway.callers import Caller
from api.gateway.fleet import FleetView
from api.gateway.host_http import HostPool, HostResponse, HostUnreachable
from api.gateway.requests import InferenceRequest
from api.gateway.routing import HostCandidate, rank_hosts
from api.gateway.selectors import InferenceTarget
from gpu_runtime.contract.grants import GRANT_HEADER, GRANT_TTL_S, Grant, grant_sign, host_key

logger = logging.getLogger("harli.gateway")

RETRY_STATUSES = frozenset({404, 429, 500, 502, 503, 504})
"""A host's answers that another host may not give: the model is not there (yet), the host is
full, or it failed. 401 is retried too (a host with a stale key) and logged as an error."""
MAX_ATTEMPTS = 2


class UpstreamUnavailable(HarliError):
    http_status = 503
    error_type = "server_error"


class Upstream:
    """One per gateway process; `client` is its pool of connections to the hosts."""

    def __init__(
        self,
        *,
        secret: str,
        fleet: FleetView,
        client: HostPool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.fleet = fleet
        self.client = client
        self._secret = secret
        self._keys: dict[str, str] = {}
        self._clock = clock

    def _grant(self, host: str, caller: Caller, target: InferenceTarget, rid: str) -> str:
        key = self._keys.get(host)
        if key is None:
            key = self._keys[host] = host_key(self._secret, host)
        grant = Grant(host, caller.tenant, (target.model,), self._clock() + GRANT_TTL_S, rid)
        return grant_sign(grant, key)

    async def open(
        self, request: InferenceRequest, target: InferenceTarget, caller: Caller, rid: str
    ) -> tuple[HostCandidate, HostResponse]:
        """The first host's response whose headers arrived and that did not refuse (or the last
        refusal, passed on to the client). The caller must close the response and call
        `fleet.closed(host.name)`. UpstreamUnavailable when no host can be reached."""
        ranked = rank_hosts(
            await self.fleet.hosts(),
            base_model=target.base_model,
            model=target.model,
            open_requests=self.fleet.open_requests,
            ejected=self.fleet.ejected(),
        )
        if not ranked:
            logger.warning("route %s model=%s: no online host serves %s", rid, target.model,
                           target.base_model)  # fmt: skip
            raise UpstreamUnavailable(
                f"No host is serving the model '{target.model}' right now; try again shortly.",
                code="model_unavailable",
            )
        body = request.upstream_body()
        attempts = ranked[:MAX_ATTEMPTS]
        for attempt, choice in enumerate(attempts):
            host = choice.host
            last = attempt == len(attempts) - 1
            logger.info(
                "route %s tenant=%s model=%s -> %s (%s; %s)", rid, caller.tenant, target.model,
                host.name, "retry" if attempt else f"best of {len(ranked)}", choice.reason,
            )  # fmt: skip
            self.fleet.opened(host.name)
            try:
                response = await self._send(host, request, body, caller, target, rid)
            except HostUnreachable as exc:
                self.fleet.closed(host.name)
                self.fleet.eject(host.name)
                logger.warning("route %s: host %s failed before its first byte: %r", rid,
                               host.name, exc)  # fmt: skip
                if last:
                    raise UpstreamUnavailable(
                        "The hosts serving this model could not be reached; try again.",
                        code="upstream_unavailable",
                    ) from None
                continue
            except BaseException:  # cancelled: the client left
                self.fleet.closed(host.name)
                raise
            refused = response.status_code in RETRY_STATUSES or response.status_code == 401
            if refused and not last:
                await response.aread()
                await response.aclose()
                self.fleet.closed(host.name)
                if response.status_code >= 500:
                    self.fleet.eject(host.name)
                log = logger.error if response.status_code == 401 else logger.warning
                log("route %s: host %s refused with %d: %s", rid, host.name,
                    response.status_code, response.text[:200])  # fmt: skip
                continue
            return host, response
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _send(
        self,
        host: HostCandidate,
        request: InferenceRequest,
        body: bytes,
        caller: Caller,
        target: InferenceTarget,
        rid: str,
    ) -> HostResponse:
        headers = {GRANT_HEADER: self._grant(host.name, caller, target, rid), "x-request-id": rid}
        return await self.client.post(request.host_url(host.server_url), body, headers)
