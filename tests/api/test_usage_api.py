"""Usage reads over HTTP: the tenant's `/v1/organization/usage/completions` in OpenAI's shape
(and through the official client), and the operator's `/api/ops/usage`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import openai
import pytest
from openai.types.admin.organization.usage_completions_response import (
    DataResultOrganizationUsageCompletionsResult,
)

from api.models import Tenant
from api.services.apikeys import api_key_issue_for_tenant
from api.services.tenants import tenant_create
from api.services.usage import UsageRow, usage_record_batch
from tests.api.conftest import ApiClient, assert_error

# Midnight UTC, 2026-03-04; hours H0 + n * 3600.
DAY = int(datetime(2026, 3, 4, tzinfo=UTC).timestamp())
URL = "/v1/organization/usage/completions"
FT = "ft:tiny:acme::ftjob-1"


def seed(acme: Tenant, globex: Tenant) -> None:
    def row(tenant: Tenant, model: str, offset: int, n: int, p: int, c: int) -> UsageRow:
        return UsageRow(
            tenant_id=tenant.pk,
            model=model,
            minute=datetime.fromtimestamp(DAY + offset, tz=UTC),
            requests=n,
            prompt_tokens=p,
            completion_tokens=c,
        )

    usage_record_batch(
        rows=[
            row(acme, "tiny", 60, 2, 100, 10),
            row(acme, FT, 120, 1, 30, 3),
            row(acme, "tiny", 3600 + 60, 1, 50, 5),
            row(acme, "tiny", 86400 + 60, 4, 400, 40),
            row(globex, "tiny", 60, 9, 900, 90),
        ]
    )


@pytest.fixture
def seeded(tenant: Tenant, other_tenant: Tenant) -> None:
    seed(tenant, other_tenant)


def result(n: int, p: int, c: int, model: str | None = None) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": p,
        "output_tokens": c,
        "num_model_requests": n,
        "model": model,
        "project_id": None,
        "user_id": None,
        "api_key_id": None,
        "batch": None,
    }


def bucket(start: int, width: int, *results: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "bucket",
        "start_time": start,
        "end_time": start + width,
        "results": list(results),
    }


pytestmark = pytest.mark.django_db


def test_day_buckets_by_default_in_openais_shape(api: ApiClient, seeded: None) -> None:
    response = api.get(f"{URL}?start_time={DAY}&end_time={DAY + 3 * 86400}")
    assert response.status_code == 200, response.content
    assert response.json() == {
        "object": "page",
        "data": [
            bucket(DAY, 86400, result(4, 180, 18)),
            bucket(DAY + 86400, 86400, result(4, 400, 40)),
            bucket(DAY + 2 * 86400, 86400),
        ],
        "has_more": False,
        "next_page": None,
    }


def test_group_by_model_and_the_models_filter(api: ApiClient, seeded: None) -> None:
    query = f"start_time={DAY}&end_time={DAY + 7200}&bucket_width=1h"
    grouped = api.get(f"{URL}?{query}&group_by=model").json()["data"]
    assert grouped == [
        bucket(DAY, 3600, result(1, 30, 3, FT), result(2, 100, 10, "tiny")),
        bucket(DAY + 3600, 3600, result(1, 50, 5, "tiny")),
    ]
    # The openai client sends arrays as `name[]=`; repeated names and commas work too.
    for models in (f"models[]={FT}", f"models={FT}", f"models={FT},nothing"):
        only = api.get(f"{URL}?{query}&group_by[]=model&{models}").json()["data"]
        assert only == [bucket(DAY, 3600, result(1, 30, 3, FT)), bucket(DAY + 3600, 3600)]


def test_minute_buckets_page_with_next_page(api: ApiClient, seeded: None) -> None:
    query = f"start_time={DAY}&end_time={DAY + 300}&bucket_width=1m&limit=2"
    first = api.get(f"{URL}?{query}").json()
    assert first["data"] == [bucket(DAY, 60), bucket(DAY + 60, 60, result(2, 100, 10))]
    assert first["has_more"] is True and isinstance(first["next_page"], str)
    second = api.get(f"{URL}?{query}&page={first['next_page']}").json()
    assert second["data"] == [bucket(DAY + 120, 60, result(1, 30, 3)), bucket(DAY + 180, 60)]
    third = api.get(f"{URL}?{query}&page={second['next_page']}").json()
    assert third == {
        "object": "page",
        "data": [bucket(DAY + 240, 60)],
        "has_more": False,
        "next_page": None,
    }


def test_a_range_that_starts_inside_a_bucket(api: ApiClient, seeded: None) -> None:
    # The hour bucket starts at DAY; only minutes from DAY + 90 on are counted.
    data = api.get(f"{URL}?start_time={DAY + 90}&end_time={DAY + 3600}&bucket_width=1h").json()
    assert data["data"] == [bucket(DAY, 3600, result(1, 30, 3))]


def test_another_tenants_usage_is_never_counted(other_key: str, seeded: None) -> None:
    response = ApiClient(other_key).get(f"{URL}?start_time={DAY}&end_time={DAY + 86400}")
    assert response.json()["data"] == [bucket(DAY, 86400, result(9, 900, 90))]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("", "start_time"),
        ("start_time=abc", "start_time"),
        ("start_time=-5", "start_time"),
        (f"start_time={DAY}&end_time={DAY}", "end_time"),
        (f"start_time={DAY}&bucket_width=1w", "bucket_width"),
        (f"start_time={DAY}&limit=0", "limit"),
        (f"start_time={DAY}&limit=32", "limit"),
        (f"start_time={DAY}&bucket_width=1h&limit=169", "limit"),
        (f"start_time={DAY}&group_by=project_id", "group_by"),
        (f"start_time={DAY}&project_ids[]=p1", "project_ids"),
        (f"start_time={DAY}&api_key_ids=k1", "api_key_ids"),
        (f"start_time={DAY}&page=garbage!", "page"),
        (f"start_time={DAY}&end_time={DAY + 86400}&page=YjE", "page"),
    ],
)
def test_bad_parameters_are_400s_naming_them(api: ApiClient, query: str, param: str) -> None:
    assert_error(api.get(f"{URL}?{query}"), 400, param=param)


def test_limit_up_to_the_widths_maximum(api: ApiClient) -> None:
    response = api.get(f"{URL}?start_time={DAY}&end_time={DAY + 86400}&bucket_width=1m&limit=1440")
    assert response.status_code == 200 and len(response.json()["data"]) == 1440


def test_a_tenant_key_is_needed(ops: ApiClient) -> None:
    assert_error(ApiClient(None).get(f"{URL}?start_time={DAY}"), 401)
    assert_error(ops.get(f"{URL}?start_time={DAY}"), 403)


@pytest.mark.django_db(transaction=True)
def test_the_openai_client_reads_usage(live_server: Any) -> None:
    acme, globex = tenant_create(name="acme"), tenant_create(name="globex")
    seed(acme, globex)
    key = api_key_issue_for_tenant(tenant=acme).key
    client = openai.OpenAI(
        base_url=f"{live_server.url}/v1", api_key=key, admin_api_key=key, max_retries=0
    )
    usage = client.admin.organization.usage.completions(
        start_time=DAY,
        end_time=DAY + 7200,
        bucket_width="1h",
        group_by=["model"],
        models=["tiny"],
        limit=1,
    )
    assert usage.object == "page" and usage.has_more and usage.next_page
    [first] = usage.data
    assert (first.start_time, first.end_time) == (DAY, DAY + 3600)
    [tiny] = first.results
    assert isinstance(tiny, DataResultOrganizationUsageCompletionsResult)
    assert (tiny.model, tiny.num_model_requests, tiny.input_tokens, tiny.output_tokens) == (
        "tiny",
        2,
        100,
        10,
    )
    following = client.admin.organization.usage.completions(
        start_time=DAY,
        end_time=DAY + 7200,
        bucket_width="1h",
        group_by=["model"],
        models=["tiny"],
        limit=1,
        page=usage.next_page,
    )
    [later] = following.data[0].results
    assert isinstance(later, DataResultOrganizationUsageCompletionsResult)
    assert not following.has_more and later.output_tokens == 5
    with pytest.raises(openai.BadRequestError) as refused:
        client.admin.organization.usage.completions(start_time=DAY, bucket_width="1m", limit=5000)
    assert "limit must be between 1 and 1440" in refused.value.message


# The operator's view


def test_ops_usage_rows_per_bucket_tenant_and_model(ops: ApiClient, seeded: None) -> None:
    response = ops.get(f"/api/ops/usage?start_time={DAY}&end_time={DAY + 7200}&bucket_width=1h")
    assert response.status_code == 200, response.content
    rows = [
        (r["start_time"], r["end_time"], r["tenant"], r["model"]) for r in response.json()["data"]
    ]
    assert rows == [
        (DAY, DAY + 3600, "acme", FT),
        (DAY, DAY + 3600, "acme", "tiny"),
        (DAY, DAY + 3600, "globex", "tiny"),
        (DAY + 3600, DAY + 7200, "acme", "tiny"),
    ]
    assert response.json()["data"][2] == {
        "start_time": DAY,
        "end_time": DAY + 3600,
        "tenant": "globex",
        "model": "tiny",
        "requests": 9,
        "prompt_tokens": 900,
        "completion_tokens": 90,
    }
    acme_tiny = ops.get(
        f"/api/ops/usage?start_time={DAY}&end_time={DAY + 2 * 86400}&tenant=acme&model=tiny"
    ).json()["data"]
    assert [(r["start_time"], r["requests"], r["prompt_tokens"]) for r in acme_tiny] == [
        (DAY, 3, 150),
        (DAY + 86400, 4, 400),
    ]


def test_ops_usage_refuses_bad_ranges_and_unknown_tenants(ops: ApiClient) -> None:
    assert_error(ops.get("/api/ops/usage"), 400, param="start_time")
    too_wide = ops.get(
        f"/api/ops/usage?start_time={DAY}&end_time={DAY + 2 * 86400}&bucket_width=1m"
    )
    assert assert_error(too_wide, 400, param="end_time")["code"] == "range_too_large"
    unknown = ops.get(f"/api/ops/usage?start_time={DAY}&end_time={DAY + 60}&tenant=nobody")
    assert_error(unknown, 404, param="tenant")
    assert_error(ops.get(f"/api/ops/usage?start_time={DAY}&bucket_width=2h"), 400)


def test_ops_usage_needs_an_operator(api: ApiClient) -> None:
    assert_error(api.get(f"/api/ops/usage?start_time={DAY}"), 403)


def test_the_schema_documents_both_usage_routes() -> None:
    from django.test import Client

    paths = Client().get("/api/schema/?format=json").json()["paths"]
    assert paths["/api/ops/usage"]["get"]["operationId"] == "ops_usage_list"
    usage = paths["/v1/organization/usage/completions"]["get"]
    names = {p["name"] for p in usage["parameters"]}
    assert {
        "start_time",
        "end_time",
        "bucket_width",
        "group_by",
        "models",
        "limit",
        "page",
    } <= names
