"""`/api/ops/hosts/<name>/engine_groups`: the deployments a host serves and on which GPUs.

`GET` lists the host's groups; `POST {"deployment", "first_gpu"?}` adds one (default: the
lowest free GPU range aligned to the deployment's `tensor_parallel_size`); `DELETE
.../engine_groups/<index>` removes one, refused (409) while a placement on it is open. Range and
overlap rules: `api.services.engine_groups`."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import OperatorAPIView
from api.apis.fields import body_fields_check, query_params_check, serializer_fields
from api.apis.ops_serializers import EngineGroupOpsSerializer
from api.models import EngineGroup
from api.schema import error_responses
from api.serializers import ErrorSerializer, list_serializer
from api.services.engine_groups import engine_group_add, engine_group_remove
from api.services.fleet import deployment_get, host_get

EngineGroupList = list_serializer(EngineGroupOpsSerializer, "EngineGroupOpsList")


class EngineGroupAddSerializer(serializers.Serializer):
    deployment = serializers.CharField(help_text="a deployment's name")
    first_gpu = serializers.IntegerField(
        min_value=0, required=False, help_text="its first GPU (default: the lowest free range)"
    )


def _listing(groups: list[EngineGroup]) -> dict[str, Any]:
    return {"object": "list", "data": EngineGroupOpsSerializer(groups, many=True).data}


class EngineGroupsApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_engine_groups_list",
        responses={200: EngineGroupList, **error_responses(404)},
    )
    def get(self, request: Request, name: str) -> Response:
        query_params_check(request)
        host = host_get(name=name)
        return Response(_listing(list(host.engine_groups.select_related("deployment", "host"))))

    @extend_schema(
        operation_id="ops_engine_groups_add",
        summary="Serve a deployment in a new engine group of a host",
        request=EngineGroupAddSerializer,
        responses={201: EngineGroupOpsSerializer, 400: ErrorSerializer, 404: ErrorSerializer,
                   409: ErrorSerializer},
    )  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        body_fields_check(request.data, allowed=serializer_fields(EngineGroupAddSerializer))
        serializer = EngineGroupAddSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        group = engine_group_add(
            host=host_get(name=name),
            deployment=deployment_get(name=data["deployment"]),
            first_gpu=data.get("first_gpu"),
        )
        return Response(EngineGroupOpsSerializer(group).data, status=status.HTTP_201_CREATED)


class EngineGroupDetailApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_engine_groups_remove",
        summary="Stop serving an engine group (refused while a placement on it is open)",
        request=None,
        responses={204: None, 404: ErrorSerializer, 409: ErrorSerializer},
    )
    def delete(self, request: Request, name: str, index: int) -> Response:
        engine_group_remove(host=host_get(name=name), index=index)
        return Response(status=status.HTTP_204_NO_CONTENT)
