"""The limiter the settings ask for."""

from __future__ import annotations

from django.conf import settings

from api.rate_limits.in_process import InProcessRateLimiter
from api.rate_limits.limiter import RateLimiter
from api.rate_limits.redis_limiter import RedisRateLimiter


def rate_limiter_from_settings() -> RateLimiter:
    """`RedisRateLimiter` on `settings.RATE_LIMIT_REDIS_URL` when it is set (every gateway
    process shares one allowance per tenant), else an `InProcessRateLimiter` (each process
    has its own: right for the one embedded gateway)."""
    url = str(getattr(settings, "RATE_LIMIT_REDIS_URL", "") or "")
    if url:
        return RedisRateLimiter.from_url(url)
    return InProcessRateLimiter()
