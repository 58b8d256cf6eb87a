"""Jobs: filtered list with progress and ETA, detail, and cancel / pause / resume.

The actions call the same services as the tenant and operator APIs
(`api.services.jobs.finetune_job_cancel`, `..._pause`, `..._resume`), so the transition table,
events and placement release behave exactly as there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect

from api import selectors as api_selectors
from api.errors import HarliError, error_body
from api.models import EventType, FinetuneJob, JobStatus
from api.services.jobs import finetune_job_cancel, finetune_job_pause, finetune_job_resume
from api.transitions import is_legal_transition
from console import selectors as console_selectors
from console.access import OperatorJsonView, OperatorView
from console.live import parts_response, render_parts
from console.views.common import not_found, render_page

PAGE_SIZE = 50
EVENTS_SHOWN = 200

ACTIONS: dict[str, tuple[str, Callable[..., FinetuneJob]]] = {
    # action -> (status it leads to, service)
    "cancel": (JobStatus.CANCELLED, finetune_job_cancel),
    "pause": (JobStatus.PAUSED, finetune_job_pause),
    "resume": (JobStatus.QUEUED, finetune_job_resume),
}


def allowed_actions(job: FinetuneJob) -> list[str]:
    """The actions the transition table allows from the job's current status. Resume is only
    for a paused job (`running -> queued` is the table's host-lost path, not an action)."""
    return [
        name
        for name, (to, _) in ACTIONS.items()
        if is_legal_transition(job.status, to)
        and (name != "resume" or job.status == JobStatus.PAUSED)
    ]


JOB_LIST_PARTS = {"table": "console/parts/jobs_table.html"}


def job_list_context(request: HttpRequest) -> tuple[dict[str, Any], str | None]:
    """The jobs table for the request's filters and page, and a warning for a bad filter."""
    filters = {
        "tenant": request.GET.get("tenant", ""),
        "status": request.GET.get("status", ""),
        "host": request.GET.get("host", ""),
    }
    warning = None
    if filters["status"] and filters["status"] not in JobStatus.values:
        warning = f"Unknown status {filters['status']!r}; filter ignored."
        filters["status"] = ""
    jobs = console_selectors.job_list(
        tenant=filters["tenant"] or None,
        status=filters["status"] or None,
        host=filters["host"] or None,
    ).select_related("training_file")
    page = Paginator(jobs, PAGE_SIZE).get_page(request.GET.get("page"))
    page_jobs = list(page.object_list)
    progress = console_selectors.job_progress_map(jobs=page_jobs)
    hosts = console_selectors.current_hosts(job_ids=[j.pk for j in page_jobs])
    context = {
        "rows": [
            {"job": j, "progress": progress[j.pk], "host": hosts.get(j.pk)} for j in page_jobs
        ],
        "page": page,
        "filters": filters,
        "query": urlencode({k: v for k, v in filters.items() if v}),
        "any_jobs": FinetuneJob.objects.exists(),
    }
    return context, warning


class JobListView(OperatorView):
    """Jobs of every tenant, filtered by tenant, status and host, newest first."""

    def get(self, request: HttpRequest) -> HttpResponse:
        context, warning = job_list_context(request)
        if warning:
            messages.error(request, warning)
        page_context = {
            "filters": context["filters"],
            "query": context["query"],
            "parts": render_parts(request, JOB_LIST_PARTS, context),
            "tenants": list(api_selectors.tenant_list().values_list("name", flat=True)),
            "statuses": JobStatus.choices,
            "host_names": list(api_selectors.host_list().values_list("name", flat=True)),
        }
        return render_page(request, "console/jobs.html", page_context, section="jobs")


class JobListLiveView(OperatorJsonView):
    """The jobs table (same filters and page as the page's URL), as a live part."""

    def get(self, request: HttpRequest) -> HttpResponse:
        context, _ = job_list_context(request)
        return parts_response(render_parts(request, JOB_LIST_PARTS, context))


JOB_PARTS = {
    "status": "console/parts/job_status.html",
    "progress": "console/parts/job_progress.html",
    "placements": "console/parts/job_placements.html",
    "events": "console/parts/job_events.html",
    "checkpoints": "console/parts/job_checkpoints.html",
}


def _job(job_id: str) -> FinetuneJob | None:
    return (
        FinetuneJob.objects.select_related("tenant", "base_model", "training_file")
        .filter(pk=job_id)
        .first()
    )


def job_context(*, job: FinetuneJob) -> dict[str, Any]:
    """What the job page's live parts show."""
    return {
        "job": job,
        "progress": console_selectors.job_progress_map(jobs=[job])[job.pk],
        # Progress and checkpoint reports (type "metrics") are plotted and tabled; the timeline
        # keeps the lifecycle messages readable.
        "events": list(
            api_selectors.job_event_list(job=job).exclude(type=EventType.METRICS)[:EVENTS_SHOWN]
        ),
        "metric_events": api_selectors.job_event_list(job=job)
        .filter(type=EventType.METRICS)
        .count(),
        "checkpoints": list(api_selectors.job_checkpoint_list(job=job)),
        "placements": list(api_selectors.placement_list(job_id=job.pk)),
    }


class JobDetailView(OperatorView):
    """A job: settings, progress, loss and throughput charts, events, checkpoints, placements."""

    def get(self, request: HttpRequest, job_id: str) -> HttpResponse:
        job = _job(job_id)
        if job is None:
            return not_found(request, what=f"job {job_id!r}", section="jobs")
        context = {
            "job": job,
            "actions": allowed_actions(job),
            "parts": render_parts(request, JOB_PARTS, job_context(job=job)),
        }
        return render_page(request, "console/job.html", context, section="jobs")


class JobLiveView(OperatorJsonView):
    """The job page's live parts, as JSON (see `console.live`)."""

    def get(self, request: HttpRequest, job_id: str) -> HttpResponse:
        job = _job(job_id)
        if job is None:
            return JsonResponse(
                error_body(f"No fine-tuning job {job_id!r}.", type_="invalid_request_error"),
                status=404,
            )
        return parts_response(render_parts(request, JOB_PARTS, job_context(job=job)))


class JobActionView(OperatorView):
    """POST: cancel, pause or resume a job through the API's services."""

    def post(self, request: HttpRequest, job_id: str, action: str) -> HttpResponse:
        if action not in ACTIONS:
            return not_found(request, what=f"action {action!r}", section="jobs")
        job = FinetuneJob.objects.filter(pk=job_id).first()
        if job is None:
            return not_found(request, what=f"job {job_id!r}", section="jobs")
        if action not in allowed_actions(job):
            messages.error(request, f"Job {job.pk} is {job.status}; it cannot {action}.")
            return redirect("console:job", job_id=job_id)
        _, service = ACTIONS[action]
        try:
            job = service(job=job)
        except HarliError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"Job {job.pk} is now {job.get_status_display().lower()}.")
        return redirect("console:job", job_id=job_id)
