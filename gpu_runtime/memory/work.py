"""`MemoryWork`: what one call of the memory adapter did, from the counters' deltas.

`EngineMemory` measures each `before_decode()` (on the critical path, before the decode step)
and `after_decode()` (after it) with `WorkMeter`: the call's host time, the decode maps and
pages mapped or unmapped, the reclaims, finetune cache flushes and waits for a quantum (count
and time of each), the finetune budget changes and decode's preemptions. A host's metrics or a
benchmark's per-iteration table read them as `EngineMemory.last_before` / `last_after`. The
counters are read, never reset: a few attribute reads per call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import NamedTuple

from gpu_runtime.memory.counters import MemoryCounters


@dataclass(frozen=True)
class MemoryWork:
    """One call's work; times in ms."""

    ms: float = 0.0
    """Host time of the whole call."""
    maps: int = 0
    """Decode map calls (urgent, refill and reclaims)."""
    map_ms: float = 0.0
    pages_mapped: int = 0
    pages_unmapped: int = 0
    """KV pages decode handed back (its range shrank)."""
    reclaims: int = 0
    """Maps that took pages back from finetuning (a cap change, a flush or a wait first)."""
    reclaim_ms: float = 0.0
    flushes: int = 0
    """Finetune cache flushes (`torch.cuda.empty_cache`, which waits for the device)."""
    flush_ms: float = 0.0
    waits: int = 0
    """Waits for a running finetune quantum to end."""
    wait_ms: float = 0.0
    budget_changes: int = 0
    """Finetune budget raised or lowered (the torch cap set)."""
    preemptions: int = 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def values(self) -> tuple[float | int, ...]:
        return tuple(getattr(self, name) for name in self.names())


class _Reading(NamedTuple):
    maps: int
    map_s: float
    mapped: int
    unmapped: int
    reclaims: int
    reclaim_s: float
    flushes: int
    flush_s: float
    waits: int
    wait_s: float
    budget_changes: int
    preemptions: int


def _read(counters: MemoryCounters) -> _Reading:
    c = counters
    return _Reading(
        c.map_latency.count,
        c.map_latency.total_s,
        c.decode_pages_mapped,
        c.decode_pages_unmapped,
        c.reclaim_latency.count,
        c.reclaim_latency.total_s,
        c.flush_latency.count,
        c.flush_latency.total_s,
        c.wait_latency.count,
        c.wait_latency.total_s,
        c.finetune_grows + c.finetune_shrinks,
        c.preemptions,
    )


class WorkMeter:
    """`start()` before a call, `stop()` after it: the call's `MemoryWork`."""

    def __init__(self, counters: MemoryCounters) -> None:
        self._counters = counters
        self._clock = time.perf_counter
        self._started = 0.0
        self._before = _read(counters)

    def start(self) -> None:
        self._before = _read(self._counters)
        self._started = self._clock()

    def stop(self) -> MemoryWork:
        elapsed = self._clock() - self._started
        a, b = self._before, _read(self._counters)
        return MemoryWork(
            ms=elapsed * 1e3,
            maps=b.maps - a.maps,
            map_ms=(b.map_s - a.map_s) * 1e3,
            pages_mapped=b.mapped - a.mapped,
            pages_unmapped=b.unmapped - a.unmapped,
            reclaims=b.reclaims - a.reclaims,
            reclaim_ms=(b.reclaim_s - a.reclaim_s) * 1e3,
            flushes=b.flushes - a.flushes,
            flush_ms=(b.flush_s - a.flush_s) * 1e3,
            waits=b.waits - a.waits,
            wait_ms=(b.wait_s - a.wait_s) * 1e3,
            budget_changes=b.budget_changes - a.budget_changes,
            preemptions=b.preemptions - a.preemptions,
        )
