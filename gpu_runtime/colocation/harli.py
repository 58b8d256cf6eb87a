"""The Harli policy: maximise finetune tokens/s subject to predicted TPOT <= SLO x (1 - margin).

Before every decode iteration it enumerates the choices the device offers:

* **spatial**: decode on ``d`` SMs and a quantum of ``k`` examples on the other ``T - d`` SMs
  (every split of the partitioner, every ``k`` of ``quantum_examples`` the memory budget allows);
* **shared**: a quantum beside decode on the whole device (stream sharing);
* **slice**: a quantum after the decode step, alone on the device (time slicing);
* **layer-sliced**: ``k`` decoder-layer passes of a micro-batch (``max_layers=k``), after decode
  within the slack or beside decode on a split, when the job's layer count is known; a
  micro-batch in progress only continues in slices (see ``slicing.py``; the choices themselves
  are enumerated in ``choices.py``).

For each it asks the latency model (stage 1 for decode alone, stage 2 with the quantum beside
it) for the iteration's TPOT, keeps the choices under ``tpot_slo_ms x (1 - margin)``, and takes
the one with the highest expected finetune tokens/s: a quantum's tokens over its expected
duration plus half a decode iteration (the relaunch gap); durations are fitted per choice from its
own quanta as ``overhead + tokens / rate`` (before any is observed, the solo rate scaled by the
SMs the quantum gets). Bigger quanta amortise the per-quantum overhead but hold a split longer,
so a quantum is capped at ``max_quantum_ms`` (the smallest size is always allowed). A request's TPOT
is a mean over its tokens and a quantum holds its split for many iterations, so a concurrent
quantum is checked on the typical iteration while it runs (running plus waiting requests; the
mean of a pure decode step and a step with the recent chunk size, weighted by how often steps
have carried a chunk: ``PrefillMix``) against the bound, and on the coming iteration
against the SLO itself. Every running request is projected to its end (its mean TPOT so
far, its remaining tokens at that typical iteration, with the chunk share a burst leaves in
memory for ~200 iterations after it if that is higher): a choice is rejected when some request
would then end over the bound while decode alone would keep it within the SLO (a request lost
either way does not hold finetuning back). When nothing is safe, finetuning pauses for that
iteration (decode gets the whole device) and the plan says why.

When decode is idle, a quantum alone on the whole device (time slicing) is weighed, at most
``idle_slice_ms`` long: a request arriving meanwhile waits for its first token, its TPOT
untouched. Beside it, quanta beside decode are planned as if one request had just arrived (on a
split, or shared on the whole device), so a request that does arrive while such a quantum runs
still meets the SLO; the highest expected tokens/s wins (alone, usually).

An iteration that launches a quantum costs more than one with the quantum already in flight (the
launch's host work, the quantum's first kernels): that extra, learnt from launch iterations
(``LaunchOverhead``), is added to the coming iteration's prediction and to one gap of every
running request; a launch whose micro-batch has no CUDA graph on that split's stream yet
(``JobView.cold_launches``) also costs ``cold_launch_ms`` there, so such launches wait for
decode to be idle or for running requests with room for one long gap.

While a quantum is in flight its SMs are taken (no new launch): decode stays on the split the
quantum was launched beside, and moves to the whole device (sharing the quantum's SMs) only when
that split is predicted over the bound and the whole device faster.

The margin adapts: ``base_margin`` plus the ``error_quantile`` of recent relative prediction
errors ``(observed - predicted) / predicted`` (only under-predictions count; each a mean over
``error_smoothing`` iterations), capped at ``max_margin``; each time a request misses the SLO
(finishes over it, or a running one's mean TPOT so far is over it and would stay over it at
decode alone's typical iteration), ``violation_step`` is added, decaying by
``violation_decay`` per busy iteration (those of a plan backoff included). The margin, the
quantum durations, the slice and launch costs are learnt from each iteration's record by
``HarliFeedback`` (``harli_feedback.py``), which the policy holds.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from gpu_runtime.colocation.baselines import memory_cap_tokens
from gpu_runtime.colocation.choices import Choice, ChoiceEnumerator
from gpu_runtime.colocation.estimates import (
    LaunchOverhead,
    MarginTracker,
    PrefillMix,
    QuantumDurations,
)
from gpu_runtime.colocation.harli_config import HarliConfig
from gpu_runtime.colocation.harli_feedback import HarliFeedback, PlanMemo
from gpu_runtime.colocation.latency_model import DecodeLatencyModel, decode_iteration, predict_many
from gpu_runtime.colocation.online import beside_quantum
from gpu_runtime.colocation.policy import CoLocationPolicy
from gpu_runtime.colocation.slicing import SliceCosts
from gpu_runtime.colocation.types import (
    DecodeSnapshot,
    FinetuneLaunch,
    IterationContext,
    IterationPlan,
    IterationRecord,
    LaunchMode,
)
from gpu_runtime.colocation.typical import TypicalPredictions, moves_to_whole


class HarliPolicy(CoLocationPolicy):
    """QoS-guaranteed, throughput-maximising co-location (see the module docstring)."""

    name = "harli"

    def __init__(self, latency: DecodeLatencyModel, config: HarliConfig | None = None) -> None:
        self.latency = latency
        self.config = config or HarliConfig()
        self.launch_sizes = self.config.quantum_examples  # the loop reports their graph state
        self.margins = MarginTracker(self.config)
        self.durations = QuantumDurations(self.config.prior_quantum_overhead_ms)
        self.launch_overhead = LaunchOverhead(
            self.config.error_smoothing, self.config.launch_overhead_prior_ms
        )
        self._launch_planned: tuple[float, bool] | None = None
        """(ms the plan's prediction adds for the launch, whether it was a cold launch)."""
        self.slice_costs = SliceCosts(
            self.config.slice_call_ms,
            self.config.slice_forward_layer_ms,
            self.config.slice_backward_layer_ms,
        )
        self.feedback = HarliFeedback(
            self.config,
            latency,
            self.margins,
            self.durations,
            self.launch_overhead,
            self.slice_costs,
        )
        self._running_over = False
        """At this iteration's plan, a running request was headed over the SLO."""
        self._alone_ms: float | None = None
        """Decode alone's typical iteration (remembered mix) at the last plan that predicted it."""
        self._prefill = PrefillMix(
            self.config.prefill_smoothing,
            self.config.error_smoothing,
            self.config.prefill_memory_smoothing,
        )
        self.predictions = TypicalPredictions(latency, self._prefill)
        self.choices = ChoiceEnumerator(
            self.config,
            latency,
            self.predictions,
            self.durations,
            self.slice_costs,
            self.launch_overhead,
        )
        self._failed_plans = 0
        """Plans in a row that found nothing safe."""
        self._backing_off = False
        """This iteration's plan paused without asking the model."""
        self._backoff: tuple[int, int, float] = (0, 0, 0.0)
        """(iterations still to pause without planning, the batch and the SLO when the backoff
        began)."""
        self.decisions = 0
        self.pauses = 0

    # ---- planning -----------------------------------------------------------------------
    def plan(self, ctx: IterationContext) -> IterationPlan:
        plan = self._plan(ctx)
        memo = PlanMemo(self._launch_planned, self._backing_off, self._running_over)
        return replace(plan, memo=memo)

    def _plan(self, ctx: IterationContext) -> IterationPlan:
        self.decisions += 1
        self._launch_planned = None
        self._backing_off = False
        self._running_over = self.feedback.headed_over(ctx, self._alone_ms)
        self.feedback.planning(ctx)
        options = ctx.decode_sms_options
        full = options[-1] if options else None
        margin = self.margins.margin
        idle = ctx.decode.is_idle
        queued = ctx.decode.waiting_requests  # requests no step has taken up yet
        if not idle:
            self._prefill.observe(ctx.decode.prefill_tokens)
        if idle:
            if not ctx.jobs or ctx.in_flight is not None:
                return IterationPlan(full, (), None, None, margin, note="idle")
            # Plan for the request that may arrive while the quantum runs.
            probe = DecodeSnapshot.from_contexts([self.config.idle_probe_context_tokens])
            ctx = replace(ctx, decode=probe)
        left, batch, slo = self._backoff
        if idle or ctx.in_flight is not None or ctx.decode.batch_size < batch:
            left = 0  # a request finished or nothing decodes: plan again now
        if left > 0 and ctx.jobs and slo == ctx.tpot_slo_ms:
            self._backoff = (left - 1, batch, slo)
            self._backing_off = True
            self.pauses += 1
            return IterationPlan(full, (), None, None, margin, paused=True, note="backing off")
        self._backoff = (0, 0, 0.0)
        bound = ctx.tpot_slo_ms * (1.0 - margin)
        total = ctx.total_sms
        solo_full = self.latency.predict_ms(decode_iteration(ctx.decode, 1.0), None)

        def pause(note: str) -> IterationPlan:
            """Decode alone on the whole device this iteration; no finetune work."""
            return IterationPlan(full, (), solo_full, solo_full, margin, paused=True, note=note)

        if ctx.in_flight is not None:
            return self._in_flight_plan(ctx, full, margin, bound)
        if not ctx.jobs:
            return IterationPlan(full, (), solo_full, solo_full, margin, note="no job")
        job = ctx.jobs[0]
        cap = memory_cap_tokens(job, ctx.finetune_budget_bytes)
        sizes = sorted(
            k for k in self.config.quantum_examples if cap is None or k * job.max_seq_len <= cap
        )
        if not sizes:
            return pause("memory budget below one example")
        offered: list[Choice] = []
        rejected_before = self.choices.risk_rejections
        sliced = self.feedback.slice_state(job)
        # Decode alone on the whole device is the kindest its typical iteration can be: when
        # even that is over the bound, no quantum beside it can be safe, and the whole batch
        # of predictions (every split x size) is host time every decode token waits for.
        hopeless = False
        if not idle:
            alone = self.predictions.typical_alone(ctx)
            hopeless, self._alone_ms = alone[0] > bound, alone[1]
        if sliced is None or not sliced.active:  # a micro-batch in progress goes on in slices
            shares = [d / total for d in options[:-1]] if total and ctx.spatial else []
            if self.config.allow_shared:
                shares.append(1.0)
            if not hopeless:
                token_counts = [k * job.max_seq_len for k in sizes]
                self.predictions.prefetch_open(ctx, job, shares, token_counts, bound)
            if total and ctx.spatial and not hopeless:
                for d in options[:-1]:
                    offered += self.choices.spatial(ctx, job, d, total, sizes, bound)
            if self.config.allow_shared and not hopeless:
                offered += self.choices.spatial(ctx, job, full, total, sizes, bound)
            if self.config.allow_slice and not idle:
                offered += self.choices.after_decode(ctx, job, full, sizes, bound, solo_full)
        if sliced is not None:
            offered += self.choices.layer_sliced(ctx, job, sliced, full, sizes, bound, solo_full)
        if idle and not queued and (sliced is None or not sliced.active):
            offered += self.choices.idle(job, full, sizes)
        if not offered:
            if idle:
                return IterationPlan(full, (), None, None, margin, note="idle, no safe split")
            self.pauses += 1
            self._failed_plans += 1
            if self.config.replan_backoff:
                wait = min(self._failed_plans, self.config.replan_backoff)
                self._backoff = (wait, ctx.decode.batch_size, ctx.tpot_slo_ms)
            at_risk = self.choices.risk_rejections > rejected_before
            return pause("request at risk" if at_risk else "no safe choice")
        self._failed_plans = 0
        best = max(offered, key=lambda c: (c.value, -c.predicted_ms))
        assert best.mode is not None
        tokens = best.examples * job.max_seq_len
        launch = FinetuneLaunch(job.job_id, tokens, best.mode, best.quantum_ms, best.max_layers)
        if idle and best.mode is LaunchMode.AFTER_DECODE:  # nothing decodes: nothing predicted
            note = f"decode idle: alone k={best.examples}"
            return IterationPlan(full, (launch,), None, None, margin, note=note)
        if best.max_layers is not None:
            assert sliced is not None
            if not sliced.active:
                sliced.start(job.job_id, best.examples, tokens)
            key = best.decode_sms if best.mode is LaunchMode.CONCURRENT else None
            self.feedback.slice_launches[job.job_id] = (key, best.mode, best.slice_base_ms)
        share = 1.0 if not total or best.decode_sms is None else best.decode_sms / total
        solo = self.latency.predict_ms(decode_iteration(ctx.decode, share), None)
        whole_beside = best.mode is LaunchMode.CONCURRENT and best.max_layers is None
        if whole_beside and not idle:
            cold = (best.examples, best.decode_sms) in job.cold_launches
            launch_ms = self.choices.launch_ms(job, best.examples, best.decode_sms)
            self._launch_planned = (launch_ms, cold)
        return IterationPlan(
            best.decode_sms,
            (launch,),
            best.predicted_ms,
            solo,
            margin,
            note=("decode idle: " if idle else "")
            + f"{best.mode.value} k={best.examples}"
            + ("" if best.max_layers is None else f" layers={best.max_layers}"),
        )

    def _in_flight_plan(
        self, ctx: IterationContext, full: int | None, margin: float, bound: float
    ) -> IterationPlan:
        """Decode's split while a quantum runs: the split it was launched on, which its launch
        checks were made for. Only when that is predicted over the bound does decode move to
        the whole device, sharing the quantum's SMs (faster for decode, slower for the quantum),
        if that is predicted faster: moving whenever the whole device is predicted faster
        would make moving the rule, taking SMs from the quantum and teaching the split's
        correction from a placement the predictor's profile never timed
        (docs/decisions/0014-harli-plan-rules.md)."""
        flight = ctx.in_flight
        assert flight is not None
        seq_len, rank = self.feedback.job_shape(flight.job_id)
        quantum = beside_quantum(flight.max_tokens, flight.decode_sms, ctx.total_sms, seq_len, rank)
        held = flight.decode_sms if flight.decode_sms in ctx.decode_sms_options else full
        candidates: tuple[int | None, ...] = (held,) if held == full else (held, full)
        iterations = [
            decode_iteration(
                ctx.decode, 1.0 if not ctx.total_sms or d is None else d / ctx.total_sms
            )
            for d in candidates
        ]
        # One batched call: each split with the quantum beside, then each alone.
        values = predict_many(
            self.latency, [(it, quantum) for it in iterations] + [(it, None) for it in iterations]
        )
        moved = len(candidates) > 1 and moves_to_whole(values[0], values[1], bound)
        best = 1 if moved else 0
        predicted, d, solo = values[best], candidates[best], values[len(candidates) + best]
        note = "quantum in flight" + (" (moved: split over bound)" if moved else "")
        if predicted > bound:
            note += " (predicted over bound)"
        return IterationPlan(d, (), predicted, solo, margin, note=note)

    # ---- feedback -----------------------------------------------------------------------
    def observe(self, record: IterationRecord) -> None:
        self.feedback.observe(record)

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, **asdict(self.config)}
