"""Typed records the co-location loop and its policies exchange (pure Python, no torch).

One iteration: the loop builds an :class:`IterationContext` (what decode is about to do, which
finetune jobs can run, what is in flight, the memory budget), the policy answers with an
:class:`IterationPlan` (decode SM share, finetune quanta to launch and how), the loop executes it
and emits an :class:`IterationRecord` (what was predicted, what was observed) to its metrics sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class PlanError(ValueError):
    """A policy returned a plan the loop cannot execute; the message names the field."""


class LaunchMode(Enum):
    """How a finetune quantum shares the GPU with the decode iteration it is launched with."""

    CONCURRENT = "concurrent"
    """On the finetune stream beside decode (spatially split when a partitioner exists); the
    quantum may outlast the iteration. On CPU the loop runs it right after the decode step."""
    AFTER_DECODE = "after_decode"
    """Time slicing: after the decode step has finished, on the whole device, and the loop
    waits for it before the iteration ends (it counts towards this iteration's TPOT)."""


@dataclass(frozen=True)
class DecodeSnapshot:
    """Decode work of the coming iteration, read from the engine's scheduler before it runs.

    Attributes:
        batch_size: running sequences that will decode one token each.
        context_tokens_total: sum of their cached tokens.
        context_tokens_max: longest of those contexts.
        prefill_tokens: prompt tokens expected in the same iteration (chunked prefill).
        waiting_requests: requests queued and not yet admitted.
    """

    batch_size: int
    context_tokens_total: int
    context_tokens_max: int
    prefill_tokens: int = 0
    waiting_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "context_tokens_total", "prefill_tokens", "waiting_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"DecodeSnapshot.{name} must be >= 0, got {getattr(self, name)}")
        if self.context_tokens_max * self.batch_size < self.context_tokens_total:
            raise ValueError(
                f"context_tokens_max {self.context_tokens_max} x batch {self.batch_size} < "
                f"total {self.context_tokens_total}"
            )

    @property
    def is_idle(self) -> bool:
        """No decode or prefill work: the iteration computes nothing."""
        return self.batch_size == 0 and self.prefill_tokens == 0

    @classmethod
    def from_contexts(
        cls, contexts: list[int], prefill_tokens: int = 0, waiting_requests: int = 0
    ) -> DecodeSnapshot:
        """From the per-sequence context lengths of the decode batch."""
        return cls(
            len(contexts), sum(contexts), max(contexts, default=0), prefill_tokens, waiting_requests
        )


@dataclass(frozen=True)
class JobView:
    """A runnable finetune job as a policy sees it.

    Attributes:
        job_id: the loop's key for the job.
        seq_len: typical (mean) example length in tokens, for the predictor's ``ft_seq_len``.
        max_seq_len: longest example; a quantum needs at least this many tokens of budget.
        lora_rank: adapter rank, for the predictor's ``ft_lora_rank``.
        bytes_per_token: observed peak finetune bytes per quantum token (None until measured).
        tokens_per_s_solo: observed tokens/s of its quanta when nothing else ran (None until
            measured).
        layers: decoder layers of the model it trains (``2 x layers`` passes per micro-batch,
            for layer-sliced quanta); None: unknown, or the job's whole micro-batches replay
            CUDA graphs (a layer slice runs eagerly: more host time than a whole replayed
            micro-batch), so whole quanta only.
        cold_launches: (examples, decode SMs) of concurrent quanta (``examples x max_seq_len``
            tokens, beside decode on that split's finetune stream) whose micro-batch has no
            CUDA graph there yet: launching one first warms up or captures, a one-off stall of
            the loop (``HarliConfig.cold_launch_ms``). Empty when unknown or not graphed.
    """

    job_id: str
    seq_len: int
    max_seq_len: int
    lora_rank: int
    bytes_per_token: float | None = None
    tokens_per_s_solo: float | None = None
    layers: int | None = None
    cold_launches: frozenset[tuple[int, int | None]] = frozenset()


@dataclass(frozen=True)
class InFlightQuantum:
    """A concurrent quantum launched earlier that has not finished yet."""

    job_id: str
    max_tokens: int
    decode_sms: int | None
    started_at: float


@dataclass(frozen=True)
class IterationContext:
    """Everything a policy may read to plan one iteration.

    Attributes:
        now: the loop clock (seconds).
        decode: the coming decode work.
        total_sms: SMs of the device (None on CPU / without a partitioner).
        decode_sms_options: decode SM counts the partitioner can give (ascending, the last one
            being ``total_sms``: no spatial split); empty without a partitioner.
        spatial: True when the options above are disjoint SM splits (green contexts).
        jobs: runnable (not paused, not finished) finetune jobs, in round-robin order.
        in_flight: the concurrent quantum still running, if any (one at a time).
        finetune_budget_bytes: memory a quantum may peak at (None: no memory manager).
        tpot_slo_ms: the decode TPOT SLO this loop serves.
        worst_running_tpot_ms: the highest mean TPOT so far among running requests that have
            emitted at least ``MIN_TOKENS_FOR_TPOT`` tokens (None: none has): how close the
            batch already is to missing its SLO.
        running: those requests one by one (tokens so far, mean TPOT so far, tokens left), so
            a policy can project where each request's mean TPOT ends up.
    """

    now: float
    decode: DecodeSnapshot
    total_sms: int | None
    decode_sms_options: tuple[int, ...]
    spatial: bool
    jobs: tuple[JobView, ...]
    in_flight: InFlightQuantum | None
    finetune_budget_bytes: int | None
    tpot_slo_ms: float
    worst_running_tpot_ms: float | None = None
    running: tuple[RunningRequest, ...] = ()


@dataclass(frozen=True)
class RunningRequest:
    """A request still decoding, as an SLO check sees it."""

    tokens: int
    """Output tokens emitted so far."""
    tpot_ms: float
    """Mean gap between those tokens so far."""
    remaining_tokens: int | None
    """At most this many tokens still to come (``max_tokens`` less those emitted; None when
    unknown)."""

    def final_tpot_ms(self, iteration_ms: float, horizon_tokens: int) -> float:
        """Its mean TPOT at the end if every remaining token (``remaining_tokens``, or
        ``horizon_tokens`` when unknown) takes ``iteration_ms``."""
        left = self.remaining_tokens if self.remaining_tokens is not None else horizon_tokens
        gaps = max(self.tokens - 1, 0)
        if gaps + left <= 0:
            return self.tpot_ms
        return (gaps * self.tpot_ms + left * iteration_ms) / (gaps + left)


MIN_TOKENS_FOR_TPOT = 16
"""Tokens a running request must have emitted before its mean TPOT counts as evidence."""


@dataclass(frozen=True)
class FinetuneLaunch:
    """One quantum to start: ``LoraTrainer.step_quantum(max_tokens=max_tokens)``."""

    job_id: str
    max_tokens: int
    mode: LaunchMode = LaunchMode.CONCURRENT
    predicted_ms: float | None = None
    """Predicted duration of the quantum itself, when the policy has a model for it."""
    max_layers: int | None = None
    """Layer-sliced quantum: at most this many decoder-layer passes of the micro-batch in
    progress (``step_quantum(max_layers=...)``); None runs a whole micro-batch."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise PlanError(f"FinetuneLaunch.max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_layers is not None and self.max_layers < 1:
            raise PlanError(f"FinetuneLaunch.max_layers must be >= 1, got {self.max_layers}")


@dataclass(frozen=True)
class IterationPlan:
    """A policy's decision for one iteration.

    Attributes:
        decode_sms: SMs decode runs on (one of ``decode_sms_options``); None without a
            partitioner (whole device / CPU).
        launches: quanta to start (at most one CONCURRENT, only when nothing is in flight).
        predicted_ms: predicted TPOT of this iteration under the plan (decode plus whatever the
            plan puts beside or after it); None when the policy has no predictor.
        predicted_solo_ms: stage-1 prediction of decode alone on ``decode_sms`` (None if none).
        margin: the safety margin the decision used (fraction of the SLO), if any.
        paused: True when the policy wanted finetuning but judged no choice safe.
        note: free-form reason, kept in the record.
        memo: the policy's own note on the plan, handed back in the record
            (``IterationRecord.plan_memo``): what ``observe`` needs of its plan, which a
            loop planning ahead may already have replaced by the next one.
    """

    decode_sms: int | None = None
    launches: tuple[FinetuneLaunch, ...] = ()
    predicted_ms: float | None = None
    predicted_solo_ms: float | None = None
    margin: float | None = None
    paused: bool = False
    note: str = ""
    memo: Any = None

    @property
    def finetune_tokens_planned(self) -> int:
        """Sum of the launches' token caps."""
        return sum(launch.max_tokens for launch in self.launches)


@dataclass(frozen=True)
class QuantumReport:
    """A quantum that completed (or failed) during an iteration."""

    job_id: str
    tokens: int
    duration_ms: float
    """Its time on its stream for a quantum launched without waiting (CUDA events), else the
    wall time from its start to its end."""
    mode: LaunchMode
    decode_sms: int | None
    loss: float | None = None
    step: int | None = None
    optimizer_step: bool = False
    job_finished: bool = False
    peak_memory_bytes: int | None = None
    """The trainer's figure: peak CUDA memory of the whole process during the quantum."""
    layer_passes: int = 0
    """Decoder-layer passes run (layer-sliced quanta only)."""
    micro_batch_done: bool = True
    """False while a layer-sliced micro-batch is still in progress (its tokens count later)."""
    finetune_peak_bytes: int | None = None
    """That peak less what was allocated when the quantum started: what the quantum added."""
    checkpoint: str | None = None
    error: str | None = None
    graph: str | None = None
    """How its micro-batch ran (``QuantumResult.graph``: "replay", "capture", "eager", "off")."""


@dataclass(frozen=True)
class FinishedRequest:
    """A decode request that finished this iteration, with its TPOT."""

    request_id: str
    output_tokens: int
    tpot_ms: float | None
    """Mean gap between its output tokens (None with a single token)."""
    ttft_ms: float | None
    """Arrival to first token (None when the loop did not see it arrive)."""
    finish_reason: str | None = None


@dataclass(frozen=True)
class IterationRecord:
    """What one iteration did: exported to the metrics sink, aggregated for the host agent.

    Times are in ms; ``timestamp`` is the loop clock (s) at the iteration's start.
    """

    index: int
    timestamp: float
    policy: str
    decode_batch: int
    prefill_tokens: int
    context_tokens_total: int
    context_tokens_max: int
    decode_tokens: int
    """Tokens emitted by decode this iteration."""
    observed_ms: float
    """Wall time of the decode step (plus an AFTER_DECODE quantum, which is part of TPOT)."""
    iteration_ms: float
    """Wall time of the whole iteration (planning and bookkeeping included)."""
    predicted_ms: float | None
    predicted_solo_ms: float | None
    margin: float | None
    decode_sms: int | None
    total_sms: int | None
    finetune_launched: tuple[FinetuneLaunch, ...]
    finetune_tokens: int
    """Tokens of quanta that completed during this iteration."""
    quanta: tuple[QuantumReport, ...]
    memory_lent_bytes: int | None
    tpot_samples_ms: tuple[float, ...]
    """Gap since the previous token, for each token emitted this iteration (first tokens
    excluded)."""
    finished: tuple[FinishedRequest, ...] = ()
    paused: bool = False
    note: str = ""
    in_flight: bool = False
    """A concurrent quantum was running while decode ran."""
    beside_tokens: int = 0
    """Token cap of the concurrent quantum that ran beside decode (0: none)."""
    beside_decode_sms: int | None = None
    """The split that quantum was launched with (its SMs are the rest of the device)."""
    plan_ms: float = 0.0
    """Host time of the policy's ``plan`` for this iteration (part of ``iteration_ms``, so
    every token of the iteration waits for it, unless the loop planned it ahead inside the
    previous iteration's step: `gpu_runtime.colocation.ahead`)."""
    plan_memo: Any = None
    """``IterationPlan.memo`` of the plan this iteration ran."""
    planned_ahead: bool = False
    """The plan was made inside the previous iteration's step (`gpu_runtime.colocation.ahead`):
    its ``plan_ms`` overlapped that step on the device instead of delaying this one."""
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def decode_sm_share(self) -> float | None:
        """Decode SMs / device SMs, when known."""
        if self.decode_sms is None or not self.total_sms:
            return None
        return self.decode_sms / self.total_sms
