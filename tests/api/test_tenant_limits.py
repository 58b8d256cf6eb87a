"""Tenants' rate limits: the service's rule, and the operator API that sets and shows them."""

from __future__ import annotations

from typing import Any

import pytest

from api.errors import HarliError
from api.models import Tenant
from api.rate_limits import Limits
from api.services.tenants import MAX_RATE_LIMIT, tenant_limits_set
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db


def stored(tenant: Tenant) -> tuple[int | None, int | None]:
    fresh = Tenant.objects.get(pk=tenant.pk)
    return fresh.requests_per_minute, fresh.tokens_per_minute


def test_a_new_tenant_is_unlimited(tenant: Tenant) -> None:
    assert stored(tenant) == (None, None)
    assert Limits.of(tenant).unlimited


def test_the_service_sets_and_clears_limits(tenant: Tenant) -> None:
    tenant_limits_set(tenant=tenant, requests_per_minute=60, tokens_per_minute=150_000)
    assert stored(tenant) == (60, 150_000)
    assert Limits.of(Tenant.objects.get(pk=tenant.pk)) == Limits(60, 150_000)
    tenant_limits_set(tenant=tenant, requests_per_minute=None, tokens_per_minute=MAX_RATE_LIMIT)
    assert stored(tenant) == (None, MAX_RATE_LIMIT)


@pytest.mark.parametrize(
    ("rpm", "tpm", "param"),
    [
        (0, None, "requests_per_minute"),
        (-1, None, "requests_per_minute"),
        (True, None, "requests_per_minute"),
        (1.5, None, "requests_per_minute"),
        ("10", None, "requests_per_minute"),
        (10, 0, "tokens_per_minute"),
        (10, MAX_RATE_LIMIT + 1, "tokens_per_minute"),
    ],
)
def test_the_service_refuses_anything_but_positive_integers(
    tenant: Tenant, rpm: Any, tpm: Any, param: str
) -> None:
    tenant_limits_set(tenant=tenant, requests_per_minute=5, tokens_per_minute=500)
    with pytest.raises(HarliError) as refused:
        tenant_limits_set(tenant=tenant, requests_per_minute=rpm, tokens_per_minute=tpm)
    assert refused.value.http_status == 400 and refused.value.param == param
    assert "or null for no limit" in refused.value.message
    assert stored(tenant) == (5, 500)  # nothing written


def test_ops_get_shows_the_limits_and_patch_sets_them(ops: ApiClient, tenant: Tenant) -> None:
    shown = ops.get("/api/ops/tenants/acme").json()
    assert (shown["requests_per_minute"], shown["tokens_per_minute"]) == (None, None)
    patched = ops.request("patch", "/api/ops/tenants/acme", {"requests_per_minute": 60})
    assert patched.status_code == 200, patched.content
    assert (patched.json()["requests_per_minute"], patched.json()["tokens_per_minute"]) == (
        60,
        None,
    )
    # A field left out keeps its value; null clears.
    ops.request("patch", "/api/ops/tenants/acme", {"tokens_per_minute": 90_000})
    assert stored(tenant) == (60, 90_000)
    cleared = ops.request("patch", "/api/ops/tenants/acme", {"requests_per_minute": None})
    assert cleared.json()["requests_per_minute"] is None and stored(tenant) == (None, 90_000)
    listed = {t["name"]: t for t in ops.get("/api/ops/tenants").json()["data"]}
    assert listed["acme"]["tokens_per_minute"] == 90_000


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"requests_per_minute": 0}, "requests_per_minute"),
        ({"requests_per_minute": -5}, "requests_per_minute"),
        ({"tokens_per_minute": "lots"}, "tokens_per_minute"),
        ({"tokens_per_minute": 2.5}, "tokens_per_minute"),
        ({"tokens_per_minute": True}, "tokens_per_minute"),
        ({"rpm": 5}, "rpm"),
    ],
)
def test_ops_patch_refuses_bad_limits_and_writes_nothing(
    ops: ApiClient, tenant: Tenant, body: dict[str, Any], param: str
) -> None:
    tenant_limits_set(tenant=tenant, requests_per_minute=5, tokens_per_minute=500)
    assert_error(ops.request("patch", "/api/ops/tenants/acme", body), 400, param=param)
    assert stored(tenant) == (5, 500)


def test_ops_patch_of_an_unknown_tenant_or_by_a_tenant_is_refused(
    ops: ApiClient, api: ApiClient, tenant: Tenant
) -> None:
    assert_error(ops.request("patch", "/api/ops/tenants/nobody", {"requests_per_minute": 1}), 404)
    assert_error(api.request("patch", "/api/ops/tenants/acme", {"requests_per_minute": 1}), 403)
    assert stored(tenant) == (None, None)


def test_the_schema_documents_the_patch() -> None:
    from django.test import Client

    paths = Client().get("/api/schema/?format=json").json()["paths"]
    patch = paths["/api/ops/tenants/{name}"]["patch"]
    assert patch["operationId"] == "ops_tenants_limits_set"
    assert set(patch["responses"]) == {"200", "400", "401", "403", "404", "413"}
