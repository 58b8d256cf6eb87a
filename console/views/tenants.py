"""Tenants and their API keys: create a tenant, issue a key (shown once), revoke a key; one
tenant's page with its rate limits and quotas (set here, each quota with its current use),
usage and keys."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.db import transaction
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils import timezone

from api import selectors as api_selectors
from api.errors import HarliError
from api.models import Tenant
from api.quotas import QUOTA_NAMES, tenant_quota_states
from api.services.apikeys import IssuedKey, api_key_issue_for_tenant, api_key_revoke
from api.services.quotas import tenant_quotas_set
from api.services.tenants import tenant_create, tenant_limits_set
from console import selectors as console_selectors
from console.access import OperatorView
from console.views.common import not_found, render_page


class TenantForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="a-z, 0-9 and '-'")


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)


class TenantLimitsForm(forms.Form):
    """The two rate limits (empty: no limit) and the quota overrides (empty: the fleet
    default); the services check the values."""

    requests_per_minute = forms.IntegerField(required=False)
    tokens_per_minute = forms.IntegerField(required=False)
    running_jobs = forms.IntegerField(required=False)
    queued_jobs = forms.IntegerField(required=False)
    stored_bytes = forms.IntegerField(required=False)
    trained_tokens_per_month = forms.IntegerField(required=False)


def _render(
    request: HttpRequest,
    *,
    tenant_form: TenantForm | None = None,
    issued: IssuedKey | None = None,
    status: int = 200,
) -> HttpResponse:
    # Two joins (keys, jobs) multiply each other's rows: each count is of distinct ids.
    tenants = api_selectors.tenant_list().annotate(
        active_keys=Count(
            "users__api_keys",
            filter=Q(users__api_keys__revoked_at__isnull=True),
            distinct=True,
        ),
        job_count=Count("jobs", distinct=True),
    )
    response = render_page(
        request,
        "console/tenants.html",
        {
            "tenants": list(tenants),
            "keys": list(api_selectors.api_key_list().filter(user__tenant__isnull=False)),
            "tenant_form": tenant_form or TenantForm(),
            "issued": issued,
        },
        section="tenants",
        status=status,
    )
    if issued is not None:
        # The page holds a secret shown once: keep it out of every cache and the history.
        response["Cache-Control"] = "no-store"
    return response


class TenantsView(OperatorView):
    """GET: tenants and keys. POST: create a tenant (its service user comes with it)."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return _render(request)

    def post(self, request: HttpRequest) -> HttpResponse:
        form = TenantForm(request.POST)
        if not form.is_valid():
            return _render(request, tenant_form=form, status=400)
        try:
            tenant = tenant_create(name=form.cleaned_data["name"])
        except HarliError as exc:
            form.add_error("name", exc.message)
            return _render(request, tenant_form=form, status=400)
        messages.success(request, f"Tenant {tenant.name} created.")
        return redirect("console:tenants")


def _render_tenant(
    request: HttpRequest,
    tenant: Tenant,
    *,
    limits_form: TenantLimitsForm | None = None,
    status: int = 200,
) -> HttpResponse:
    now = timezone.now()
    quotas = tenant_quota_states(tenant=tenant, now=now)
    by_model = console_selectors.tenant_usage_by_model(tenant=tenant, now=now)
    day = [row.day for row in by_model if row.day is not None]
    form = limits_form or TenantLimitsForm(
        initial={
            "requests_per_minute": tenant.requests_per_minute,
            "tokens_per_minute": tenant.tokens_per_minute,
        }
        | {q.name: q.override for q in quotas}
    )
    context = {
        "tenant": tenant,
        "limits_form": form,
        "quotas": [
            {
                **q.as_dict(),
                "field": form[q.name],
                "used_frac": min(q.used / q.limit, 1.0) if q.limit else 1.0,
            }
            for q in quotas
        ],
        "usage_by_model": by_model,
        "day_requests": sum(s.requests for s in day),
        "day_prompt_tokens": sum(s.prompt_tokens for s in day),
        "day_completion_tokens": sum(s.completion_tokens for s in day),
        "keys": list(api_selectors.api_key_list(tenant=tenant)),
        "job_count": tenant.jobs.count(),
    }
    return render_page(request, "console/tenant.html", context, section="tenants", status=status)


class TenantView(OperatorView):
    """One tenant: its rate limits (with the form to set them), usage over the last day per
    minute and hour, usage per model, and its API keys."""

    def get(self, request: HttpRequest, name: str) -> HttpResponse:
        tenant = Tenant.objects.filter(name=name).first()
        if tenant is None:
            return not_found(request, what=f"tenant {name!r}", section="tenants")
        return _render_tenant(request, tenant)


class TenantLimitsView(OperatorView):
    """POST: set a tenant's rate limits through `api.services.tenants.tenant_limits_set`."""

    def post(self, request: HttpRequest, name: str) -> HttpResponse:
        tenant = Tenant.objects.filter(name=name).first()
        if tenant is None:
            return not_found(request, what=f"tenant {name!r}", section="tenants")
        form = TenantLimitsForm(request.POST)
        if not form.is_valid():
            return _render_tenant(request, tenant, limits_form=form, status=400)
        try:
            with transaction.atomic():
                tenant = tenant_limits_set(
                    tenant=tenant,
                    requests_per_minute=form.cleaned_data["requests_per_minute"],
                    tokens_per_minute=form.cleaned_data["tokens_per_minute"],
                )
                tenant_quotas_set(
                    tenant=tenant, changes={q: form.cleaned_data[q] for q in QUOTA_NAMES}
                )
        except HarliError as exc:
            field = (exc.param or "").removeprefix("quotas.")
            form.add_error(field if field in form.fields else None, exc.message)
            return _render_tenant(request, tenant, limits_form=form, status=400)
        messages.success(
            request, f"Rate limits of {tenant.name} saved. Quotas of {tenant.name} saved."
        )
        return redirect("console:tenant", name=tenant.name)


class ApiKeyIssueView(OperatorView):
    """POST: issue a key for a tenant and show it in clear, this once (never stored in clear)."""

    def post(self, request: HttpRequest, name: str) -> HttpResponse:
        tenant = Tenant.objects.filter(name=name).first()
        if tenant is None:
            return not_found(request, what=f"tenant {name!r}", section="tenants")
        form = ApiKeyForm(request.POST)
        if not form.is_valid():
            messages.error(request, "A key name is at most 100 characters.")
            return redirect("console:tenants")
        issued = api_key_issue_for_tenant(tenant=tenant, name=form.cleaned_data["name"])
        return _render(request, issued=issued)


class ApiKeyRevokeView(OperatorView):
    """POST: revoke a tenant's key by id (revoking twice is harmless)."""

    def post(self, request: HttpRequest, key_id: int) -> HttpResponse:
        try:
            api_key = api_key_revoke(prefix_or_id=str(key_id))
        except HarliError as exc:
            messages.error(request, exc.message)
            return redirect("console:tenants")
        messages.success(request, f"Key {api_key.prefix}… revoked.")
        tenant = api_key.user.tenant
        if request.POST.get("back") == "tenant" and tenant is not None:
            return redirect("console:tenant", name=tenant.name)
        return redirect("console:tenants")
