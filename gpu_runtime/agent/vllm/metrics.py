"""vLLM's Prometheus `/metrics` as the host's figures.

`parse_scrape` reads the text format (prometheus_client's parser) into a `VllmScrape`: the
latency histograms (TTFT; per-token TPOT, `vllm:inter_token_latency_seconds` or the older
`vllm:time_per_output_token_seconds`; per-request mean TPOT), request and token counters,
running/waiting gauges, KV cache usage and the KV block count, the LoRA adapters running.
Series are summed over their labels (one engine, one served model).

Histograms are cumulative since vLLM started; an interval's figures come from the difference of
two scrapes (`Histogram.minus`). A process that restarted has smaller counts than the scrape
before: the newer scrape is then taken whole (what the new process observed). Quantiles
interpolate linearly inside the bucket holding the rank (Prometheus's `histogram_quantile`),
so they are exact only to the bucket's width; the share within an SLO counts the observations
in buckets whose upper bound is at most the SLO, exact when the SLO is a bucket bound and a
lower bound otherwise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

TTFT = ("vllm:time_to_first_token_seconds",)
TOKEN_TPOT = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
REQUEST_TPOT = ("vllm:request_time_per_output_token_seconds",)
ITERATION_TOKENS = ("vllm:iteration_tokens_total",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (ascending, +Inf last), with count and sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    total: float

    def minus(self, older: Histogram | None) -> Histogram:
        """The observations since `older` (all of them when `older` is None, has other
        buckets, or counts more: a restarted process)."""
        if older is None or older.bounds != self.bounds or older.count > self.count:
            return self
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, older.cumulative, strict=True)),
            self.count - older.count,
            self.total - older.total,
        )

    def quantile(self, q: float) -> float | None:
        """The q-quantile (0..1) by linear interpolation in its bucket; None when empty. The
        +Inf bucket answers its lower bound."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower

    def share_at_most(self, limit: float) -> float | None:
        """The share of observations in buckets bounded by `limit` or less; None when empty."""
        if self.count <= 0:
            return None
        within = 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if bound <= limit:
                within = cumulative
        return within / self.count

    def spread(self, scale: float = 1.0) -> list[float]:
        """One value per observation (times `scale`), spaced evenly inside its bucket (the
        +Inf bucket's at its lower bound): a list whose percentiles match `quantile`'s to the
        bucket's width."""
        values: list[float] = []
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            n = int(round(cumulative - below))
            top = lower if math.isinf(bound) else bound
            values += [(lower + (top - lower) * (i + 0.5) / n) * scale for i in range(n)]
            lower, below = bound, cumulative
        return values


@dataclass(frozen=True)
class VllmScrape:
    """One scrape of vLLM's `/metrics` (see the module docstring)."""

    at: float
    """When it was taken (monotonic seconds)."""
    ttft: Histogram | None
    token_tpot: Histogram | None
    request_tpot: Histogram | None
    iterations: float
    """Engine steps so far (the count of `vllm:iteration_tokens_total`)."""
    running: int
    waiting: int
    kv_usage: float | None
    """Share of the KV cache's blocks in use, 0..1."""
    kv_blocks: int | None
    """KV blocks of the cache (`vllm:cache_config_info`'s `num_gpu_blocks`)."""
    generation_tokens: float
    prompt_tokens: float
    finished_requests: float
    running_adapters: tuple[str, ...]
    max_loras: int | None


def _histograms(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Histogram]:
    buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, float] = defaultdict(float)
    sums: dict[str, float] = defaultdict(float)
    for name, labels, value in samples:
        if name.endswith("_bucket") and "le" in labels:
            buckets[name[: -len("_bucket")]][float(labels["le"])] += value
        elif name.endswith("_count"):
            counts[name[: -len("_count")]] += value
        elif name.endswith("_sum"):
            sums[name[: -len("_sum")]] += value
    return {
        name: Histogram(
            tuple(sorted(by_bound)),
            tuple(by_bound[b] for b in sorted(by_bound)),
            counts.get(name, 0.0),
            sums.get(name, 0.0),
        )
        for name, by_bound in buckets.items()
    }


def parse_scrape(text: str, at: float) -> VllmScrape:
    """`text` (the Prometheus text format) as a `VllmScrape` taken at `at`."""
    samples = [
        (sample.name, dict(sample.labels), float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]
    histograms = _histograms(samples)
    plain: dict[str, float] = defaultdict(float)
    labels_of: dict[str, dict[str, str]] = {}
    latest: dict[str, float] = {}
    for name, labels, value in samples:
        plain[name] += value
        if name.endswith("_info") and value >= latest.get(name, float("-inf")):
            labels_of[name], latest[name] = labels, value  # info series: the newest wins

    def first(names: tuple[str, ...]) -> Histogram | None:
        return next((histograms[n] for n in names if n in histograms), None)

    iterations = first(ITERATION_TOKENS)
    kv_usage = next((plain[n] for n in KV_USAGE if n in plain), None)
    cache = labels_of.get("vllm:cache_config_info", {})
    lora = labels_of.get("vllm:lora_requests_info", {})
    running_adapters = tuple(a for a in lora.get("running_lora_adapters", "").split(",") if a)
    return VllmScrape(
        at=at,
        ttft=first(TTFT),
        token_tpot=first(TOKEN_TPOT),
        request_tpot=first(REQUEST_TPOT),
        iterations=iterations.count if iterations else 0.0,
        running=int(plain.get("vllm:num_requests_running", 0)),
        waiting=int(plain.get("vllm:num_requests_waiting", 0)),
        kv_usage=kv_usage,
        kv_blocks=int(cache["num_gpu_blocks"]) if cache.get("num_gpu_blocks") else None,
        generation_tokens=plain.get("vllm:generation_tokens_total", 0.0),
        prompt_tokens=plain.get("vllm:prompt_tokens_total", 0.0),
        finished_requests=plain.get("vllm:request_success_total", 0.0),
        running_adapters=running_adapters,
        max_loras=int(lora["max_lora"]) if lora.get("max_lora") else None,
    )


def hist_delta(new: Histogram | None, old: Histogram | None) -> Histogram | None:
    return new.minus(old) if new is not None else None


def counter_delta(new: float, old: float | None) -> float:
    """`new - old`, or `new` after a restart (the counter went back)."""
    return new if old is None or new < old else new - old
