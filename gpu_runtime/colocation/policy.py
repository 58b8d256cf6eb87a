"""The co-location policy contract (what `HostLoop` expects of every policy)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from gpu_runtime.colocation.types import (
    IterationContext,
    IterationPlan,
    IterationRecord,
    LaunchMode,
    PlanError,
)


class CoLocationPolicy(ABC):
    """Decides, before every decode iteration, how decode and finetuning share the GPU.

    Contract:
      * ``plan(ctx)`` is called once per iteration, before the decode step, on the loop's thread.
        It must be cheap (microseconds to a few hundred), must not touch the GPU, and must not
        block. It returns an :class:`IterationPlan`:
          - ``decode_sms`` is None when ``ctx.decode_sms_options`` is empty, else one of them;
          - ``launches`` only name jobs in ``ctx.jobs``; at most one CONCURRENT launch, and none
            while ``ctx.in_flight`` is set (one finetune stream, one quantum on it);
          - a launch's ``max_tokens`` caps the quantum's padded tokens; the trainer still runs
            one example when that example alone is longer, so policies size from the job's
            ``max_seq_len`` upwards.
        The loop checks these rules (:func:`validate_plan`) and raises PlanError on a breach.
      * ``observe(record)`` is called after the iteration with what was measured, so a policy
        can correct itself (margins, fitted rates). It must not block either.
      * A policy holds only its own state; one instance serves one loop.
    """

    name: str = "policy"
    launch_sizes: tuple[int, ...] = ()
    """Quantum sizes (examples of a job's longest length) whose graph readiness the policy
    reads from ``JobView.cold_launches``; empty: the loop does not ask the trainer."""

    @abstractmethod
    def plan(self, ctx: IterationContext) -> IterationPlan:
        """The decision for the coming iteration."""

    def observe(self, record: IterationRecord) -> None:  # noqa: B027 - optional hook
        """Feedback after the iteration ran (default: ignore)."""

    def describe(self) -> dict[str, Any]:
        """Settings worth recording next to results (benchmark JSON, host metrics)."""
        return {"policy": self.name}


def validate_plan(plan: IterationPlan, ctx: IterationContext) -> None:
    """Raise PlanError when ``plan`` breaks the contract above for ``ctx``."""
    if ctx.decode_sms_options:
        if plan.decode_sms not in ctx.decode_sms_options:
            raise PlanError(
                f"decode_sms={plan.decode_sms} not among options {list(ctx.decode_sms_options)}"
            )
    elif plan.decode_sms is not None:
        raise PlanError(f"decode_sms={plan.decode_sms} given but no partitioner exists")
    jobs = {job.job_id: job for job in ctx.jobs}
    concurrent = [launch for launch in plan.launches if launch.mode is LaunchMode.CONCURRENT]
    if len(concurrent) > 1:
        raise PlanError(f"{len(concurrent)} concurrent launches; at most one is allowed")
    if concurrent and ctx.in_flight is not None:
        raise PlanError(f"a concurrent launch while job {ctx.in_flight.job_id!r} is in flight")
    for launch in plan.launches:
        job = jobs.get(launch.job_id)
        if job is None:
            raise PlanError(f"launch names job {launch.job_id!r}, not runnable now")
