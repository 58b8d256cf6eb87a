"""The request id of each web request (`gpu_runtime.contract.request_id` says how it travels).

:class:`RequestIdMiddleware` (first in `MIDDLEWARE`) takes the client's `X-Request-Id` when it
is valid, else makes one; binds it to every log line of the request (with the tenant once
`api.apis.base` resolves it, and the job a URL names); answers it in `x-request-id`; and logs
one access line (logger `harli.request`) when the response leaves. Tasks the request queues
inherit it through their message headers (`workers.request_ids`), host commands through their
`request_id` field (`workers.commands`).

Every 4xx and 5xx also leaves Django's `django.request` line under the request's id (a 500
from an exception exactly one, at ERROR, with the traceback).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.utils.log import log_response

from gpu_runtime.contract.request_id import (
    REQUEST_ID_HEADER,
    bind_log_context,
    request_id_or_new,
    reset_log_context,
)

access_logger = logging.getLogger("harli.request")

JOB_URL_KWARGS = ("fine_tuning_job_id", "job_id")
"""URL parameters that name a fine-tuning job (`api.urls`)."""
QUIET_PATHS = frozenset({"/healthz", "/readyz"})
"""Probes, called every few seconds: their access lines are DEBUG."""


class RequestIdMiddleware:
    """See the module docstring."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request_id = request_id_or_new(request.META.get("HTTP_X_REQUEST_ID"))
        request.request_id = request_id  # type: ignore[attr-defined]
        token = bind_log_context(request_id=request_id)
        started = time.monotonic()
        try:
            response = self.get_response(request)
            response[REQUEST_ID_HEADER] = request_id
            if response.status_code >= 400:
                # Django's own line for a 4xx/5xx, here, so it carries the request id (under
                # ASGI Django writes it after the middleware returned; a 500 from an exception
                # was logged already, with its traceback, and is not logged twice)
                log_response(
                    "%s: %s", response.reason_phrase, request.path,
                    response=response, request=request,
                )  # fmt: skip
            level = logging.DEBUG if request.path in QUIET_PATHS else logging.INFO
            access_logger.log(
                level,
                "%s %s %d",
                request.method,
                request.path,
                response.status_code,
                extra={
                    "method": request.method,
                    "path": request.path,
                    "status": response.status_code,
                    "duration_ms": round((time.monotonic() - started) * 1000, 1),
                },
            )
            return response
        finally:
            reset_log_context(token)

    def process_view(
        self,
        request: HttpRequest,
        view_func: Callable[..., Any],
        view_args: tuple[Any, ...],
        view_kwargs: dict[str, Any],
    ) -> None:
        job_id = next((view_kwargs[k] for k in JOB_URL_KWARGS if k in view_kwargs), None)
        if isinstance(job_id, str):
            bind_log_context(job_id=job_id[:64])
