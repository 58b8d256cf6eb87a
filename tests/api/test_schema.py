"""The OpenAPI document lists every route of both APIs with the statuses its code returns,
each error with the uniform body (`api.schema.standard_error_statuses` and the views' own)."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern

from api.urls import ops_urlpatterns, v1_urlpatterns

ERROR_REF = "#/components/schemas/Error"


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    response = Client().get("/api/schema/?format=json")
    assert response.status_code == 200
    return dict(response.json())


def _openapi_path(prefix: str, pattern: URLPattern) -> str:
    route = str(pattern.pattern)
    for converter in ("str:", "int:"):
        route = route.replace(f"<{converter}", "{")
    return prefix + route.replace(">", "}")


def _routes() -> list[tuple[str, str, Any]]:
    routes = []
    for prefix, patterns in (("/v1/", v1_urlpatterns), ("/api/ops/", ops_urlpatterns)):
        for pattern in patterns:
            view = pattern.callback.view_class  # type: ignore[attr-defined]
            for method in ("get", "post", "put", "patch", "delete"):
                if hasattr(view, method):
                    routes.append((method, _openapi_path(prefix, pattern), view))
    return routes


ROUTES = _routes()


def test_every_route_and_method_is_in_the_schema(document: dict[str, Any]) -> None:
    documented = {
        (method, path) for path, operations in document["paths"].items() for method in operations
    }
    assert {(method, path) for method, path, _ in ROUTES} == documented
    assert len(ROUTES) >= 46


@pytest.mark.parametrize(("method", "path"), [(m, p) for m, p, _ in ROUTES])
def test_each_route_documents_its_error_statuses(
    document: dict[str, Any], method: str, path: str
) -> None:
    operation = document["paths"][path][method]
    responses = operation["responses"]
    # Authentication and the caller's role on every route.
    required = {"401", "403"}
    if "{" in path:
        required.add("404")  # a path parameter names an object
    if any(p["in"] == "query" for p in operation.get("parameters", [])):
        required.add("400")  # a query parameter out of range, unknown or not a number
    if method == "get" and "{" not in path:
        required.add("400")  # a list: an unknown query parameter
    if "requestBody" in operation:
        required |= {"400", "413"}  # a bad or unknown field; a body past the route's limit
    headers = {p["name"] for p in operation.get("parameters", []) if p["in"] == "header"}
    if "Idempotency-Key" in headers:
        required |= {"400", "409", "422"}  # a malformed key; in flight; reused
    assert required <= set(responses), (method, path, sorted(responses))
    success = [code for code in responses if code.startswith("2")]
    assert success, (method, path)
    for code, response in responses.items():
        if code.startswith(("4", "5")):
            schema = response["content"]["application/json"]["schema"]
            assert schema == {"$ref": ERROR_REF}, (method, path, code)
            assert response["description"], (method, path, code)


def test_the_error_component_is_the_uniform_body(document: dict[str, Any]) -> None:
    components = document["components"]["schemas"]
    assert set(components["Error"]["properties"]) == {"error"}
    detail = components["ErrorDetail"]["properties"]
    assert set(detail) == {"message", "type", "param", "code"}
