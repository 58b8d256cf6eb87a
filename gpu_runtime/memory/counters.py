"""Counters and latency samples of the memory manager (one object per manager, no globals)."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

from gpu_runtime.contract.statistics import percentile


class LatencySamples:
    """The last `capacity` durations (seconds) of one kind of event, with percentiles in ms;
    `count` and `total_s` cover every event ever added (for deltas over a window)."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._samples: deque[float] = deque(maxlen=capacity)
        self.count = 0
        """Events added so far (not capped by `capacity`)."""
        self.total_s = 0.0
        """Their summed duration (seconds)."""

    def add(self, seconds: float) -> None:
        if seconds < 0 or math.isnan(seconds):
            raise ValueError(f"a duration must be >= 0, got {seconds}")
        self._samples.append(seconds)
        self.count += 1
        self.total_s += seconds

    def __len__(self) -> int:
        return len(self._samples)

    def values_ms(self) -> list[float]:
        return [s * 1e3 for s in self._samples]

    def percentile_ms(self, q: float) -> float:
        """Percentile `q` in [0, 100] (`contract.statistics`) in milliseconds; NaN when empty."""
        value = percentile(self._samples, q)
        return math.nan if value is None else value * 1e3


@dataclass
class MemoryCounters:
    """Every transition of the memory manager, counted. Pages are pool pages."""

    iterations: int = 0
    """Decode iterations seen (`MemoryManager.before_step` calls)."""
    urgent_maps: int = 0
    """Times decode's next step needed blocks beyond the mapped free ones (mapped inline)."""
    urgent_pages: int = 0
    """Pages mapped inline for those."""
    refill_maps: int = 0
    """Reserve refills done off the critical path (`maintain`)."""
    refill_pages: int = 0
    decode_pages_mapped: int = 0
    """All pages mapped for decode (urgent + refill)."""
    decode_pages_unmapped: int = 0
    """All KV pages handed back by decode (load fell)."""
    kv_shrinks: int = 0
    """Times decode's KV range shrank."""
    finetune_shrinks: int = 0
    """Times the finetune budget was lowered (reclaims)."""
    finetune_reclaimed_pages: int = 0
    finetune_waits: int = 0
    """Urgent reclaims that first waited for a running finetune quantum to end."""
    busy_reclaims: int = 0
    """Urgent reclaims served, while a quantum ran, from budget that quantum was not promised
    and its allocator did not hold (a cap change: no wait, no flush)."""
    deferred_reclaims: int = 0
    """Refills that needed finetune pages while a quantum was in flight (taken later)."""
    deferred_flushes: int = 0
    """Refills (off the critical path or between quanta) that took only the budget the finetune
    allocator does not hold and left the rest, which only a cache flush could free: a refill
    never flushes."""
    urgent_flushes: int = 0
    """Flushes inside an iteration: decode's next step needed more than the free pages and the
    budget the finetune allocator does not hold (the one case a reclaim may flush)."""
    graph_releases: int = 0
    """Times the finetune side dropped a separately pooled CUDA-graph shape between quanta
    (`FinetuneBudget.graph_release`), each followed by a cache flush (also counted in
    `flush_latency`)."""
    finetune_grows: int = 0
    """Times the finetune budget was raised."""
    finetune_grown_pages: int = 0
    preemptions: int = 0
    """Times decode had to preempt its own requests (nothing left to reclaim)."""
    preempted_blocks: int = 0
    """Blocks decode was short at those times."""
    map_failures: int = 0
    """Maps that got less physical memory than the ledger promised."""
    finetune_quanta: int = 0
    finetune_budget_violations: int = 0
    """Quanta whose reported peak exceeded the budget (a sizing bug on the finetune side)."""
    finetune_ooms: int = 0
    """Quanta the finetune side reported as failed for lack of memory."""
    finetune_recompute_launches: int = 0
    """Quanta the finetune side launched with activation recomputation
    (`FinetuneBudget.quantum_mode`): its memory did not fit the shape without."""
    finetune_mode_switches: int = 0
    """Times a launch's mode (with or without recomputation) differed from the last one's."""
    reclaim_latency: LatencySamples = field(default_factory=LatencySamples, repr=False)
    """Host time of every move that took pages back from finetuning (cache flush + maps)."""
    map_latency: LatencySamples = field(default_factory=LatencySamples, repr=False)
    """Host time of every decode map, reclaim included."""
    wait_latency: LatencySamples = field(default_factory=LatencySamples, repr=False)
    """Time urgent reclaims spent waiting for a running finetune quantum to end."""
    flush_latency: LatencySamples = field(default_factory=LatencySamples, repr=False)
    """The finetune cache flush of each decode reclaim that needed one (the allocator held more
    than its new budget); `len` is the number of such flushes."""
    flush_release_latency: LatencySamples = field(default_factory=LatencySamples, repr=False)
    """The part of each flush spent in `PagePool.before_flush` (dropping the finetune side's CUDA
    graphs), before the cache release itself."""

    def as_dict(self) -> dict[str, float]:
        """Flat numbers for metrics: every counter plus reclaim/map p50 and p99 (ms)."""
        out: dict[str, float] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not isinstance(getattr(self, f.name), LatencySamples)
        }
        for name, samples in (
            ("reclaim", self.reclaim_latency),
            ("map", self.map_latency),
            ("wait", self.wait_latency),
            ("flush", self.flush_latency),
            ("flush_release", self.flush_release_latency),
        ):
            out[f"{name}_ms_p50"] = samples.percentile_ms(50)
            out[f"{name}_ms_p99"] = samples.percentile_ms(99)
            out[f"{name}_count"] = len(samples)
        return out
