"""Tenants and their API keys: create a tenant, issue a key (shown once), revoke a key."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect

from api import selectors as api_selectors
from api.errors import HarliError
from api.models import Tenant
from api.services.apikeys import IssuedKey, api_key_issue_for_tenant, api_key_revoke
from api.services.tenants import tenant_create
from console.access import OperatorView
from console.views.common import not_found, render_page


class TenantForm(forms.Form):
    name = forms.CharField(max_length=63, help_text="a-z, 0-9 and '-'")


class ApiKeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)


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
        else:
            messages.success(request, f"Key {api_key.prefix}… revoked.")
        return redirect("console:tenants")
