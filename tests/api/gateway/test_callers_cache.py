"""The gateway's lookup cache: one load however many requests miss at once, a reload ahead of
expiry that nobody waits for, and entries that expire on time."""

from __future__ import annotations

import asyncio

from api.gateway.callers import _TtlCache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_concurrent_misses_share_one_load_and_entries_expire() -> None:
    clock = Clock()
    cache: _TtlCache[str, str] = _TtlCache(clock)
    loads: list[int] = []
    gate = asyncio.Event()

    async def load() -> str:
        loads.append(1)
        await gate.wait()
        return f"v{len(loads)}"

    async def scenario() -> None:
        waiting = [asyncio.create_task(cache.get("k", load, lambda _: 10.0)) for _ in range(50)]
        await asyncio.sleep(0)
        gate.set()
        assert set(await asyncio.gather(*waiting)) == {"v1"}
        assert len(loads) == 1
        clock.now += 5  # young: answered from the entry, no load
        assert await cache.get("k", load, lambda _: 10.0) == "v1" and len(loads) == 1
        clock.now += 4  # in the last fifth of its life: answered, and reloaded behind
        assert await cache.get("k", load, lambda _: 10.0) == "v1"
        await asyncio.sleep(0)
        assert len(loads) == 2
        assert await cache.get("k", load, lambda _: 10.0) == "v2"
        clock.now += 11  # expired: the request waits for the load
        assert await cache.get("k", load, lambda _: 10.0) == "v3"

    asyncio.run(scenario())


def test_a_failed_load_reaches_every_waiter_and_the_next_request_retries() -> None:
    cache: _TtlCache[str, str] = _TtlCache(Clock())
    calls: list[int] = []

    async def load() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("database away")
        return "ok"

    async def scenario() -> None:
        results = await asyncio.gather(
            *(cache.get("k", load, lambda _: 1.0) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, ConnectionError) for r in results) and len(calls) == 1
        assert await cache.get("k", load, lambda _: 1.0) == "ok"

    asyncio.run(scenario())
