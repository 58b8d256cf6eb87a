"""A vLLM host's scrapes as the inputs of the agent's report builders (`agent.reporting`):
`ServingFigures` for the heartbeat, `IntervalMetrics` and `RequestMetrics` for
`deployment_metrics`. Mapping (differences of two scrapes, `vllm.metrics`):

- `running`, `waiting`: vLLM's gauges; `kv_total_pages`: its KV blocks, `kv_free_pages` those
  less `kv_usage` of them; `adapter_slots_total`: `--max-loras`, `adapter_slots_used` and
  `resident_adapters`: the adapters of running requests (vLLM does not export which adapters
  sit in its GPU slots).
- `tpot_p50_ms`, `slo_attainment` (heartbeat, last `SERVING_WINDOW_S`): the per-token TPOT
  histogram's median and its share within the TPOT SLO.
- Interval: `tpot_ms_p50/p99` from the per-token histogram; `slo_attainment` from the
  per-request mean TPOT histogram (`token_slo_attainment` from the per-token one);
  `decode_iterations`: engine steps; `finished_requests`: `request_success`;
  `goodput_tokens_per_s`: generated tokens/s times the request attainment (vLLM does not
  count tokens per request outcome). TTFT: one `RequestMetrics` per TTFT observation, spread
  inside its bucket (`Histogram.spread`), so the builder's percentiles are the histogram's.
"""

from __future__ import annotations

from gpu_runtime.agent.reporting import ServingFigures
from gpu_runtime.agent.vllm.metrics import Histogram, VllmScrape, counter_delta, hist_delta
from gpu_runtime.colocation import IntervalMetrics
from gpu_runtime.server.metrics import RequestMetrics


def _ms(seconds: float | None) -> float | None:
    return seconds * 1e3 if seconds is not None else None


def serving_figures(
    now: VllmScrape, window_start: VllmScrape | None, *, max_loras: int, tpot_slo_ms: float
) -> ServingFigures:
    """The heartbeat's serving figures from the newest scrape and the oldest of the window."""
    blocks = now.kv_blocks or 0
    used = round((now.kv_usage or 0.0) * blocks)
    tpot = hist_delta(now.token_tpot, window_start.token_tpot if window_start else None)
    adapters = now.running_adapters
    return ServingFigures(
        running=now.running,
        waiting=now.waiting,
        kv_free_pages=max(0, blocks - used),
        kv_total_pages=blocks,
        adapter_slots_used=min(len(adapters), max_loras),
        adapter_slots_total=max_loras,
        resident_adapters=adapters,
        tpot_p50_ms=_quantile_ms(tpot, 0.5),
        slo_attainment=_share(tpot, tpot_slo_ms / 1e3),
    )


def _quantile_ms(h: Histogram | None, q: float) -> float | None:
    return _ms(h.quantile(q)) if h is not None else None


def _share(h: Histogram | None, limit: float) -> float | None:
    return h.share_at_most(limit) if h is not None else None


def interval_metrics(
    now: VllmScrape, before: VllmScrape | None, *, tpot_slo_ms: float
) -> IntervalMetrics:
    """The interval between `before` (None: since vLLM started) and `now`."""
    start = before.at if before is not None else now.at
    seconds = max(now.at - start, 1e-9)
    token = hist_delta(now.token_tpot, before.token_tpot if before else None)
    request = hist_delta(now.request_tpot, before.request_tpot if before else None)
    ttft = hist_delta(now.ttft, before.ttft if before else None)
    slo_s = tpot_slo_ms / 1e3
    tokens = counter_delta(now.generation_tokens, before.generation_tokens if before else None)
    attainment = _share(request, slo_s)
    steps = int(counter_delta(now.iterations, before.iterations if before else None))
    return IntervalMetrics(
        start=start,
        end=now.at,
        iterations=steps,
        decode_iterations=steps,
        tpot_slo_ms=tpot_slo_ms,
        tpot_ms_p50=_quantile_ms(token, 0.5),
        tpot_ms_p99=_quantile_ms(token, 0.99),
        tpot_samples=int(token.count) if token else 0,
        finished_requests=int(
            counter_delta(now.finished_requests, before.finished_requests if before else None)
        ),
        slo_attainment=attainment,
        token_slo_attainment=_share(token, slo_s),
        decode_tokens_per_s=tokens / seconds,
        goodput_tokens_per_s=tokens / seconds * (attainment or 0.0),
        finetune_tokens=0,
        finetune_tokens_per_s=0.0,
        finetune_quanta=0,
        paused_iterations=0,
        memory_lent_bytes_mean=None,
        memory_lent_bytes_max=None,
        decode_sm_share_mean=None,
        prediction_mape=None,
        ttft_ms_p50=_quantile_ms(ttft, 0.5),
        ttft_ms_p99=_quantile_ms(ttft, 0.99),
    )


def ttft_requests(now: VllmScrape, before: VllmScrape | None, model: str) -> list[RequestMetrics]:
    """One record per TTFT observed in the interval (its other latencies unknown: TPOT None,
    end-to-end = TTFT), for `deployment_metrics`'s TTFT percentiles."""
    ttft = hist_delta(now.ttft, before.ttft if before else None)
    if ttft is None:
        return []
    return [
        RequestMetrics(f"vllm-{i}", model, 0, 0, value, None, value, None)
        for i, value in enumerate(ttft.spread())
    ]
