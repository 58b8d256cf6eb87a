"""The finetune jobs on one `HostLoop`: their states in round-robin order, the executor's task
for each launch a plan names, and the accounting of every quantum that finished.

A launched job goes to the back of the order (round robin). A finished quantum's report updates
its job's state (tokens, loss, step, failure, the solo rate of a quantum run alone) and, with a
memory pool, the pool's accounting of its peak; reports of jobs no longer on the loop are
dropped. Not thread-safe: the loop's thread owns it (the executor's worker only runs the task).
"""

from __future__ import annotations

from typing import Any, cast

from gpu_runtime.colocation.executor import QuantumExecutor, QuantumTask
from gpu_runtime.colocation.job_state import FinetuneMemory, JobError, JobState, ReleasePlanMemory
from gpu_runtime.colocation.snapshot import describe_trainer, trainer_layers
from gpu_runtime.colocation.types import IterationPlan, QuantumReport
from gpu_runtime.finetune.trainer import LoraTrainer

REPORTS_KEPT = 64
"""Reports a job keeps (the most recent)."""


class LoopJobs:
    """Jobs launched through `executor`, sized and accounted against `memory` (None: no pool).

    ``choose_recompute`` and ``release_graph_shapes``: see `HostLoop`; the second needs the
    first and a ``ReleasePlanMemory``."""

    def __init__(
        self,
        executor: QuantumExecutor,
        memory: FinetuneMemory | None,
        *,
        choose_recompute: bool,
        release_graph_shapes: bool,
    ) -> None:
        if release_graph_shapes and not (
            choose_recompute and hasattr(memory, "finetune_release_plan_bytes")
        ):
            raise ValueError("release_graph_shapes needs choose_recompute and a ReleasePlanMemory")
        self._executor = executor
        self._memory = memory
        self.choose_recompute = choose_recompute
        self.release_graph_shapes = release_graph_shapes
        self.states: dict[str, JobState] = {}
        self.order: list[str] = []
        """Job ids, the next to launch first."""

    def add(self, job_id: str, trainer: LoraTrainer) -> JobState:
        """Register a finetune job; it runs when the policy gives it quanta."""
        if job_id in self.states:
            raise JobError(f"job {job_id!r} is already on this loop")
        seq_len, max_seq_len, rank = describe_trainer(trainer)
        state = JobState(job_id, trainer, seq_len, max_seq_len, rank)
        state.layers = trainer_layers(trainer)
        # Recomputation chosen per launch (with a pool) unless the hparams force it.
        state.choose_recompute = (
            self.choose_recompute
            and self._memory is not None
            and getattr(trainer, "recompute", None) is False
        )
        if self.release_graph_shapes and state.choose_recompute:
            state.pool_shapes_per_launch()  # graph shapes released one at a time
        self.states[job_id] = state
        self.order.append(job_id)
        return state

    def state(self, job_id: str) -> JobState:
        try:
            return self.states[job_id]
        except KeyError:
            raise JobError(f"no job {job_id!r} on this loop") from None

    def remove(self, job_id: str) -> LoraTrainer:
        """Take the job off (waiting for its in-flight quantum, accounted); returns its
        trainer."""
        state = self.state(job_id)
        task = self._executor.in_flight
        if task is not None and task.job_id == job_id:
            self._executor.wait()
            self.collect()
        del self.states[job_id]
        self.order.remove(job_id)
        return state.trainer

    def any_runnable(self) -> bool:
        return any(self.states[j].runnable for j in self.order)

    def names_a_gone_job(self, plan: IterationPlan) -> bool:
        """Whether one of `plan`'s launches names a job that can no longer run a quantum."""
        for launch in plan.launches:
            job = self.states.get(launch.job_id)
            if job is None or not job.runnable:
                return True
        return False

    def release_memory(self) -> ReleasePlanMemory:
        """The pool as a ``ReleasePlanMemory`` (with ``release_graph_shapes`` only)."""
        return cast(ReleasePlanMemory, self._memory)  # checked in __init__

    def task(self, launch: Any, plan: IterationPlan, stream: Any = None) -> QuantumTask:
        """The executor's task for one of ``plan``'s launches (the job goes to the back of
        the round robin)."""
        job_id = launch.job_id
        self.order.remove(job_id)
        self.order.append(job_id)
        job = self.states[job_id]
        trainer = job.trainer
        if job.choose_recompute:  # the mode `choose_mode` sized this launch by
            trainer.recompute = job.recompute
            examples = max(1, launch.max_tokens // max(1, job.max_seq_len))
            if job.release_shapes:  # where its graphs go; a separate shape alone
                idle = self._executor.in_flight is None
                job.prepare_launch(examples, self.release_memory(), idle)
            if self._memory is not None and launch.max_layers is None:
                self._memory.finetune_quantum_mode(examples=examples, recompute=job.recompute)
        return QuantumTask(
            job_id,
            trainer,
            launch.max_tokens,
            launch.mode,
            plan.decode_sms,
            stream,
            launch.max_layers,
        )

    def collect(self) -> list[QuantumReport]:
        """Account the reports of concurrent quanta that finished since the last poll."""
        reports = self._executor.poll()
        for report in reports:
            self.account(report, alone=False)
        return reports

    def account(self, report: QuantumReport, *, alone: bool) -> None:
        """One finished quantum (``alone``: it ran with no decode beside it)."""
        state = self.states.get(report.job_id)
        if state is None:
            return
        state.quanta += 1
        state.reports.append(report)
        del state.reports[:-REPORTS_KEPT]
        if report.error is not None:
            state.failed = report.error
            return
        state.tokens_trained += report.tokens
        if report.loss is not None:  # a layer slice that did not finish its micro-batch has none
            state.last_loss = report.loss
        state.step = report.step if report.step is not None else state.step
        state.record_quantum(report)
        if report.peak_memory_bytes is not None and self._memory is not None:
            self._memory.quantum_done(peak_bytes=report.peak_memory_bytes, resident_bytes=0)
        if alone and report.duration_ms > 0 and report.tokens:
            state.solo_tokens_per_s = report.tokens / (report.duration_ms / 1e3)
