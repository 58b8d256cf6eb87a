"""Query parameters of the usage reads (`/v1/organization/usage/completions`,
`/api/ops/usage`): Unix times, bucket widths, lists; a bad value is a 400 naming it."""

from __future__ import annotations

import time

from drf_spectacular.utils import OpenApiParameter
from rest_framework.request import Request

from api.errors import HarliError
from api.usage_selectors import BUCKET_SECONDS

DEFAULT_BUCKET_WIDTH = "1d"
# Buckets per page (tenant API) or per call (operator API), by width, as OpenAI's Usage API.
DEFAULT_BUCKETS = {"1d": 7, "1h": 24, "1m": 60}
MAX_BUCKETS = {"1d": 31, "1h": 168, "1m": 1440}
# Unix seconds a time may name: 1970 to the end of 9999 (what a datetime holds).
MAX_UNIX_S = 253_402_300_799

TIME_PARAMETERS = [
    OpenApiParameter(
        "start_time",
        int,
        required=True,
        description="start of the range, Unix seconds, inclusive",
    ),
    OpenApiParameter(
        "end_time", int, description="end of the range, Unix seconds, exclusive (default: now)"
    ),
    OpenApiParameter(
        "bucket_width",
        str,
        enum=list(BUCKET_SECONDS),
        description="width of each time bucket, aligned to UTC (default 1d)",
    ),
]


def query_list(request: Request, name: str) -> list[str]:
    """Every value of `name`, given as `name=a&name=b`, `name[]=a` (the openai client's form)
    or `name=a,b`; blanks dropped."""
    raw = request.query_params.getlist(name) + request.query_params.getlist(f"{name}[]")
    return [item.strip() for value in raw for item in value.split(",") if item.strip()]


def unix_time(request: Request, name: str, *, default: int | None = None) -> int:
    """The query parameter `name` as Unix seconds; required when `default` is None."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        if default is None:
            raise HarliError(
                f"Missing required parameter '{name}' (Unix seconds).",
                param=name,
                code="missing_required_parameter",
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise HarliError(
            f"{name} must be an integer (Unix seconds), got {raw!r}.",
            param=name,
            code="invalid_value",
        ) from None
    if not 0 <= value <= MAX_UNIX_S:
        raise HarliError(
            f"{name} must be between 0 and {MAX_UNIX_S} (Unix seconds), got {value}.",
            param=name,
            code="invalid_value",
        )
    return value


def time_range(request: Request) -> tuple[int, int]:
    """`start_time` (required) and `end_time` (default now), with start before end."""
    start = unix_time(request, "start_time")
    end = unix_time(request, "end_time", default=max(int(time.time()), start + 1))
    if end <= start:
        raise HarliError(
            f"end_time ({end}) must be after start_time ({start}).",
            param="end_time",
            code="invalid_value",
        )
    return start, end


def bucket_width(request: Request) -> str:
    raw = request.query_params.get("bucket_width") or DEFAULT_BUCKET_WIDTH
    if raw not in BUCKET_SECONDS:
        raise HarliError(
            f"bucket_width must be one of {', '.join(BUCKET_SECONDS)}; got {raw!r}.",
            param="bucket_width",
            code="invalid_value",
        )
    return raw


def bucket_limit(request: Request, width: str) -> int:
    """`limit`: how many buckets, 1 to MAX_BUCKETS[width] (default DEFAULT_BUCKETS[width])."""
    raw = request.query_params.get("limit")
    if raw is None or raw == "":
        return DEFAULT_BUCKETS[width]
    try:
        limit = int(raw)
    except ValueError:
        raise HarliError(
            f"limit must be an integer, got {raw!r}.", param="limit", code="invalid_value"
        ) from None
    if not 1 <= limit <= MAX_BUCKETS[width]:
        raise HarliError(
            f"limit must be between 1 and {MAX_BUCKETS[width]} for bucket_width={width}, "
            f"got {limit}.",
            param="limit",
            code="invalid_value",
        )
    return limit
