"""`HostLoop`: one decode engine, the host's finetune jobs, a policy; one iteration at a time.

Each ``run_iteration()``:
1. collects quanta that finished since the last iteration (accounting tokens, memory, job state)
   and lets the memory pool make room for the step's KV blocks (``memory.before_decode``);
2. reads the coming decode work from the engine's scheduler and asks the policy for a plan;
3. starts the plan's CONCURRENT quantum on the finetune stream of the chosen split (a worker
   thread on GPU; inline right after decode on CPU), runs the decode step on the decode stream
   (``engine.step(partition=decode_sms)``, so CUDA graphs captured for that split replay), then
   any AFTER_DECODE quantum inline on the whole device; with ``launch_during_decode`` the
   CONCURRENT quantum starts once the step is queued, before the host waits for it;
4. times every token against its request's previous one and emits an ``IterationRecord`` to the
   metrics sink and to ``policy.observe``.
With an engine that schedules asynchronously (`EngineConfig.async_scheduling`), steps 1-2 of the
next iteration run inside this one's step, while the device computes, whenever the engine
launches the next step ahead (`gpu_runtime.colocation.ahead`).
Not thread-safe: one thread owns the loop and its engine (the finetune worker thread only runs
``step_quantum`` of the job it was handed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gpu_runtime.colocation.ahead import LoopAhead, PlannedIteration
from gpu_runtime.colocation.executor import (
    QuantumExecutor,
    QuantumTask,
    SequentialExecutor,
    ThreadedExecutor,
)
from gpu_runtime.colocation.jobs import FinetuneMemory, JobError, JobState
from gpu_runtime.colocation.loop_views import LoopViews
from gpu_runtime.colocation.policy import CoLocationPolicy, validate_plan
from gpu_runtime.colocation.snapshot import decode_snapshot, describe_trainer, trainer_layers
from gpu_runtime.colocation.token_clock import TokenClock
from gpu_runtime.colocation.types import (
    FinishedRequest,
    IterationPlan,
    IterationRecord,
    LaunchMode,
    QuantumReport,
)
from gpu_runtime.engine import Engine, RequestOutput, SamplingParams
from gpu_runtime.finetune.trainer import LoraTrainer

LAUNCH_DURING_DECODE = True
"""`HostLoop`'s default for ``launch_during_decode``. On the H200 at 017bdfb (same machine, one
after the other; `bench/results/colocate-launch-*-h200-20261201.json`), harli's iterations that
launched a graphed quantum before the step took 9.38 / 8.37 ms at the median (Llama-3-8B /
Qwen2.5-7B; p90 12.67 / 11.44, max 15.1 / 15.9) against 7.00 / 6.16 ms for iterations beside a
quantum already in flight; launched from inside the step, 7.16 / 5.92 (p90 7.97 / 6.51, max
9.0 / 7.6): the launch's host time no longer delays any token."""


