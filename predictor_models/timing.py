"""Timing on CUDA streams for the profiler: graph replays alone, and decode beside quanta.

``time_graph`` times replays of one captured step on a stream with CUDA events; ``time_fn`` the
GPU and host-enqueue time of a callable; ``corun`` runs decode replays on the decode stream while
finetune quanta keep the finetune stream busy, and reports both sides (see its docstring).

Without streams (``CpuSharing``, ``--device cpu``: a dry run of the profiler's whole path on a
tiny model) the same functions time with the wall clock and ``corun`` runs one quantum, then the
decode replays: the figures mean nothing, the code path is the GPU run's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gpu_runtime.sharing.base import GpuSharing
from gpu_runtime.sharing.partition import PartitionTable
from predictor_models.standin import CapturedStep


class CpuSharing(GpuSharing):
    """Partitions without streams for dry runs on CPU: ``partition`` returns ``(None, None)``
    and the table is an H200's (132 SMs, the given decode groups of 8 SMs)."""

    mechanism = "cpu"

    def __init__(self, decode_groups: tuple[int, ...] | None = None) -> None:
        super().__init__(PartitionTable.build(132, decode_groups), torch.device("cpu"))

    def partition(self, decode_sms: int) -> tuple[Any, Any]:
        self.table.get(decode_sms)
        return None, None

    def close(self) -> None:
        pass


def _wall_ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_graph(
    graph: CapturedStep, stream: torch.cuda.Stream | None, iters: int, warmup: int = 3
) -> list[float]:
    """Milliseconds of each of ``iters`` replays on ``stream`` after ``warmup`` replays."""
    if stream is None:  # CPU dry run
        for _ in range(warmup):
            graph.replay()
        return [_wall_ms(graph.replay) for _ in range(iters)]
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            graph.replay()
        events[0].record(stream)
        for i in range(iters):
            graph.replay()
            events[i + 1].record(stream)
    stream.synchronize()
    return [events[i].elapsed_time(events[i + 1]) for i in range(iters)]


def time_fn(fn: Callable[[], None], stream: torch.cuda.Stream, reps: int) -> tuple[float, float]:
    """(median GPU ms, median host enqueue ms) of ``fn`` on ``stream`` after one warm-up."""
    gpu, host = [], []
    with torch.cuda.stream(stream):
        fn()
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream.synchronize()
            t0 = time.perf_counter()
            start.record(stream)
            fn()
            end.record(stream)
            host.append((time.perf_counter() - t0) * 1e3)
            stream.synchronize()
            gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def corun(
    graph: CapturedStep,
    ds: torch.cuda.Stream | None,
    fs: torch.cuda.Stream | None,
    fn: Callable[[], Any],
    iters: int,
    blocking: bool = False,
) -> tuple[list[float], float, float]:
    """Decode replays on ``ds`` while quanta ``fn`` keep ``fs`` busy until they finish.

    Decode replays are enqueued at once (gated on the first quantum's start); quanta are
    enqueued two in flight until the last decode replay completes. ``blocking``: ``fn``
    returns only when its quantum has finished (the trainer's host sync), so quanta run
    back to back, each issued after the previous one's sync, and the decode replays are
    gated on an event recorded on ``fs`` just before the first. Returns the decode
    iteration times, the median quantum time inside the decode window, and the fraction
    of that window during which the finetune stream had work.
    """
    if ds is None:  # CPU dry run: one quantum, then the decode replays
        quantum_ms = _wall_ms(fn)
        return time_graph(graph, ds, iters), quantum_ms, 1.0
    warm = 3
    timing = {"enable_timing": True}
    starts: list[torch.cuda.Event] = []
    ends: list[torch.cuda.Event] = []
    dec_events = [torch.cuda.Event(**timing) for _ in range(iters + 1)]
    torch.cuda.synchronize()
    gate = torch.cuda.Event()

    def enqueue_quantum() -> None:
        start, end = torch.cuda.Event(**timing), torch.cuda.Event(**timing)
        with torch.cuda.stream(fs):
            start.record(fs)
            fn()
            end.record(fs)
        starts.append(start)
        ends.append(end)

    if blocking:
        gate.record(fs)
        ds.wait_event(gate)
    else:
        enqueue_quantum()
        ds.wait_event(starts[0])
    with torch.cuda.stream(ds):
        for _ in range(warm):
            graph.replay()
        dec_events[0].record(ds)
        for i in range(iters):
            graph.replay()
            dec_events[i + 1].record(ds)
    while (not ends or not dec_events[-1].query()) and len(ends) < 400:
        if not blocking and len(ends) >= 2 and not ends[-2].query():
            time.sleep(0.0002)  # keep two quanta in flight
            continue
        enqueue_quantum()
    torch.cuda.synchronize()
    times = [dec_events[i].elapsed_time(dec_events[i + 1]) for i in range(iters)]
    origin = starts[0]
    win_start = origin.elapsed_time(dec_events[0])
    win_end = origin.elapsed_time(dec_events[-1])
    busy, inside = 0.0, []
    for start, end in zip(starts, ends, strict=True):
        s_ms, e_ms = origin.elapsed_time(start), origin.elapsed_time(end)
        busy += max(0.0, min(e_ms, win_end) - max(s_ms, win_start))
        if s_ms >= win_start and e_ms <= win_end:
            inside.append(e_ms - s_ms)
    all_quanta = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    colocated = statistics.median(inside) if inside else statistics.median(all_quanta)
    return times, colocated, busy / max(win_end - win_start, 1e-6)
