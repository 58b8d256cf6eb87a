"""`/v1/organization/usage/completions`: the tenant's own inference usage, in the shape of
OpenAI's Usage API (time buckets, optionally grouped by model, paged by bucket)."""

from __future__ import annotations

import base64
import binascii

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.apis.usage_params import (
    DEFAULT_BUCKETS,
    MAX_BUCKETS,
    TIME_PARAMETERS,
    bucket_limit,
    bucket_width,
    query_list,
    time_range,
)
from api.apis.usage_serializers import UsageBucketSerializer, UsagePageSerializer
from api.errors import HarliError
from api.serializers import ErrorSerializer
from api.usage_selectors import BUCKET_SECONDS, bucket_starts, usage_buckets

GROUP_BY = ("model",)
# OpenAI's filters and groups that name what Harli does not have (projects, users, batch) or
# does not record (API keys): refused, not ignored, so no sum reads as filtered when it is not.
UNSUPPORTED = ("project_ids", "user_ids", "api_key_ids", "batch")

_limits = ", ".join(
    f"{width}: default {DEFAULT_BUCKETS[width]}, max {MAX_BUCKETS[width]}"
    for width in BUCKET_SECONDS
)


def page_token(bucket_start: int) -> str:
    """The opaque `next_page` cursor: the start of the next page's first bucket."""
    return base64.urlsafe_b64encode(f"b{bucket_start}".encode()).decode().rstrip("=")


def parse_page_token(token: str) -> int:
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        if not text.startswith("b"):
            raise ValueError(text)
        return int(text[1:])
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise HarliError(
            f"page {token!r} is not a next_page value of this endpoint.",
            param="page",
            code="invalid_value",
        ) from None


class UsageCompletionsApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="usage_completions",
        summary="The tenant's completions usage, in time buckets",
        parameters=[
            *TIME_PARAMETERS,
            OpenApiParameter(
                "group_by", str, many=True, enum=list(GROUP_BY), description="group by model"
            ),
            OpenApiParameter("models", str, many=True, description="only these models"),
            OpenApiParameter("limit", int, description=f"buckets per page ({_limits})"),
            OpenApiParameter("page", str, description="the previous page's next_page"),
        ],
        responses={200: UsagePageSerializer, 400: ErrorSerializer},
    )
    def get(self, request: Request) -> Response:
        for name in UNSUPPORTED:
            if query_list(request, name):
                raise HarliError(
                    f"{name} is not supported: Harli has no projects, users or batch calls and "
                    "does not record usage per API key.",
                    param=name,
                    code="unsupported_parameter",
                )
        group_by = query_list(request, "group_by")
        unknown = [g for g in group_by if g not in GROUP_BY]
        if unknown:
            raise HarliError(
                f"group_by supports only {', '.join(GROUP_BY)}; got {', '.join(unknown)}.",
                param="group_by",
                code="invalid_value",
            )
        start, end = time_range(request)
        width = bucket_width(request)
        limit = bucket_limit(request, width)
        starts = bucket_starts(start=start, end=end, width=width)
        token = request.query_params.get("page")
        if token:
            first = parse_page_token(token)
            if first not in starts:
                raise HarliError(
                    f"page {token!r} does not belong to this time range and bucket_width.",
                    param="page",
                    code="invalid_value",
                )
            starts = starts[starts.index(first) :]
        page, rest = starts[:limit], starts[limit:]
        buckets = usage_buckets(
            tenant=self.tenant,
            start=max(start, page[0]),
            end=min(end, page[-1] + BUCKET_SECONDS[width]),
            width=width,
            models=query_list(request, "models") or None,
            by_model=bool(group_by),
        )
        return Response(
            {
                "object": "page",
                "data": UsageBucketSerializer(buckets, many=True).data,
                "has_more": bool(rest),
                "next_page": page_token(rest[0]) if rest else None,
            }
        )
