"""Token-bucket rate limits in process: exact levels, resets and waits with an injected clock;
OpenAI's headers; the token estimate; the limiter the settings pick."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from pytest_django.fixtures import Settings as SettingsWrapper

from api.rate_limits import (
    InProcessRateLimiter,
    Limits,
    RateDecision,
    RedisRateLimiter,
    estimate_request_tokens,
    openai_duration,
    rate_limiter_from_settings,
)

T = TypeVar("T")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


class Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def limiter(clock: Clock) -> InProcessRateLimiter:
    return InProcessRateLimiter(clock=clock)


def test_requests_bucket_drains_refills_and_refuses_without_consuming(
    limiter: InProcessRateLimiter, clock: Clock
) -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=None)
    first = run(limiter.acquire("acme", limits, 0))
    assert first == RateDecision(
        allowed=True,
        limit_requests=60,
        remaining_requests=59,
        reset_requests_s=1.0,  # one request refills in 60 s / 60
    )
    assert (first.kind, first.retry_after_s, first.message()) == ("", 0.0, "")
    for expected in range(58, -1, -1):
        assert run(limiter.acquire("acme", limits, 0)).remaining_requests == expected
    refused = run(limiter.acquire("acme", limits, 0))
    assert not refused.allowed and not refused.too_large and refused.kind == "requests"
    assert refused.remaining_requests == 0
    assert refused.reset_requests_s == pytest.approx(60.0)
    assert refused.retry_after_s == pytest.approx(1.0)
    assert refused.message() == (
        "Rate limit reached on requests per min (RPM): Limit 60, Used 60, Requested 1. "
        "Please try again in 1s."
    )
    # A refusal took nothing: after half a second the bucket holds half a request, still short.
    clock.advance(0.5)
    again = run(limiter.acquire("acme", limits, 0))
    assert not again.allowed and again.retry_after_s == pytest.approx(0.5)
    assert again.reset_requests_s == pytest.approx(59.5)
    clock.advance(0.5)
    allowed = run(limiter.acquire("acme", limits, 0))
    assert allowed.allowed and allowed.remaining_requests == 0
    assert allowed.reset_requests_s == pytest.approx(60.0)
    # Twenty seconds refill twenty requests.
    clock.advance(20)
    assert run(limiter.acquire("acme", limits, 0)).remaining_requests == 19


def test_tenants_have_separate_buckets(limiter: InProcessRateLimiter) -> None:
    limits = Limits(requests_per_minute=1, tokens_per_minute=None)
    assert run(limiter.acquire("acme", limits, 0)).allowed
    assert not run(limiter.acquire("acme", limits, 0)).allowed
    assert run(limiter.acquire("globex", limits, 0)).allowed


def test_both_limits_pay_together_or_not_at_all(
    limiter: InProcessRateLimiter, clock: Clock
) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=1000)
    first = run(limiter.acquire("acme", limits, 600))
    assert (first.allowed, first.remaining_requests, first.remaining_tokens) == (True, 9, 400)
    assert first.reset_tokens_s == pytest.approx(36.0)  # 600 tokens at 1000/60 per second
    assert first.reset_requests_s == pytest.approx(6.0)
    # The tokens bucket is short: refused, and the requests bucket keeps its 9.
    refused = run(limiter.acquire("acme", limits, 500))
    assert not refused.allowed and refused.kind == "tokens"
    assert (refused.remaining_requests, refused.remaining_tokens) == (9, 400)
    assert refused.retry_after_s == pytest.approx(6.0)  # 100 more tokens at 16.67/s
    assert refused.message() == (
        "Rate limit reached on tokens per min (TPM): Limit 1000, Used 600, Requested 500. "
        "Please try again in 6s."
    )
    assert run(limiter.acquire("acme", limits, 400)).remaining_requests == 8
    # Now the requests bucket runs out first: 8 more calls of no tokens, then a refusal whose
    # wait is the requests bucket's, with the tokens bucket left as it was.
    for _ in range(8):
        assert run(limiter.acquire("acme", limits, 0)).allowed
    refused = run(limiter.acquire("acme", limits, 0))
    assert not refused.allowed and refused.remaining_tokens == 0 and refused.kind == "requests"
    assert refused.retry_after_s == pytest.approx(6.0)
    clock.advance(6)
    ok = run(limiter.acquire("acme", limits, 100))
    assert ok.allowed and (ok.remaining_requests, ok.remaining_tokens) == (0, 0)


def test_a_request_larger_than_the_token_limit_is_too_large(
    limiter: InProcessRateLimiter,
) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=1000)
    refused = run(limiter.acquire("acme", limits, 1001))
    assert not refused.allowed and refused.too_large and refused.kind == "tokens"
    assert refused.remaining_tokens == 1000 and refused.remaining_requests == 10
    assert refused.retry_after_s == 0.0  # the bucket is full: waiting does not help
    assert refused.message() == (
        "Request too large on tokens per min (TPM): Limit 1000, Requested 1001. "
        "The input or output tokens must be reduced in order to run successfully."
    )
    assert run(limiter.acquire("acme", limits, 1000)).remaining_tokens == 0


def test_settle_charges_and_refunds_within_the_bucket(
    limiter: InProcessRateLimiter, clock: Clock
) -> None:
    limits = Limits(requests_per_minute=None, tokens_per_minute=600)
    assert run(limiter.acquire("acme", limits, 300)).remaining_tokens == 300
    run(limiter.settle("acme", limits, -100))  # used 100 fewer than estimated
    assert run(limiter.acquire("acme", limits, 0)).remaining_tokens == 400
    run(limiter.settle("acme", limits, 150))  # used 150 more
    check = run(limiter.acquire("acme", limits, 0))
    assert check.remaining_tokens == 250 and check.reset_tokens_s == pytest.approx(35.0)
    run(limiter.settle("acme", limits, 10_000))  # never below empty
    assert run(limiter.acquire("acme", limits, 0)).remaining_tokens == 0
    run(limiter.settle("acme", limits, -10_000))  # never over full
    full = run(limiter.acquire("acme", limits, 0))
    assert full.remaining_tokens == 600 and full.reset_tokens_s == 0.0
    assert len(limiter) == 0  # a full bucket is not stored
    # Without a tokens limit there is nothing to settle.
    run(limiter.settle("acme", Limits(requests_per_minute=5, tokens_per_minute=None), 50))
    assert len(limiter) == 0


def test_unlimited_is_always_allowed_and_stores_nothing(limiter: InProcessRateLimiter) -> None:
    for _ in range(100):
        decision = run(limiter.acquire("acme", Limits(None, None), 10**9))
        assert decision.allowed and decision.headers() == {}
    assert len(limiter) == 0


def test_a_lowered_limit_caps_what_a_bucket_holds(
    limiter: InProcessRateLimiter, clock: Clock
) -> None:
    assert run(limiter.acquire("acme", Limits(100, None), 0)).remaining_requests == 99
    lowered = run(limiter.acquire("acme", Limits(10, None), 0))
    assert lowered.remaining_requests == 9 and lowered.reset_requests_s == pytest.approx(6.0)


def test_memory_is_bounded(clock: Clock) -> None:
    limiter = InProcessRateLimiter(clock=clock, max_buckets=4)
    limits = Limits(requests_per_minute=60, tokens_per_minute=None)
    for index in range(10):
        run(limiter.acquire(f"t{index}", limits, 0))
    assert len(limiter) == 4
    # Refilled buckets are dropped as soon as the next call sees them.
    clock.advance(1.0)
    run(limiter.acquire("late", limits, 0))
    assert len(limiter) == 1


def test_refusals_are_atomic_under_concurrent_coroutines(clock: Clock) -> None:
    limiter = InProcessRateLimiter(clock=clock)
    limits = Limits(requests_per_minute=25, tokens_per_minute=10_000)

    async def many() -> list[RateDecision]:
        return await asyncio.gather(*(limiter.acquire("acme", limits, 100) for _ in range(200)))

    decisions = run(many())
    assert sum(d.allowed for d in decisions) == 25


def test_bad_costs_are_refused(limiter: InProcessRateLimiter) -> None:
    limits = Limits(requests_per_minute=5, tokens_per_minute=5)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        run(limiter.acquire("acme", limits, -1))
    with pytest.raises(ValueError, match="tokens must be an integer"):
        run(limiter.acquire("acme", limits, 1.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens_delta must be an integer"):
        run(limiter.settle("acme", limits, True))
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="requests_per_minute must be a positive integer"):
            Limits(requests_per_minute=bad, tokens_per_minute=None)  # type: ignore[arg-type]


def test_headers_are_openais() -> None:
    decision = RateDecision(
        allowed=True,
        limit_requests=60,
        remaining_requests=59,
        reset_requests_s=1.0,
        limit_tokens=150_000,
        remaining_tokens=149_984,
        reset_tokens_s=0.0064,
    )
    assert decision.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "7ms",
    }
    tokens_only = RateDecision(
        allowed=False,
        limit_tokens=1000,
        remaining_tokens=10,
        reset_tokens_s=59.4,
        requested_tokens=48,
        kind="tokens",
        retry_after_s=2.3,
    )
    assert tokens_only.headers() == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "59.4s",
    }
    assert tokens_only.message() == (
        "Rate limit reached on tokens per min (TPM): Limit 1000, Used 990, Requested 48. "
        "Please try again in 2.3s."
    )


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0000001, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (0.9991, "1s"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.999, "59.999s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (61.25, "1m1.25s"),
        (3600, "1h0m0s"),
        (3725.5, "1h2m5.5s"),
    ],
)
def test_openai_duration(seconds: float, text: str) -> None:
    assert openai_duration(seconds) == text


def test_openai_duration_refuses_negative() -> None:
    with pytest.raises(ValueError):
        openai_duration(-1)


def test_estimate_request_tokens() -> None:
    assert estimate_request_tokens(prompt_chars=0, max_tokens=0) == 0
    assert estimate_request_tokens(prompt_chars=1, max_tokens=0) == 1
    assert estimate_request_tokens(prompt_chars=4, max_tokens=16) == 17
    assert estimate_request_tokens(prompt_chars=5, max_tokens=16) == 18
    assert estimate_request_tokens(prompt_chars=4000, max_tokens=256) == 1256
    with pytest.raises(ValueError, match="max_tokens"):
        estimate_request_tokens(prompt_chars=4, max_tokens=-1)


def test_limits_of_a_tenant() -> None:
    class Row:
        requests_per_minute = 3
        tokens_per_minute = None

    assert Limits.of(Row()) == Limits(requests_per_minute=3, tokens_per_minute=None)


def test_the_settings_pick_the_limiter(settings: SettingsWrapper) -> None:
    settings.RATE_LIMIT_REDIS_URL = ""
    assert isinstance(rate_limiter_from_settings(), InProcessRateLimiter)
    settings.RATE_LIMIT_REDIS_URL = "redis://127.0.0.1:6379/0"
    limiter = rate_limiter_from_settings()
    assert isinstance(limiter, RedisRateLimiter)
    run(limiter.aclose())


def test_the_redis_url_is_parsed_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from config.env import EnvError, env_redis_url

    monkeypatch.delenv("HARLI_RATE_LIMIT_REDIS_URL", raising=False)
    assert env_redis_url("HARLI_RATE_LIMIT_REDIS_URL") == ""
    monkeypatch.setenv("HARLI_RATE_LIMIT_REDIS_URL", "redis://cache:6379/2")
    assert env_redis_url("HARLI_RATE_LIMIT_REDIS_URL") == "redis://cache:6379/2"
    monkeypatch.setenv("HARLI_RATE_LIMIT_REDIS_URL", "http://cache:6379")
    with pytest.raises(EnvError, match="is not a Redis URL"):
        env_redis_url("HARLI_RATE_LIMIT_REDIS_URL")
