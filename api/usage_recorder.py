"""The gateway's usage meter: counts calls in memory, writes them to the database in batches."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from django.conf import settings
from django.db import close_old_connections

from api.services.usage import UsageRow, usage_record_batch

logger = logging.getLogger(__name__)

_Key = tuple[int, str, datetime]  # (tenant id, model, UTC minute)


class UsageRecorder:
    """Sums finished calls by (tenant, model, minute) and writes the sums with `flush()`.

    `record` only adds to a dict under a lock: cheap, never blocks on the database, safe from
    threads and coroutines. `flush` hands everything recorded so far to `usage_record_batch`
    (one transaction, a few statements per 200 rows, never one per call). A flush that fails
    (the database is down) puts its sums back to be written by the next one, and logs; calls
    recorded meanwhile are added to them. Usage is lost only if the process ends unflushed:
    flush on shutdown (`flush_every` does when cancelled).

    Tenants are given by id (`Tenant.pk`): the gateway holds the tenant row from the API key,
    and ids need no lookup to write. Usage of a tenant deleted before the flush is dropped.
    `clock` gives Unix seconds (tests inject one).
    """

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._pending: dict[_Key, list[int]] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        # One thread for `aflush`, so the recorder holds at most one database connection.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usage-flush")

    def record(
        self,
        tenant_id: int,
        model: str,
        prompt_tokens: int,
        completion_tokens: int,
        at: float | None = None,
    ) -> None:
        """Count one finished call of `model` by the tenant `tenant_id`, with the host's token
        counts, in the UTC minute of `at` (Unix seconds; default now)."""
        for name, value in (
            ("tenant_id", tenant_id),
            ("prompt_tokens", prompt_tokens),
            ("completion_tokens", completion_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not model or len(model) > 255:
            raise ValueError(f"model must be 1-255 characters, got {model!r}")
        key = (tenant_id, model, _minute_of(self._clock() if at is None else at))
        with self._lock:
            counts = self._pending.setdefault(key, [0, 0, 0])
            counts[0] += 1
            counts[1] += prompt_tokens
            counts[2] += completion_tokens

    def pending(self) -> dict[tuple[int, str, datetime], tuple[int, int, int]]:
        """What the next flush would write: (tenant id, model, minute) -> (requests, prompt
        tokens, completion tokens)."""
        with self._lock:
            return {key: (c[0], c[1], c[2]) for key, c in self._pending.items()}

    def flush(self) -> int:
        """Write what was recorded; returns the rows written (0 when nothing was pending or the
        write failed). Synchronous (the ORM): from async code use `aflush`."""
        with self._flush_lock:
            with self._lock:
                taken, self._pending = self._pending, {}
            if not taken:
                return 0
            rows = [
                UsageRow(
                    tenant_id=t,
                    model=m,
                    minute=minute,
                    requests=c[0],
                    prompt_tokens=c[1],
                    completion_tokens=c[2],
                )
                for (t, m, minute), c in taken.items()
            ]
            try:
                return usage_record_batch(rows=rows)
            except Exception:
                # Anything the write raised (a database down, a deadlock victim): keep the sums.
                logger.exception(
                    "usage: writing %d rows failed; kept for the next flush", len(rows)
                )
                self._put_back(taken)
                return 0

    async def aflush(self) -> int:
        """`flush` on the recorder's own thread, closing that thread's stale database connection
        before and after (a long-running gateway outlives `CONN_MAX_AGE`)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._flush_in_thread)

    async def flush_every(self, interval_s: float | None = None) -> None:
        """Flush every `interval_s` seconds (default `settings.HARLI_USAGE_FLUSH_INTERVAL_S`)
        until cancelled, then once more: run it as a task of the gateway's lifespan."""
        interval = float(interval_s or settings.HARLI_USAGE_FLUSH_INTERVAL_S)
        try:
            while True:
                await asyncio.sleep(interval)
                await self.aflush()
        finally:
            await asyncio.shield(self.aflush())

    def _flush_in_thread(self) -> int:
        close_old_connections()
        try:
            return self.flush()
        finally:
            close_old_connections()

    def _put_back(self, taken: dict[_Key, list[int]]) -> None:
        with self._lock:
            for key, counts in taken.items():
                current = self._pending.setdefault(key, [0, 0, 0])
                for index, value in enumerate(counts):
                    current[index] += value


def _minute_of(unix_s: float) -> datetime:
    """The UTC minute that Unix second `unix_s` falls in."""
    if (
        isinstance(unix_s, bool)
        or not isinstance(unix_s, (int, float))
        or not math.isfinite(unix_s)
    ):
        raise ValueError(f"at must be a finite Unix time in seconds, got {unix_s!r}")
    try:
        return datetime.fromtimestamp(math.floor(unix_s / 60) * 60, tz=UTC)
    except (OverflowError, OSError, ValueError):
        raise ValueError(f"at={unix_s!r} is not a representable time") from None
