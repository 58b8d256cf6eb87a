"""Streams at a fixed concurrency, timed at the client: time to the first token, and the time
between one token's chunk and the next."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

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


async def one_stream(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, object]
) -> StreamResult:
    result = StreamResult()
    started = time.perf_counter()
    last = started
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = "before_first_byte"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if '"error"' in line[:20]:
                    result.error = "after_first_byte"
                    return result
                now = time.perf_counter()
                if result.ttft_s is None:
                    result.ttft_s = now - started
                else:
                    result.gaps_s.append(now - last)
                last = now
                result.tokens += 1
    except httpx.HTTPError:
        result.error = "after_first_byte" if result.ttft_s is not None else "before_first_byte"
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
    """`requests` streams, `concurrency` at a time; `on_done(n)` after the n-th finishes."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(120.0)
    results: list[StreamResult] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def worker() -> None:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_stream(client, url, headers(), body))
                if on_done is not None:
                    on_done(len(results))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
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
    )
