"""Calibration and policy choices of ``bench/colocate/run.py``: the stage-1/2 model fitted from a
calibration trace (`calibrate`), the trained artifact's check (`predictor_check`), the TPOT SLO
from decode_only's runs (`tpot_slo`), the static split per trace (`choose_static_split`) and
the policies themselves (`make_policy`)."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from bench.colocate.backends import BASELINE_MAX_EXAMPLES, QUANTUM_EXAMPLES, Backend
from bench.colocate.report import request_tpots
from bench.common.traces import generate, preset
from gpu_runtime.colocation import (
    CoLocationPolicy,
    DecodeOnlyPolicy,
    HarliConfig,
    HarliPolicy,
    IterationRecord,
    LaunchMode,
    NaivePolicy,
    OnlineLatencyModel,
    StaticSplitPolicy,
    TimeSlicePolicy,
    summarize,
)
from gpu_runtime.colocation.calibration import CalibrationPolicy
from gpu_runtime.colocation.latency_model import DecodeLatencyModel, decode_iteration
from gpu_runtime.colocation.online import beside_quantum
from gpu_runtime.colocation.types import DecodeSnapshot, FinishedRequest


def calibrate(
    backend: Backend,
    seconds: float,
    warm_s: float,
    ft_seq_len: int,
    lora_rank: int,
    quantum_examples: tuple[int, ...] = QUANTUM_EXAMPLES,
) -> tuple[OnlineLatencyModel, list[IterationRecord], dict[str, Any]]:
    """Fit Harli's stage-1/2 model from a separate seeded high-load trace driven by
    `CalibrationPolicy`: decode alone on the least-sampled split, then quanta of each of
    `quantum_examples` beside decode on the least-sampled split, until every split has its
    samples or ``seconds`` passed. Before it, a discarded warm-up of ``warm_s`` s uses every
    split's streams once (prefill, decode and a quantum), so first-use costs do not land in the
    samples."""
    info: dict[str, Any] = {}
    wall = time.perf_counter()
    if warm_s > 0:
        warm = CalibrationPolicy(
            solo_target=2, beside_target=1, solo_s=warm_s / 2, quantum_examples=(1,)
        )
        spec = preset("high", duration_s=warm_s)
        got, s, e = backend.run(
            warm, generate(spec, seed=998), warm_s, 1e9, True, stop=lambda _: warm.done
        )
        info["warmup"] = {"seconds": round(e - s, 2), "iterations": len(got), **warm.counts()}
    model = OnlineLatencyModel(min_samples=6)
    policy = CalibrationPolicy(
        solo_target=40, beside_target=24, solo_s=seconds * 0.5, quantum_examples=quantum_examples
    )
    spec = preset("high", duration_s=seconds)
    records, s, e = backend.run(
        policy, generate(spec, seed=999), seconds, 1e9, True, stop=lambda _: policy.done
    )
    records = [r for r in records if not r.note.endswith("settle")]  # just after a split move
    for record in records:
        model.observe_record(record, ft_seq_len, lora_rank)
    choices: list[int | None] = list(backend.choices) or [None]
    total = backend.total_sms or 1
    busy = [r for r in records if r.decode_batch or r.prefill_tokens]
    per_split: dict[str, Any] = {}
    for d in choices:
        solo = [r.iteration_ms for r in busy if r.decode_sms == d and not r.beside_tokens]
        beside = [r.iteration_ms for r in busy if r.beside_decode_sms == d and r.beside_tokens]
        share = (d or total) / total
        per_split[str(d)] = {
            **policy.counts().get(str(d), {}),
            "solo_iteration_ms_median": round(statistics.median(solo), 2) if solo else None,
            "beside_iteration_ms_median": round(statistics.median(beside), 2) if beside else None,
            "fitted": round(share, 4) in model.fitted_shares,
            "interference": model.interference_ratio(share, d is not None and d < total),
        }
    unfitted = [k for k, v in per_split.items() if not v["fitted"]]
    info.update(
        {
            "seconds": round(e - s, 2),
            "wall_s": round(time.perf_counter() - wall, 2),
            "iterations": len(records),
            "busy_iterations": len(busy),
            "targets_met": policy.done,
            "per_split": per_split,
            "fitted_splits": model.fitted_shares,
            "fits": model.describe(),
            "pooled_fit": model.pooled,
        }
    )
    if unfitted:
        info["note"] = (
            f"splits {unfitted} got fewer than {model.min_samples} solo samples in "
            f"{e - s:.1f} s ({len(busy)} busy iterations of {len(records)}): "
            + (
                "predicted by the fit pooled over all splits"
                if model.pooled
                else "NOTHING FITTED: decode_only's runs are added to the model below"
            )
        )
    return model, records, info


def predictor_check(
    artifact: Any, online: OnlineLatencyModel, runs: list[list[IterationRecord]]
) -> dict[str, Any]:
    """Stage-1 error of the trained artifact and of the in-run model on decode_only's iterations
    (held out from calibration), overall and on iterations without prefill (the artifact was
    trained on decode steps without prefill chunks); and the artifact's cost per call."""
    rows = [
        (
            decode_iteration(
                DecodeSnapshot(
                    r.decode_batch, r.context_tokens_total, r.context_tokens_max, r.prefill_tokens
                ),
                1.0,
            ),
            r.iteration_ms,
        )
        for run in runs
        for r in run
        if r.decode_batch
    ][:2000]
    if not rows:
        return {"error": "no decode_only iteration"}
    t0 = time.perf_counter()
    trained = [float(artifact.predict_ms(it, None)) for it, _ in rows]
    per_call_us = (time.perf_counter() - t0) / len(rows) * 1e6
    fitted = [online.predict_ms(it, None) for it, _ in rows]

    def mape(pred: list[float], keep: list[bool]) -> float | None:
        errs = [
            abs(p - ms) / ms
            for p, (_, ms), k in zip(pred, rows, keep, strict=True)
            if k and math.isfinite(p)
        ]
        return round(statistics.mean(errs), 4) if errs else None

    every = [True] * len(rows)
    plain = [it.prefill_chunk_tokens == 0 for it, _ in rows]
    return {
        "iterations": len(rows),
        "without_prefill": sum(plain),
        "artifact_mape": mape(trained, every),
        "artifact_mape_without_prefill": mape(trained, plain),
        "online_mape": mape(fitted, every),
        "online_mape_without_prefill": mape(fitted, plain),
        "observed_ms_median": round(statistics.median(ms for _, ms in rows), 3),
        "artifact_ms_median": round(statistics.median(p for p in trained if math.isfinite(p)), 3)
        if any(math.isfinite(p) for p in trained)
        else None,
        "online_ms_median": round(statistics.median(fitted), 3),
        "artifact_nonfinite": sum(not math.isfinite(p) for p in trained),
        "artifact_us_per_call": round(per_call_us, 1),
    }


