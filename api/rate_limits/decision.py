"""What a limiter answers for one request, and the response headers and message that say so."""

from __future__ import annotations

from dataclasses import dataclass

from api.rate_limits.bucket import seconds_to_full, seconds_until, whole
from api.rate_limits.durations import openai_duration
from api.rate_limits.limits import Limits

_UNITS = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


@dataclass(frozen=True)
class RateDecision:
    """Whether a request may go ahead, and the state of the tenant's buckets after the call.

    For each kind (requests, tokens) with a limit: `limit_*` is the per-minute limit,
    `remaining_*` what the bucket holds now (after this request's cost, if it was allowed),
    `reset_*_s` the seconds until the bucket is full again. A kind without a limit has None in
    all three. `requested_tokens` is the request's token cost.

    A refused request has `kind`, the limit that refused it ("requests" or "tokens", which is
    OpenAI's error `type` for a 429), and `retry_after_s`, the seconds until both buckets would
    hold its cost. `too_large` marks one whose tokens exceed the tokens-per-minute limit, which
    no wait cures ("request too large"); its `retry_after_s` is the time until the tokens bucket
    is full. An allowed request has kind "" and retry_after_s 0.
    """

    allowed: bool
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    requested_tokens: int = 0
    kind: str = ""
    retry_after_s: float = 0.0
    too_large: bool = False

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
        kind, retry, too_large = "", 0.0, False
        if not allowed:
            waits: dict[str, float] = {}
            for name, capacity, level, cost in (
                ("requests", limits.requests_per_minute, request_level, 1),
                ("tokens", limits.tokens_per_minute, token_level, tokens),
            ):
                if capacity is None or level is None:
                    continue
                wait = seconds_until(level, cost, capacity)
                if wait is None:  # more than the bucket holds when full
                    too_large, wait = True, seconds_to_full(level, capacity)
                if wait > 0 or too_large:
                    waits[name] = wait
            if too_large:
                kind = "tokens"
            elif waits:  # the limit with the longest wait is the one that binds
                kind = max(waits, key=lambda name: waits[name])
            else:  # refused at the float edge of a cost: retry at once
                kind = "requests" if limits.requests_per_minute is not None else "tokens"
            retry = max(waits.values(), default=0.0)
        return cls(
            allowed=allowed,
            limit_requests=requests[0],
            remaining_requests=requests[1],
            reset_requests_s=requests[2],
            limit_tokens=token_reading[0],
            remaining_tokens=token_reading[1],
            reset_tokens_s=token_reading[2],
            requested_tokens=tokens,
            kind=kind,
            retry_after_s=retry,
            too_large=too_large,
        )

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`
        for each kind with a limit (none for a kind without one); resets as "1s", "6m0s",
        "20ms". (`retry-after` on a refusal is the caller's, from `retry_after_s`.)"""
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
        return headers

    def message(self) -> str:
        """A refusal's error message, worded as OpenAI's ("" for an allowed request)."""
        if self.allowed:
            return ""
        unit = _UNITS[self.kind]
        if self.kind == "requests":
            limit, remaining, requested = self.limit_requests, self.remaining_requests, 1
        else:
            limit, remaining, requested = (
                self.limit_tokens,
                self.remaining_tokens,
                self.requested_tokens,
            )
        if self.too_large:
            return (
                f"Request too large on {unit}: Limit {limit}, Requested {requested}. "
                "The input or output tokens must be reduced in order to run successfully."
            )
        used = (limit or 0) - (remaining or 0)
        return (
            f"Rate limit reached on {unit}: Limit {limit}, Used {used}, Requested {requested}. "
            f"Please try again in {openai_duration(self.retry_after_s)}."
        )


def _reading(
    kind: str, capacity: int | None, level: float | None
) -> tuple[int | None, int | None, float | None]:
    """(limit, remaining, seconds to full) of one bucket; all None without a limit."""
    if capacity is None:
        return None, None, None
    if level is None:
        raise ValueError(f"no {kind} level given for a {kind} limit of {capacity}")
    return capacity, whole(level), seconds_to_full(level, capacity)
