"""Planning one `HostLoop` iteration: what the loop shows its policy and the plan it gets back.

`IterationPlanner.plan` collects the quanta that finished (their reports belong to the
iteration), lets the memory pool make room for the step's KV blocks (``memory.before_decode``:
a reclaim changes the finetune budget, so it comes before the context is built), reads the
coming decode work from the engine's scheduler, builds the policy's `IterationContext` (the
jobs, the quantum in flight, the memory budget, the running requests' TPOT so far) and asks the
policy for its plan, checked against that context. The loop calls it at the start of an
iteration, or `LoopAhead` inside the previous iteration's step (async engines).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpu_runtime.colocation.executor import QuantumExecutor
from gpu_runtime.colocation.job_state import FinetuneMemory, JobState
from gpu_runtime.colocation.loop_jobs import LoopJobs
from gpu_runtime.colocation.policy import CoLocationPolicy, validate_plan
from gpu_runtime.colocation.snapshot import decode_snapshot
from gpu_runtime.colocation.token_clock import TokenClock
from gpu_runtime.colocation.types import (
    DecodeSnapshot,
    InFlightQuantum,
    IterationContext,
    IterationPlan,
    JobView,
    QuantumReport,
    RunningRequest,
)
from gpu_runtime.engine import Engine


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


class IterationPlanner:
    """Plans `engine`'s next iteration with `policy` over `jobs` (see the module docstring).

    ``sharing``: the loop's ``gpu_runtime.sharing.GpuSharing`` or None; ``memory``: its pool
    or None; ``tokens``: its running requests' latency clock."""

    def __init__(
        self,
        engine: Engine,
        policy: CoLocationPolicy,
        jobs: LoopJobs,
        executor: QuantumExecutor,
        tokens: TokenClock,
        *,
        tpot_slo_ms: float,
        sharing: Any,
        memory: FinetuneMemory | None,
        clock: Callable[[], float],
    ) -> None:
        self._engine = engine
        self._policy = policy
        self._jobs = jobs
        self._executor = executor
        self._tokens = tokens
        self._tpot_slo_ms = tpot_slo_ms
        self._sharing = sharing
        self._memory = memory
        self._clock = clock
        self._finetune_streams: tuple[tuple[int | None, int], ...] | None = None

    def plan(self, now: float) -> PlannedIteration:
        """Collect finished quanta, let the memory pool make room, read the coming decode work
        and ask the policy for its plan (checked)."""
        reports = self._jobs.collect()
        if self._memory is not None:  # before planning: a reclaim changes the finetune budget
            self._memory.before_decode()
        snapshot = decode_snapshot(self._engine)
        ctx = self.context(now, snapshot)
        planning = self._clock()
        plan = self._policy.plan(ctx)
        plan_ms = (self._clock() - planning) * 1e3
        validate_plan(plan, ctx)
        return PlannedIteration(reports, snapshot, ctx, plan, plan_ms)

    def context(self, now: float, snapshot: Any) -> IterationContext:
        """The policy's view of the coming iteration, whose decode work is `snapshot`."""
        options: tuple[int, ...] = ()
        total = None
        spatial = False
        sharing = self._sharing
        if sharing is not None:
            options = tuple(sharing.table.choices)
            total = int(sharing.table.total_sms)
            spatial = bool(sharing.spatial)
        executor = self._executor
        task = executor.in_flight
        in_flight = None
        if task is not None:
            in_flight = InFlightQuantum(
                task.job_id, task.max_tokens, task.decode_sms, executor.submitted_at or now
            )
        budget = None if self._memory is None else self._memory.finetune_budget_bytes()
        jobs = self._jobs
        release = None
        if jobs.release_graph_shapes and in_flight is None:
            release = jobs.release_memory().finetune_release_plan_bytes()
        runnable: list[JobView] = []
        planned = budget  # the policies launch the first runnable job: its plan is the budget
        for j in jobs.order:
            job = jobs.states[j]
            if job.runnable:
                job.choose_mode(budget, release if job.release_shapes else None)
                if not runnable:
                    planned = job.planned_bytes
                runnable.append(job.view(self.cold_launches(job)))
        running = self.running_view()
        return IterationContext(
            now=now,
            decode=snapshot,
            total_sms=total,
            decode_sms_options=options,
            spatial=spatial,
            jobs=tuple(runnable),
            in_flight=in_flight,
            finetune_budget_bytes=planned,
            tpot_slo_ms=self._tpot_slo_ms,
            worst_running_tpot_ms=max((r.tpot_ms for r in running), default=None),
            running=running,
        )

    def cold_launches(self, job: JobState) -> frozenset[tuple[int, int | None]]:
        """``JobState.cold_launches`` for the policy's quantum sizes over every split's
        finetune stream (none without a partitioner or when the policy asks for no sizes)."""
        sizes = self._policy.launch_sizes
        sharing = self._sharing
        if sharing is None or not sizes:
            return frozenset()
        if self._finetune_streams is None:  # the partitions are made once, up front
            streams = []
            for d in sharing.table.choices:
                handle = getattr(sharing.partition(d)[1], "cuda_stream", None)
                if handle is not None:
                    streams.append((d, int(handle)))
            self._finetune_streams = tuple(streams)
        return job.cold_launches(sizes, self._finetune_streams)

    def running_view(self) -> tuple[RunningRequest, ...]:
        """Requests decoding with at least ``MIN_TOKENS_FOR_TPOT`` tokens: their TPOT so far
        and the tokens ``max_tokens`` still allows."""
        return self._tokens.views(self._engine.scheduler.requests)
