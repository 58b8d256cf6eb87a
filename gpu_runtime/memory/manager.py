"""`MemoryManager`: decode first over the unified pool.

Call order, once per engine iteration (one thread; no call is made from a kernel or a callback):
1. `before_step(demand)` before the decode scheduler allocates blocks for the next step. It
   makes sure `demand.next_step_blocks` fit (critical path: maps inline only when the reserve
   was too small, reclaiming from finetuning first) and returns a `DecodeGrant`: the usable block
   count the block manager must apply, and how many blocks decode is still short (it preempts
   its own requests for those only; that happens only when finetuning holds nothing reclaimable).
2. The engine launches the decode step (and a finetune quantum, if the scheduler picked one).
3. `maintain(demand)` while the GPU runs: maps or unmaps at most `max_step_pages` pages,
   refilling decode's reserve of mapped free pages up to the low watermark (+ waiting
   requests), giving KV pages back when the reserve stayed above the high watermark for
   `shrink_after_iterations` iterations, and lending every free page decode's reserve does not
   lack to finetuning (one cap change) `grow_hold_iterations` after the last reclaim
   (hysteresis). The demand passed here is read after the step's block allocation, so
   `top_used_block` covers every block the in-flight step can read.
Flushes: a reclaim is a cap change unless finetune's allocator holds more than the new budget;
then its cache must be flushed (on CUDA: waits for the device, drops the trainers' graphs).
Refills (`refill_reserve`, `maintain`) never flush while a job exists: they take the free pages
and the budget the allocator does not hold, and leave the rest (`deferred_flushes`). Only
`before_step` may flush, when the step's own blocks need more (`urgent_flushes`), and, with
`FinetuneBudget.graph_release` set, `refill_reserve` (between quanta) after the finetune side
drops a separately pooled graph shape (`graph_releases`).
Finetune side (`MemoryManager.finetune`, a `FinetuneBudget`): read `budget_bytes` before each
quantum and fit its peak in it; after the quantum call `quantum_done(peak_bytes=...,
resident_bytes=...)`. The page moves both sides make are a `PageMoves` (`moves.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gpu_runtime.memory.config import DecodeDemand, DecodeGrant, MemoryManagerConfig
from gpu_runtime.memory.counters import MemoryCounters
from gpu_runtime.memory.finetune_budget import FinetuneBudget
from gpu_runtime.memory.headroom import DecodeHistory
from gpu_runtime.memory.layout import KVLayout, MemoryPoolError
from gpu_runtime.memory.moves import PageMoves
from gpu_runtime.memory.pool import MemorySplit, PagePool

logger = logging.getLogger(__name__)

__all__ = ["DecodeDemand", "DecodeGrant", "MemoryManager", "MemoryManagerConfig"]


class MemoryManager:
    """Decode-first policy over a `PagePool`; every transition is logged and counted. The
    decode side is here; it holds the finetune side (budget, plan, demand, lending) as
    `finetune` and the page moves as `moves`."""

    def __init__(
        self,
        pool: PagePool,
        layout: KVLayout,
        config: MemoryManagerConfig | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if layout.page_bytes != pool.page_bytes:
            raise ValueError(
                f"layout page_bytes {layout.page_bytes} != pool page_bytes {pool.page_bytes}"
            )
        self.config = config or MemoryManagerConfig()
        if self.config.min_decode_pages > pool.prefix_limit_pages:
            raise ValueError(
                f"min_decode_pages {self.config.min_decode_pages} > the pool's KV prefix limit "
                f"({pool.prefix_limit_pages} pages)"
            )
        if self.config.max_step_pages < pool.map_unit_pages:
            raise ValueError(
                f"max_step_pages {self.config.max_step_pages} < the pool's map unit "
                f"({pool.map_unit_pages} pages)"
            )
        self.pool = pool
        self.layout = layout
        self.counters = MemoryCounters()
        self._clock = clock
        self._iterations_above_high = 0
        self._history = DecodeHistory(self.config, layout)
        self.moves = PageMoves(pool, self.config, self.counters, clock)
        self.finetune = FinetuneBudget(
            pool, self.config, self.counters, self._history, self.moves, clock
        )
        self.before_decode_unmap: Callable[[], object] | None = None
        """Called before decode's KV pages are unmapped: waits for any decode step still on
        the device that may write them (`EngineMemory.attach` sets the engine's
        `runner.wait_for_launched`: with async scheduling, a step launched ahead for a request
        that has since stopped writes blocks already freed). None: nothing to wait for."""
        initial = min(
            max(self.config.min_decode_pages, self.config.reserve_low_pages),
            pool.prefix_limit_pages,
        )
        self.moves.grow_decode(initial, reason="initial")

    # ---- decode side -------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        """KV blocks backed by mapped pages: ids `[0, usable_blocks)`."""
        return self.layout.blocks_in_pages(self.pool.kv_prefix_pages)

    def before_step(
        self,
        demand: DecodeDemand,
        *,
        finetune_busy: bool = False,
        wait_for_finetune: Callable[[], object] | None = None,
        promised_bytes: int | None = None,
    ) -> DecodeGrant:
        """Make room for the next step's blocks; returns the usable count and any shortfall.

        When the free pages do not cover the need and a finetune quantum is in flight
        (`finetune_busy`), the budget that quantum was not promised (`promised_bytes`: what
        it was told to fit in at launch) and its allocator does not hold is taken first, as a
        cap change (`FinetuneBudget.busy_spare_pages`; counted as `busy_reclaims`). Only if
        that is not enough is `wait_for_finetune` called (counted as `finetune_waits`):
        cutting deeper under a running quantum could make it run out of memory, and the cache
        flush would wait for it anyway.
        """
        self.counters.iterations += 1
        self.moves.iterations_since_reclaim += 1
        self._check_demand(demand)
        wanted = demand.used_blocks + demand.next_step_blocks
        if wanted > self.usable_blocks:
            need = self.layout.pages_for_blocks(wanted) - self.pool.kv_prefix_pages
            limit: int | None = None
            if (
                finetune_busy
                and self.moves.round_up(need) > self.pool.free_pages
                # Pages can come back only when reclaims are on (not under a static split).
                and self.config.reclaim_from_finetune
                and self.pool.finetune_pages > 0
            ):
                spare = self.finetune.busy_spare_pages(promised_bytes)
                if self.moves.round_up(need) <= self.pool.free_pages + spare:
                    limit = spare
                    self.counters.busy_reclaims += 1
                elif wait_for_finetune is not None:
                    self.counters.finetune_waits += 1
                    logger.info("decode needs finetune pages: waiting for the running quantum")
                    waited = self._clock()
                    wait_for_finetune()
                    self.counters.wait_latency.add(self._clock() - waited)
            got = self.moves.grow_decode(need, reason="urgent", reclaim_limit=limit)
            self.counters.urgent_maps += 1
            self.counters.urgent_pages += got
        short = max(wanted - self.usable_blocks, 0)
        if short:
            self.counters.preemptions += 1
            self.counters.preempted_blocks += short
            logger.warning(
                "decode short of %d blocks: free %d pages, finetune reclaimable %d pages; "
                "decode must preempt",
                short,
                self.pool.free_pages,
                self.pool.finetune_reclaimable_pages(),
            )
        return DecodeGrant(usable_blocks=self.usable_blocks, short_blocks=short)

    def maintain(
        self,
        demand: DecodeDemand,
        *,
        top_used_block: Callable[[], int] | None = None,
        finetune_busy: bool = False,
        promised_bytes: int | None = None,
    ) -> None:
        """One small step off the critical path: refill, shrink KV, or lend to finetuning.

        `top_used_block` is asked (only when decode is about to give pages back) when the
        demand does not carry it; one of the two is needed for a shrink. `finetune_busy`: a
        finetune quantum is still running on the device; a reclaim that flushes torch's cache
        would wait for that quantum, so the refill then takes free pages and the budget the
        running quantum was not promised (`FinetuneBudget.busy_spare_pages`: a cap change)
        only, and the rest waits for a later call (counted as `deferred_reclaims`).
        """
        self._check_demand(demand)
        cfg = self.config
        free_blocks = self.usable_blocks - demand.used_blocks
        target_pages, low_blocks, high_blocks = self._watermarks(demand)
        if free_blocks < low_blocks:
            self._iterations_above_high = 0
            limit = self.finetune.busy_spare_pages(promised_bytes) if finetune_busy else None
            self._refill(demand, low_blocks, reclaim_limit=limit)
        elif free_blocks > high_blocks:
            self._iterations_above_high += 1
            if self._iterations_above_high >= cfg.shrink_after_iterations:
                top = demand.top_used_block
                if top is None:
                    if top_used_block is None:
                        raise MemoryPoolError(
                            "a KV shrink needs top_used_block (value or callable)"
                        )
                    top = top_used_block()
                    self._check_top(top, demand.used_blocks)
                self._shrink_decode(demand.used_blocks, top, target_pages, high_blocks)
        else:
            self._iterations_above_high = 0
        if not finetune_busy:
            self.finetune.return_unwanted_budget()
        # Pages decode's reserve still lacks (the waiting prompts' included) stay free.
        short = self.layout.pages_for_blocks(demand.used_blocks + low_blocks)
        self.finetune.lend_idle_pages(
            keep_free=self.moves.round_up(max(short - self.pool.kv_prefix_pages, 0))
        )

    def refill_reserve(self, demand: DecodeDemand) -> int:
        """Between finetune quanta (none in flight): refill decode's reserve up to the low
        watermark plus what decode grew by over each of the last `growth_window` intervals
        between such calls (the most of them), reclaiming from finetuning if the free pages fall
        short. Not limited to `max_step_pages`. Returns the pages mapped.

        On a GPU the finetune quanta run back to back, so `maintain` (called while the next
        quantum runs) can only defer reclaims: this is the one point of the iteration where a
        reclaim neither waits for a quantum nor cuts a running quantum's budget, and the reserve
        must last until the next such point, one quantum later. It does not touch the
        hysteresis counters (`maintain` still runs once per iteration).

        With `finetune.graph_release` set, it first lets the finetune side release its
        largest separately pooled graph shape when what finetune holds exceeds
        `finetune.release_plan_bytes()` or the refill needs what only a flush frees (then
        flushes: `graph_releases`); a quantum never runs here, so none loses its pool."""
        self._check_demand(demand)
        self._history.observe(demand.used_blocks)
        free_blocks = self.usable_blocks - demand.used_blocks
        _, low_blocks, _ = self._watermarks(demand)
        low_blocks += self._history.refill_growth_blocks()
        need = self.layout.pages_for_blocks(demand.used_blocks + low_blocks)
        got = 0
        if free_blocks < low_blocks:
            got = self.moves.grow_decode(
                need - self.pool.kv_prefix_pages, reason="refill", allow_flush=False
            )
        # After this boundary's refill: what it still lacks (within the KV range) may come
        # from a graph release, which also runs when decode's growth leaves what finetune
        # holds above the release plan.
        room = self.pool.prefix_limit_pages - self.pool.kv_prefix_pages
        missing = 0
        if free_blocks < low_blocks:
            missing = min(max(need - self.pool.kv_prefix_pages, 0), room)
        if self.finetune.release_graphs(self.moves.round_up(missing)) and missing > 0:
            got += self.moves.grow_decode(missing, reason="refill", allow_flush=False)
        if got:
            self.counters.refill_maps += 1
            self.counters.refill_pages += got
        return got

    def _watermarks(self, demand: DecodeDemand) -> tuple[int, int, int]:
        """(low target in pages, low and high watermarks in blocks), waiting prompts included."""
        cfg = self.config
        waiting_pages = min(
            self.layout.pages_for_blocks(demand.waiting_blocks), cfg.max_waiting_pages
        )
        target_pages = cfg.reserve_low_pages + waiting_pages
        low_blocks = self.layout.blocks_in_pages(target_pages)
        high_blocks = self.layout.blocks_in_pages(cfg.reserve_high_pages + waiting_pages)
        return target_pages, low_blocks, high_blocks

    def _refill(self, demand: DecodeDemand, low_blocks: int, *, reclaim_limit: int | None) -> int:
        need = (
            self.layout.pages_for_blocks(demand.used_blocks + low_blocks)
            - self.pool.kv_prefix_pages
        )
        got = self.moves.grow_decode(
            min(need, self.config.max_step_pages),
            reason="refill",
            reclaim_limit=reclaim_limit,
            allow_flush=False,
        )
        if got:
            self.counters.refill_maps += 1
            self.counters.refill_pages += got
        return got

    def _shrink_decode(
        self, used_blocks: int, top_used_block: int, target_pages: int, high_blocks: int
    ) -> None:
        cfg = self.config
        mid_blocks = (self.layout.blocks_in_pages(target_pages) + high_blocks) // 2
        keep = max(
            cfg.min_decode_pages,
            self.layout.pages_for_blocks(top_used_block),
            self.layout.pages_for_blocks(used_blocks + mid_blocks),
        )
        count = self.moves.round_down(min(cfg.max_step_pages, self.pool.kv_prefix_pages - keep))
        if count <= 0:
            # Live blocks sit at the top of the range: look again (the scan for the top used
            # block costs a pass over the free ids) only after another hysteresis period.
            self._iterations_above_high = 0
            return
        before = self.pool.kv_prefix_pages
        if self.before_decode_unmap is not None:
            self.before_decode_unmap()
        self.pool.shrink_decode(count)
        self.counters.kv_shrinks += 1
        self.counters.decode_pages_unmapped += count
        logger.info(
            "decode KV shrinks %d -> %d pages (reserve above high watermark for %d iterations)",
            before,
            self.pool.kv_prefix_pages,
            self._iterations_above_high,
        )

    def split(self) -> MemorySplit:
        return self.pool.split()

    def _check_demand(self, demand: DecodeDemand) -> None:
        if demand.used_blocks > self.usable_blocks:
            raise MemoryPoolError(
                f"decode uses {demand.used_blocks} blocks but only {self.usable_blocks} are mapped"
            )
        if demand.top_used_block is not None:
            self._check_top(demand.top_used_block, demand.used_blocks)

    def _check_top(self, top_used_block: int, used_blocks: int) -> None:
        if not used_blocks <= top_used_block <= self.usable_blocks:
            raise MemoryPoolError(
                f"top_used_block {top_used_block} outside [{used_blocks}, {self.usable_blocks}]"
            )
