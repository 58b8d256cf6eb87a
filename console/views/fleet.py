"""Fleet overview, deployment detail, hosts (drain, return to service), base models and
predictors."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import messages
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect

from api import selectors as api_selectors
from api.errors import HarliError, error_body
from api.models import Deployment, FinetuneJob, GpuHost, HostMetric, HostStatus, JobStatus
from api.services.fleet import host_drain, host_undrain
from console import selectors as console_selectors
from console.access import OperatorJsonView, OperatorView
from console.live import parts_response, render_parts
from console.selectors.engine_groups import (
    group_open_placements,
    host_engine_groups,
    host_gpu_rows,
)
from console.views.common import not_found, page_range, render_page


def _host_rows(hosts: list[GpuHost], latest: dict[int, HostMetric]) -> list[dict[str, object]]:
    """Hosts with their newest fresh metric row (or None), their agent's last heartbeat state
    (`agent`, None before one: engine and capabilities) and their engine groups, each with its
    number of open placements (`jobs`)."""
    jobs = group_open_placements()
    return [
        {
            "host": h,
            "metric": latest.get(h.pk),
            "agent": getattr(h, "agent_state", None),
            "groups": [{"group": g, "jobs": jobs.get(g.pk, 0)} for g in h.engine_groups.all()],
        }
        for h in hosts
    ]


PLACEMENTS_SHOWN = 100

FLEET_PARTS = {
    "kpis": "console/parts/fleet_kpis.html",
    "hosts": "console/parts/fleet_hosts.html",
    "deployments": "console/parts/fleet_deployments.html",
}


def fleet_context(*, since: datetime) -> dict[str, Any]:
    """Everything the fleet page's live parts show, over the window starting at `since`."""
    hosts = list(api_selectors.host_list())
    latest = console_selectors.host_memory_latest()
    summaries = console_selectors.deployment_summaries(since=since)
    job_counts = dict(FinetuneJob.objects.values_list("status").annotate(n=Count("id")).order_by())
    return {
        "host_rows": _host_rows(hosts, latest),
        "hosts_online": sum(1 for h in hosts if h.status == HostStatus.ONLINE),
        "fleet_finetune_tokens_per_s": (
            sum(m.finetune_tokens_per_s for m in latest.values()) if latest else None
        ),
        "summaries": summaries,
        "deployments_meeting": sum(1 for s in summaries if s.meets_target),
        "deployments_reporting": sum(1 for s in summaries if s.meets_target is not None),
        "jobs_running": job_counts.get(JobStatus.RUNNING, 0),
        "jobs_queued": job_counts.get(JobStatus.QUEUED, 0),
    }


class FleetView(OperatorView):
    """Hosts, memory split, harvested finetune throughput and SLO attainment of the fleet."""

    def get(self, request: HttpRequest) -> HttpResponse:
        _, _, since = page_range(request)
        parts = render_parts(request, FLEET_PARTS, fleet_context(since=since))
        return render_page(
            request, "console/fleet.html", {"parts": parts}, section="fleet", ranged=True
        )


class FleetLiveView(OperatorJsonView):
    """The fleet page's live parts, as JSON (see `console.live`)."""

    def get(self, request: HttpRequest) -> HttpResponse:
        _, _, since = page_range(request)
        return parts_response(render_parts(request, FLEET_PARTS, fleet_context(since=since)))


DEPLOYMENT_PARTS = {"kpis": "console/parts/deployment_kpis.html"}


def deployment_context(*, deployment: Deployment, since: datetime) -> dict[str, Any]:
    columns = console_selectors.deployment_series(deployment=deployment, since=since)
    return {
        "deployment": deployment,
        "summary": console_selectors.summarize(deployment=deployment, columns=columns),
    }


class DeploymentView(OperatorView):
    """One deployment: TPOT against its SLO, attainment, goodput, request rate, predictor."""

    def get(self, request: HttpRequest, name: str) -> HttpResponse:
        deployment = Deployment.objects.select_related("base_model").filter(name=name).first()
        if deployment is None:
            return not_found(request, what=f"deployment {name!r}", section="fleet")
        _, _, since = page_range(request)
        context = {
            "deployment": deployment,
            "engine_groups": list(
                deployment.engine_groups.select_related("host").order_by("host__name", "index")
            ),
            "parts": render_parts(
                request,
                DEPLOYMENT_PARTS,
                deployment_context(deployment=deployment, since=since),
            ),
        }
        return render_page(
            request, "console/deployment.html", context, section="fleet", ranged=True
        )


