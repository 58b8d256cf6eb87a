"""The shared limiter: buckets in Redis, so every gateway process spends one allowance."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.rate_limits.bucket import check_integer
from api.rate_limits.decision import RateDecision
from api.rate_limits.limiter import RateLimiter
from api.rate_limits.limits import Limits
from api.rate_limits.unavailable import RateLimiterUnavailable

DEFAULT_KEY_PREFIX = "harli:ratelimit:"
# A dead Redis must not hold requests for long: connect and answer within these.
SOCKET_TIMEOUT_S = 1.0

# The Lua below repeats `api.rate_limits.bucket`'s arithmetic on the server, atomically.
# A bucket is a hash {level, at}; `at` is the server's clock (TIME) when `level` was true.
# A missing bucket is full; each write sets the key to expire once it has refilled, so idle
# buckets disappear and a missing key still reads as full.
_BUCKET_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local function level_of(key, capacity)
  local stored = redis.call('HMGET', key, 'level', 'at')
  if not stored[1] then return capacity end
  local elapsed = now - tonumber(stored[2])
  if elapsed < 0 then elapsed = 0 end
  return math.min(capacity, tonumber(stored[1]) + elapsed * capacity / 60)
end
local function store(key, capacity, level)
  level = math.max(0, math.min(capacity, level))
  if level >= capacity then
    redis.call('DEL', key)
    return level
  end
  redis.call('HSET', key, 'level', string.format('%.17g', level), 'at', string.format('%.17g', now))
  redis.call('PEXPIRE', key, math.ceil((capacity - level) * 60000 / capacity) + 1000)
  return level
end
"""

# KEYS: the requests bucket, the tokens bucket. ARGV: their capacities (0: no limit, the
# bucket is not touched) and their costs. Both buckets pay or neither does.
# Returns {1 allowed | 0 refused, requests level, tokens level} (levels as text, "-1": none).
ACQUIRE_LUA = (
    _BUCKET_LUA
    + """
local capacities = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local costs = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local levels = {-1, -1}
local allowed = 1
for i = 1, 2 do
  if capacities[i] > 0 then
    levels[i] = level_of(KEYS[i], capacities[i])
    if levels[i] + 1e-9 < costs[i] then allowed = 0 end
  end
end
if allowed == 1 then
  for i = 1, 2 do
    if capacities[i] > 0 then
      levels[i] = store(KEYS[i], capacities[i], levels[i] - costs[i])
    end
  end
end
return {allowed, string.format('%.17g', levels[1]), string.format('%.17g', levels[2])}
"""
)

# KEYS: the tokens bucket. ARGV: its capacity, the charge (negative: a refund).
SETTLE_LUA = (
    _BUCKET_LUA
    + """
local capacity = tonumber(ARGV[1])
local level = store(KEYS[1], capacity, level_of(KEYS[1], capacity) - tonumber(ARGV[2]))
return string.format('%.17g', level)
"""
)


class RedisRateLimiter(RateLimiter):
    """Buckets in Redis, over redis-py's asyncio client; one Lua script per call, so checking
    and paying both buckets is atomic across every process that shares the server.

    Time is the Redis server's (`TIME` inside the script), never the caller's, so gateways
    with skewed clocks agree. Keys are `<key_prefix>{<tenant>}:requests` and `...:tokens` (one
    hash slot per tenant, for Redis Cluster) and expire once their bucket has refilled.
    A Redis error becomes `RateLimiterUnavailable`, with nothing consumed.

    The client is bound to the event loop it first runs on: build the limiter inside the
    gateway's loop (its lifespan), and `aclose()` it there.
    """

    def __init__(
        self, client: Redis, *, key_prefix: str = DEFAULT_KEY_PREFIX, owns_client: bool = False
    ) -> None:
        self._client = client
        self._key_prefix = key_prefix
        self._owns_client = owns_client
        self._acquire_script = client.register_script(ACQUIRE_LUA)
        self._settle_script = client.register_script(SETTLE_LUA)

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> RedisRateLimiter:
        """A limiter over its own client for `url` (`redis://host:port/db`), closed by
        `aclose()`."""
        client = Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        return cls(client, key_prefix=key_prefix, owns_client=True)

    def keys(self, tenant: str) -> tuple[str, str]:
        """The tenant's requests and tokens bucket keys."""
        base = f"{self._key_prefix}{{{tenant}}}"
        return f"{base}:requests", f"{base}:tokens"

    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> RateDecision:
        check_integer("tokens", tokens, minimum=0)
        if limits.unlimited:
            return RateDecision(allowed=True)
        reply = await self._run(
            self._acquire_script,
            keys=list(self.keys(tenant)),
            args=[limits.requests_per_minute or 0, limits.tokens_per_minute or 0, 1, tokens],
        )
        allowed, request_level, token_level = reply
        return RateDecision.from_levels(
            limits=limits,
            tokens=tokens,
            allowed=int(allowed) == 1,
            request_level=float(request_level) if limits.requests_per_minute else None,
            token_level=float(token_level) if limits.tokens_per_minute else None,
        )

    async def settle(self, tenant: str, limits: Limits, tokens_delta: int) -> None:
        check_integer("tokens_delta", tokens_delta)
        if limits.tokens_per_minute is None or tokens_delta == 0:
            return
        await self._run(
            self._settle_script,
            keys=[self.keys(tenant)[1]],
            args=[limits.tokens_per_minute, tokens_delta],
        )

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _run(self, script: Any, *, keys: list[str], args: list[int]) -> Any:
        try:
            return await script(keys=keys, args=args)
        except RedisError as exc:
            raise RateLimiterUnavailable(
                f"The rate limiter's Redis did not answer: {exc}", code="rate_limiter_unavailable"
            ) from exc
