"""A simulated host: policies plan real decisions, a fake clock advances by modelled latencies.

For what-if studies and for running the co-location benchmark's policies when no GPU is at hand
(`python -m bench.colocate --simulate`); the product's one loop is
`gpu_runtime.colocation.HostLoop`, and nothing in the product runs this one. It is not a
measurement: every latency comes from a model (``truth``), typically fitted to iterations
profiled on a real GPU
(``fit_truth_from_profile``). Decode follows the engine's continuous batching in outline: FCFS
admission up to ``max_num_seqs``, running requests first, chunked prefill within
``max_num_batched_tokens``; a request's first token comes with the iteration that computes its
last prompt token. Finetune quanta take ``QuantumCostModel`` time; one concurrent quantum at a
time, polled at iteration boundaries like ``HostLoop``.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from gpu_runtime.colocation.latency_model import DecodeLatencyModel, decode_iteration
from gpu_runtime.colocation.loop import LAUNCH_DURING_DECODE
from gpu_runtime.colocation.online import OnlineLatencyModel
from gpu_runtime.colocation.policy import CoLocationPolicy, validate_plan
from gpu_runtime.colocation.types import (
    MIN_TOKENS_FOR_TPOT,
    DecodeSnapshot,
    FinishedRequest,
    InFlightQuantum,
    IterationContext,
    IterationRecord,
    JobView,
    LaunchMode,
    QuantumReport,
    RunningRequest,
)
from gpu_runtime.predictor.schema import DecodeIteration, FinetuneQuantum


@dataclass(frozen=True)
class QuantumCostModel:
    """Quantum duration: ``overhead_ms + tokens x ms_per_token / share``, where share is the
    quantum's fraction of SMs (1 alone on the device; ``1 / shared_slowdown`` beside decode on
    the same SMs)."""

    overhead_ms: float
    ms_per_token: float
    shared_slowdown: float = 1.3

    def duration_ms(self, tokens: int, ft_share: float, mode: LaunchMode) -> float:
        if mode is LaunchMode.AFTER_DECODE:
            share = 1.0
        elif ft_share >= 1.0:
            share = 1.0 / self.shared_slowdown
        else:
            share = ft_share
        return self.overhead_ms + tokens * self.ms_per_token / max(share, 1e-3)


@dataclass(frozen=True)
class PrefillCost:
    """Extra ms of an iteration carrying a prefill chunk: per token, compute-bound, so inverse
    to the SM share, plus a fixed cost per such step (host-side launch work of an eager step,
    whatever the share)."""

    ms_per_token_full: float = 0.025
    fixed_ms: float = 0.0

    def ms(self, tokens: int, decode_share: float) -> float:
        if tokens <= 0:
            return 0.0
        return self.fixed_ms + tokens * self.ms_per_token_full / decode_share


def fit_truth_from_profile(path: str | Path) -> tuple[OnlineLatencyModel, QuantumCostModel]:
    """Stage-1/2 decode model and quantum cost fitted to a profiler CSV (``predictor_models``
    schema: one row per profiled configuration, ``latency_ms`` the median iteration)."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    model = OnlineLatencyModel(min_samples=4, refit_every=1)
    solo = [r for r in rows if float(r["ft_tokens"]) == 0]
    beside = [r for r in rows if float(r["ft_tokens"]) > 0]
    for row in solo + beside:
        iteration = DecodeIteration(
            int(row["batch_size"]),
            int(float(row["context_tokens_total"])),
            int(float(row["context_tokens_max"])),
            int(float(row["prefill_chunk_tokens"])),
            float(row["decode_sm_share"]),
        )
        quantum = None
        if float(row["ft_tokens"]) > 0:
            quantum = FinetuneQuantum(
                int(float(row["ft_tokens"])),
                int(float(row["ft_seq_len"])),
                int(float(row["ft_lora_rank"])),
                float(row["ft_backward"]) > 0,
                float(row["ft_sm_share"]),
            )
        model.observe(iteration, quantum, float(row["latency_ms"]))
    points = [
        (float(r["ft_tokens"]) / float(r["ft_sm_share"]), float(r["ft_quantum_ms_colocated"]))
        for r in beside
        if float(r["ft_backward"]) > 0 and r["ft_quantum_ms_colocated"]
    ]
    if len(points) < 2:
        raise ValueError(f"{path}: fewer than two backward quanta to fit a cost model")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
        (x - mean_x) ** 2 for x, _ in points
    )
    return model, QuantumCostModel(
        overhead_ms=max(mean_y - slope * mean_x, 0.0), ms_per_token=slope
    )


