"""`LatencySamples` totals and `WorkMeter`: one call's work from the counters' deltas."""

from __future__ import annotations

import pytest

from gpu_runtime.memory import LatencySamples, MemoryCounters, MemoryWork
from gpu_runtime.memory.work import WorkMeter


def test_count_and_total_cover_every_sample_beyond_the_capacity() -> None:
    samples = LatencySamples(capacity=2)
    for seconds in (0.001, 0.002, 0.004):
        samples.add(seconds)
    assert len(samples) == 2 and samples.count == 3
    assert samples.total_s == pytest.approx(0.007)
    assert samples.values_ms() == pytest.approx([2.0, 4.0])


def test_a_meter_reports_only_what_happened_between_start_and_stop() -> None:
    counters = MemoryCounters()
    counters.map_latency.add(0.5)  # before the call: not in its work
    counters.decode_pages_mapped = 10
    meter = WorkMeter(counters)
    meter.start()
    counters.map_latency.add(0.002)
    counters.reclaim_latency.add(0.002)
    counters.flush_latency.add(0.001)
    counters.decode_pages_mapped += 4
    counters.decode_pages_unmapped += 2
    counters.finetune_shrinks += 1
    work = meter.stop()
    assert (work.maps, work.pages_mapped, work.pages_unmapped) == (1, 4, 2)
    assert (work.reclaims, work.flushes, work.waits, work.budget_changes) == (1, 1, 0, 1)
    assert work.map_ms == pytest.approx(2.0) and work.flush_ms == pytest.approx(1.0)
    assert work.ms >= 0
    meter.start()
    assert meter.stop().values()[1:] == MemoryWork().values()[1:]  # nothing the second time
    assert MemoryWork.names()[:2] == ("ms", "maps")
