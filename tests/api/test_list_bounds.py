"""Every list route of both APIs answers one clear 400 to a `limit` out of 1..100 or not an
integer, to an `after` cursor that names no object of the list, and to a query parameter it
does not take; nothing is ignored."""

from __future__ import annotations

from typing import Any

import pytest

from api.models import BaseModel, File, FinetuneJob
from tests.api.conftest import ApiClient, assert_error

pytestmark = pytest.mark.django_db

BAD_LIMITS = ["0", "101", "-1", "abc", "1.5", "1e2", "99999999999999999999999"]


@pytest.fixture
def job(api: ApiClient, training_file: File, tiny: BaseModel) -> FinetuneJob:
    created = api.post("/v1/fine_tuning/jobs", {"model": "tiny", "training_file": training_file.id})
    assert created.status_code == 200, created.content
    return FinetuneJob.objects.get(pk=created.json()["id"])


def paged_routes(job: FinetuneJob) -> list[tuple[str, str]]:
    return [
        ("v1", "/v1/files"),
        ("v1", "/v1/fine_tuning/jobs"),
        ("v1", f"/v1/fine_tuning/jobs/{job.id}/events"),
        ("v1", f"/v1/fine_tuning/jobs/{job.id}/checkpoints"),
        ("ops", "/api/ops/jobs"),
    ]


def test_limit_bounds_on_every_paged_list(api: ApiClient, ops: ApiClient, job: FinetuneJob) -> None:
    for api_name, path in paged_routes(job):
        client = ops if api_name == "ops" else api
        for limit in BAD_LIMITS:
            error = assert_error(client.get(f"{path}?limit={limit}"), 400, param="limit")
            assert "limit" in error["message"], (path, limit)
        for limit in ("1", "100"):
            body = client.get(f"{path}?limit={limit}").json()
            assert body["object"] == "list" and len(body["data"]) <= int(limit), (path, limit)


def test_an_after_cursor_outside_the_list_is_a_400(
    api: ApiClient, ops: ApiClient, other_key: str, job: FinetuneJob
) -> None:
    for api_name, path in paged_routes(job):
        client = ops if api_name == "ops" else api
        assert_error(client.get(f"{path}?after=nothing-here"), 400, param="after")
    # Another tenant's job is no cursor of this tenant's list (as unknown, not a 403).
    other = ApiClient(other_key)
    assert_error(other.get(f"/v1/fine_tuning/jobs?after={job.id}"), 400, param="after")
    # The cursor of the list's own last row answers the next (empty) page.
    assert api.get(f"/v1/fine_tuning/jobs?after={job.id}").json()["data"] == []


def list_routes(job: FinetuneJob) -> list[tuple[str, str]]:
    return [
        *paged_routes(job),
        ("v1", "/v1/models"),
        ("ops", "/api/ops/tenants"),
        ("ops", "/api/ops/apikeys"),
        ("ops", "/api/ops/basemodels"),
        ("ops", "/api/ops/deployments"),
        ("ops", "/api/ops/hosts"),
        ("ops", "/api/ops/placements"),
    ]


@pytest.mark.parametrize("name", ["stauts", "order", "limt"])
def test_an_unknown_query_parameter_of_a_list_is_a_400(
    api: ApiClient, ops: ApiClient, job: FinetuneJob, name: str
) -> None:
    for api_name, path in list_routes(job):
        client: Any = ops if api_name == "ops" else api
        error = assert_error(client.get(f"{path}?{name}=1"), 400, param=name)
        assert error["code"] == "unknown_parameter", path
        assert client.get(path).status_code == 200, path
    # The operator API's browsable renderer reads `format`.
    assert ops.get("/api/ops/tenants?format=json").status_code == 200
