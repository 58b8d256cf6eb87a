"""Streams at a fixed concurrency, timed at the client: time to the first token, and the time
between one token's chunk and the next."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from api.gateway.host_http import HostPool, HostStreamError, HostUnreachable
from bench.common.samples import sample_percentile


@dataclass
class StreamResult:
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    """"before_first_byte" or "after_first_byte" when the request failed."""


@dataclass(frozen=True)
class LoadSummary:
    requests: int
    failed_before_first_byte: int
    failed_after_first_byte: int
    tokens: int
    wall_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    chunk_ms_p50: float
    chunk_ms_p99: float
    chunk_ms_mean: float
    """The mean gap: a stream's time from its first token to its last over its gaps. A relay
    that delays every chunk alike leaves it unchanged; one that slows the stream raises it."""


async def one_stream(
    pool: HostPool, url: str, headers: dict[str, str], body: bytes
) -> StreamResult:
    """One streamed request; a chunk holding several events counts them as arriving at once."""
    result = StreamResult()
    started = time.perf_counter()
    last = started
    try:
        response = await pool.post(url, body, headers)
    except HostUnreachable:
        result.error = "before_first_byte"
        return result
    try:
        if response.status_code != 200:
            await response.aread()
            result.error = "before_first_byte"
            return result
        async for chunk in response.aiter_raw():
            if b'data: {"error"' in chunk:
                result.error = "after_first_byte"
                return result
            events = chunk.count(b"data: {")
            if not events:
                continue
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - started
                events -= 1
            else:
                result.gaps_s.append(now - last)
                events -= 1
            result.gaps_s.extend([0.0] * events)
            result.tokens += 1 + events
            last = now
    except HostStreamError:
        result.error = "after_first_byte" if result.ttft_s is not None else "before_first_byte"
    finally:
        await response.aclose()
    return result


async def run_load(
    url: str,
    headers: Callable[[], dict[str, str]],
    body: dict[str, object],
    *,
    concurrency: int,
    requests: int,
    on_done: Callable[[int], None] | None = None,
) -> tuple[LoadSummary, list[StreamResult]]:
    """`requests` streams, `concurrency` at a time; `on_done(n)` after the n-th finishes. The
    client is the gateway's own lean HTTP/1.1 client, so the client's CPU stays small beside
    what it measures."""
    pool = HostPool(connect_timeout_s=10.0, read_timeout_s=120.0)
    payload = json.dumps(body).encode()
    results: list[StreamResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)

    async def worker() -> None:
        while True:
            try:
                queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_stream(pool, url, headers(), payload))
            if on_done is not None:
                on_done(len(results))

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await pool.aclose()
    wall = time.perf_counter() - started
    return summarize(results, wall), results


def summarize(results: list[StreamResult], wall_s: float) -> LoadSummary:
    ttfts = [r.ttft_s * 1e3 for r in results if r.ttft_s is not None and r.error is None]
    gaps = [g * 1e3 for r in results if r.error is None for g in r.gaps_s]
    return LoadSummary(
        requests=len(results),
        failed_before_first_byte=sum(r.error == "before_first_byte" for r in results),
        failed_after_first_byte=sum(r.error == "after_first_byte" for r in results),
        tokens=sum(r.tokens for r in results),
        wall_s=wall_s,
        ttft_ms_p50=sample_percentile(ttfts, 50) if ttfts else float("nan"),
        ttft_ms_p99=sample_percentile(ttfts, 99) if ttfts else float("nan"),
        chunk_ms_p50=sample_percentile(gaps, 50) if gaps else float("nan"),
        chunk_ms_p99=sample_percentile(gaps, 99) if gaps else float("nan"),
        chunk_ms_mean=sum(gaps) / len(gaps) if gaps else float("nan"),
    )
