"""Finetuning's budget over the unified pool: the bytes a quantum reads and plans for (the plan
headroom beside decode's expected reclaims, what finetune already holds), what a reclaim may
take while a quantum runs, finetune's demand and quantum accounting, the release of separately
pooled CUDA-graph shapes between quanta, and the moves of budget to and from finetuning
(lending idle pages, returning budget above the demand). `FinetuneBudget` is held by
`MemoryManager`, which tells it when to lend and return; the finetune side reads it through
`MemoryManager.finetune` (or `EngineMemory`)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from gpu_runtime.memory.config import MemoryManagerConfig
from gpu_runtime.memory.counters import MemoryCounters
from gpu_runtime.memory.headroom import DecodeHistory
from gpu_runtime.memory.layout import FinetuneBudgetExceeded
from gpu_runtime.memory.moves import PageMoves
from gpu_runtime.memory.pool import PagePool

logger = logging.getLogger(__name__)


class FinetuneBudget:
    """Finetuning's share of `pool`: decode's `history` sets the plan headroom, `moves` counts
    the flushes and knows when decode last reclaimed (lending waits after it)."""

    def __init__(
        self,
        pool: PagePool,
        config: MemoryManagerConfig,
        counters: MemoryCounters,
        history: DecodeHistory,
        moves: PageMoves,
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.config = config
        self.counters = counters
        self._history = history
        self._moves = moves
        self._clock = clock
        self._demand_pages = 0
        self._recompute: bool | None = None  # the last launch's mode
        self._headroom_cache: dict[bool, tuple[tuple[bool, int, int, int], int]] = {}
        self.graph_release: Callable[[], int] | None = None
        """The finetune side's release of its largest separately pooled CUDA-graph shape (the
        graphs dropped; 0 when none is), called only from `release_graphs`, i.e. between
        quanta. None (the default): never called."""

    @property
    def budget_bytes(self) -> int:
        """Bytes the next finetune quantum may peak at (live state included)."""
        return self.pool.finetune_budget_bytes

    def reclaim_headroom_pages(self, *, with_peak: bool = True) -> int:
        """Budget pages decode is expected to take back soon, beyond the free pages: see
        `DecodeHistory.headroom_pages` (recent growth times `plan_headroom_intervals`, the floor
        `plan_headroom_min_pages`, decode's recent peak with `plan_peak_window`). 0 under a
        static split (nothing is ever reclaimed). `with_peak=False`: without the peak term.

        Read every iteration (`plan_bytes`) while its inputs change only when pages
        move or at a quantum boundary: the figure is kept until one of them changes (decode's
        prefix, the finetune budget, the history's `version`); the config is frozen and the
        free pages follow from the first two. `_reclaim_headroom_uncached` is the computation."""
        cfg = self.config
        if not cfg.reclaim_from_finetune or cfg.plan_headroom_intervals == 0:
            return 0
        pool = self.pool
        key = (with_peak, pool.kv_prefix_pages, pool.finetune_pages, self._history.version)
        cached = self._headroom_cache.get(with_peak)
        if cached is not None and cached[0] == key:
            return cached[1]
        pages = self._reclaim_headroom_uncached(with_peak=with_peak)
        self._headroom_cache[with_peak] = (key, pages)
        return pages

    def _reclaim_headroom_uncached(self, *, with_peak: bool = True) -> int:
        cfg = self.config
        if not cfg.reclaim_from_finetune or cfg.plan_headroom_intervals == 0:
            return 0
        history = self._history
        pages = self._moves.round_up(
            history.headroom_pages(self.pool.kv_prefix_pages, with_peak=with_peak)
        )
        return min(max(pages - self.pool.free_pages, 0), self.pool.finetune_pages)

    def plan_bytes(self) -> int:
        """Bytes the next quantum should plan to peak at: the budget less
        `reclaim_headroom_pages`, but never less than what the finetune allocator already
        holds while that is within the budget. A finetune side that stays within the budget
        less the headroom keeps its allocator below the budget the next reclaim leaves, so
        that reclaim needs no cache flush (on CUDA a flush waits for the device, frees every
        cached segment and drops the trainers' CUDA graphs: the one costly part of a
        reclaim). Memory the allocator already holds goes back only by such a flush, whatever
        the next quantum's size, so planning below it frees nothing: a quantum that fits in it
        (e.g. the replay of a CUDA graph already captured, whose private pool is held) adds
        nothing a reclaim would have to flush. Held memory above the budget (a flush is
        pending) does not count."""
        pages = self.pool.finetune_pages - self.reclaim_headroom_pages()
        # Its pools' reserved bytes only: the live figure is process-wide on CUDA
        # (decode's live growth would count).
        held = -(-self.pool.backend.finetune_reserved_bytes() // self.pool.page_bytes)
        if held <= self.pool.finetune_pages:
            pages = max(pages, held)
        return pages * self.pool.page_bytes

    def release_plan_bytes(self) -> int:
        """Bytes a quantum may plan to peak at when what it adds beyond `plan_bytes()`
        can be released between quanta (a separately pooled CUDA-graph shape, which
        `graph_release` drops): the budget less the plan headroom without the peak
        term (decode's recent growth and the floor only). Not floored at what finetune holds:
        held memory above it is what the next quantum boundary releases."""
        pages = self.pool.finetune_pages - self.reclaim_headroom_pages(with_peak=False)
        return max(pages, 0) * self.pool.page_bytes

    def release_graphs(self, refill_pages: int) -> bool:
        """Between quanta only (`MemoryManager.refill_reserve`): when what finetune's pools
        hold exceeds `release_plan_bytes()` (decode grew), or the refill's `refill_pages` need
        more than the free pages and the budget the allocator does not hold, ask the finetune
        side to drop its largest separately pooled graphs (`graph_release`: the count dropped,
        0 when nothing is releasable) and flush its cache, so that the refill and the next
        reclaims are cap changes. The flush waits for the device (no quantum runs here)
        and is counted as one (`flush_latency`) and in `graph_releases`. Returns whether it
        released anything."""
        release = self.graph_release
        if release is None or not self.config.reclaim_from_finetune:
            return False
        page = self.pool.page_bytes
        held = -(-self.pool.backend.finetune_reserved_bytes() // page)
        plan = self.release_plan_bytes() // page
        room = self.pool.free_pages + self.pool.finetune_flush_free_pages()
        if held <= plan and refill_pages <= room:
            return False
        start = self._clock()
        dropped = release()
        if dropped <= 0:
            return False
        self._flush_released_graphs(start)
        logger.info(
            "finetune released %d graphs of its largest separate shape: held %d pages, "
            "release plan %d, refill %d beyond %d free or unheld; now holds %d pages",
            dropped,
            held,
            plan,
            refill_pages,
            room,
            -(-self.pool.backend.finetune_reserved_bytes() // page),
        )
        return True

    def graphs_released(self, dropped: int) -> None:
        """The finetune side dropped `dropped` graphs between quanta on its own (e.g. the
        shapes of its shared pool before a larger shape is captured into a pool of its own):
        flush the finetune cache so that their pool goes back to the device before the next
        capture allocates. Counted like a release by `graph_release` (a graph
        release and a flush). Call only with no quantum in flight."""
        if dropped <= 0:
            return
        self._flush_released_graphs(self._clock())
        logger.info("finetune dropped %d graphs between quanta: cache flushed", dropped)

    def _flush_released_graphs(self, start: float) -> None:
        self.pool.flush_finetune_cache()
        self.counters.graph_releases += 1
        self._moves.count_flush(self._clock() - start, "graph release")

    def busy_spare_pages(self, promised_bytes: int | None) -> int:
        """Budget pages a reclaim may take while a quantum runs, without waiting for it or
        flushing: those above both what its allocator holds and what the quantum was promised
        at launch (`promised_bytes`; None: the whole budget, so nothing is spare). Rounded
        down to the map unit."""
        backend = self.pool.backend
        held = max(backend.finetune_reserved_bytes(), backend.finetune_allocated_bytes())
        if promised_bytes is None:
            promised_bytes = self.pool.finetune_budget_bytes
        held = max(held, promised_bytes)
        spare = self.pool.finetune_pages - -(-held // self.pool.page_bytes)
        return self._moves.round_down(max(spare, 0))

    def headroom_bytes(self) -> int:
        """Budget left for the next quantum's activations after its live state."""
        live = self.pool.backend.finetune_allocated_bytes()
        return max(self.pool.finetune_budget_bytes - live, 0)

    def set_demand(self, nbytes: int) -> None:
        """Most memory finetuning can use now (0: no job). Budget grows toward it, never past."""
        if nbytes < 0:
            raise ValueError(f"finetune demand must be >= 0, got {nbytes}")
        self._demand_pages = nbytes // self.pool.page_bytes
        logger.info("finetune demand set to %d B (%d pages)", nbytes, self._demand_pages)

    def quantum_done(self, *, peak_bytes: int, resident_bytes: int) -> None:
        """Account a finished quantum; raises `FinetuneBudgetExceeded` if it broke the budget."""
        self.counters.finetune_quanta += 1
        try:
            self.pool.backend.record_finetune_usage(
                peak_bytes=peak_bytes, resident_bytes=resident_bytes
            )
        except FinetuneBudgetExceeded:
            self.counters.finetune_budget_violations += 1
            logger.error(
                "finetune quantum peaked at %d B over its budget %d B",
                peak_bytes,
                self.budget_bytes,
            )
            raise

    def quantum_mode(self, *, examples: int, recompute: bool) -> None:
        """The finetune side launches a quantum of `examples` examples per micro-batch, with
        activation recomputation or without (sized to what `plan_bytes()` allowed:
        recomputation is how it fits a budget too small for the shape without). Counted
        (`finetune_recompute_launches`); a change of mode is a transition, logged and counted
        (`finetune_mode_switches`)."""
        if recompute:
            self.counters.finetune_recompute_launches += 1
        last = self._recompute
        self._recompute = recompute
        if last is None or last == recompute:
            return
        self.counters.finetune_mode_switches += 1
        logger.info(
            "finetune quanta %s activation recomputation (%d examples; budget %d B)",
            "start" if recompute else "stop",
            examples,
            self.budget_bytes,
        )

    def record_oom(self) -> None:
        """The finetune side lost a quantum to an out-of-memory error under its cap."""
        self.counters.finetune_ooms += 1
        logger.warning("finetune quantum ran out of memory under budget %d B", self.budget_bytes)

    def lend_idle_pages(self, keep_free: int) -> None:
        """Raise the budget by every free page beyond `keep_free`, up to finetune's demand, in
        one move (a cap change: nothing physical moves), `grow_hold_iterations` after the last
        reclaim."""
        if self._moves.iterations_since_reclaim < self.config.grow_hold_iterations:
            return
        count = min(
            self.pool.free_pages - keep_free,
            self._demand_pages - self.pool.finetune_pages,
        )
        if count <= 0:
            return
        before = self.pool.finetune_pages
        self.pool.lend_to_finetune(count)
        self.counters.finetune_grows += 1
        self.counters.finetune_grown_pages += count
        logger.info("finetune budget grows %d -> %d pages", before, self.pool.finetune_pages)

    def return_unwanted_budget(self) -> None:
        """Budget above finetune's demand is idle: take it back in one step (no decode need).
        A cap change only while a job exists; with no job (demand 0) the cache is flushed."""
        excess = self.pool.finetune_pages - self._demand_pages
        if excess <= 0:  # the usual case: no backend reads (on CUDA each is a torch stats call)
            return
        count = min(excess, self.pool.finetune_reclaimable_pages(), self.config.max_step_pages)
        no_job = self._demand_pages == 0
        if not no_job:
            count = min(count, self.pool.finetune_flush_free_pages())
        if count <= 0:
            return
        before = self.pool.finetune_pages
        start = self._clock()
        if self.pool.reclaim_from_finetune(count, allow_flush=no_job):
            self._moves.count_flush(self._clock() - start, "no job")
        self.counters.finetune_shrinks += 1
        self.counters.finetune_reclaimed_pages += count
        logger.info(
            "finetune budget shrinks %d -> %d pages (above its demand)",
            before,
            self.pool.finetune_pages,
        )