def tpot_slo(
    decode_only: dict[str, tuple[list[IterationRecord], float, float, list[FinishedRequest]]],
    slo_parts: dict[str, float],
    *,
    slo_factor: float,
    slo_headroom: float,
    slo_rule: str,
    fixed_ms: float | None = None,
) -> tuple[float, str | None]:
    """The TPOT SLO from decode_only's runs per trace (records, start, end, still running):
    ``slo_parts`` must hold ``factor_x_medium_p50``; it gains ``attainable`` (``slo_headroom`` x
    the slowest request decode_only served on any trace; a window finishes tens of requests:
    their p99 is their maximum anyway) and, when medium's p50 looks suspect, the median-based
    part. With ``fixed_ms`` the SLO is that (the parts are still computed; ``fixed`` joins
    them). Returns (SLO ms, the flag saying why medium's p50 was replaced, or None)."""
    worst = [max(tpots) for v in decode_only.values() if (tpots := request_tpots(v[0], v[3]))]
    if worst:
        slo_parts["attainable"] = slo_headroom * max(worst)
    slo_ms = slo_parts["factor_x_medium_p50"]
    p50s = {
        trace: m.tpot_ms_p50
        for trace, v in decode_only.items()
        if (m := summarize(v[0], 1e9, start=v[1], end=v[2])).tpot_ms_p50 is not None
    }
    flag = None
    if "high" in p50s and slo_ms > 3 * p50s["high"]:  # p50 on medium above high's: suspect
        flag = (
            f"1.5 x medium p50 ({slo_ms:.1f} ms) > 3 x decode_only's high-load p50 "
            f"({p50s['high']:.1f} ms): medium p50 replaced by the median of the traces' p50s"
        )
        slo_ms = slo_factor * statistics.median(p50s.values())
        slo_parts["factor_x_median_p50"] = slo_ms
    if slo_rule == "attainable" and "attainable" in slo_parts:
        slo_ms = max(slo_ms, slo_parts["attainable"])
    if fixed_ms is not None:
        slo_parts["fixed"] = slo_ms = fixed_ms
    return slo_ms, flag


