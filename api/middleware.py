"""Keep the uniform error body for unknown API URLs when DEBUG shows Django's HTML 404 page."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from api.errors import is_api_path, not_found_view


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
