"""Authentication, roles and the one error body on every failure path."""

from __future__ import annotations

import json

import pytest
from django.test import Client, RequestFactory

from api.errors import server_error_view
from api.models import ApiKey, Tenant, User
from api.services.apikeys import api_key_issue_for_tenant, api_key_revoke
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db


def test_missing_and_wrong_keys_are_401(tenant_key: str) -> None:
    error = assert_error(ApiClient(None).get("/v1/files"), 401)
    assert error["type"] == "authentication_error"
    response = ApiClient("hk-" + "x" * 40).get("/v1/files")
    error = assert_error(response, 401)
    assert error["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert_error(ApiClient(tenant_key + "x").get("/v1/files"), 401)
    malformed = Client().get("/v1/files", headers={"Authorization": "Bearer a b"})
    assert_error(malformed, 401)


def test_revoked_key_is_401_and_last_used_is_recorded(tenant: Tenant) -> None:
    issued = api_key_issue_for_tenant(tenant=tenant)
    assert ApiClient(issued.key).get("/v1/files").status_code == 200
    issued.api_key.refresh_from_db()
    assert issued.api_key.last_used_at is not None
    assert issued.api_key.digest != issued.key and issued.key not in issued.api_key.digest
    api_key_revoke(prefix_or_id=issued.api_key.prefix)
    assert_error(ApiClient(issued.key).get("/v1/files"), 401)


def test_roles_are_enforced(api: ApiClient, ops: ApiClient) -> None:
    error = assert_error(ops.get("/v1/files"), 403)
    assert error["type"] == "permission_error"
    assert_error(api.get("/api/ops/tenants"), 403)
    assert_error(ApiClient(None).get("/api/ops/tenants"), 401)


def test_operator_session_login_reaches_ops(operator: User) -> None:
    client = Client()
    assert client.login(username="ops", password="s3cret-pass")
    assert client.get("/api/ops/tenants").status_code == 200
    # A session is not a tenant credential.
    assert_error(client.get("/v1/files"), 401)


def test_unknown_url_and_method_use_the_error_body(api: ApiClient) -> None:
    error = assert_error(api.get("/v1/nothing-here"), 404)
    assert error["code"] == "unknown_url"
    assert_error(api.request("put", "/v1/files"), 405)
    assert Client().get("/not-an-api").status_code == 404


def test_ops_validation_errors_use_the_error_body(ops: ApiClient) -> None:
    error = assert_error(ops.post("/api/ops/deployments", {"name": "d"}), 400)
    assert error["param"] == "base_model"
    assert error["type"] == "invalid_request_error"
    assert_error(ops.get("/api/ops/hosts/nope"), 404, param="host")
    assert_error(ops.post("/api/ops/tenants", {"name": "Bad Name"}), 400, param="name")
    assert ops.post("/api/ops/tenants", {"name": "ok"}).status_code == 201
    assert assert_error(ops.post("/api/ops/tenants", {"name": "ok"}), 409)["param"] == "name"


def test_server_error_body() -> None:
    response = server_error_view(RequestFactory().get("/v1/files"))
    assert response.status_code == 500
    assert json.loads(response.content)["error"]["type"] == "server_error"


def test_keys_are_stored_hashed(tenant_key: str) -> None:
    stored = ApiKey.objects.get()
    assert tenant_key.startswith(stored.prefix)
    assert tenant_key not in {stored.digest, stored.name}


def test_unknown_api_url_is_json_even_in_debug(settings: object) -> None:
    settings.DEBUG = True  # type: ignore[attr-defined]
    response = Client().get("/v1/nothing-here")
    assert_error(response, 404)
    assert response["Content-Type"] == "application/json"
