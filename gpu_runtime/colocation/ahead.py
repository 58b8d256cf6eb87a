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

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpu_runtime.colocation.types import (
    DecodeSnapshot,
    IterationContext,
    IterationPlan,
    LaunchMode,
    QuantumReport,
)

ASYNC_SCHEDULING = True
"""Whether a co-location host's engine schedules asynchronously (`EngineConfig.async_scheduling`,
so its loop plans ahead): the host agent's engine and `bench/colocate.py --async-scheduling`.
On the H200 at 3a3d0b1 (`bench/results/colocate-async*-h200-20261201.json`), decode_only's
TPOT p50 fell 8-12% on every trace of both models against the synchronous runs of the same day,
and harli kept 99% on every trace of both (Qwen2.5-7B had missed it at high and bursty with the
synchronous loop that morning, its violators running with no quantum beside them)."""

if TYPE_CHECKING:
    from gpu_runtime.colocation.loop import HostLoop


@dataclass
class PlannedIteration:
    """A plan with what it was made from, waiting for its iteration."""

    reports: list[QuantumReport]
    """Quanta collected before planning: they belong to this iteration's record."""
    snapshot: DecodeSnapshot
    ctx: IterationContext
    plan: IterationPlan
    plan_ms: float
    launched: bool = False
    """Its CONCURRENT quanta were already handed to the executor (by `LoopAhead.launched`)."""
    ahead: bool = False
    """Made inside the previous iteration's step."""


class LoopAhead:
    """`gpu_runtime.engine.StepAhead` of one `HostLoop` (see the module docstring)."""

    def __init__(self, loop: HostLoop) -> None:
        self.loop = loop
        self._after: Any = None
        """CUDA event recorded behind the current step, for the quantum launched ahead."""

    def plan(self) -> tuple[Hashable, Any] | None:
        loop = self.loop
        planned = loop.plan_iteration(loop.clock())
        planned.ahead = True
        loop.pending = planned
        plan = planned.plan
        if any(launch.mode is LaunchMode.AFTER_DECODE for launch in plan.launches):
            return None
        stream = self._after = None
        if loop.sharing is not None and plan.decode_sms is not None:
            import torch

            stream = loop.sharing.partition(plan.decode_sms)[0]
            if plan.launches:
                self._after = torch.cuda.Event()
                self._after.record(torch.cuda.current_stream())
        return plan.decode_sms, stream

    def launched(self) -> None:
        loop = self.loop
        planned = loop.pending
        if planned is None or not planned.plan.launches:
            return
        plan = planned.plan
        finetune_stream = None
        if loop.sharing is not None and plan.decode_sms is not None:
            finetune_stream = loop.sharing.partition(plan.decode_sms)[1]
            if self._after is not None:
                finetune_stream.wait_event(self._after)
        planned.launched = True
        for launch in plan.launches:
            loop.executor.submit(loop.quantum_task(launch.job_id, launch, plan, finetune_stream))
