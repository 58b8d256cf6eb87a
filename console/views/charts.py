"""Chart data endpoints: one JSON document per chart, polled by the live-refresh module.

`GET .../charts/<scope>/<chart>?range=15m|1h|6h|24h` answers `console.charts.ChartPayload`
as JSON; an unknown chart, deployment or job is a 404 and an unknown range a 400, both with the
API's error body (`{"error": {"message", ...}}`) that the page shows inline.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone

from api.errors import HarliError, error_body
from api.models import Deployment, FinetuneJob, GpuHost, Tenant
from console import charts
from console.access import OperatorJsonView
from console.charts import ChartPayload
from console.selectors import parse_range

FLEET_CHARTS: dict[str, Callable[..., ChartPayload]] = {
    "memory": charts.fleet_memory,
    "finetune": charts.fleet_finetune,
    "attainment": charts.fleet_attainment,
}
DEPLOYMENT_CHARTS: dict[str, Callable[..., ChartPayload]] = {
    "tpot": charts.deployment_tpot,
    "attainment": charts.deployment_attainment,
    "goodput": charts.deployment_goodput,
    "iteration": charts.deployment_iteration,
}
HOST_CHARTS: dict[str, Callable[..., ChartPayload]] = {
    "memory": charts.host_memory,
    "finetune": charts.host_finetune,
}
JOB_CHARTS: dict[str, Callable[..., ChartPayload]] = {
    "loss": charts.job_loss,
    "throughput": charts.job_throughput,
}
# A tenant's usage charts cover the last day, whatever the page's range.
TENANT_CHARTS: dict[str, str] = {"tokens-per-minute": "1m", "tokens-per-hour": "1h"}
PREDICTOR_CHARTS: dict[str, Callable[..., ChartPayload]] = {
    "scatter": charts.predictor_scatter,
}


def _not_found(message: str) -> JsonResponse:
    return JsonResponse(error_body(message, type_="invalid_request_error"), status=404)


def _answer(payload: ChartPayload) -> JsonResponse:
    response = JsonResponse(payload.as_json())
    response["Cache-Control"] = "no-store"
    return response


class _RangedChartView(OperatorJsonView):
    def ranged_answer(
        self, request: HttpRequest, build: Callable[..., ChartPayload], **scope: object
    ) -> JsonResponse:
        """`build(since=..., **scope)` over the requested window; an unknown range is a 400."""
        try:
            since = timezone.now() - parse_range(request.GET.get("range"))
        except HarliError as exc:
            return JsonResponse(exc.body(), status=exc.http_status)
        return _answer(build(since=since, **scope))


class FleetChartView(_RangedChartView):
    def get(self, request: HttpRequest, chart: str) -> HttpResponse:
        if chart not in FLEET_CHARTS:
            return _not_found(f"No fleet chart named {chart!r}.")
        return self.ranged_answer(request, FLEET_CHARTS[chart])


class DeploymentChartView(_RangedChartView):
    def get(self, request: HttpRequest, name: str, chart: str) -> HttpResponse:
        if chart not in DEPLOYMENT_CHARTS:
            return _not_found(f"No deployment chart named {chart!r}.")
        deployment = Deployment.objects.filter(name=name).first()
        if deployment is None:
            return _not_found(f"No deployment named {name!r}.")
        return self.ranged_answer(request, DEPLOYMENT_CHARTS[chart], deployment=deployment)


class HostChartView(_RangedChartView):
    def get(self, request: HttpRequest, name: str, chart: str) -> HttpResponse:
        if chart not in HOST_CHARTS:
            return _not_found(f"No host chart named {chart!r}.")
        host = GpuHost.objects.filter(name=name).first()
        if host is None:
            return _not_found(f"No host named {name!r}.")
        return self.ranged_answer(request, HOST_CHARTS[chart], host=host)


class JobChartView(OperatorJsonView):
    """A job's charts cover its whole history; `range` is ignored."""

    def get(self, request: HttpRequest, job_id: str, chart: str) -> HttpResponse:
        if chart not in JOB_CHARTS:
            return _not_found(f"No job chart named {chart!r}.")
        job = FinetuneJob.objects.filter(pk=job_id).first()
        if job is None:
            return _not_found(f"No fine-tuning job {job_id!r}.")
        return _answer(JOB_CHARTS[chart](job=job))


class TenantChartView(OperatorJsonView):
    """A tenant's tokens per minute or per hour over the last 24 hours; `range` is ignored."""

    def get(self, request: HttpRequest, name: str, chart: str) -> HttpResponse:
        if chart not in TENANT_CHARTS:
            return _not_found(f"No tenant chart named {chart!r}.")
        tenant = Tenant.objects.filter(name=name).first()
        if tenant is None:
            return _not_found(f"No tenant named {name!r}.")
        return _answer(
            charts.tenant_tokens(tenant=tenant, width=TENANT_CHARTS[chart], now=timezone.now())
        )


class PredictorChartView(_RangedChartView):
    def get(self, request: HttpRequest, chart: str) -> HttpResponse:
        if chart not in PREDICTOR_CHARTS:
            return _not_found(f"No predictor chart named {chart!r}.")
        return self.ranged_answer(request, PREDICTOR_CHARTS[chart])
