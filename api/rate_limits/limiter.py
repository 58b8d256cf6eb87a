"""The contract of a rate limiter, as the inference gateway calls it."""

from __future__ import annotations

import abc

from api.rate_limits.decision import RateDecision
from api.rate_limits.limits import Limits


class RateLimiter(abc.ABC):
    """Per-tenant request and token buckets (arithmetic in `api.rate_limits.bucket`).

    Each tenant has two buckets, one per limit in its `Limits`; a kind whose limit is None has
    no bucket and is never refused. `tenant` is any string that names one tenant for good
    (the gateway passes the tenant's name). Implementations are safe to call concurrently
    from coroutines of one event loop and from threads.

    The gateway calls `acquire` before forwarding a request, with the request's estimated
    tokens (`estimate_request_tokens`), and `settle` once the request is over with the
    difference between the tokens it used and the estimate.
    """

    @abc.abstractmethod
    async def acquire(self, tenant: str, limits: Limits, tokens: int) -> RateDecision:
        """Take one request and `tokens` tokens from the tenant's buckets, all or nothing.

        Allowed only when each limited bucket holds its cost; a refused request consumes
        nothing. `tokens` must be an integer >= 0 (ValueError otherwise).
        """

    @abc.abstractmethod
    async def settle(self, tenant: str, limits: Limits, tokens_delta: int) -> None:
        """Charge the tokens bucket `tokens_delta` more (actual - estimate): positive takes
        more, negative gives back. The level stays within [0, tokens_per_minute]: a charge
        beyond what the bucket holds empties it, a refund beyond full fills it."""

    async def aclose(self) -> None:  # noqa: B027  (optional: most limiters hold nothing)
        """Release what the limiter holds (connections); it is not used afterwards."""