@dataclass
class _Request:
    request_id: str
    arrival: float
    prompt: int
    output: int
    computed: int = 0
    generated: int = 0
    first: float | None = None
    last: float | None = None


@dataclass
class SimulatedHost:
    """Runs one policy over a trace on a fake clock (see the module docstring)."""

    truth: DecodeLatencyModel
    quanta: QuantumCostModel
    total_sms: int = 132
    decode_sms_options: tuple[int, ...] = (32, 48, 64, 80, 96, 112, 132)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    prefill: PrefillCost = field(default_factory=PrefillCost)
    noise_sigma: float = 0.05
    host_overhead_ms: float = 0.4
    launch_host_ms: float = 0.0
    """Host time to launch one concurrent quantum, spent before the decode step (the iteration
    takes launch + step), or, with ``launch_during_decode``, beside it (max(launch, step)), as
    ``HostLoop(launch_during_decode=...)`` orders them. The quantum's device work starts at the
    iteration's start either way (its kernels are issued as the launch proceeds)."""
    launch_during_decode: bool = LAUNCH_DURING_DECODE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.launch_host_ms < 0:
            raise ValueError(f"launch_host_ms must be >= 0, got {self.launch_host_ms}")

    def run(
        self,
        policy: CoLocationPolicy,
        trace: list[tuple[float, int, int]],
        duration_s: float,
        tpot_slo_ms: float,
        job: JobView | None,
        drain_s: float = 0.0,
    ) -> list[IterationRecord]:
        """``trace``: (arrival s, prompt tokens, output tokens) in arrival order. Arrivals for
        ``duration_s``, then up to ``drain_s`` more while requests are still decoding."""
        if drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {drain_s}")
        rng = random.Random(self.seed)
        t = 0.0
        pending = [  # arrivals after the window are not part of the run
            _Request(f"r{i}", a, p, o) for i, (a, p, o) in enumerate(trace) if a < duration_s
        ]
        waiting: list[_Request] = []
        running: list[_Request] = []
        flight: tuple[InFlightQuantum, float, LaunchMode] | None = None
        records: list[IterationRecord] = []
        while t < duration_s or (t < duration_s + drain_s and (running or waiting)):
            while pending and pending[0].arrival <= t:
                waiting.append(pending.pop(0))
            reports: list[QuantumReport] = []
            if flight is not None and flight[1] <= t:
                done, end, mode = flight
                reports.append(
                    QuantumReport(
                        done.job_id,
                        done.max_tokens,
                        (end - done.started_at) * 1e3,
                        mode,
                        done.decode_sms,
                    )
                )
                flight = None
            decode, prefill_plan = self._schedule(running, waiting)
            views = _running_views(running)
            ctx = IterationContext(
                now=t,
                decode=decode,
                total_sms=self.total_sms,
                decode_sms_options=self.decode_sms_options,
                spatial=True,
                jobs=(job,) if job is not None else (),
                in_flight=flight[0] if flight else None,
                finetune_budget_bytes=None,
                tpot_slo_ms=tpot_slo_ms,
                worst_running_tpot_ms=max((r.tpot_ms for r in views), default=None),
                running=views,
            )
            plan = policy.plan(ctx)
            validate_plan(plan, ctx)
            d = plan.decode_sms or self.total_sms
            share = d / self.total_sms
            launch_ms = 0.0
            for launch in plan.launches:
                if launch.mode is LaunchMode.CONCURRENT:
                    launch_ms += self.launch_host_ms
                    ms = self.quanta.duration_ms(launch.max_tokens, _ft_share(share), launch.mode)
                    flight = (
                        InFlightQuantum(launch.job_id, launch.max_tokens, plan.decode_sms, t),
                        t + ms / 1e3,
                        launch.mode,
                    )
            if decode.is_idle:
                nxt = min(
                    [t + 0.002]
                    + ([flight[1]] if flight else [])
                    + ([pending[0].arrival] if pending else [])
                )
                nxt = max(nxt, t + launch_ms / 1e3)  # the launch holds the host all the same
                observed = 0.0
            else:
                beside = None
                if flight is not None:
                    ft_share = _ft_share((flight[0].decode_sms or self.total_sms) / self.total_sms)
                    beside = FinetuneQuantum(flight[0].max_tokens, 256, 16, True, ft_share)
                base = (
                    DecodeSnapshot.from_contexts(
                        [r.prompt + r.generated for r in running if r.computed >= r.prompt]
                    )
                    if decode.batch_size
                    else None
                )
                if base is not None:
                    ms = self.truth.predict_ms(decode_iteration(base, share), beside)
                else:
                    ms = self.truth.predict_ms(DecodeIteration(1, 1, 1, 0, share), beside)
                ms += self.prefill.ms(decode.prefill_tokens, share)
                step = ms * math.exp(rng.gauss(0.0, self.noise_sigma))
                host = max(step, launch_ms) if self.launch_during_decode else step + launch_ms
                observed = host + self.host_overhead_ms
                nxt = t + observed / 1e3
            emit = nxt  # tokens exist once the decode step is done; a slice comes after
            for launch in plan.launches:
                if launch.mode is LaunchMode.AFTER_DECODE:
                    ms = self.quanta.duration_ms(launch.max_tokens, 1.0, launch.mode)
                    observed += ms
                    nxt += ms / 1e3
                    reports.append(
                        QuantumReport(
                            launch.job_id, launch.max_tokens, ms, launch.mode, plan.decode_sms
                        )
                    )
            samples, finished, tokens = self._advance(running, prefill_plan, emit)
            record = IterationRecord(
                index=len(records),
                timestamp=t,
                policy=policy.name,
                decode_batch=decode.batch_size,
                prefill_tokens=decode.prefill_tokens,
                context_tokens_total=decode.context_tokens_total,
                context_tokens_max=decode.context_tokens_max,
                decode_tokens=tokens,
                observed_ms=observed,
                iteration_ms=(nxt - t) * 1e3,
                predicted_ms=plan.predicted_ms,
                predicted_solo_ms=plan.predicted_solo_ms,
                margin=plan.margin,
                decode_sms=plan.decode_sms,
                total_sms=self.total_sms,
                finetune_launched=plan.launches,
                finetune_tokens=sum(r.tokens for r in reports),
                quanta=tuple(reports),
                memory_lent_bytes=None,
                tpot_samples_ms=tuple(samples),
                finished=tuple(finished),
                paused=plan.paused,
                note=plan.note,
                in_flight=flight is not None,
                beside_tokens=flight[0].max_tokens if flight else 0,
                beside_decode_sms=flight[0].decode_sms if flight else None,
                plan_memo=plan.memo,
            )
            records.append(record)
            policy.observe(record)
            t = nxt
        return records

    def _schedule(
        self, running: list[_Request], waiting: list[_Request]
    ) -> tuple[DecodeSnapshot, list[tuple[_Request, int]]]:
        """Admit and chunk like the engine; returns the snapshot and (request, tokens) chunks."""
        decoding = [r for r in running if r.computed >= r.prompt]
        budget = self.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[_Request, int]] = []
        for r in running:
            if r.computed < r.prompt and budget > 0:
                n = min(r.prompt - r.computed, budget)
                chunks.append((r, n))
                budget -= n
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            r = waiting.pop(0)
            running.append(r)
            n = min(r.prompt, budget)
            chunks.append((r, n))
            budget -= n
        snapshot = DecodeSnapshot.from_contexts(
            [r.prompt + r.generated for r in decoding], sum(n for _, n in chunks), len(waiting)
        )
        return snapshot, chunks

    def _advance(
        self, running: list[_Request], chunks: list[tuple[_Request, int]], t: float
    ) -> tuple[list[float], list[FinishedRequest], int]:
        samples: list[float] = []
        finished: list[FinishedRequest] = []
        emitted = 0
        chunked = {id(r): n for r, n in chunks}
        for r in list(running):
            if r.computed >= r.prompt:
                r.generated += 1
                emitted += 1
                if r.last is not None:
                    samples.append((t - r.last) * 1e3)
                r.last = t
            elif id(r) in chunked:
                r.computed += chunked[id(r)]
                if r.computed >= r.prompt:
                    r.generated, r.first, r.last = 1, t, t
                    emitted += 1
            if r.generated >= r.output:
                running.remove(r)
                tpot = None
                if r.generated > 1 and r.first is not None and r.last is not None:
                    tpot = (r.last - r.first) * 1e3 / (r.generated - 1)
                ttft = None if r.first is None else (r.first - r.arrival) * 1e3
                finished.append(FinishedRequest(r.request_id, r.generated, tpot, ttft, "length"))
        return samples, finished, emitted


def _running_views(running: list[_Request]) -> tuple[RunningRequest, ...]:
    return tuple(
        RunningRequest(
            r.generated, (r.last - r.first) * 1e3 / (r.generated - 1), r.output - r.generated
        )
        for r in running
        if r.generated >= MIN_TOKENS_FOR_TPOT and r.first is not None and r.last is not None
    )


def _ft_share(decode_share: float) -> float:
    return 1.0 if decode_share >= 1.0 else 1.0 - decode_share
