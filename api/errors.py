"""One domain error type and one DRF exception handler, so every error body has one shape.

The body is OpenAI's: `{"error": {"message", "type", "param", "code"}}`, on `/v1` and on
`/api/ops/` alike. Services raise `HarliError` (or a subclass); views never build error bodies.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import (
    RequestDataTooBig,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response


class HarliError(Exception):
    """A failure the caller can act on, with the HTTP status it maps to.

    `type` follows OpenAI's vocabulary (`invalid_request_error`, `authentication_error`,
    `permission_error`, `not_found_error`, `conflict_error`, `server_error`); `param` names the
    offending input field, if any; `code` is a stable machine-readable reason.
    """

    http_status: int = status.HTTP_400_BAD_REQUEST
    error_type: str = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        http_status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        if http_status is not None:
            self.http_status = http_status

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.error_type, param=self.param, code=self.code)


class NotFoundError(HarliError):
    """The object does not exist or belongs to another tenant (the two are indistinguishable)."""

    http_status = status.HTTP_404_NOT_FOUND
    error_type = "invalid_request_error"


class ConflictError(HarliError):
    """The request is valid but the object's state forbids it (e.g. cancelling a finished job)."""

    http_status = status.HTTP_409_CONFLICT
    error_type = "invalid_request_error"


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _first_validation_error(detail: Any, path: str = "") -> tuple[str | None, str, str | None]:
    """Flatten DRF's nested validation detail to (param, message, code) of the first error."""
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = path if key == "non_field_errors" else (f"{path}.{key}" if path else str(key))
            return _first_validation_error(value, name)
    if isinstance(detail, list):
        for index, value in enumerate(detail):
            if isinstance(value, (dict, list)):
                return _first_validation_error(value, f"{path}[{index}]" if path else str(index))
            return _first_validation_error(value, path)
    code = getattr(detail, "code", None)
    return (path or None, str(detail), str(code) if code else None)


_DRF_TYPES: dict[int, str] = {
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
}


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's EXCEPTION_HANDLER: map domain and DRF errors to the uniform body.

    Django's refusals of a body as it is read (too large: 413; too many form fields or files:
    400) get the same body. Anything else propagates (a 500, rendered by `server_error_view`
    outside DEBUG).
    """
    if isinstance(exc, HarliError):
        return Response(exc.body(), status=exc.http_status)
    if isinstance(exc, RequestDataTooBig):
        # A body without Content-Length that grew past DATA_UPLOAD_MAX_MEMORY_SIZE as it was read
        # (one that declares its size is refused before, by api.middleware).
        body = error_body(
            "The request body is larger than this route accepts.",
            type_="invalid_request_error",
            code="request_too_large",
        )
        return Response(body, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, (TooManyFieldsSent, TooManyFilesSent)):
        body = error_body(str(exc), type_="invalid_request_error", code="too_many_fields")
        return Response(body, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    if not isinstance(exc, exceptions.APIException):
        return None
    headers: dict[str, str] = {}
    auth_header = getattr(exc, "auth_header", None)
    if auth_header:
        headers["WWW-Authenticate"] = auth_header
    wait = getattr(exc, "wait", None)
    if wait:
        headers["Retry-After"] = str(int(wait))
    if isinstance(exc, exceptions.ValidationError):
        param, message, code = _first_validation_error(exc.detail)
        if param and not message.lower().startswith(param.lower()):
            message = f"{param}: {message}"
        body = error_body(message, type_="invalid_request_error", param=param, code=code)
    else:
        detail = exc.detail
        message = str(detail) if not isinstance(detail, (list, dict)) else str(exc)
        code = getattr(detail, "code", None)
        body = error_body(
            message,
            type_=_DRF_TYPES.get(exc.status_code, "invalid_request_error"),
            code=str(code) if code else None,
        )
    return Response(body, status=exc.status_code, headers=headers)


API_PATH_PREFIXES = ("/v1/", "/api/")


def is_api_path(request: HttpRequest) -> bool:
    return request.path == "/v1" or request.path.startswith(API_PATH_PREFIXES)


def not_found_view(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """handler404: unknown URLs under the APIs get the uniform body; pages get Django's page."""
    if not is_api_path(request):
        return defaults.page_not_found(request, exception or Http404())
    return JsonResponse(
        error_body(
            f"Unknown request URL: {request.method} {request.path}.",
            type_="invalid_request_error",
            code="unknown_url",
        ),
        status=404,
    )


def server_error_view(request: HttpRequest) -> HttpResponse:
    """handler500: an unexpected failure, without internals in the body."""
    if not is_api_path(request):
        return defaults.server_error(request)
    return JsonResponse(
        error_body(
            "The server had an error while processing your request.",
            type_="server_error",
            code="internal_error",
        ),
        status=500,
    )