def choose_static_split(
    model: DecodeLatencyModel,
    backend: Backend,
    runs: list[list[IterationRecord]],
    slo_ms: float,
    ft_tokens: int,
    ft_seq_len: int,
    rank: int,
) -> int | None:
    """The smallest split under which >= 99% of decode_only's requests on ``runs`` would keep
    their predicted mean TPOT within 0.95 x SLO with a ``ft_tokens`` quantum always beside
    decode: each finished request's TPOT is the mean of the predicted co-run times of the busy
    iterations it decoded in (its last ``output_tokens`` busy iterations). None: no splits;
    the largest split when none qualifies."""
    if not backend.choices or backend.total_sms is None:
        return None
    total = backend.total_sms
    choices = backend.choices
    for d in choices[:-1]:
        quantum = beside_quantum(ft_tokens, d, total, ft_seq_len, rank)
        met = judged = 0
        for run in runs:
            predicted: list[float] = []
            for r in run:
                if not (r.decode_batch or r.prefill_tokens):
                    continue
                snap = DecodeSnapshot(
                    r.decode_batch, r.context_tokens_total, r.context_tokens_max, r.prefill_tokens
                )
                predicted.append(model.predict_ms(decode_iteration(snap, d / total), quantum))
                for f in r.finished:
                    span = predicted[-max(f.output_tokens - 1, 1) :]
                    judged += 1
                    met += sum(span) / len(span) <= 0.95 * slo_ms
        if judged and met / judged >= 0.99:
            return int(d)
    return int(choices[-2]) if len(choices) > 1 else None


def make_policy(
    name: str,
    harli_latency: DecodeLatencyModel,
    static_d: int | None,
    harli_config: HarliConfig,
    calib_records: list[IterationRecord],
) -> CoLocationPolicy:
    if name == "decode_only":
        return DecodeOnlyPolicy()
    if name == "naive":
        return NaivePolicy(quantum_examples=BASELINE_MAX_EXAMPLES)
    if name == "time_slice":
        return TimeSlicePolicy(
            harli_latency,
            margin=0.1,
            max_quantum_examples=BASELINE_MAX_EXAMPLES,
            idle_quantum_examples=BASELINE_MAX_EXAMPLES,
        )
    if name == "static_split":
        return StaticSplitPolicy(static_d, quantum_examples=2)
    harli = HarliPolicy(harli_latency, harli_config)
    for record in calib_records:  # quanta timed during calibration seed its duration model
        for q in record.quanta:
            if q.mode is LaunchMode.CONCURRENT and not q.error:
                harli.durations.observe(q.decode_sms, q.mode, q.tokens, q.duration_ms)
    return harli
