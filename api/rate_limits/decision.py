"""What a limiter answers for one request, and the response headers that say so."""

from __future__ import annotations

import math
from dataclasses import dataclass

from api.rate_limits.bucket import seconds_to_full, seconds_until, whole
from api.rate_limits.durations import openai_duration
from api.rate_limits.limits import Limits


@dataclass(frozen=True)
class RateDecision:
    """Whether a request may go ahead, and the state of the tenant's buckets after the call.

    For each kind (requests, tokens) with a limit: `limit_*` is the per-minute limit,
    `remaining_*` what the bucket holds now (after this request's cost, if it was allowed),
    `reset_*_s` the seconds until the bucket is full again. A kind without a limit has None in
    all three. `retry_after_s` is 0 for an allowed request; for a refused one the seconds until
    both buckets would hold its cost, or None when they never can (its tokens exceed the
    tokens-per-minute limit: OpenAI calls that "request too large").
    """

    allowed: bool
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    retry_after_s: float | None = 0.0

    @classmethod
    def from_levels(
        cls,
        *,
        limits: Limits,
        tokens: int,
        allowed: bool,
        request_level: float | None,
        token_level: float | None,
    ) -> RateDecision:
        """The decision for a request costing one request and `tokens` tokens, given each
        limited bucket's level after the call (None for a kind without a limit)."""
        requests = _reading("requests", limits.requests_per_minute, request_level)
        token_reading = _reading("tokens", limits.tokens_per_minute, token_level)
        retry: float | None = 0.0
        if not allowed:
            waits = [
                seconds_until(level, cost, capacity)
                for capacity, level, cost in (
                    (limits.requests_per_minute, request_level, 1),
                    (limits.tokens_per_minute, token_level, tokens),
                )
                if capacity is not None and level is not None
            ]
            retry = None if None in waits else max((w for w in waits if w is not None), default=0.0)
        return cls(
            allowed=allowed,
            limit_requests=requests[0],
            remaining_requests=requests[1],
            reset_requests_s=requests[2],
            limit_tokens=token_reading[0],
            remaining_tokens=token_reading[1],
            reset_tokens_s=token_reading[2],
            retry_after_s=retry,
        )

    @property
    def too_large(self) -> bool:
        """Refused for good: the request alone is more than a per-minute limit."""
        return not self.allowed and self.retry_after_s is None

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`
        for each kind with a limit (none for a kind without one); resets as "1s", "6m0s",
        "20ms". A refused request that can be retried also gets `retry-after` (whole seconds,
        rounded up) and `retry-after-ms`, which the official clients wait for before retrying.
        """
        headers: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = openai_duration(reset or 0.0)
        if not self.allowed and self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return headers


def _reading(
    kind: str, capacity: int | None, level: float | None
) -> tuple[int | None, int | None, float | None]:
    """(limit, remaining, seconds to full) of one bucket; all None without a limit."""
    if capacity is None:
        return None, None, None
    if level is None:
        raise ValueError(f"no {kind} level given for a {kind} limit of {capacity}")
    return capacity, whole(level), seconds_to_full(level, capacity)
