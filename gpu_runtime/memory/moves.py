"""Page moves over a `PagePool`: decode's KV range grows (from free pages, then from
finetuning's budget: a cap change, or a cache flush only where allowed), with the rounding to
the pool's map unit and the flush accounting. `PageMoves` is held by `MemoryManager` (which
decides when decode grows) and by `FinetuneBudget` (which counts its own flushes here)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpu_runtime.memory.config import MemoryManagerConfig
from gpu_runtime.memory.counters import MemoryCounters
from gpu_runtime.memory.pool import PagePool

logger = logging.getLogger(__name__)


class PageMoves:
    """Moves pages toward decode over `pool`, counting into `counters` and timing by `clock`."""

    def __init__(
        self,
        pool: PagePool,
        config: MemoryManagerConfig,
        counters: MemoryCounters,
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.config = config
        self.counters = counters
        self._clock = clock
        self.iterations_since_reclaim = config.grow_hold_iterations
        """Iterations since decode last took budget from finetuning (`grow_decode` resets it,
        the manager counts iterations): lending waits `grow_hold_iterations` after a reclaim."""

    def grow_decode(
        self,
        pages: int,
        *,
        reason: str,
        allow_reclaim: bool = True,
        reclaim_limit: int | None = None,
        allow_flush: bool = True,
    ) -> int:
        """Map `pages` more KV pages (rounded up to the map unit, or down to what can be had):
        from free pages first, then (if allowed) reclaimed finetune budget, at most
        `reclaim_limit` pages of it when given. With `allow_flush=False` only the budget the
        finetune allocator does not hold is reclaimed (a cap change; counted in
        `deferred_flushes` when more was wanted): refills run ahead of need and never flush,
        so a flush happens only when the next step cannot run otherwise."""
        if pages <= 0:
            return 0
        room = self.pool.prefix_limit_pages - self.pool.kv_prefix_pages
        pages = min(self.round_up(pages), self.round_down(room))
        reclaimable = self.pool.finetune_reclaimable_pages()
        if reclaim_limit is not None and reclaimable > reclaim_limit:
            if self.config.reclaim_from_finetune and pages > self.pool.free_pages + reclaim_limit:
                self.counters.deferred_reclaims += 1
            reclaimable = reclaim_limit
        if not self.config.reclaim_from_finetune:
            reclaimable = 0
        elif not allow_reclaim:
            if reclaimable and pages > self.pool.free_pages:
                self.counters.deferred_reclaims += 1
            reclaimable = 0
        if not allow_flush and reclaimable:
            flush_free = self.pool.finetune_flush_free_pages()
            if reclaimable > flush_free:
                if pages > self.pool.free_pages + flush_free:
                    self.counters.deferred_flushes += 1
                reclaimable = flush_free
        available = self.pool.free_pages + reclaimable
        if pages > available:
            pages = self.round_down(available)
            if pages == 0:
                return 0
        start = self._clock()
        reclaimed = 0
        short = pages - self.pool.free_pages
        if short > 0:
            # read again: a running quantum may have allocated since `reclaimable` was taken
            reclaimed = min(short, reclaimable, self.pool.finetune_reclaimable_pages())
            if not allow_flush:
                reclaimed = min(reclaimed, self.pool.finetune_flush_free_pages())
            if reclaimed:
                before = self.pool.finetune_pages
                flush_start = self._clock()
                if self.pool.reclaim_from_finetune(reclaimed, allow_flush=allow_flush):
                    self.count_flush(self._clock() - flush_start, reason)
                self.iterations_since_reclaim = 0
                self.counters.finetune_shrinks += 1
                self.counters.finetune_reclaimed_pages += reclaimed
                logger.info(
                    "finetune budget shrinks %d -> %d pages for decode (%s)",
                    before,
                    self.pool.finetune_pages,
                    reason,
                )
        want = self.round_down(min(pages, self.pool.free_pages))
        before = self.pool.kv_prefix_pages
        got = self.pool.grow_decode(want)
        elapsed = self._clock() - start
        self.counters.decode_pages_mapped += got
        self.counters.map_latency.add(elapsed)
        if reclaimed:
            self.counters.reclaim_latency.add(elapsed)
        if got < want:
            self.counters.map_failures += 1
            logger.warning("mapped %d of %d pages: device out of physical memory", got, want)
        if got:
            logger.info(
                "decode KV grows %d -> %d pages (%s, %.3f ms)",
                before,
                self.pool.kv_prefix_pages,
                reason,
                elapsed * 1e3,
            )
        return got

    def count_flush(self, seconds: float, reason: str) -> None:
        self.counters.flush_latency.add(seconds)
        if self.pool.last_flush_s is not None:
            self.counters.flush_release_latency.add(self.pool.last_flush_s[0])
        if reason == "urgent":
            self.counters.urgent_flushes += 1
        logger.warning("finetune cache flushed for decode (%s, %.3f ms)", reason, seconds * 1e3)

    def round_up(self, pages: int) -> int:
        unit = self.pool.map_unit_pages
        return -(-pages // unit) * unit

    def round_down(self, pages: int) -> int:
        unit = self.pool.map_unit_pages
        return pages // unit * unit
