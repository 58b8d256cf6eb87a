"""Prometheus metrics of the web process: Django's requests, the inference gateway's, and job
counts read at scrape time; `GET /metrics` serves them.

- `RequestMetricsMiddleware` (first in `MIDDLEWARE`) times every Django request into
  `harli_http_request_duration_seconds` by route (the URL pattern, never the path: ids would
  make a series each), method and status class; the gateway (`api.gateway.app`), which answers
  `/v1/completions` and `/v1/chat/completions` outside Django, times its own into the same
  histogram and counts each inference request by tenant, model and outcome
  (`inference_observe`).
- `harli_jobs{status}` and `harli_hosts{status}` are one `GROUP BY` each, run per scrape.
- Several uvicorn workers: with `PROMETHEUS_MULTIPROC_DIR` set (before prometheus-client is
  imported, so in the unit's environment), every worker writes its samples under that directory
  and a scrape of any one sums them all (`MultiProcessCollector`). The directory must be empty
  when the workers start (the web unit's `RuntimeDirectory` is a fresh one each start).
- Access: a scrape carries `Authorization: Bearer <HARLI_METRICS_TOKEN>` (else 401). Without a
  token set, `/metrics` answers 404, except under `METRICS_OPEN` (local settings).

`METRIC_NAMES` lists every family exported here (the dashboard test reads it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from django.conf import settings
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.errors import error_body
from gpu_runtime.contract.metrics_scrape import bearer_matches, process_exposition

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

HTTP_REQUEST_DURATION = Histogram(
    "harli_http_request_duration_seconds",
    "Web requests, from arrival to the last byte of the answer, by route, method and status "
    "class (2xx, 4xx, ...).",
    ["route", "method", "status_class"],
    buckets=LATENCY_BUCKETS_S,
)
INFERENCE_REQUESTS = Counter(
    "harli_gateway_inference_requests",
    "Inference requests through the gateway, by tenant, model and outcome.",
    ["tenant", "model", "outcome"],
)
INFERENCE_TOKENS = Counter(
    "harli_gateway_inference_tokens",
    "Tokens of inference requests through the gateway, by tenant, model and kind (prompt, "
    "completion).",
    ["tenant", "model", "kind"],
)
GATEWAY_OUTCOMES = (
    "ok", "invalid_request", "unauthenticated", "model_not_found", "rate_limited",
    "upstream_error", "cancelled",
)  # fmt: skip
"""Outcomes of a gateway request (`inference_observe`)."""

METRIC_NAMES: frozenset[str] = frozenset(
    {
        "harli_http_request_duration_seconds",
        "harli_gateway_inference_requests_total",
        "harli_gateway_inference_tokens_total",
        "harli_jobs",
        "harli_hosts",
    }
)


def status_class(status: int) -> str:
    return f"{status // 100}xx"


def http_observe(route: str, method: str, status: int, seconds: float) -> None:
    HTTP_REQUEST_DURATION.labels(route, method, status_class(status)).observe(seconds)


def inference_observe(
    *, tenant: str, model: str, outcome: str, prompt_tokens: int, completion_tokens: int
) -> None:
    """One gateway inference request ended (`GATEWAY_OUTCOMES`); `tenant` and `model` are ""
    when the request did not get as far as naming them (refused before authentication or
    before the model resolved)."""
    INFERENCE_REQUESTS.labels(tenant, model, outcome).inc()
    if prompt_tokens:
        INFERENCE_TOKENS.labels(tenant, model, "prompt").inc(prompt_tokens)
    if completion_tokens:
        INFERENCE_TOKENS.labels(tenant, model, "completion").inc(completion_tokens)


class RequestMetricsMiddleware:
    """Times each Django request into `harli_http_request_duration_seconds`; the route is the
    matched URL pattern (`unmatched` for a 404 no pattern matched)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        route = f"/{match.route}" if match is not None and match.route else "unmatched"
        http_observe(route, request.method or "", response.status_code,
                     time.perf_counter() - started)  # fmt: skip
        return response


class _StatusCounts(Collector):
    """Jobs and hosts by status, counted when scraped."""

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily("harli_jobs", "Finetune jobs by status."),
                GaugeMetricFamily("harli_hosts", "GPU hosts by status.")]  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        from api.models import FinetuneJob, GpuHost, JobStatus
        from api.models.fleet import HostStatus

        for name, text, model, choices in (
            ("harli_jobs", "Finetune jobs by status.", FinetuneJob, JobStatus),
            ("harli_hosts", "GPU hosts by status.", GpuHost, HostStatus),
        ):
            rows = model.objects.order_by().values_list("status").annotate(n=Count("pk"))
            counts = {status: 0 for status in choices.values} | dict(rows)
            family = GaugeMetricFamily(name, text, labels=["status"])
            for status, count in sorted(counts.items()):
                family.add_metric([status], count)
            yield family


def exposition() -> bytes:
    """Every metric of this process (of every worker, in multiprocess mode), then the counts."""
    own = process_exposition(settings.PROMETHEUS_MULTIPROC_DIR)
    counts = CollectorRegistry(auto_describe=True)
    counts.register(_StatusCounts())
    return own + generate_latest(counts)


@never_cache
def metrics(request: HttpRequest) -> HttpResponse:
    """`GET /metrics` (see the module docstring for who may scrape it)."""
    token = settings.METRICS_TOKEN
    if not token and not settings.METRICS_OPEN:
        return _error(404, "Not found.", "not_found")
    if token:
        if not bearer_matches(request.headers.get("Authorization"), token):
            return _error(401, "Incorrect or missing metrics token.", "invalid_api_key")
    if request.method != "GET":
        return _error(405, "Use GET for /metrics.", "method_not_allowed")
    return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)


def _error(status: int, message: str, code: str) -> HttpResponse:
    body = error_body(message, type_="invalid_request_error", param=None, code=code)
    return JsonResponse(body, status=status)
