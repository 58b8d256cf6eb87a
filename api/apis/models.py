"""`/v1/models`: base models plus the tenant's finished adapters (checkpoints are retrievable by
name, not listed, as OpenAI's); delete a fine-tuned model or checkpoint."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.apis.fields import query_params_check
from api.selectors import model_get, model_list
from api.serializers import (
    ErrorSerializer,
    ModelDeletedSerializer,
    ModelListSerializer,
    ModelObjectSerializer,
)
from api.services.models import fine_tuned_model_delete


class ModelCollectionApi(TenantScopedAPIView):
    @extend_schema(operation_id="models_list", responses={200: ModelListSerializer})
    def get(self, request: Request) -> Response:
        query_params_check(request)
        data = ModelObjectSerializer(model_list(tenant=self.tenant), many=True).data
        return Response({"object": "list", "data": list(data)})


class ModelDetailApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="models_retrieve", responses={200: ModelObjectSerializer, 404: ErrorSerializer}
    )
    def get(self, request: Request, model: str) -> Response:
        return Response(ModelObjectSerializer(model_get(tenant=self.tenant, model_id=model)).data)

    @extend_schema(
        operation_id="models_delete",
        summary="Delete a fine-tuned model or checkpoint (unloaded from every host)",
        responses={
            200: ModelDeletedSerializer,
            403: ErrorSerializer,
            404: ErrorSerializer,
            409: ErrorSerializer,
        },
    )
    def delete(self, request: Request, model: str) -> Response:
        fine_tuned_model_delete(tenant=self.tenant, model_id=model)
        return Response({"id": model, "object": "model", "deleted": True})
