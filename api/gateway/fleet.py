"""The gateway's view of the fleet: routable hosts from the database, refreshed in the
background every `refresh_s` (a request never waits for the database once a view exists),
plus what only this gateway knows: its open requests per host, and hosts it failed to reach
in the last `eject_s` seconds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from api.gateway.db import db_call
from api.gateway.routing import HostCandidate
from api.gateway.selectors import routable_hosts

logger = logging.getLogger("harli.gateway")


class FleetView:
    def __init__(
        self,
        refresh_s: float = 0.5,
        eject_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        load: Callable[[], list[HostCandidate]] = routable_hosts,
    ) -> None:
        self.refresh_s = refresh_s
        self.eject_s = eject_s
        self._clock = clock
        self._load = load
        self._hosts: list[HostCandidate] | None = None
        self._loaded_at = 0.0
        self._refreshing: asyncio.Task[Any] | None = None
        self._ejected: dict[str, float] = {}
        self.open_requests: dict[str, int] = {}

    async def hosts(self) -> list[HostCandidate]:
        """The routable hosts: the current view, refreshed in the background when it is older
        than `refresh_s` (the first call waits for it)."""
        if self._hosts is None:
            await self._refresh()
        elif self._clock() - self._loaded_at > self.refresh_s and self._refreshing is None:
            self._refreshing = asyncio.create_task(self._refresh())
        return self._hosts or []

    async def _refresh(self) -> None:
        try:
            hosts = await db_call(self._load)
        except Exception:  # the database is away: keep routing by the last view
            logger.exception("cannot read the fleet; routing by the view of %.1f s ago",
                             self._clock() - self._loaded_at)  # fmt: skip
            hosts = self._hosts if self._hosts is not None else []
        finally:
            self._refreshing = None
        self._hosts = hosts
        self._loaded_at = self._clock()

    def eject(self, host: str) -> None:
        self._ejected[host] = self._clock() + self.eject_s

    def ejected(self) -> frozenset[str]:
        now = self._clock()
        if not self._ejected:
            return frozenset()
        self._ejected = {h: until for h, until in self._ejected.items() if until > now}
        return frozenset(self._ejected)

    def opened(self, host: str) -> None:
        self.open_requests[host] = self.open_requests.get(host, 0) + 1

    def closed(self, host: str) -> None:
        left = self.open_requests.get(host, 1) - 1
        if left > 0:
            self.open_requests[host] = left
        else:
            self.open_requests.pop(host, None)
