"""`RedisRateLimiter` against the real Redis, as the suite's own user (`tests.services`):
the same arithmetic as in process, atomic across OS processes, on the server's clock, with keys
that expire. Each test has its own key prefix."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from redis.asyncio import Redis

from api.rate_limits import Limits, RateLimiterUnavailable, RedisRateLimiter
from tests.services import REDIS_URL_ENV, service_url

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = service_url(REDIS_URL_ENV)
T = TypeVar("T")


@pytest.fixture
def prefix() -> Iterator[str]:
    try:
        sync = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
        sync.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis refuses the suite's user ({exc}); run `bash scripts/services.sh`")
    key_prefix = f"harli-test:{uuid.uuid4().hex}:"
    yield key_prefix
    for key in sync.scan_iter(match=f"{key_prefix}*"):
        sync.delete(key)
    sync.close()


def with_limiter(prefix: str, body: Callable[[RedisRateLimiter, Redis], Awaitable[T]]) -> T:
    """Run `body(limiter, raw client)` in a fresh event loop (the clients are bound to it)."""

    async def main() -> T:
        limiter = RedisRateLimiter.from_url(REDIS_URL, key_prefix=prefix)
        raw = Redis.from_url(REDIS_URL)
        try:
            return await body(limiter, raw)
        finally:
            await limiter.aclose()
            await raw.aclose()

    return asyncio.run(main())


def test_requests_drain_and_a_refusal_consumes_nothing(prefix: str) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=None)

    async def body(limiter: RedisRateLimiter, raw: Redis) -> None:
        remaining = [
            (await limiter.acquire("acme", limits, 0)).remaining_requests for _ in range(10)
        ]
        assert remaining == [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
        level_before = float(await raw.hget(limiter.keys("acme")[0], "level"))  # type: ignore[arg-type]
        refused = await limiter.acquire("acme", limits, 0)
        assert not refused.allowed and refused.remaining_requests == 0
        # A tenth of a request refills in 0.6 s: the wait is just under 6 s.
        assert 5.0 < refused.retry_after_s <= 6.0 and refused.kind == "requests"
        assert 59.0 < (refused.reset_requests_s or 0) <= 60.0
        level_after = float(await raw.hget(limiter.keys("acme")[0], "level"))  # type: ignore[arg-type]
        assert level_after == level_before  # the refusal wrote nothing
        assert (await limiter.acquire("globex", limits, 0)).remaining_requests == 9

    with_limiter(prefix, body)


def test_both_buckets_pay_or_neither_does(prefix: str) -> None:
    limits = Limits(requests_per_minute=10, tokens_per_minute=1000)

    async def body(limiter: RedisRateLimiter, raw: Redis) -> None:
        first = await limiter.acquire("acme", limits, 600)
        assert (first.remaining_requests, first.remaining_tokens) == (9, 400)
        refused = await limiter.acquire("acme", limits, 500)
        assert not refused.allowed
        assert (refused.remaining_requests, refused.remaining_tokens) == (9, 400)
        assert refused.retry_after_s == pytest.approx(6.0, abs=0.5)
        too_large = await limiter.acquire("acme", limits, 1001)
        assert too_large.too_large and too_large.kind == "tokens"
        assert too_large.remaining_requests == 9 and too_large.retry_after_s > 30
        assert (await limiter.acquire("acme", limits, 400)).remaining_requests == 8

    with_limiter(prefix, body)


def test_settle_refunds_and_charges_within_the_bucket(prefix: str) -> None:
    limits = Limits(requests_per_minute=None, tokens_per_minute=600)

    async def body(limiter: RedisRateLimiter, raw: Redis) -> None:
        assert (await limiter.acquire("acme", limits, 300)).remaining_tokens == 300
        await limiter.settle("acme", limits, -100)
        assert (await limiter.acquire("acme", limits, 0)).remaining_tokens == 400
        await limiter.settle("acme", limits, 150)
        assert (await limiter.acquire("acme", limits, 0)).remaining_tokens == 250
        await limiter.settle("acme", limits, 10_000)
        assert (await limiter.acquire("acme", limits, 0)).remaining_tokens == 0
        await limiter.settle("acme", limits, -10_000)
        assert (await limiter.acquire("acme", limits, 0)).remaining_tokens == 600
        # A full bucket is no key at all.
        assert await raw.exists(limiter.keys("acme")[1]) == 0

    with_limiter(prefix, body)


def test_keys_expire_once_refilled_and_time_is_the_servers(prefix: str) -> None:
    limits = Limits(requests_per_minute=60, tokens_per_minute=6000)

    async def body(limiter: RedisRateLimiter, raw: Redis) -> None:
        await limiter.acquire("acme", limits, 3000)
        requests_key, tokens_key = limiter.keys("acme")
        assert requests_key.startswith(prefix) and "{acme}" in requests_key
        # Full again after 1 s (requests) and 30 s (tokens); each key lives that long + 1 s.
        assert 1000 < await raw.pttl(requests_key) <= 2000
        assert 30_000 < await raw.pttl(tokens_key) <= 31_000
        seconds, micros = await raw.time()
        stored_at = float(await raw.hget(tokens_key, "at"))  # type: ignore[arg-type]
        assert abs(stored_at - (seconds + micros / 1e6)) < 5

    with_limiter(prefix, body)


def test_the_callers_clock_does_not_matter(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway whose clock is an hour off spends the same bucket as the others."""
    limits = Limits(requests_per_minute=2, tokens_per_minute=None)

    async def body(limiter: RedisRateLimiter, raw: Redis) -> list[bool]:
        results = [(await limiter.acquire("acme", limits, 0)).allowed]
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)
        results += [(await limiter.acquire("acme", limits, 0)).allowed for _ in range(2)]
        return results

    assert with_limiter(prefix, body) == [True, True, False]


