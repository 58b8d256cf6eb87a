"""The web process's request ids (`api.request_ids`): a client's valid `X-Request-Id` is used,
answered in `x-request-id` and on every JSON log line of the request (with its tenant and job);
an invalid one is replaced; a 500 leaves exactly one error line, with its traceback, under it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client

from api.models import Tenant
from api.services.apikeys import api_key_issue_for_tenant
from api.services.tenants import tenant_create
from tests.json_logs import JsonLines, captured_json_logs


@pytest.fixture
def json_logs() -> Iterator[JsonLines]:
    with captured_json_logs() as lines:
        yield lines


pytestmark = pytest.mark.django_db


@pytest.fixture
def tenant_key(db: None) -> str:
    return api_key_issue_for_tenant(tenant=tenant_create(name="acme")).key


def _get(path: str, key: str, **headers: str) -> Any:
    client = Client(raise_request_exception=False)
    return client.get(path, headers={"Authorization": f"Bearer {key}", **headers})


def test_a_clients_request_id_is_answered_and_on_every_line(
    tenant_key: str, json_logs: JsonLines
) -> None:
    response = _get("/v1/fine_tuning/jobs/ftjob-nothere", tenant_key,
                    **{"X-Request-Id": "client-42.a:b_c"})  # fmt: skip
    assert response.status_code == 404
    assert response["x-request-id"] == "client-42.a:b_c"
    lines = [line for line in json_logs() if line["request_id"] == "client-42.a:b_c"]
    assert {line["logger"] for line in lines} == {"harli.request", "django.request"}
    access = next(line for line in lines if line["logger"] == "harli.request")
    assert access["message"] == "GET /v1/fine_tuning/jobs/ftjob-nothere 404"
    assert access["tenant"] == "acme" and access["job_id"] == "ftjob-nothere"
    assert access["status"] == 404 and access["level"] == "INFO"
    assert set(access) >= {"timestamp", "level", "logger", "message", "request_id", "tenant"}
    assert all(line["request_id"] == "client-42.a:b_c" for line in json_logs())


@pytest.mark.parametrize(
    "sent", ["", "x" * 129, "two words", "semi;colon", 'quote"', "new\\nline", "é"]
)
def test_an_invalid_request_id_is_replaced(tenant_key: str, sent: str) -> None:
    response = _get("/v1/fine_tuning/jobs", tenant_key, **{"X-Request-Id": sent})
    assert response.status_code == 200
    assert response["x-request-id"].startswith("req_") and response["x-request-id"] != sent


def test_each_request_without_an_id_gets_its_own(tenant_key: str) -> None:
    first = _get("/v1/fine_tuning/jobs", tenant_key)["x-request-id"]
    second = _get("/v1/fine_tuning/jobs", tenant_key)["x-request-id"]
    assert first.startswith("req_") and second.startswith("req_") and first != second
    assert _get("/healthz", tenant_key)["x-request-id"].startswith("req_")


def test_a_500_leaves_one_json_error_line_with_its_traceback(
    tenant_key: str, json_logs: JsonLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(**_: Any) -> Any:
        raise RuntimeError("selector exploded")

    monkeypatch.setattr("api.apis.jobs.finetune_job_list", broken)
    response = _get("/v1/fine_tuning/jobs", tenant_key, **{"X-Request-Id": "boom-1"})
    assert response.status_code == 500
    assert response["x-request-id"] == "boom-1"
    errors = [line for line in json_logs() if line["level"] == "ERROR"]
    assert len(errors) == 1, errors
    (error,) = errors
    assert error["request_id"] == "boom-1" and error["tenant"] == "acme"
    assert error["logger"] == "django.request"
    assert error["message"] == "Internal Server Error: /v1/fine_tuning/jobs"
    assert error["exception"].startswith("Traceback (most recent call last):")
    assert "RuntimeError: selector exploded" in error["exception"]


def test_the_tenant_is_bound_only_for_its_own_request(
    tenant_key: str, json_logs: JsonLines
) -> None:
    other: Tenant = tenant_create(name="globex")
    other_key = api_key_issue_for_tenant(tenant=other).key
    _get("/v1/fine_tuning/jobs", tenant_key, **{"X-Request-Id": "from-acme"})
    _get("/v1/fine_tuning/jobs", other_key, **{"X-Request-Id": "from-globex"})
    Client().get("/v1/models", headers={"X-Request-Id": "anonymous"})  # 401: no tenant
    tenants = {(line["request_id"], line["tenant"]) for line in json_logs()}
    assert tenants == {("from-acme", "acme"), ("from-globex", "globex"), ("anonymous", None)}
