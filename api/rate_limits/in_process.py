"""The embedded limiter: buckets in this process's memory."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from api.rate_limits.bucket import check_integer, clamped, holds, refilled, seconds_to_full
from api.rate_limits.decision import RateDecision
from api.rate_limits.limiter import RateLimiter
from api.rate_limits.limits import Limits

DEFAULT_MAX_BUCKETS = 100_000

_Key = tuple[str, str]  # (tenant, "requests" | "tokens")


class InProcessRateLimiter(RateLimiter):
    """Buckets held in a dict, for one gateway process (several processes each get their own
    allowance: use `RedisRateLimiter` to share one).

    A bucket is stored only while it is not full, as (level, time of that level, capacity);
    a missing bucket is full. Memory is bounded: the least recently used bucket is dropped
    once it has refilled, and past `max_buckets` the least recently used is dropped anyway
    (which forgives what it had spent). Every operation runs under one lock without awaiting,
    so it is atomic for coroutines and threads alike.

    `clock` gives seconds on a monotonic scale (tests inject one).
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_buckets: int = DEFAULT_MAX_BUCKETS,
    ) -> None:
        if max_buckets < 2:
            raise ValueError(f"max_buckets must be >= 2 (one tenant's pair), got {max_buckets}")
        self._clock = clock
        self._max_buckets = max_buckets
        self._buckets: OrderedDict[_Key, tuple[float, float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many buckets are held (the ones not full)."""
        return len(self._buckets)

    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> RateDecision:
        check_integer("tokens", tokens, minimum=0)
        if limits.unlimited:
            return RateDecision(allowed=True)
        with self._lock:
            now = self._clock()
            wanted = [
                ((tenant, kind), capacity, cost)
                for kind, capacity, cost in (
                    ("requests", limits.requests_per_minute, 1),
                    ("tokens", limits.tokens_per_minute, tokens),
                )
                if capacity is not None
            ]
            levels = {key: self._level(key, capacity, now) for key, capacity, _ in wanted}
            allowed = all(holds(levels[key], cost) for key, _, cost in wanted)
            if allowed:
                for key, capacity, cost in wanted:
                    levels[key] -= cost
                    self._store(key, levels[key], capacity, now)
                self._sweep(now)
        return RateDecision.from_levels(
            limits=limits,
            tokens=tokens,
            allowed=allowed,
            request_level=levels.get((tenant, "requests")),
            token_level=levels.get((tenant, "tokens")),
        )

    async def settle(self, tenant: str, limits: Limits, tokens_delta: int) -> None:
        check_integer("tokens_delta", tokens_delta)
        capacity = limits.tokens_per_minute
        if capacity is None or tokens_delta == 0:
            return
        key = (tenant, "tokens")
        with self._lock:
            now = self._clock()
            level = clamped(self._level(key, capacity, now) - tokens_delta, capacity)
            self._store(key, level, capacity, now)
            self._sweep(now)

    def _level(self, key: _Key, capacity: int, now: float) -> float:
        stored = self._buckets.get(key)
        if stored is None:
            return float(capacity)
        level, at, _ = stored
        return refilled(min(level, float(capacity)), now - at, capacity)

    def _store(self, key: _Key, level: float, capacity: int, now: float) -> None:
        level = clamped(level, capacity)
        if level >= capacity:
            self._buckets.pop(key, None)
            return
        self._buckets[key] = (level, now, capacity)
        self._buckets.move_to_end(key)

    def _sweep(self, now: float) -> None:
        """Drop refilled buckets from the least recently used end, then any over the bound."""
        while self._buckets:
            key, (level, at, capacity) = next(iter(self._buckets.items()))
            if now - at < seconds_to_full(level, capacity):
                break
            del self._buckets[key]
        while len(self._buckets) > self._max_buckets:
            self._buckets.popitem(last=False)
