"""The error a shared limiter raises when its store cannot be reached."""

from __future__ import annotations

from rest_framework import status

from api.errors import HarliError


class RateLimiterUnavailable(HarliError):
    """The limiter's store (Redis) did not answer; nothing was decided or consumed.

    The caller chooses to fail closed (answer with this error's body, a 503) or open (let the
    request through unlimited and log it).
    """

    http_status = status.HTTP_503_SERVICE_UNAVAILABLE
    error_type = "server_error"
