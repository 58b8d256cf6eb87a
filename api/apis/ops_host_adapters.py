"""`/api/ops/hosts/<name>/adapters`: what a host serves and what operators ordered about it;
`.../adapters/load` and `.../adapters/unload` `{"model"}` load or unload a fine-tuned model on
that host now, without restarting it (`api.services.host_adapters`). Both answer 202: the
command goes to the host once the order commits, and the outcome shows in this list (`served`
after its next heartbeat, or the host's `failure`)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import OperatorAPIView
from api.apis.fields import body_fields_check, query_params_check, serializer_fields
from api.schema import error_responses
from api.serializers import ErrorSerializer, list_serializer
from api.services.host_adapters import (
    HostAdapterEntry,
    host_adapter_list,
    host_adapter_load,
    host_adapter_unload,
)


class HostAdapterSerializer(serializers.Serializer):
    name = serializers.CharField()
    served = serializers.BooleanField(help_text="the host's last heartbeat named it")
    order = serializers.CharField(allow_null=True, help_text="the operator's last order")
    failure = serializers.CharField(allow_blank=True, help_text="the host's last load failure")
    failed_at = serializers.DateTimeField(allow_null=True)


HostAdapterList = list_serializer(HostAdapterSerializer, "HostAdapterList")


class HostAdapterOrderSerializer(serializers.Serializer):
    model = serializers.CharField(max_length=255, help_text="a fine-tuned model's name")


def _model(request: Request) -> str:
    body_fields_check(request.data, allowed=serializer_fields(HostAdapterOrderSerializer))
    serializer = HostAdapterOrderSerializer(data=request.data)
    serializer.is_valid(raise_exception=True)
    return str(serializer.validated_data["model"])


def _entry(host: str, model: str) -> dict[str, Any]:
    entry = next(e for e in host_adapter_list(host_name=host) if e.name == model)
    return dict(HostAdapterSerializer(entry).data)


def _listing(entries: list[HostAdapterEntry]) -> dict[str, Any]:
    return {"object": "list", "data": HostAdapterSerializer(entries, many=True).data}


class HostAdaptersApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_host_adapters_list",
        responses={200: HostAdapterList, **error_responses(404)},
    )
    def get(self, request: Request, name: str) -> Response:
        query_params_check(request)
        return Response(_listing(host_adapter_list(host_name=name)))


class HostAdapterLoadApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_host_adapters_load",
        summary="Serve a fine-tuned model on a host now",
        request=HostAdapterOrderSerializer,
        responses={202: HostAdapterSerializer, 400: ErrorSerializer, 404: ErrorSerializer,
                   409: ErrorSerializer},
    )  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        model = _model(request)
        order = host_adapter_load(host_name=name, model=model)
        return Response(_entry(order.host.name, model), status=status.HTTP_202_ACCEPTED)


class HostAdapterUnloadApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_host_adapters_unload",
        summary="Stop serving a model on a host now",
        request=HostAdapterOrderSerializer,
        responses={202: HostAdapterSerializer, 400: ErrorSerializer, 404: ErrorSerializer},
    )
    def post(self, request: Request, name: str) -> Response:
        model = _model(request)
        order = host_adapter_unload(host_name=name, model=model)
        return Response(_entry(order.host.name, model), status=status.HTTP_202_ACCEPTED)
