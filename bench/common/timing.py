"""Timing helpers every benchmark shares: device time between CUDA events, and a device sync
that is a no-op on the CPU (smoke runs)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def event_times(run: Callable[[], object], reps: int) -> list[float]:
    """Device ms of each of `reps` calls of `run()`, between two CUDA events (synchronized)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        run()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return times


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
