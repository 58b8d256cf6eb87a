"""What the Harli policy learns from the iterations it ran (``HarliPolicy.observe``).

Each record updates the estimates the policy's plans read: the durations of whole quanta per
(split, mode) (``QuantumDurations``), the correction of layer slices (``SliceCosts``) and the
micro-batch each job has in progress (``SliceState``), the extra cost of a launch iteration
(``LaunchOverhead``), the margin (``MarginTracker``) and, for models that learn online, the
latency model itself. What a record needs of the plan it ran travels in ``PlanMemo``
(``IterationPlan.memo`` -> ``IterationRecord.plan_memo``), so a plan made ahead of the step it
belongs to is judged by its own terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.colocation.estimates import LaunchOverhead, MarginTracker, QuantumDurations
from gpu_runtime.colocation.harli_config import HarliConfig
from gpu_runtime.colocation.latency_model import DecodeLatencyModel
from gpu_runtime.colocation.slicing import SliceCosts, SliceState
from gpu_runtime.colocation.types import IterationContext, IterationRecord, JobView, LaunchMode


@dataclass(frozen=True)
class PlanMemo:
    """What `HarliFeedback.observe` needs of the plan an iteration ran (`IterationPlan.memo`)."""

    launch_planned: tuple[float, bool] | None
    """(expected launch cost, cold) of a whole quantum launched beside decode."""
    backing_off: bool
    running_over: bool


NO_PLAN = PlanMemo(None, False, False)
"""A record that carries no plan of this policy: nothing launched, no backoff, no breach."""


class HarliFeedback:
    """Harli's estimates, updated from each iteration's record (see the module docstring).

    The estimates are built by the policy, which reads them when it plans; this object holds
    the per-job state both sides need: the last view of each job, each job's sliced micro-batch
    (``slices``) and the expected cost of the slice launched for it (``slice_launches``)."""

    def __init__(
        self,
        config: HarliConfig,
        latency: DecodeLatencyModel,
        margins: MarginTracker,
        durations: QuantumDurations,
        launch_overhead: LaunchOverhead,
        slice_costs: SliceCosts,
    ) -> None:
        self.config = config
        self.latency = latency
        self.margins = margins
        self.durations = durations
        self.launch_overhead = launch_overhead
        self.slice_costs = slice_costs
        self.slices: dict[str, SliceState] = {}
        self.slice_launches: dict[str, tuple[int | None, LaunchMode, float]] = {}
        """job id -> (decode split key, mode, base ms) of the slice launched for it."""
        self._jobs: dict[str, JobView] = {}
        self._slo_ms: float | None = None

    def planning(self, ctx: IterationContext) -> None:
        """Remember the SLO and the job views of the iteration being planned."""
        self._slo_ms = ctx.tpot_slo_ms
        for job in ctx.jobs:
            self._jobs[job.job_id] = job

    def job_shape(self, job_id: str) -> tuple[int, int]:
        """(sequence length, LoRA rank) of the job as last seen (512, 16 before any view)."""
        job = self._jobs.get(job_id)
        return (job.seq_len, job.lora_rank) if job else (512, 16)

    def slice_state(self, job: JobView) -> SliceState | None:
        """The job's sliced micro-batch tracker (None: its layers unknown or slicing off)."""
        if not job.layers or not self.config.layer_slices:
            return None
        state = self.slices.get(job.job_id)
        if state is None or state.layers != job.layers:
            state = self.slices[job.job_id] = SliceState(job.layers)
        return state

    def headed_over(self, ctx: IterationContext, alone: float | None) -> bool:
        """Whether a running request is headed over the SLO (a breach for the margin): its mean
        so far is over it and it would still end over it if its remaining tokens took decode
        alone's typical iteration (``alone``, as last predicted; before any, its mean so far
        decides). A request's first tokens carry its own prefill chunks and those of requests
        arriving beside it, so its early mean is often over a tight SLO and then falls; counting
        such a request as a breach would raise the margin at every burst until it turned down
        every split (docs/decisions/0014-harli-plan-rules.md)."""
        slo = ctx.tpot_slo_ms
        worst = ctx.worst_running_tpot_ms
        if worst is None or worst <= slo:
            return False
        if alone is None:
            return True
        horizon = self.config.unknown_remaining_tokens
        return any(r.tpot_ms > slo and r.final_tpot_ms(alone, horizon) > slo for r in ctx.running)

    def observe(self, record: IterationRecord) -> None:
        for quantum in record.quanta:
            launched = self.slice_launches.pop(quantum.job_id, None)
            state = self.slices.get(quantum.job_id)
            if state is not None:
                state.observe(quantum)
            if quantum.error is not None:
                continue
            if quantum.layer_passes:  # a slice: its duration says nothing of whole quanta
                if launched is not None:
                    key, mode, base = launched
                    self.slice_costs.observe(key, mode, base, quantum.duration_ms)
                continue
            key = None if quantum.mode is LaunchMode.AFTER_DECODE else quantum.decode_sms
            self.durations.observe(key, quantum.mode, quantum.tokens, quantum.duration_ms)
        busy = record.decode_batch or record.prefill_tokens
        memo = record.plan_memo if isinstance(record.plan_memo, PlanMemo) else NO_PLAN
        planned = memo.launch_planned  # this iteration launched a whole quantum beside
        if busy and planned is not None and not planned[1] and record.predicted_ms is not None:
            self.launch_overhead.observe(record.predicted_ms - planned[0], record.iteration_ms)
        if busy and self._slo_ms is not None:  # backoff iterations too: the breach term ages
            slo = self._slo_ms
            breached = any(f.tpot_ms is not None and f.tpot_ms > slo for f in record.finished)
            breached |= memo.running_over
            # An iteration of decode alone (paused, nothing safe) is judged without the plan's
            # own host time: a prediction learnt from cheap plans does not hold a full search
            # that found nothing, and counted as error it would raise the margin until every
            # plan searched and found nothing again (docs/decisions/0014-harli-plan-rules.md).
            observed = record.iteration_ms
            if not (record.in_flight or record.finetune_launched or record.planned_ahead):
                observed = max(observed - record.plan_ms, 0.0)
            self.margins.observe(record.predicted_ms, observed, slo, breached)
        learn = getattr(self.latency, "observe_record", None)  # models that learn online
        # Not from a launch iteration (its extra is launch_overhead's), nor from a pause that
        # asked nothing (the model would be asked now for its base prediction: the host time
        # the backoff saves; decode alone on the whole device is learnt from the other ones).
        if learn is not None and planned is None and not memo.backing_off:
            seq_len, rank = self.job_shape(record.quanta[0].job_id) if record.quanta else (512, 16)
            learn(record, seq_len, rank)
