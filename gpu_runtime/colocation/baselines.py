"""Baseline policies, run by the same `HostLoop` as Harli so comparisons share everything else.

* ``decode_only``: never finetunes; decode on the whole device.
* ``naive``: a quantum beside decode on a second stream whenever none is in flight, whole device,
  no throttling (what co-location without a scheduler does).
* ``time_slice``: no spatial split; after each decode step, a quantum sized to the iteration's
  slack (SLO x (1 - margin) minus predicted decode time) runs alone on the device.
* ``static_split``: a fixed decode/finetune SM split chosen offline; a quantum runs on the
  finetune side whenever none is in flight.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from gpu_runtime.colocation.latency_model import DecodeLatencyModel, decode_iteration
from gpu_runtime.colocation.policy import CoLocationPolicy
from gpu_runtime.colocation.types import (
    FinetuneLaunch,
    IterationContext,
    IterationPlan,
    IterationRecord,
    JobView,
    LaunchMode,
)


def whole_device(ctx: IterationContext) -> int | None:
    """The decode SM count meaning "no split" (None without a partitioner)."""
    return ctx.decode_sms_options[-1] if ctx.decode_sms_options else None


def quantum_tokens(job: JobView, examples: int) -> int:
    """A token cap fitting ``examples`` of the job's longest examples."""
    return max(1, examples) * job.max_seq_len


def memory_cap_tokens(job: JobView, budget_bytes: int | None) -> int | None:
    """Most quantum tokens the memory budget allows (None: no limit known)."""
    if budget_bytes is None or job.bytes_per_token is None or job.bytes_per_token <= 0:
        return None
    return int(budget_bytes // job.bytes_per_token)


class DecodeOnlyPolicy(CoLocationPolicy):
    """Decode alone; finetune jobs never run."""

    name = "decode_only"

    def plan(self, ctx: IterationContext) -> IterationPlan:
        return IterationPlan(decode_sms=whole_device(ctx), note="decode only")


class NaivePolicy(CoLocationPolicy):
    """Unthrottled co-run: a quantum of ``quantum_examples`` examples whenever none runs."""

    name = "naive"

    def __init__(self, quantum_examples: int = 4) -> None:
        if quantum_examples < 1:
            raise ValueError(f"quantum_examples must be >= 1, got {quantum_examples}")
        self.quantum_examples = quantum_examples

    def plan(self, ctx: IterationContext) -> IterationPlan:
        launches: tuple[FinetuneLaunch, ...] = ()
        if ctx.jobs and ctx.in_flight is None:
            job = ctx.jobs[0]
            launches = (FinetuneLaunch(job.job_id, quantum_tokens(job, self.quantum_examples)),)
        return IterationPlan(decode_sms=whole_device(ctx), launches=launches)

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "quantum_examples": self.quantum_examples}


class StaticSplitPolicy(CoLocationPolicy):
    """Decode always on ``decode_sms`` SMs; quanta continuously on the rest."""

    name = "static_split"

    def __init__(self, decode_sms: int | None, quantum_examples: int = 4) -> None:
        """``decode_sms`` None: no partitioner (then it behaves as ``naive``)."""
        if (decode_sms is not None and decode_sms < 1) or quantum_examples < 1:
            raise ValueError(f"decode_sms={decode_sms}, quantum_examples={quantum_examples}")
        self.decode_sms = decode_sms
        self.quantum_examples = quantum_examples

    def plan(self, ctx: IterationContext) -> IterationPlan:
        decode_sms = self.decode_sms if ctx.decode_sms_options else None
        launches: tuple[FinetuneLaunch, ...] = ()
        if ctx.jobs and ctx.in_flight is None:
            job = ctx.jobs[0]
            launches = (FinetuneLaunch(job.job_id, quantum_tokens(job, self.quantum_examples)),)
        return IterationPlan(decode_sms=decode_sms, launches=launches)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "decode_sms": self.decode_sms,
            "quantum_examples": self.quantum_examples,
        }


class TimeSlicePolicy(CoLocationPolicy):
    """Finetune only in each iteration's slack, after decode, on the whole device.

    Slack = ``tpot_slo_ms x (1 - margin)`` minus the stage-1 prediction of the decode step (a
    model that learns online, such as ``CorrectedLatencyModel``, is taught every iteration). The
    quantum's duration is estimated from this policy's own observed quanta (a high quantile of
    ms per token over the last ``window`` quanta); until one was observed it runs one example.
    When decode is idle the quantum is ``idle_quantum_examples`` examples.
    """

    name = "time_slice"

    def __init__(
        self,
        latency: DecodeLatencyModel,
        margin: float = 0.1,
        max_quantum_examples: int = 8,
        idle_quantum_examples: int = 8,
        window: int = 32,
    ) -> None:
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.latency = latency
        self.margin = margin
        self.max_quantum_examples = max_quantum_examples
        self.idle_quantum_examples = idle_quantum_examples
        self._ms_per_token: deque[float] = deque(maxlen=window)
        self._fixed_ms: deque[float] = deque(maxlen=window)

    def _ms_per_token_estimate(self) -> float | None:
        if not self._ms_per_token:
            return None
        ordered = sorted(self._ms_per_token)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def plan(self, ctx: IterationContext) -> IterationPlan:
        full = whole_device(ctx)
        if not ctx.jobs or ctx.in_flight is not None:
            return IterationPlan(decode_sms=full)
        job = ctx.jobs[0]
        if ctx.decode.is_idle:
            tokens = quantum_tokens(job, self.idle_quantum_examples)
            return IterationPlan(
                decode_sms=full,
                launches=(FinetuneLaunch(job.job_id, tokens, LaunchMode.AFTER_DECODE),),
                note="decode idle",
            )
        share = 1.0
        solo = self.latency.predict_ms(decode_iteration(ctx.decode, share), None)
        bound = ctx.tpot_slo_ms * (1.0 - self.margin)
        slack = bound - solo
        per_token = self._ms_per_token_estimate()
        if per_token is None:
            examples = 1
        else:
            examples = min(self.max_quantum_examples, int(slack / (per_token * job.max_seq_len)))
        if examples < 1:
            return IterationPlan(
                decode_sms=full,
                predicted_ms=solo,
                predicted_solo_ms=solo,
                margin=self.margin,
                paused=True,
                note="no slack",
            )
        tokens = quantum_tokens(job, examples)
        predicted_quantum = None if per_token is None else per_token * tokens
        return IterationPlan(
            decode_sms=full,
            launches=(
                FinetuneLaunch(job.job_id, tokens, LaunchMode.AFTER_DECODE, predicted_quantum),
            ),
            predicted_ms=solo + (predicted_quantum or 0.0),
            predicted_solo_ms=solo,
            margin=self.margin,
        )

    def observe(self, record: IterationRecord) -> None:
        for quantum in record.quanta:
            if quantum.mode is LaunchMode.AFTER_DECODE and quantum.tokens and not quantum.error:
                self._ms_per_token.append(quantum.duration_ms / quantum.tokens)
        learn = getattr(self.latency, "observe_record", None)  # models that learn online
        if learn is not None:  # (a quantum after decode is taken out of the decode step's time)
            learn(record)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "margin": self.margin,
            "max_quantum_examples": self.max_quantum_examples,
        }
