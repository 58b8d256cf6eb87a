"""Planning the next iteration while the current decode step runs (async scheduling).

With `EngineConfig.async_scheduling`, `Engine.step` launches the next decode step before it
reads the current one back. A `HostLoop` hands it a `LoopAhead`: once the next step is known
(the current step's tokens counted as placeholders), the loop plans that iteration there, so
the policy's plan, the snapshot and the loop's bookkeeping run while the device computes, and
the step ahead is launched on the split the plan chose. The plan's CONCURRENT quantum is
launched right after the step ahead, on a finetune stream that first waits for the current
step to end (a CUDA event), so it runs beside the step it was planned with. A plan that puts a
quantum after decode declines: the next iteration then runs its step synchronously with that
plan. With a memory pool, the pool makes room for the step ahead there too
(`memory.before_decode`, before it is scheduled), and its `after_decode` for the current
iteration runs while the step ahead computes, as `MemoryManager.maintain` expects; the pool
waits for that step before it unmaps any KV page (`MemoryManager.before_decode_unmap`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from gpu_runtime.colocation.executor import QuantumExecutor
from gpu_runtime.colocation.loop_jobs import LoopJobs
from gpu_runtime.colocation.planning import IterationPlanner, PlannedIteration
from gpu_runtime.colocation.types import LaunchMode

ASYNC_SCHEDULING = True
"""Whether a co-location host's engine schedules asynchronously (`EngineConfig.async_scheduling`,
so its loop plans ahead): the host agent's engine and `python -m bench.colocate
--async-scheduling`. Planning inside the step keeps the policy's and the loop's host time off
decode's critical path (docs/decisions/0011-planning-ahead.md)."""


class LoopAhead:
    """`gpu_runtime.engine.StepAhead` of one `HostLoop` (see the module docstring): plans with
    `planner`, launches the plan's quanta through `executor` as `jobs`' tasks, on `sharing`'s
    split (None: the current stream)."""

    def __init__(
        self,
        planner: IterationPlanner,
        jobs: LoopJobs,
        executor: QuantumExecutor,
        sharing: Any,
        clock: Callable[[], float],
    ) -> None:
        self._planner = planner
        self._jobs = jobs
        self._executor = executor
        self._sharing = sharing
        self._clock = clock
        self._after: Any = None
        """CUDA event recorded behind the current step, for the quantum launched ahead."""
        self.pending: PlannedIteration | None = None
        """The next iteration's plan, made while the current step ran."""

    def take(self) -> PlannedIteration | None:
        """The plan made ahead for the iteration now starting (None: none was), forgotten."""
        planned, self.pending = self.pending, None
        return planned

    def plan(self) -> tuple[Hashable, Any] | None:
        planned = self._planner.plan(self._clock())
        planned.ahead = True
        self.pending = planned
        plan = planned.plan
        if any(launch.mode is LaunchMode.AFTER_DECODE for launch in plan.launches):
            return None
        stream = self._after = None
        if self._sharing is not None and plan.decode_sms is not None:
            import torch

            stream = self._sharing.partition(plan.decode_sms)[0]
            if plan.launches:
                self._after = torch.cuda.Event()
                self._after.record(torch.cuda.current_stream())
        return plan.decode_sms, stream

    def launched(self) -> None:
        planned = self.pending
        if planned is None or not planned.plan.launches:
            return
        plan = planned.plan
        finetune_stream = None
        if self._sharing is not None and plan.decode_sms is not None:
            finetune_stream = self._sharing.partition(plan.decode_sms)[1]
            if self._after is not None:
                finetune_stream.wait_event(self._after)
        planned.launched = True
        for launch in plan.launches:
            self._executor.submit(self._jobs.task(launch, plan, finetune_stream))
