"""Services and the tenant base view, below the HTTP layer."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError
from rest_framework import exceptions

from api.apis.base import TenantScopedAPIView
from api.errors import ConflictError, HarliError
from api.models import File, GpuHost, HostStatus, Tenant, User, UserRole
from api.services.apikeys import api_key_authenticate, api_key_issue_for_tenant
from api.services.files import UploadSource, file_create
from api.services.fleet import base_model_register, deployment_create, host_drain, host_register
from api.services.tenants import operator_create, tenant_create
from tests.api.conftest import VALID_JSONL


@pytest.mark.parametrize(
    "method", ["get_queryset", "dispatch", "initial", "tenant", "permission_classes"]
)
def test_tenant_view_cannot_be_bypassed(method: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=method):
        type("Sneaky", (TenantScopedAPIView,), {method: lambda self: None})


def test_tenant_view_fails_closed_without_a_tenant() -> None:
    view = type("Plain", (TenantScopedAPIView,), {})()
    with pytest.raises(exceptions.PermissionDenied):
        _ = view.tenant


@pytest.mark.django_db
def test_tenant_create_makes_a_service_user_that_cannot_sign_in() -> None:
    tenant = tenant_create(name="acme")
    user = User.objects.get(tenant=tenant)
    assert user.username == "tenant.acme" and user.role == UserRole.TENANT
    assert not user.has_usable_password()
    with pytest.raises(ConflictError):
        tenant_create(name="acme")
    with pytest.raises(HarliError, match="Invalid tenant name"):
        tenant_create(name="-bad")


@pytest.mark.django_db
def test_api_key_shape_and_lookup(tenant: Tenant) -> None:
    issued = api_key_issue_for_tenant(tenant=tenant)
    assert issued.key.startswith("hk-") and len(issued.key) == 43
    assert issued.api_key.prefix == issued.key[:11]
    for wrong in ("", "hk-", issued.key[:-1], "sk-" + issued.key[3:], issued.key[:-1] + "?"):
        assert api_key_authenticate(key=wrong) is None


@pytest.mark.django_db
def test_operator_create_rules() -> None:
    assert operator_create(username="ops", password="pw").is_operator
    with pytest.raises(HarliError):
        operator_create(username="x", password="")
    with pytest.raises(ConflictError):
        operator_create(username="ops", password="pw")


@pytest.mark.django_db
def test_fleet_service_errors() -> None:
    with pytest.raises(HarliError, match="Unknown preset"):
        base_model_register(name="m", preset="gpt")
    with pytest.raises(HarliError, match="exactly one"):
        base_model_register(name="m", preset="tiny", checkpoint_dir="/x")
    with pytest.raises(HarliError, match="name"):
        base_model_register(name="has:colon", preset="tiny")
    tiny = base_model_register(name="tiny", preset="tiny")
    assert tiny.config is not None and tiny.context_length == 512
    with pytest.raises(HarliError, match="slo_attainment_target_pct"):
        deployment_create(
            name="d", base_model=tiny, tpot_slo_ms=1, ttft_slo_ms=1, slo_attainment_target_pct=101
        )
    host = host_register(name="h", gpu_kind="H200", gpu_memory_bytes=1)
    GpuHost.objects.filter(pk=host.pk).update(status=HostStatus.LOST)
    with pytest.raises(ConflictError, match="lost"):
        host_drain(host=host)


@pytest.mark.django_db
def test_uploaded_filename_is_reduced_to_a_safe_base_name(tenant: Tenant) -> None:
    file = file_create(
        tenant=tenant,
        purpose="fine-tune",
        upload=UploadSource.from_bytes(filename='../../etc/"x"\n.jsonl', data=VALID_JSONL),
    )
    assert file.filename == "_x__.jsonl"


@pytest.mark.django_db(transaction=True)
def test_failed_insert_removes_the_stored_bytes(storage_dir: Path) -> None:
    """The row fails at commit (its tenant does not exist): the stored bytes are removed too."""
    ghost = Tenant(pk=987654, name="ghost")
    with pytest.raises(IntegrityError):
        file_create(
            tenant=ghost,
            purpose="fine-tune",
            upload=UploadSource.from_bytes(filename="t.jsonl", data=VALID_JSONL),
        )
    assert not File.objects.exists()
    assert [p for p in storage_dir.rglob("*") if p.is_file()] == []
