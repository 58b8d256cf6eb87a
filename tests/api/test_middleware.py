"""NUL in any kind of input on any API route is a 4xx in the uniform body, never a 5xx:
PostgreSQL text cannot hold NUL, so it must be refused before a query sees it."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.urls import URLPattern

from api.models import BaseModel, File
from api.urls import ops_urlpatterns, v1_urlpatterns
from tests.api.conftest import ApiClient, assert_error

NUL = "\x00"
ROUTES = [("/v1/", p) for p in v1_urlpatterns] + [("/api/ops/", p) for p in ops_urlpatterns]
CONVERTER = re.compile(r"<(?:(\w+):)?\w+>")
METHODS = ("get", "post", "delete")


def route_path(prefix: str, pattern: URLPattern, value: str) -> str:
    """The route with every path parameter set to `value` (an int parameter to 1)."""
    return prefix + CONVERTER.sub(
        lambda m: "1" if m.group(1) == "int" else value, str(pattern.pattern)
    )


def route_ids() -> list[str]:
    return [f"{prefix}{pattern.pattern}" for prefix, pattern in ROUTES]


def assert_refused(response: Any, statuses: tuple[int, ...]) -> None:
    assert response.status_code < 500, response.content
    assert response.status_code in statuses, (response.status_code, response.content)
    assert_error(response, response.status_code)


@pytest.fixture
def clients(api: ApiClient, ops: ApiClient) -> dict[str, ApiClient]:
    return {"/v1/": api, "/api/ops/": ops}


@pytest.mark.parametrize(("prefix", "pattern"), ROUTES, ids=route_ids())
def test_nul_in_every_kind_of_input_on_every_route_is_a_4xx(
    clients: dict[str, ApiClient],
    training_file: File,
    tiny: BaseModel,
    prefix: str,
    pattern: URLPattern,
) -> None:
    client = clients[prefix]
    plain = route_path(prefix, pattern, "x")
    has_path_parameter = CONVERTER.search(str(pattern.pattern)) is not None
    for method in METHODS:
        call = getattr(client.client, method)
        if has_path_parameter and "<int:" not in str(pattern.pattern):
            response = call(route_path(prefix, pattern, "x%00y"), headers=client.headers)
            assert_refused(response, (404,))
        response = call(plain + "?after=a%00b&limit=1", headers=client.headers)
        assert_refused(response, (400,))
        response = call(plain + "?a%00b=1", headers=client.headers)
        assert_refused(response, (400,))
        response = call(plain, headers={"Authorization": "Bearer hk-" + NUL + "x"})
        assert_refused(response, (401,))
        if method == "post":
            body = {"name": NUL, "model": "tiny" + NUL, "training_file": training_file.id + NUL}
            response = call(
                plain, json.dumps(body), content_type="application/json", headers=client.headers
            )
            assert response.status_code < 500, response.content
            response = call(plain, {"purpose": NUL, "name": NUL}, headers=client.headers)
            assert response.status_code < 500, response.content


def test_nul_in_a_json_body_string_is_a_400_on_a_json_route(
    ops: ApiClient,
) -> None:
    response = ops.post("/api/ops/tenants", {"name": "a" + NUL})
    assert_error(response, 400)
