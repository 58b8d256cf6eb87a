"""`/v1/models`: base models plus the tenant's finished adapters."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.selectors import model_get, model_list
from api.serializers import ErrorSerializer, ModelListSerializer, ModelObjectSerializer


class ModelCollectionApi(TenantScopedAPIView):
    @extend_schema(operation_id="models_list", responses={200: ModelListSerializer})
    def get(self, request: Request) -> Response:
        data = ModelObjectSerializer(model_list(tenant=self.tenant), many=True).data
        return Response({"object": "list", "data": list(data)})


class ModelDetailApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="models_retrieve", responses={200: ModelObjectSerializer, 404: ErrorSerializer}
    )
    def get(self, request: Request, model: str) -> Response:
        return Response(ModelObjectSerializer(model_get(tenant=self.tenant, model_id=model)).data)
