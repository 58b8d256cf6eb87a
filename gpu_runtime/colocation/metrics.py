"""Per-interval metrics from iteration records (what the host agent reports upwards).

Definitions (used by the host agent, the console and ``bench.colocate`` alike):

* **TPOT sample**: the gap between two consecutive output tokens of one request (first tokens
  excluded: their latency is TTFT). p50/p99 are over the samples of the interval.
* **Request TPOT**: a finished request's mean gap, (last token - first token) / (tokens - 1).
* **SLO attainment**: fraction of requests finished in the interval whose request TPOT is within
  ``tpot_slo_ms`` (requests with one output token have no TPOT and are not counted).
  ``token_slo_attainment`` is the stricter per-sample fraction.
* **Goodput**: output tokens per second of the requests that met the SLO.
* **Finetune tokens/s**: real (unpadded) tokens of quanta completed in the interval, per second.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from gpu_runtime.colocation.types import IterationRecord
from gpu_runtime.contract.statistics import percentile


@dataclass(frozen=True)
class IntervalMetrics:
    """One interval's figures (see the module docstring); None where nothing was measured."""

    start: float
    end: float
    iterations: int
    decode_iterations: int
    tpot_slo_ms: float
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    tpot_samples: int
    finished_requests: int
    slo_attainment: float | None
    token_slo_attainment: float | None
    decode_tokens_per_s: float
    goodput_tokens_per_s: float
    finetune_tokens: int
    finetune_tokens_per_s: float
    finetune_quanta: int
    paused_iterations: int
    memory_lent_bytes_mean: float | None
    memory_lent_bytes_max: int | None
    decode_sm_share_mean: float | None
    prediction_mape: float | None
    """Mean |observed - predicted| / observed of the iterations that had a prediction."""
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    """Time to first token of the requests finished in the interval (p99): quanta that run
    alone on the whole device while decode is idle delay a new request's first token."""

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsAggregator:
    """Collects iteration records and turns them into :class:`IntervalMetrics`.

    Use it as the loop's metrics sink (``loop = HostLoop(..., metrics_sink=agg.add)``) and call
    ``flush(now)`` once per reporting interval; ``summarize(records, ...)`` does the same for a
    finished run.
    """

    def __init__(self, tpot_slo_ms: float, start: float | None = None) -> None:
        if tpot_slo_ms <= 0:
            raise ValueError(f"tpot_slo_ms must be > 0, got {tpot_slo_ms}")
        self.tpot_slo_ms = tpot_slo_ms
        self._records: list[IterationRecord] = []
        self._start = start

    def add(self, record: IterationRecord) -> None:
        """Metrics sink: keep the record for the current interval."""
        if self._start is None:
            self._start = record.timestamp
        self._records.append(record)

    def flush(self, now: float) -> IntervalMetrics:
        """Metrics of the records since the last flush; starts a new interval at ``now``."""
        records, self._records = self._records, []
        start = self._start if self._start is not None else now
        self._start = now
        return summarize(records, self.tpot_slo_ms, start=start, end=now)


def summarize(
    records: Iterable[IterationRecord], tpot_slo_ms: float, *, start: float, end: float
) -> IntervalMetrics:
    """Aggregate ``records`` over the interval [start, end] (seconds of the loop clock)."""
    records = list(records)
    seconds = max(end - start, 1e-9)
    samples: list[float] = []
    request_tpots: list[float] = []
    good_tokens = 0
    decode_tokens = 0
    ttfts: list[float] = []
    for record in records:
        samples.extend(record.tpot_samples_ms)
        decode_tokens += record.decode_tokens
        for finished in record.finished:
            if finished.ttft_ms is not None:
                ttfts.append(finished.ttft_ms)
            if finished.tpot_ms is None:
                continue
            request_tpots.append(finished.tpot_ms)
            if finished.tpot_ms <= tpot_slo_ms:
                good_tokens += finished.output_tokens
    met = sum(1 for t in request_tpots if t <= tpot_slo_ms)
    lent = [r.memory_lent_bytes for r in records if r.memory_lent_bytes is not None]
    shares = [s for s in (r.decode_sm_share for r in records if r.decode_batch) if s is not None]
    errors = [
        abs(r.iteration_ms - r.predicted_ms) / r.iteration_ms
        for r in records
        if r.predicted_ms is not None and r.decode_batch and r.iteration_ms > 0
    ]
    finetune_tokens = sum(r.finetune_tokens for r in records)
    return IntervalMetrics(
        start=start,
        end=end,
        iterations=len(records),
        decode_iterations=sum(1 for r in records if r.decode_batch or r.prefill_tokens),
        tpot_slo_ms=tpot_slo_ms,
        tpot_ms_p50=percentile(samples, 50),
        tpot_ms_p99=percentile(samples, 99),
        tpot_samples=len(samples),
        finished_requests=len(request_tpots),
        slo_attainment=met / len(request_tpots) if request_tpots else None,
        token_slo_attainment=(
            sum(1 for s in samples if s <= tpot_slo_ms) / len(samples) if samples else None
        ),
        decode_tokens_per_s=decode_tokens / seconds,
        goodput_tokens_per_s=good_tokens / seconds,
        finetune_tokens=finetune_tokens,
        finetune_tokens_per_s=finetune_tokens / seconds,
        finetune_quanta=sum(len(r.quanta) for r in records),
        paused_iterations=sum(1 for r in records if r.paused),
        memory_lent_bytes_mean=sum(lent) / len(lent) if lent else None,
        memory_lent_bytes_max=max(lent) if lent else None,
        decode_sm_share_mean=sum(shares) / len(shares) if shares else None,
        prediction_mape=sum(errors) / len(errors) if errors else None,
        ttft_ms_p50=percentile(ttfts, 50),
        ttft_ms_p99=percentile(ttfts, 99),
    )
