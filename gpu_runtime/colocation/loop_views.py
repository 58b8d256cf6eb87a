"""What `HostLoop` shows its policy: the iteration's context, built from the loop's own state
(jobs, the quantum in flight, the memory budget, the running requests' TPOT so far)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from gpu_runtime.colocation.jobs import FinetuneMemory, JobState, ReleasePlanMemory
from gpu_runtime.colocation.token_clock import TokenClock
from gpu_runtime.colocation.types import (
    InFlightQuantum,
    IterationContext,
    JobView,
    RunningRequest,
)

if TYPE_CHECKING:
    from gpu_runtime.colocation.ahead import PlannedIteration
    from gpu_runtime.colocation.executor import QuantumExecutor
    from gpu_runtime.colocation.policy import CoLocationPolicy
    from gpu_runtime.engine import Engine


class LoopViews:
    """`HostLoop`'s views for its policy (a base of `HostLoop`; see `loop.py`)."""

    engine: Engine
    policy: CoLocationPolicy
    tpot_slo_ms: float
    sharing: Any
    memory: FinetuneMemory | None
    executor: QuantumExecutor
    release_graph_shapes: bool
    _jobs: dict[str, JobState]
    _order: list[str]
    _tokens: TokenClock
    _finetune_streams: tuple[tuple[int | None, int], ...] | None

    def _context(self, now: float, snapshot: Any) -> IterationContext:
        """The policy's view of the coming iteration, whose decode work is `snapshot`."""
        options: tuple[int, ...] = ()
        total = None
        spatial = False
        if self.sharing is not None:
            options = tuple(self.sharing.table.choices)
            total = int(self.sharing.table.total_sms)
            spatial = bool(self.sharing.spatial)
        task = self.executor.in_flight
        in_flight = None
        if task is not None:
            in_flight = InFlightQuantum(
                task.job_id, task.max_tokens, task.decode_sms, self.executor.submitted_at or now
            )
        budget = None if self.memory is None else self.memory.finetune_budget_bytes()
        release = None
        if self.release_graph_shapes and in_flight is None:
            release = self._release_memory().finetune_release_plan_bytes()
        runnable: list[JobView] = []
        planned = budget  # the policies launch the first runnable job: its plan is the budget
        for j in self._order:
            job = self._jobs[j]
            if job.runnable:
                job.choose_mode(budget, release if job.release_shapes else None)
                if not runnable:
                    planned = job.planned_bytes
                runnable.append(job.view(self._cold_launches(job)))
        running = self._running_view()
        return IterationContext(
            now=now,
            decode=snapshot,
            total_sms=total,
            decode_sms_options=options,
            spatial=spatial,
            jobs=tuple(runnable),
            in_flight=in_flight,
            finetune_budget_bytes=planned,
            tpot_slo_ms=self.tpot_slo_ms,
            worst_running_tpot_ms=max((r.tpot_ms for r in running), default=None),
            running=running,
        )

    def _names_a_gone_job(self, planned: PlannedIteration) -> bool:
        """A plan made ahead, not yet launched, whose job can no longer run a quantum."""
        if planned.launched:
            return False
        for launch in planned.plan.launches:
            job = self._jobs.get(launch.job_id)
            if job is None or not job.runnable:
                return True
        return False

    def _release_memory(self) -> ReleasePlanMemory:
        return cast(ReleasePlanMemory, self.memory)  # checked in __init__

    def _cold_launches(self, job: JobState) -> frozenset[tuple[int, int | None]]:
        """``JobState.cold_launches`` for the policy's quantum sizes over every split's
        finetune stream (none without a partitioner or when the policy asks for no sizes)."""
        sizes = self.policy.launch_sizes
        if self.sharing is None or not sizes:
            return frozenset()
        if self._finetune_streams is None:  # the partitions are made once, up front
            streams = []
            for d in self.sharing.table.choices:
                handle = getattr(self.sharing.partition(d)[1], "cuda_stream", None)
                if handle is not None:
                    streams.append((d, int(handle)))
            self._finetune_streams = tuple(streams)
        return job.cold_launches(sizes, self._finetune_streams)

    def _running_view(self) -> tuple[RunningRequest, ...]:
        """Requests decoding with at least ``MIN_TOKENS_FOR_TPOT`` tokens: their TPOT so far
        and the tokens ``max_tokens`` still allows."""
        return self._tokens.views(getattr(self.engine.scheduler, "requests", None))
