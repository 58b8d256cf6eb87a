"""`/api/ops/usage`: every tenant's inference usage, per time bucket, tenant and model."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import OperatorAPIView
from api.apis.usage_params import MAX_BUCKETS, TIME_PARAMETERS, bucket_width, time_range
from api.apis.usage_serializers import UsageOpsListSerializer, UsageOpsRowSerializer
from api.errors import HarliError
from api.selectors import tenant_get
from api.serializers import ErrorSerializer
from api.usage_selectors import BUCKET_SECONDS, bucket_starts, usage_sums


class UsageOpsApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_usage_list",
        summary="Inference usage per bucket, tenant and model (buckets with usage only)",
        parameters=[
            *TIME_PARAMETERS,
            OpenApiParameter("tenant", str, description="only this tenant (by name)"),
            OpenApiParameter("model", str, description="only this model name"),
        ],
        responses={200: UsageOpsListSerializer, 400: ErrorSerializer, 404: ErrorSerializer},
    )
    def get(self, request: Request) -> Response:
        start, end = time_range(request)
        width = bucket_width(request)
        buckets = len(bucket_starts(start=start, end=end, width=width))
        if buckets > MAX_BUCKETS[width]:
            raise HarliError(
                f"The range spans {buckets} buckets of {width}; at most {MAX_BUCKETS[width]} "
                "per call: narrow it or use a wider bucket_width.",
                param="end_time",
                code="range_too_large",
            )
        tenant_name = request.query_params.get("tenant")
        model = request.query_params.get("model")
        rows = usage_sums(
            tenant=tenant_get(name=tenant_name) if tenant_name else None,
            start=start,
            end=end,
            width=width,
            models=[model] if model else None,
            by_model=True,
            by_tenant=True,
        )
        data = UsageOpsRowSerializer(
            rows, many=True, context={"bucket_seconds": BUCKET_SECONDS[width]}
        ).data
        return Response({"object": "list", "data": data})
