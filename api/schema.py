"""OpenAPI schema of both APIs (drf-spectacular): the API-key scheme, and the error statuses
every operation documents.

`HarliAutoSchema` (the `DEFAULT_SCHEMA_CLASS`) adds to each operation's own responses the
statuses any route of its kind can return, all with the uniform error body
(`ErrorSerializer`): see `standard_error_statuses`. A view documents the statuses only it
returns in its `extend_schema(responses=...)`, with `error_responses(409, 429, ...)` for the
error body, so the two lists merge and a status is declared once.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid request: a parameter or body field is missing, unknown or out of range "
    "(`param` names it), or the body is not valid JSON.",
    401: "No API key, or one that matches no active key (or no operator session).",
    403: "The key or session may not call this API (a tenant key on the operator API, an "
    "operator on a tenant route), or the object may not be changed this way.",
    404: "No such object for this caller (another tenant's object is not found either).",
    409: "The object's state forbids the operation, or a request with the same "
    "`Idempotency-Key` is still in flight.",
    413: "The request body is larger than this route accepts (refused from Content-Length).",
    422: "The `Idempotency-Key` was used with another request.",
    429: "Too many requests or a quota is exhausted; `Retry-After` says when to retry.",
}

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    """`extend_schema` responses for `statuses`, each the uniform error body."""
    from api.serializers import ErrorSerializer

    return {
        status: OpenApiResponse(ErrorSerializer, description=ERROR_DESCRIPTIONS[status])
        for status in statuses
    }


def standard_error_statuses(
    *, method: str, path: str, has_query: bool, has_body: bool, idempotent: bool = False
) -> tuple[int, ...]:
    """The error statuses every operation with this shape can return.

    401 and 403: every route authenticates and checks the caller's role. 404: a path
    parameter names an object. 400: the operation reads query parameters or a body, or
    lists a collection (an unknown query parameter is refused, `api.apis.fields`).
    413: a body is read (`api.middleware.declared_size_refusal`). An operation that takes
    `Idempotency-Key` (`api.idempotency`): 400 (a malformed key), 409 (in flight), 422 (reused).
    """
    statuses = [401, 403]
    if "{" in path:
        statuses.append(404)
    lists = method == "GET" and "{" not in path
    if has_query or has_body or lists:
        statuses.append(400)
    if has_body:
        statuses.append(413)
    if idempotent:
        statuses.extend((400, 409, 422))
    return tuple(sorted(set(statuses)))


class HarliAutoSchema(AutoSchema):
    """drf-spectacular's schema, plus `standard_error_statuses` on every operation."""

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = dict(super()._get_response_bodies(direction))
        from api.idempotency import HEADER as IDEMPOTENCY_HEADER

        parameters = self._get_parameters()
        has_query = any(p.get("in") == "query" for p in parameters)
        has_body = self.method in BODY_METHODS and self.get_request_serializer() is not None
        idempotent = any(
            p.get("in") == "header" and p.get("name") == IDEMPOTENCY_HEADER for p in parameters
        )
        statuses = standard_error_statuses(
            method=self.method,
            path=self.path,
            has_query=has_query,
            has_body=has_body,
            idempotent=idempotent,
        )
        for status, response in error_responses(*statuses).items():
            if str(status) not in responses:
                responses[str(status)] = self._get_response_for_code(
                    response, str(status), direction=direction
                )
        for code, response in responses.items():
            if not response.get("description") and int(code) in ERROR_DESCRIPTIONS:
                response["description"] = ERROR_DESCRIPTIONS[int(code)]
        return dict(sorted(responses.items()))


def closed_request_bodies(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Postprocessing hook: every request body's object schema has `additionalProperties:
    false`, as the views refuse a field they do not take (`api.apis.fields`)."""
    components = result.get("components", {}).get("schemas", {})
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            content = operation.get("requestBody", {}).get("content", {})
            for media in content.values():
                ref = media.get("schema", {}).get("$ref", "")
                component = components.get(ref.rpartition("/")[2])
                if component is not None and component.get("type") == "object":
                    component["additionalProperties"] = False
    return result


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "api.authentication.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key (`hk-...`) as a bearer token.",
        }
