"""API middleware: the uniform error body for unknown API URLs under DEBUG, and request-size
limits enforced from the headers before any body is read."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import Resolver404, resolve

from api.errors import API_PATH_PREFIXES, error_body, is_api_path, not_found_view

NUL = "\x00"
# Room for the multipart framing and form fields around the file in an upload's body.
MULTIPART_OVERHEAD_BYTES = 64 * 1024


class ApiNotFoundMiddleware:
    """Replace an HTML 404 on `/v1` or `/api/` (Django's DEBUG page) with the JSON error body.

    Outside DEBUG, `handler404` already produces the same body; this only covers DEBUG.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (
            response.status_code == 404
            and is_api_path(request)
            and response.get("Content-Type", "").startswith("text/html")
        ):
            return not_found_view(request)
        return response


BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def declared_size_refusal(
    method: str, path: str, content_length: str | None
) -> HttpResponse | None:
    """The 413 for a request whose declared `Content-Length` cannot fit its route's limit (see
    `RequestSizeLimitMiddleware`), or None. Reads headers only: the ASGI app calls it before
    Django reads the body, and the middleware covers servers that call Django directly."""
    if method not in BODY_METHODS or not path.startswith(API_PATH_PREFIXES):
        return None
    try:
        declared = int(content_length or 0)
        route = resolve(path).view_name
    except (ValueError, Resolver404):
        return None
    if route == "v1:files":
        limit = int(settings.HARLI_MAX_UPLOAD_BYTES) + MULTIPART_OVERHEAD_BYTES
        what, param, code = "a file sent to POST /v1/files", "file", "file_too_large"
        shown = int(settings.HARLI_MAX_UPLOAD_BYTES)
        advice = "Upload larger files in parts with the Uploads API (POST /v1/uploads)."
    elif route == "v1:upload-parts":
        limit = int(settings.HARLI_UPLOAD_PART_MAX_BYTES) + MULTIPART_OVERHEAD_BYTES
        what, param, code = "an upload part", "data", "part_too_large"
        shown = int(settings.HARLI_UPLOAD_PART_MAX_BYTES)
        advice = "Split the file into smaller parts."
    elif settings.DATA_UPLOAD_MAX_MEMORY_SIZE is None:
        return None
    else:
        limit = shown = int(settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        what, param, code = f"the body of {method} {path}", None, "request_too_large"
        advice = ""
    if declared <= limit:
        return None
    message = f"The request body has {declared} bytes; {what} may have at most {shown} bytes."
    return JsonResponse(
        error_body(
            f"{message} {advice}".strip(), type_="invalid_request_error", param=param, code=code
        ),
        status=413,
    )


class RequestSizeLimitMiddleware:
    """Answer 413 (the uniform error body) to an API request whose declared `Content-Length`
    cannot fit its route, before the body is read or spooled.

    `POST /v1/files` may carry `HARLI_MAX_UPLOAD_BYTES` of file, a part
    (`POST /v1/uploads/{id}/parts`) `HARLI_UPLOAD_PART_MAX_BYTES`, each plus
    `MULTIPART_OVERHEAD_BYTES` of framing: this refuses only bodies too big for any file within
    the limit; the services check the file's exact size once it is parsed. Every other body
    (POST, PUT, PATCH under `/v1/` and `/api/`) may have `DATA_UPLOAD_MAX_MEMORY_SIZE` bytes,
    the limit Django applies when it reads one (a body without `Content-Length` that grows
    past it is refused by `api.errors.exception_handler`, also 413). The server still
    decides what happens to the unread bytes. Under `config.asgi` Django reads a body before
    its middleware runs, so the ASGI app applies the same check first (`api.gateway.asgi`).
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        refusal = declared_size_refusal(
            request.method or "", request.path_info, request.META.get("CONTENT_LENGTH")
        )
        return refusal if refusal is not None else self.get_response(request)


class NulRefusalMiddleware:
    """Refuse a NUL character in an API request's URL or `Authorization` header before any
    view, authentication or database query sees it (PostgreSQL text cannot hold NUL).

    A path holding NUL names no object: 404 (`unknown_url`, as for any unknown URL). A query
    parameter: 400. The `Authorization` header: 401, as for any key that matches none. Body
    strings are refused by the API's parsers (`api.parsers`).
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not is_api_path(request) and NUL not in request.path:
            return self.get_response(request)
        if NUL in request.path_info:
            return not_found_view(request)
        if any(
            NUL in key or any(NUL in value for value in values)
            for key, values in request.GET.lists()
        ):
            return JsonResponse(
                error_body(
                    "Query parameters cannot contain the NUL character (%00).",
                    type_="invalid_request_error",
                    code="invalid_query",
                ),
                status=400,
            )
        if NUL in request.META.get("HTTP_AUTHORIZATION", ""):
            response = JsonResponse(
                error_body(
                    "Incorrect API key provided.",
                    type_="authentication_error",
                    code="invalid_api_key",
                ),
                status=401,
            )
            response["WWW-Authenticate"] = 'Bearer realm="harli"'
            return response
        return self.get_response(request)
