"""A fake-clock GPU for policy tests: latencies come from a known analytic model."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_runtime.colocation import (
    AnalyticLatencyModel,
    CoLocationPolicy,
    DecodeSnapshot,
    IterationContext,
    IterationPlan,
    IterationRecord,
    JobView,
    LaunchMode,
    QuantumReport,
    validate_plan,
)
from gpu_runtime.colocation.latency_model import decode_iteration
from gpu_runtime.colocation.online import beside_quantum
from gpu_runtime.colocation.types import InFlightQuantum

TOTAL_SMS = 132
OPTIONS = (*range(8, 120, 8), TOTAL_SMS)
JOB = JobView("job", seq_len=256, max_seq_len=256, lora_rank=16)


def context(
    decode: DecodeSnapshot,
    slo_ms: float,
    *,
    jobs: tuple[JobView, ...] = (JOB,),
    in_flight: InFlightQuantum | None = None,
    budget: int | None = None,
    spatial: bool = True,
) -> IterationContext:
    return IterationContext(
        now=0.0,
        decode=decode,
        total_sms=TOTAL_SMS if spatial else None,
        decode_sms_options=OPTIONS if spatial else (),
        spatial=spatial,
        jobs=jobs,
        in_flight=in_flight,
        finetune_budget_bytes=budget,
        tpot_slo_ms=slo_ms,
    )


def record(
    plan: IterationPlan,
    decode: DecodeSnapshot,
    observed_ms: float,
    index: int = 0,
    quanta: tuple[QuantumReport, ...] = (),
    beside: int = 0,
    beside_sms: int | None = None,
) -> IterationRecord:
    return IterationRecord(
        index=index,
        timestamp=0.0,
        policy="test",
        decode_batch=decode.batch_size,
        prefill_tokens=decode.prefill_tokens,
        context_tokens_total=decode.context_tokens_total,
        context_tokens_max=decode.context_tokens_max,
        decode_tokens=decode.batch_size,
        observed_ms=observed_ms,
        iteration_ms=observed_ms,
        predicted_ms=plan.predicted_ms,
        predicted_solo_ms=plan.predicted_solo_ms,
        margin=plan.margin,
        decode_sms=plan.decode_sms,
        total_sms=TOTAL_SMS,
        finetune_launched=plan.launches,
        finetune_tokens=sum(q.tokens for q in quanta),
        quanta=quanta,
        memory_lent_bytes=None,
        tpot_samples_ms=(observed_ms,) * decode.batch_size,
        paused=plan.paused,
        in_flight=bool(beside),
        beside_tokens=beside,
        beside_decode_sms=beside_sms,
        plan_memo=plan.memo,
    )


@dataclass
class FakeGpu:
    """Runs a policy on a fake clock: decode takes what ``truth`` says, quanta run at
    ``solo_tokens_per_s`` x their SM share."""

    truth: AnalyticLatencyModel
    solo_tokens_per_s: float = 20_000.0
    now_ms: float = 0.0
    flight: tuple[InFlightQuantum, float, int] | None = None  # quantum, end ms, tokens
    tpots: list[float] = field(default_factory=list)
    finetune_tokens: int = 0
    plans: list[IterationPlan] = field(default_factory=list)

    def step(self, policy: CoLocationPolicy, decode: DecodeSnapshot, slo_ms: float) -> None:
        reports: list[QuantumReport] = []
        if self.flight is not None and self.flight[1] <= self.now_ms:
            quantum, end, tokens = self.flight
            reports.append(
                QuantumReport(
                    "job",
                    tokens,
                    end - quantum.started_at * 1e3,
                    LaunchMode.CONCURRENT,
                    quantum.decode_sms,
                )
            )
            self.finetune_tokens += tokens
            self.flight = None
        ctx = context(decode, slo_ms, in_flight=self.flight[0] if self.flight else None)
        plan = policy.plan(ctx)
        validate_plan(plan, ctx)
        self.plans.append(plan)
        share = (plan.decode_sms or TOTAL_SMS) / TOTAL_SMS
        for launch in plan.launches:
            if launch.mode is LaunchMode.CONCURRENT:
                ft_share = 1.0 if share >= 1 else 1.0 - share
                tokens = launch.max_tokens
                rate = self.solo_tokens_per_s * ft_share * (0.5 if share >= 1 else 1)
                started = InFlightQuantum("job", tokens, plan.decode_sms, self.now_ms / 1e3)
                self.flight = (started, self.now_ms + tokens / rate * 1e3, tokens)
        beside = None
        if self.flight is not None:
            beside = beside_quantum(
                self.flight[0].max_tokens,
                self.flight[0].decode_sms,
                TOTAL_SMS,
                JOB.seq_len,
                JOB.lora_rank,
            )
        ms = self.truth.predict_ms(decode_iteration(decode, share), beside)
        for launch in plan.launches:
            if launch.mode is LaunchMode.AFTER_DECODE:
                q_ms = launch.max_tokens / self.solo_tokens_per_s * 1e3
                ms += q_ms
                reports.append(
                    QuantumReport(
                        "job", launch.max_tokens, q_ms, LaunchMode.AFTER_DECODE, plan.decode_sms
                    )
                )
                self.finetune_tokens += launch.max_tokens
        self.now_ms += ms
        self.tpots.append(ms)
        policy.observe(
            record(
                plan,
                decode,
                ms,
                quanta=tuple(reports),
                beside=self.flight[0].max_tokens if self.flight else 0,
                beside_sms=self.flight[0].decode_sms if self.flight else None,
            )
        )
