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

from gpu_runtime.colocation.ahead import LoopAhead
from gpu_runtime.colocation.executor import QuantumExecutor, SequentialExecutor, ThreadedExecutor
from gpu_runtime.colocation.job_state import FinetuneMemory, JobState
from gpu_runtime.colocation.loop_jobs import LoopJobs
from gpu_runtime.colocation.planning import IterationPlanner
from gpu_runtime.colocation.policy import CoLocationPolicy
from gpu_runtime.colocation.token_clock import TokenClock
from gpu_runtime.colocation.tp_loop import mirror_loop
from gpu_runtime.colocation.types import FinishedRequest, IterationRecord, LaunchMode
from gpu_runtime.engine import Engine, RequestOutput, SamplingParams
from gpu_runtime.engine.fanout import sequence_ids
from gpu_runtime.finetune.trainer import LoraTrainer

LAUNCH_DURING_DECODE = True
"""`HostLoop`'s default for ``launch_during_decode``: a quantum launched from inside the step
overlaps its launch's host time (graph replays, optimizer step) with the step instead of
delaying the step's tokens (docs/decisions/0010-launch-inside-decode-step.md)."""


class HostLoop:
    """Runs decode iterations and finetune quanta as a `CoLocationPolicy` plans them. It holds
    the jobs (`jobs`: a `LoopJobs`), the planner (`planner`: an `IterationPlanner`) and, for
    async engines, the planning inside the step (`ahead`: a `LoopAhead`)."""

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
        finetune side that sets the trainer's mode itself, e.g. ``bench.memory``);
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
        # under tensor parallelism quanta and jobs are mirrored to the followers (`tp_loop`)
        self.executor, self._mirror = mirror_loop(engine, executor, memory)
        self.launch_during_decode = launch_during_decode
        self.jobs = LoopJobs(
            self.executor,
            memory,
            choose_recompute=choose_recompute,
            release_graph_shapes=release_graph_shapes,
        )
        self._tokens = TokenClock()
        self._index = 0
        self.planner = IterationPlanner(
            engine,
            policy,
            self.jobs,
            self.executor,
            self._tokens,
            tpot_slo_ms=tpot_slo_ms,
            sharing=sharing,
            memory=memory,
            clock=clock,
        )
        self.ahead = LoopAhead(self.planner, self.jobs, self.executor, sharing, clock)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival: float | None = None,
        lora_name: str | None = None,
        tenant: str = "",
    ) -> str:
        """Queue a decode request (``Engine.add_request``, with its adapter ``lora_name`` if
        any, admitted fairly among ``tenant``'s peers) and start its latency clock (one per
        sequence: with ``params.n > 1``, each child's)."""
        request_id = self.engine.add_request(
            prompt, params, request_id, lora_name=lora_name, tenant=tenant
        )
        start = self.clock() if arrival is None else arrival
        for sequence in sequence_ids(request_id, params.n if params is not None else 1):
            self._tokens.start(sequence, start)
        return request_id

    def abort_request(self, request_id: str) -> None:
        live = self.engine.scheduler.requests
        request = live.get(request_id)
        sequences = sequence_ids(request_id, request.fan_out if request is not None else 1)
        sequences += [r.request_id for r in live.values() if r.parent_id == request_id]
        self.engine.abort_request(request_id)
        for sequence in sequences:
            self._tokens.forget(sequence)

    # ---- jobs -------------------------------------------------------------------------------
    def add_job(self, job_id: str, trainer: LoraTrainer, spec: Any = None) -> JobState:
        """Register a finetune job; it runs when the policy gives it quanta. Under tensor
        parallelism `spec` is required: each follower's job factory builds the job's trainer
        over its shard from it (`tp_follower_jobs`)."""
        if self._mirror is not None:
            self._mirror.check_spec(job_id, spec)
        state = self.jobs.add(job_id, trainer)
        if self._mirror is not None:
            self._mirror.added(job_id, spec)
        return state

    def pause_job(self, job_id: str, *, at_batch_end: bool = False) -> None:
        """No new quanta for the job (a quantum in flight completes normally); with
        ``at_batch_end``, only those that finish the optimizer batch in progress."""
        state = self.job_state(job_id)
        if at_batch_end:
            state.stop_at_batch_end = True
        else:
            state.paused = True
        if self._mirror is not None:
            self._mirror.paused(job_id, True)

    def resume_job(self, job_id: str) -> None:
        state = self.job_state(job_id)
        state.paused = state.stop_at_batch_end = False
        if self._mirror is not None:
            self._mirror.paused(job_id, False)

    def remove_job(self, job_id: str) -> LoraTrainer:
        """Take the job off the loop (waiting for its in-flight quantum, on every rank under
        tensor parallelism); returns its trainer."""
        trainer = self.jobs.remove(job_id)
        if self._mirror is not None:
            self._mirror.removed(job_id)
        return trainer

    def job_state(self, job_id: str) -> JobState:
        return self.jobs.state(job_id)

    @property
    def job_ids(self) -> list[str]:
        return list(self.jobs.order)

    # ---- the iteration ----------------------------------------------------------------------
    def has_work(self) -> bool:
        """Decode requests pending, a quantum in flight, or a runnable job."""
        return (
            self.engine.has_unfinished_requests()
            or self.executor.in_flight is not None
            or self.jobs.any_runnable()
        )

    def run_iteration(self) -> IterationRecord:
        """Plan, launch, decode, account (see the module docstring); returns the record."""
        started = self.clock()
        planned = self.ahead.take()
        if (
            planned is not None
            and not planned.launched
            and self.jobs.names_a_gone_job(planned.plan)
        ):
            earlier = planned.reports  # planned ahead, then its job was paused or removed
            planned = self.planner.plan(started)
            planned.reports[:0] = earlier
        if planned is None:
            planned = self.planner.plan(started)
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
                self.executor.submit(self.jobs.task(launch, plan, finetune_stream))

        if not self.launch_during_decode:
            submit()
        decode_start = self.clock()
        outputs = self._decode(decode_stream, plan.decode_sms, submit)
        submit()  # a step that ran nothing called no hook
        beside = self.executor.in_flight
        pending = self.ahead.pending
        if pending is not None and pending.launched:
            beside = None  # launched for the step ahead: it waited for this one to end
        emitted = self.clock()
        for launch in plan.launches:
            if launch.mode is LaunchMode.AFTER_DECODE:
                report = self.executor.run_now(self.jobs.task(launch, plan))
                self.jobs.account(report, alone=True)
                reports.append(report)
        observed_ms = (self.clock() - decode_start) * 1e3
        self.executor.after_decode()
        if self.memory is not None:
            self.memory.after_decode()
        reports += self.jobs.collect()
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
        self.jobs.collect()
        self.executor.close()

    # ---- internals --------------------------------------------------------------------------
    def _decode(
        self, stream: Any, decode_sms: int | None, on_launched: Callable[[], None]
    ) -> list[RequestOutput]:
        ahead = self.ahead
        if stream is None:
            return self.engine.step(decode_sms, on_launched, ahead)
        import torch

        with torch.cuda.stream(stream):
            return self.engine.step(decode_sms, on_launched, ahead)
