"""Per-tenant rate limits for the inference gateway: requests and tokens per minute.

The gateway builds one limiter with `rate_limiter_from_settings()`, and for each request:

    limits = Limits.of(tenant)
    decision = await limiter.acquire(tenant.name, limits, estimate_request_tokens(...))
    if not decision.allowed: answer 429 (decision.message(), type decision.kind) with
        decision.headers() and retry-after from decision.retry_after_s
    ... forward; on every response add decision.headers() ...
    await limiter.settle(tenant.name, limits, used_tokens - estimate)

`bucket` holds the arithmetic, `decision` the answer and its headers, `limiter` the contract,
`in_process` and `redis_limiter` the two stores.
"""

from api.rate_limits.decision import RateDecision
from api.rate_limits.durations import openai_duration
from api.rate_limits.estimate import estimate_request_tokens
from api.rate_limits.factory import rate_limiter_from_settings
from api.rate_limits.in_process import InProcessRateLimiter
from api.rate_limits.limiter import RateLimiter
from api.rate_limits.limits import Limits
from api.rate_limits.redis_limiter import RedisRateLimiter
from api.rate_limits.unavailable import RateLimiterUnavailable

__all__ = [
    "InProcessRateLimiter",
    "Limits",
    "RateDecision",
    "RateLimiter",
    "RateLimiterUnavailable",
    "RedisRateLimiter",
    "estimate_request_tokens",
    "openai_duration",
    "rate_limiter_from_settings",
]