def test_an_unreachable_redis_is_unavailable_and_unlimited_needs_no_redis() -> None:
    async def main() -> None:
        limiter = RedisRateLimiter.from_url("redis://127.0.0.1:1/0")
        try:
            with pytest.raises(RateLimiterUnavailable) as raised:
                await limiter.acquire("acme", Limits(5, None), 0)
            assert raised.value.http_status == 503
            assert raised.value.body()["error"]["code"] == "rate_limiter_unavailable"
            assert (await limiter.acquire("acme", Limits(None, None), 0)).allowed
        finally:
            await limiter.aclose()

    asyncio.run(main())


WORKER = """
import asyncio, json, sys, time
from api.rate_limits import Limits, RedisRateLimiter

url, prefix, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])

async def main():
    limiter = RedisRateLimiter.from_url(url, key_prefix=prefix)
    await limiter._client.ping()
    while time.time() < start_at:
        await asyncio.sleep(0.001)
    allowed = 0
    for _ in range(10):
        decision = await limiter.acquire("acme", Limits(10, 600), 7)
        allowed += decision.allowed
    await limiter.aclose()
    print(json.dumps({"allowed": allowed}))

asyncio.run(main())
"""


def test_two_processes_share_one_limit(prefix: str) -> None:
    start_at = time.time() + 3.0  # both processes imported and connected by then
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings.test"}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, REDIS_URL, prefix, str(start_at)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results: list[dict[str, Any]] = []
    for worker in workers:
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err
        results.append(json.loads(out))
    assert sum(r["allowed"] for r in results) == 10
    # The ten allowed calls took 7 tokens each; the ten refused took none (600 - 140 = 460
    # otherwise). The bucket refills 10 tokens a second meanwhile.
    tokens = redis.Redis.from_url(REDIS_URL).hget(f"{prefix}{{acme}}:tokens", "level")
    assert tokens is not None and 530 <= float(tokens) < 540
