"""`/v1/organization/limits`: the calling tenant's own quotas and rate limits, with current use."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.quotas import tenant_quota_states


class QuotaSerializer(serializers.Serializer):
    name = serializers.CharField()
    description = serializers.CharField()
    limit = serializers.IntegerField(help_text="the quota in force (0 refuses everything)")
    used = serializers.IntegerField()
    remaining = serializers.IntegerField()
    default = serializers.IntegerField(help_text="the fleet default")
    override = serializers.IntegerField(
        allow_null=True, help_text="this tenant's override; null: the fleet default applies"
    )


class OrganizationLimitsSerializer(serializers.Serializer):
    object = serializers.CharField(default="organization.limits")
    quotas = QuotaSerializer(many=True)
    requests_per_minute = serializers.IntegerField(
        allow_null=True, help_text="inference requests per minute; null: no limit"
    )
    tokens_per_minute = serializers.IntegerField(
        allow_null=True, help_text="inference tokens per minute; null: no limit"
    )


class OrganizationLimitsApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="organization_limits",
        summary="The tenant's quotas (with current use) and rate limits",
        responses={200: OrganizationLimitsSerializer},
    )
    def get(self, request: Request) -> Response:
        states = tenant_quota_states(tenant=self.tenant, now=timezone.now())
        return Response(
            {
                "object": "organization.limits",
                "quotas": [state.as_dict() for state in states],
                "requests_per_minute": self.tenant.requests_per_minute,
                "tokens_per_minute": self.tenant.tokens_per_minute,
            }
        )
