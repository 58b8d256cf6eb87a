"""Property-based tests of the unified pool: random decode and finetune demands, every step.

A small decode engine model (requests that arrive, grow by one block per iteration, finish, or
get preempted) and a finetune trainer model (fits each quantum into the budget it reads) drive
`KVPoolBinding` + `MemoryManager` + `PagePool` over the CPU backend, whose physical pages are
individually tracked. After every step: no physical page has two owners, the ledger sums to the
pool and agrees with the backend, the block manager's usable ids are exactly the mapped blocks,
no request is lost, decode is short of blocks only when finetuning holds nothing reclaimable,
and finetuning never exceeds its budget. Refills and `maintain` never flush the finetune cache
while a job exists; a flush happens only inside `before_step`, when the step's own blocks need
more than the free pages and the budget the finetune allocator does not hold, or (with a
releasable graph shape) in the refill between quanta, once per release the finetune side made.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpu_runtime.memory import (
    CpuPageBackend,
    KVLayout,
    KVPoolBinding,
    MemoryManager,
    MemoryManagerConfig,
    PagePool,
)

PAGE = 4096


class LowestFirstBlocks:
    """A block manager in plain integers: usable ids `[0, n)` grow/shrink at the top; the
    lowest free id is allocated first."""

    def __init__(self, num_blocks: int, capacity: int) -> None:
        self.capacity = capacity
        self._free = set(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return len(self._free) + len(self._used)

    def free_block_ids(self) -> list[int]:
        return sorted(self._free)

    def allocate(self, count: int) -> list[int]:
        assert count <= len(self._free), "allocation beyond the free blocks"
        out = sorted(self._free)[:count]
        self._free -= set(out)
        self._used |= set(out)
        return out

    def free(self, ids: list[int]) -> None:
        assert set(ids) <= self._used
        self._used -= set(ids)
        self._free |= set(ids)

    def grow(self, block_ids: list[int]) -> None:
        assert not set(block_ids) & (self._free | self._used)
        assert all(0 <= b < self.capacity for b in block_ids)
        self._free |= set(block_ids)

    def remove(self, block_ids: list[int]) -> None:
        assert set(block_ids) <= self._free, "removing a block that is in use"
        self._free -= set(block_ids)


@dataclass
class Request:
    rid: int
    prompt_blocks: int
    total_blocks: int
    blocks: list[int] = field(default_factory=list)


class UnifiedPoolMachine(RuleBasedStateMachine):
    @initialize(
        # 6+: the pinned tail (up to 3 pages of padding blocks + 1 unit) must leave pages
        units=st.integers(6, 24),
        unit=st.sampled_from([1, 2, 4]),
        block_ratio=st.sampled_from([(1, 1), (1, 2), (3, 2)]),
        pinned=st.booleans(),
        low=st.integers(0, 6),
        spread=st.integers(1, 12),
        step_units=st.integers(1, 4),
        shrink_after=st.integers(0, 4),
        grow_hold=st.integers(0, 4),
        # 0: quanta sized to the whole budget, so decode's growth often needs a flush
        headroom=st.sampled_from([0, 4]),
        peak_window=st.sampled_from([0, 3]),
        # a finetune side with a separately pooled shape, planned by the release plan
        releasable=st.booleans(),
    )
    def setup(
        self,
        units: int,
        unit: int,
        block_ratio: tuple[int, int],
        pinned: bool,
        low: int,
        spread: int,
        step_units: int,
        shrink_after: int,
        grow_hold: int,
        headroom: int,
        peak_window: int,
        releasable: bool,
    ) -> None:
        num_pages = units * unit
        block_bytes = PAGE * block_ratio[0] // block_ratio[1]
        self.backend = CpuPageBackend(num_pages=num_pages, page_bytes=PAGE, map_unit_pages=unit)
        # The engine's padding block lives in the pinned tail: room for two blocks at least.
        tail = -(-2 * block_bytes // PAGE) + (unit if pinned else 0)
        self.pool = PagePool(self.backend, pinned_tail_pages=tail)
        self.layout = KVLayout(page_bytes=PAGE, block_bytes=block_bytes)
        config = MemoryManagerConfig(
            reserve_low_pages=low,
            reserve_high_pages=low + spread,
            max_step_pages=step_units * unit,
            shrink_after_iterations=shrink_after,
            grow_hold_iterations=grow_hold,
            min_decode_pages=1,
            plan_headroom_intervals=headroom,
            plan_peak_window=peak_window,
        )
        self.manager = MemoryManager(self.pool, self.layout, config)
        self.binding = KVPoolBinding(self.manager)
        self.blocks = LowestFirstBlocks(self.binding.initial_blocks, self.binding.capacity_blocks)
        self.binding.attach(self.blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.arrived = 0
        self.finetune_resident = 0
        self.finetune_want_peak = 0
        self.promised: int | None = None
        self.releasable = releasable
        self.separate_held = False
        if releasable:
            self.manager.finetune.graph_release = self._release_separate_shape

    def _release_separate_shape(self) -> int:
        """The finetune side drops its separately pooled shape, if it holds one."""
        held, self.separate_held = self.separate_held, False
        return int(held)

    # ---- decode ---------------------------------------------------------------------------
    @rule(burst=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 8)), min_size=1, max_size=5))
    def arrive(self, burst: list[tuple[int, int]]) -> None:
        capacity = self.layout.blocks_in_pages(self.pool.prefix_limit_pages)
        for prompt, extra in burst:
            total = min(prompt + extra, capacity)
            self.waiting.append(Request(self.arrived, min(prompt, total), total))
            self.arrived += 1

    @rule(iterations=st.integers(1, 8), finetune_busy=st.booleans())
    def decode_iterations(self, iterations: int, finetune_busy: bool) -> None:
        for _ in range(iterations):
            self.decode_iteration(finetune_busy)
            self.usable_blocks_are_exactly_the_mapped_ones()
            self.no_page_owned_twice()

    def decode_iteration(self, finetune_busy: bool) -> None:
        growing = [r for r in self.running if len(r.blocks) < r.total_blocks]
        waiting_blocks = sum(r.prompt_blocks for r in self.waiting)
        flushes = self.manager.counters.flush_latency
        releases = self.manager.counters.graph_releases
        if not finetune_busy:  # between quanta: the reserve refill (EngineMemory.before_decode)
            before = len(flushes)
            self.binding.refill(waiting_blocks=waiting_blocks)
            released = self.manager.counters.graph_releases - releases
            if released:
                event("graph release")
            assert released <= 1 and len(flushes) - before == released, "a refill flushed"
            releases += released
        # A flush inside the iteration only when the step's own blocks need more than the free
        # pages and the budget the finetune allocator does not hold (a cap change).
        wanted = self.blocks.num_used_blocks + len(growing)
        unit = self.pool.map_unit_pages
        need = self.layout.pages_for_blocks(wanted) - self.pool.kv_prefix_pages
        cheap = self.pool.free_pages + self.pool.finetune_flush_free_pages()
        before = len(flushes)
        # While a quantum runs, decode takes only the budget it was not promised without
        # waiting; beyond that it waits for the quantum (here: already over).
        grant = self.binding.before_step(
            next_step_blocks=len(growing),
            waiting_blocks=waiting_blocks,
            finetune_busy=finetune_busy,
            wait_for_finetune=lambda: None,
            promised_bytes=self.promised if finetune_busy else None,
        )
        if len(flushes) > before:
            event("urgent flush")
            assert -(-need // unit) * unit > cheap, "flushed with enough flush-free pages"
        if grant.short_blocks:
            # Decode may be short only when finetuning holds nothing it could give back.
            obtainable = self.pool.free_pages + self.pool.finetune_reclaimable_pages()
            room = self.pool.prefix_limit_pages - self.pool.kv_prefix_pages
            assert min(obtainable, room) < self.pool.map_unit_pages or (
                self.layout.blocks_in_pages(self.pool.kv_prefix_pages + self.pool.map_unit_pages)
                == self.manager.usable_blocks
            )
        preempted = False
        # Running requests grow by one block; preempt the latest arrivals when blocks lack.
        for request in list(self.running):
            if request not in self.running or len(request.blocks) >= request.total_blocks:
                continue
            while self.blocks.num_free_blocks < 1 and self.running:
                victim = self.running.pop()
                self.blocks.free(victim.blocks)
                victim.blocks = []
                self.waiting.appendleft(victim)
                preempted = True
            if request in self.running:
                request.blocks += self.blocks.allocate(1)
        for request in [r for r in self.running if len(r.blocks) >= r.total_blocks]:
            self.running.remove(request)
            self.blocks.free(request.blocks)
            self.finished.append(request)
        while (
            not preempted
            and self.waiting
            and self.blocks.num_free_blocks >= self.waiting[0].prompt_blocks
        ):
            request = self.waiting.popleft()
            request.blocks = self.blocks.allocate(request.prompt_blocks)
            self.running.append(request)
        before = len(flushes)
        self.binding.maintain(
            waiting_blocks=sum(r.prompt_blocks for r in self.waiting),
            finetune_busy=finetune_busy,
            promised_bytes=self.promised if finetune_busy else None,
        )
        # Off the critical path nothing flushes while a job exists (with none, the idle budget
        # goes back with its cache).
        assert len(flushes) == before or self.finetune_want_peak == 0, "maintain flushed"
        # Graph shapes are released only by the refill between quanta.
        assert self.manager.counters.graph_releases == releases, "released outside a refill"

    # ---- finetune -------------------------------------------------------------------------
    @rule(pages=st.integers(0, 200))
    def finetune_demand(self, pages: int) -> None:
        self.manager.finetune.set_demand(pages * PAGE)
        self.finetune_want_peak = pages * PAGE

    @rule(resident_share=st.floats(0, 0.5), peak_share=st.floats(0, 1))
    def finetune_quantum(self, resident_share: float, peak_share: float) -> None:
        # What the finetune side reads: the budget less decode's expected reclaims; the
        # quantum's promise while it runs (`decode_iteration(finetune_busy=True)`).
        budget = self.manager.finetune.plan_bytes()
        if self.releasable and peak_share > 0.5:  # the separate shape: its own plan
            budget = max(budget, self.manager.finetune.release_plan_bytes())
            self.separate_held = True
        self.promised = budget
        if budget == 0:
            return
        # The trainer sizes its quantum to the budget it reads: state kept plus activations.
        resident = min(int(budget * resident_share), budget)
        resident = max(resident, min(self.finetune_resident, budget))
        peak = min(max(int(self.finetune_want_peak * peak_share), resident), budget)
        self.manager.finetune.quantum_done(peak_bytes=peak, resident_bytes=resident)
        self.finetune_resident = resident

    @rule()
    def finetune_job_ends(self) -> None:
        self.manager.finetune.set_demand(0)
        self.finetune_want_peak = 0
        if self.manager.finetune.budget_bytes:
            self.manager.finetune.quantum_done(peak_bytes=0, resident_bytes=0)
        self.finetune_resident = 0

    def teardown(self) -> None:
        counters = self.manager.counters
        names = ("finetune_shrinks", "kv_shrinks", "finetune_grows", "preemptions")
        for name in (*names, "urgent_flushes", "deferred_flushes"):
            event(f"{name} {'> 0' if getattr(counters, name) else '= 0'}")

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def no_page_owned_twice(self) -> None:
        owners = self.backend.physical_owners()
        assert len(owners) == self.pool.num_pages
        kv = sum(1 for owner in owners.values() if owner.startswith("kv:"))
        assert kv == self.pool.decode_pages

    @invariant()
    def accounting_sums_to_the_pool(self) -> None:
        pool = self.pool
        assert pool.decode_pages + pool.finetune_pages + pool.free_pages == pool.num_pages
        assert min(pool.decode_pages, pool.finetune_pages, pool.free_pages) >= 0
        pool.check()
        split = pool.split()
        assert split.decode_bytes + split.finetune_budget_bytes + split.free_bytes == (
            split.pool_bytes
        )

    @invariant()
    def usable_blocks_are_exactly_the_mapped_ones(self) -> None:
        assert self.blocks.num_usable_blocks == self.manager.usable_blocks
        held = [b for r in self.running for b in r.blocks]
        assert len(held) == len(set(held)) == self.blocks.num_used_blocks
        assert all(b < self.manager.usable_blocks for b in held)

    @invariant()
    def no_request_is_dropped(self) -> None:
        ids = [r.rid for r in (*self.waiting, *self.running, *self.finished)]
        assert sorted(ids) == list(range(self.arrived))

    @invariant()
    def finetune_within_budget(self) -> None:
        assert self.manager.counters.finetune_budget_violations == 0
        assert self.backend.finetune_reserved_bytes() <= self.manager.finetune.budget_bytes
        assert self.backend.finetune_allocated_bytes() <= self.manager.finetune.budget_bytes

    @invariant()
    def cached_plan_figures_equal_a_fresh_computation(self) -> None:
        """The reclaim headroom kept between iterations and the history's maxima are what a
        computation from scratch gives now (test_cached_figures.py compares decisions)."""
        manager = self.manager
        for with_peak in (True, False):
            assert manager.finetune.reclaim_headroom_pages(
                with_peak=with_peak
            ) == manager.finetune._reclaim_headroom_uncached(with_peak=with_peak)
        history = manager._history
        assert history.refill_growth_blocks() == max(history._interval_growth, default=0)
        if manager.config.plan_peak_window:
            assert history.peak_used_blocks() == max(history._recent_used, default=0)


UnifiedPoolMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestUnifiedPool = UnifiedPoolMachine.TestCase
