"""What `Engine.step` takes besides the partition and gives back besides outputs: the caller's
say over a step launched ahead (`StepAhead`), the hook rule, and where a step's wall time went
(`StepTimes`, recorded by `StepClock`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol


class StepTimes(NamedTuple):
    """Where the last `Engine.step()` spent its wall time (seconds)."""

    schedule: float
    """Scheduler: the step's plan."""
    launch: float
    """Runner until the model's work is queued: request state, input staging, graph replay or
    eager kernel launches (the device is idle until the first kernel is queued)."""
    sample: float
    """Runner queueing the sampling and the copies back (overlaps the device's work)."""
    wait: float
    """Waiting for the device at the one host sync."""
    post: float
    """After the sync: tokens into runner and scheduler state, stop rules, outputs."""


class StepClock:
    """The last step's wall time and its phases, as `Engine` reports them."""

    def __init__(self) -> None:
        self.last_step_seconds = 0.0
        self.last_step_times = StepTimes(0.0, 0.0, 0.0, 0.0, 0.0)

    def record(
        self, started: float, scheduled: float, launch: float, sample: float, wait: float
    ) -> None:
        """A step that started at `started` and had its plan at `scheduled` (perf_counter
        seconds), with the runner's phase seconds, ends now."""
        now = time.perf_counter()
        self.last_step_seconds = now - started
        post = max(0.0, now - scheduled - launch - sample - wait)
        self.last_step_times = StepTimes(scheduled - started, launch, sample, wait, post)


class StepAhead(Protocol):
    """A caller's say over the step that `Engine.step` launches ahead (async scheduling)."""

    def plan(self) -> tuple[Hashable, Any] | None:
        """Called once the next step is known (this step's tokens counted as placeholders,
        before it is scheduled): its `(partition, stream)` (stream None: the current one), or
        None to launch nothing ahead (the next call then runs its step synchronously)."""

    def launched(self) -> None:
        """Called right after the step ahead was launched."""


def ask_ahead(
    plan: Callable[[], tuple[Hashable, Any] | None],
) -> tuple[tuple[Hashable, Any] | None, Exception | None]:
    """`StepAhead.plan`'s answer; an error declines the step ahead and is raised once this
    call's step has been read back and applied, as `on_launched`'s is."""
    try:
        return plan(), None
    except Exception as exc:
        return None, exc


def call_hook(hook: Callable[[], None] | None) -> Exception | None:
    """Run `Engine.step`'s `on_launched`; an error is returned, to be raised once the launched
    step has been read back and applied (a step left unresolved would corrupt the next)."""
    if hook is None:
        return None
    try:
        hook()
    except Exception as exc:
        return exc
    return None