class DeploymentLiveView(OperatorJsonView):
    """The deployment page's live parts, as JSON (see `console.live`)."""

    def get(self, request: HttpRequest, name: str) -> HttpResponse:
        deployment = Deployment.objects.filter(name=name).first()
        if deployment is None:
            return JsonResponse(
                error_body(f"No deployment named {name!r}.", type_="invalid_request_error"),
                status=404,
            )
        _, _, since = page_range(request)
        context = deployment_context(deployment=deployment, since=since)
        return parts_response(render_parts(request, DEPLOYMENT_PARTS, context))


class HostsView(OperatorView):
    """Every host with status, heartbeat, memory and predictor; drain and return-to-service
    buttons."""

    def get(self, request: HttpRequest) -> HttpResponse:
        hosts = list(api_selectors.host_list())
        rows = _host_rows(hosts, console_selectors.host_memory_latest())
        return render_page(request, "console/hosts.html", {"host_rows": rows}, section="hosts")


class HostView(OperatorView):
    """One host: its engine groups (deployment, GPUs, figures, jobs) and GPUs, memory lent and
    reclaimed over time, harvested throughput, its placements."""

    def get(self, request: HttpRequest, name: str) -> HttpResponse:
        host = (
            GpuHost.objects.select_related("agent_state")
            .prefetch_related("engine_groups__deployment")
            .filter(name=name)
            .first()
        )
        if host is None:
            return not_found(request, what=f"host {name!r}", section="hosts")
        latest = console_selectors.host_memory_latest()
        metric = latest.get(host.pk)
        context = {
            "host": host,
            "agent": getattr(host, "agent_state", None),
            "metric": metric,
            "engine_groups": host_engine_groups(host=host),
            "gpus": host_gpu_rows(host=host, metric=metric),
            "placements": list(api_selectors.placement_list(host=host.name)[:PLACEMENTS_SHOWN]),
        }
        return render_page(request, "console/host.html", context, section="hosts", ranged=True)


class HostDrainView(OperatorView):
    """POST: drain a host through `api.services.fleet.host_drain` (as the API does)."""

    def post(self, request: HttpRequest, name: str) -> HttpResponse:
        host = GpuHost.objects.filter(name=name).first()
        if host is None:
            return not_found(request, what=f"host {name!r}", section="hosts")
        try:
            host_drain(host=host)
        except HarliError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"Host {name} is draining: it takes no new jobs.")
        return redirect("console:hosts")


class HostUndrainView(OperatorView):
    """POST: return a draining host to service through `api.services.fleet.host_undrain`."""

    def post(self, request: HttpRequest, name: str) -> HttpResponse:
        host = GpuHost.objects.filter(name=name).first()
        if host is None:
            return not_found(request, what=f"host {name!r}", section="hosts")
        try:
            host = host_undrain(host=host)
        except HarliError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"Host {name} is {host.status}: it takes new jobs again.")
        return redirect("console:hosts")


class BaseModelsView(OperatorView):
    """Base models and the deployments serving them."""

    def get(self, request: HttpRequest) -> HttpResponse:
        context = {
            "base_models": list(api_selectors.base_model_list().annotate(job_count=Count("jobs"))),
            "deployments": list(api_selectors.deployment_list()),
        }
        return render_page(request, "console/models.html", context, section="models")


class PredictorsView(OperatorView):
    """Latency predictor accuracy per host and version, and predicted against observed."""

    def get(self, request: HttpRequest) -> HttpResponse:
        _, _, since = page_range(request)
        context = {
            "accuracy": console_selectors.predictor_accuracy(since=since),
            "hosts": list(api_selectors.host_list()),
        }
        return render_page(
            request, "console/predictors.html", context, section="predictors", ranged=True
        )