class HostLoop(LoopViews):
    """Runs decode iterations and finetune quanta as a `CoLocationPolicy` plans them."""

    def __init__(
        self,
        engine: Engine,
        policy: CoLocationPolicy,
        *,
        tpot_slo_ms: float,
        sharing: Any = None,
        memory: FinetuneMemory | None = None,
        metrics_sink: Callable[[IterationRecord], None] | None = None,
        output_sink: Callable[[list[RequestOutput]], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        executor: QuantumExecutor | None = None,
        choose_recompute: bool = False,
        release_graph_shapes: bool = False,
        launch_during_decode: bool = LAUNCH_DURING_DECODE,
    ) -> None:
        """``sharing``: a ``gpu_runtime.sharing.GpuSharing`` (None on CPU or to run decode on
        the current stream); ``memory``: the unified pool's adapter (None: no budget);
        ``choose_recompute``: with ``memory``, pick each launch's activation recomputation from
        the budget (``JobState.choose_mode``) for jobs whose hparams do not force it (off for a
        finetune side that sets the trainer's mode itself, e.g. ``bench/memory.py``);
        ``release_graph_shapes``: with ``choose_recompute`` and a ``ReleasePlanMemory``, those
        jobs' CUDA-graph shapes are pooled per launch and a launch may plan against the
        release plan in a pool of its own (``JobState.choose_mode``), which the memory manager
        releases between quanta (``HostMemory.bind_loop`` sets its hook);
        ``launch_during_decode`` (default ``LAUNCH_DURING_DECODE``): a CONCURRENT quantum is
        handed to the executor once the decode step is queued on the device (``Engine.step``'s
        ``on_launched``) instead of before the step, so the host time of launching it (graph
        replays, optimizer step) overlaps the step instead of delaying it; an iteration that
        runs no step still launches it. False: before the step."""
        if tpot_slo_ms <= 0:
            raise ValueError(f"tpot_slo_ms must be > 0, got {tpot_slo_ms}")
        if release_graph_shapes and not (
            choose_recompute and hasattr(memory, "finetune_release_plan_bytes")
        ):
            raise ValueError("release_graph_shapes needs choose_recompute and a ReleasePlanMemory")
        self.engine = engine
        self.policy = policy
        self.tpot_slo_ms = tpot_slo_ms
        self.sharing = sharing
        self.memory = memory
        self.metrics_sink = metrics_sink
        self.output_sink = output_sink
        self.clock = clock
        if executor is None:
            executor = (ThreadedExecutor if engine.config.is_cuda else SequentialExecutor)(clock)
        self.executor = executor
        self.choose_recompute = choose_recompute
        self.release_graph_shapes = release_graph_shapes
        self.launch_during_decode = launch_during_decode
        self._jobs: dict[str, JobState] = {}
        self._order: list[str] = []
        self._tokens = TokenClock()
        self._index = 0
        self._finetune_streams: tuple[tuple[int | None, int], ...] | None = None
        self._ahead = LoopAhead(self)
        self.pending: PlannedIteration | None = None
        """The next iteration's plan, made while the current step ran (async engines)."""

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival: float | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Queue a decode request (``Engine.add_request``, with its adapter ``lora_name`` if
        any) and start its latency clock."""
        request_id = self.engine.add_request(prompt, params, request_id, lora_name=lora_name)
        self._tokens.start(request_id, self.clock() if arrival is None else arrival)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._tokens.forget(request_id)

    # ---- jobs -------------------------------------------------------------------------------
    def add_job(self, job_id: str, trainer: LoraTrainer) -> JobState:
        """Register a finetune job; it runs when the policy gives it quanta."""
        if job_id in self._jobs:
            raise JobError(f"job {job_id!r} is already on this loop")
        seq_len, max_seq_len, rank = describe_trainer(trainer)
        state = JobState(job_id, trainer, seq_len, max_seq_len, rank)
        state.layers = trainer_layers(trainer)
        # Recomputation chosen per launch (with a pool) unless the hparams force it.
        state.choose_recompute = (
            self.choose_recompute
            and self.memory is not None
            and getattr(trainer, "recompute", None) is False
        )
        if self.release_graph_shapes and state.choose_recompute:
            state.pool_shapes_per_launch()  # graph shapes released one at a time
        self._jobs[job_id] = state
        self._order.append(job_id)
        return state

    def pause_job(self, job_id: str, *, at_batch_end: bool = False) -> None:
        """No new quanta for the job (a quantum in flight completes normally); with
        ``at_batch_end``, only those that finish the optimizer batch in progress."""
        state = self.job_state(job_id)
        if at_batch_end:
            state.stop_at_batch_end = True
        else:
            state.paused = True

    def resume_job(self, job_id: str) -> None:
        state = self.job_state(job_id)
        state.paused = state.stop_at_batch_end = False

    def remove_job(self, job_id: str) -> LoraTrainer:
        """Take the job off the loop (waiting for its in-flight quantum); returns its trainer."""
        state = self.job_state(job_id)
        task = self.executor.in_flight
        if task is not None and task.job_id == job_id:
            self.executor.wait()
            self._collect()
        del self._jobs[job_id]
        self._order.remove(job_id)
        return state.trainer

    def job_state(self, job_id: str) -> JobState:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise JobError(f"no job {job_id!r} on this loop") from None

    @property
    def job_ids(self) -> list[str]:
        return list(self._order)

    # ---- the iteration ----------------------------------------------------------------------
    def has_work(self) -> bool:
        """Decode requests pending, a quantum in flight, or a runnable job."""
        return (
            self.engine.has_unfinished_requests()
            or self.executor.in_flight is not None
            or any(self._jobs[j].runnable for j in self._order)
        )

    def run_iteration(self) -> IterationRecord:
        """Plan, launch, decode, account (see the module docstring); returns the record."""
        started = self.clock()
        planned, self.pending = self.pending, None
        if planned is not None and self._names_a_gone_job(planned):
            earlier = planned.reports  # planned ahead, then its job was paused or removed
            planned = self.plan_iteration(started)
            planned.reports[:0] = earlier
        if planned is None:
            planned = self.plan_iteration(started)
        snapshot, ctx, plan, reports = planned.snapshot, planned.ctx, planned.plan, planned.reports
        decode_stream = finetune_stream = None
        if self.sharing is not None and plan.decode_sms is not None:
            decode_stream, finetune_stream = self.sharing.partition(plan.decode_sms)
        concurrent = [
            launch
            for launch in plan.launches
            if launch.mode is LaunchMode.CONCURRENT and not planned.launched
        ]

        def submit() -> None:
            while concurrent:
                launch = concurrent.pop(0)
                task = self.quantum_task(launch.job_id, launch, plan, finetune_stream)
                self.executor.submit(task)

        if not self.launch_during_decode:
            submit()
        decode_start = self.clock()
        outputs = self._decode(decode_stream, plan.decode_sms, submit)
        submit()  # a step that ran nothing called no hook
        beside = self.executor.in_flight
        if self.pending is not None and self.pending.launched:
            beside = None  # launched for the step ahead: it waited for this one to end
        emitted = self.clock()
        for launch in plan.launches:
            if launch.mode is LaunchMode.AFTER_DECODE:
                report = self.executor.run_now(self.quantum_task(launch.job_id, launch, plan))
                self._account(report, alone=True)
                reports.append(report)
        observed_ms = (self.clock() - decode_start) * 1e3
        self.executor.after_decode()
        if self.memory is not None:
            self.memory.after_decode()
        reports += self._collect()
        samples, finished = self._tokens.time(outputs, emitted)
        if self.output_sink is not None and outputs:
            self.output_sink(outputs)
        record = IterationRecord(
            index=self._index,
            timestamp=started,
            policy=self.policy.name,
            decode_batch=snapshot.batch_size,
            prefill_tokens=snapshot.prefill_tokens,
            context_tokens_total=snapshot.context_tokens_total,
            context_tokens_max=snapshot.context_tokens_max,
            decode_tokens=len(outputs),
            observed_ms=observed_ms,
            iteration_ms=(self.clock() - started) * 1e3,
            predicted_ms=plan.predicted_ms,
            predicted_solo_ms=plan.predicted_solo_ms,
            margin=plan.margin,
            decode_sms=plan.decode_sms,
            total_sms=ctx.total_sms,
            finetune_launched=plan.launches,
            finetune_tokens=sum(r.tokens for r in reports),
            quanta=tuple(reports),
            memory_lent_bytes=None if self.memory is None else self.memory.lent_bytes(),
            tpot_samples_ms=tuple(samples),
            finished=tuple(finished),
            paused=plan.paused,
            note=plan.note,
            in_flight=beside is not None,
            beside_tokens=0 if beside is None else beside.max_tokens,
            beside_decode_sms=None if beside is None else beside.decode_sms,
            plan_ms=planned.plan_ms,
            plan_memo=plan.memo,
            planned_ahead=planned.ahead,
        )
        self._index += 1
        self.policy.observe(record)
        if self.metrics_sink is not None:
            self.metrics_sink(record)
        return record

    def plan_iteration(self, now: float) -> PlannedIteration:
        """Collect finished quanta, let the memory pool make room, read the coming decode work
        and ask the policy for its plan (checked)."""
        reports = self._collect()
        if self.memory is not None:  # before planning: a reclaim changes the finetune budget
            self.memory.before_decode()
        snapshot = decode_snapshot(self.engine)
        ctx = self._context(now, snapshot)
        planning = self.clock()
        plan = self.policy.plan(ctx)
        plan_ms = (self.clock() - planning) * 1e3
        validate_plan(plan, ctx)
        return PlannedIteration(reports, snapshot, ctx, plan, plan_ms)

    def run_until_idle(self, max_iterations: int = 1_000_000) -> list[IterationRecord]:
        """Iterate until no request is pending and no job can run (tests, batch runs)."""
        records: list[IterationRecord] = []
        while self.has_work() and len(records) < max_iterations:
            record = self.run_iteration()
            records.append(record)
            if not (record.decode_batch or record.prefill_tokens):
                self.wait_for_finetune(timeout_s=None)
        self.executor.wait()
        return records

    def wait_for_finetune(self, timeout_s: float | None) -> bool:
        """Block until the in-flight quantum (if any) has finished or ``timeout_s`` passed;
        for callers with no decode work, so the loop does not spin. True when none runs."""
        if self.executor.in_flight is None:
            return True
        return self.executor.wait(timeout_s)

    def running_requests(self) -> list[FinishedRequest]:
        """Requests still decoding that emitted at least ``MIN_TOKENS_FOR_TPOT`` tokens, with
        their mean TPOT so far (``finish_reason`` "running"): for figures over a window that
        ends before every request has finished."""
        return self._tokens.running()

    def close(self) -> None:
        """Wait for the in-flight quantum, account it, stop the worker (a persistent
        executor's thread lives on)."""
        self.executor.wait()
        self._collect()
        self.executor.close()

    # ---- internals --------------------------------------------------------------------------
    def quantum_task(
        self, job_id: str, launch: Any, plan: IterationPlan, stream: Any = None
    ) -> QuantumTask:
        """The executor's task for one of ``plan``'s launches (the job goes to the back of
        the round robin)."""
        # Round robin: the launched job goes to the back of the order.
        self._order.remove(job_id)
        self._order.append(job_id)
        job = self._jobs[job_id]
        trainer = job.trainer
        if job.choose_recompute:  # the mode `choose_mode` sized this launch by
            trainer.recompute = job.recompute
            examples = max(1, launch.max_tokens // max(1, job.max_seq_len))
            if job.release_shapes:  # where its graphs go; a separate shape alone
                idle = self.executor.in_flight is None
                job.prepare_launch(examples, self._release_memory(), idle)
            if self.memory is not None and launch.max_layers is None:
                self.memory.finetune_quantum_mode(examples=examples, recompute=job.recompute)
        return QuantumTask(
            job_id,
            trainer,
            launch.max_tokens,
            launch.mode,
            plan.decode_sms,
            stream,
            launch.max_layers,
        )

    def _decode(
        self, stream: Any, decode_sms: int | None, on_launched: Callable[[], None]
    ) -> list[RequestOutput]:
        ahead = self._ahead
        if stream is None:
            return self.engine.step(decode_sms, on_launched, ahead)
        import torch

        with torch.cuda.stream(stream):
            return self.engine.step(decode_sms, on_launched, ahead)

    def _collect(self) -> list[QuantumReport]:
        """Account the reports of concurrent quanta that finished since the last poll."""
        reports = self.executor.poll()
        for report in reports:
            self._account(report, alone=False)
        return reports

    def _account(self, report: QuantumReport, *, alone: bool) -> None:
        state = self._jobs.get(report.job_id)
        if state is None:
            return
        state.quanta += 1
        state.reports.append(report)
        del state.reports[:-64]
        if report.error is not None:
            state.failed = report.error
            return
        state.tokens_trained += report.tokens
        if report.loss is not None:  # a layer slice that did not finish its micro-batch has none
            state.last_loss = report.loss
        state.step = report.step if report.step is not None else state.step
        state.record_quantum(report)
        if report.peak_memory_bytes is not None and self.memory is not None:
            self.memory.quantum_done(peak_bytes=report.peak_memory_bytes, resident_bytes=0)
        if alone and report.duration_ms > 0 and report.tokens:
            state.solo_tokens_per_s = report.tokens / (report.duration_ms / 1e3)
