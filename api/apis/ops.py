"""`/api/ops/`: the operator API over the fleet and every tenant's jobs."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import OperatorAPIView
from api.apis.fields import body_fields_check, query_params_check, serializer_fields
from api.apis.files import PAGING_PARAMETERS
from api.apis.ops_serializers import (
    ApiKeyOpsSerializer,
    BaseModelOpsSerializer,
    DeploymentOpsSerializer,
    FinetuneJobOpsSerializer,
    GpuHostOpsSerializer,
    JobEventOpsSerializer,
    PlacementOpsSerializer,
    TenantDetailOpsSerializer,
    TenantOpsSerializer,
    TenantQuotasPatchSerializer,
)
from api.errors import HarliError, NotFoundError
from api.models import (
    Dtype,
    Engine,
    HostStatus,
    JobStatus,
    PlacementState,
    Tenant,
    User,
    UserRole,
)
from api.pagination import cursor_page, page_body, parse_limit
from api.presets import PRESETS
from api.quotas import tenant_quota_states
from api.schema import error_responses
from api.selectors import (
    api_key_list,
    base_model_list,
    deployment_list,
    finetune_job_get,
    finetune_job_list,
    host_list,
    job_event_list,
    placement_list,
    tenant_get,
    tenant_list,
)
from api.serializers import ErrorSerializer, list_serializer
from api.services.apikeys import api_key_issue, api_key_issue_for_tenant, api_key_revoke
from api.services.fleet import (
    base_model_get,
    base_model_register,
    deployment_create,
    deployment_get,
    host_drain,
    host_get,
    host_register,
    host_undrain,
)
from api.services.jobs import finetune_job_cancel
from api.services.quotas import tenant_quotas_set
from api.services.tenants import tenant_create, tenant_limits_set

LISTS = {
    item: list_serializer(item, item.__name__.replace("Serializer", "List"))
    for item in (
        TenantOpsSerializer,
        ApiKeyOpsSerializer,
        BaseModelOpsSerializer,
        DeploymentOpsSerializer,
        GpuHostOpsSerializer,
        PlacementOpsSerializer,
        FinetuneJobOpsSerializer,
        JobEventOpsSerializer,
    )
}


def _valid(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    """The body, validated by `serializer_class`; a field it does not declare is a 400."""
    body_fields_check(data, allowed=serializer_fields(serializer_class))
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def _listing(data: Any) -> dict[str, Any]:
    return {"object": "list", "data": list(data)}


def _choice_param(request: Request, param: str, choices: list[str]) -> str | None:
    """The query parameter `param`, None when absent; a value outside `choices` is a 400 (a
    typo such as `status=runing` would otherwise list nothing, as if no row matched)."""
    raw = request.query_params.get(param)
    if raw is None or raw == "":
        return None
    if raw not in choices:
        raise HarliError(
            f"{param} must be one of {', '.join(choices)}; got {raw!r}.",
            param=param,
            code="invalid_value",
        )
    return raw


class TenantsApi(OperatorAPIView):
    class TenantCreateSerializer(serializers.Serializer):
        name = serializers.CharField()

    @extend_schema(operation_id="ops_tenants_list", responses={200: LISTS[TenantOpsSerializer]})
    def get(self, request: Request) -> Response:
        query_params_check(request)
        return Response(_listing(TenantOpsSerializer(tenant_list(), many=True).data))

    @extend_schema(
        operation_id="ops_tenants_create",
        request=TenantCreateSerializer,
        responses={201: TenantOpsSerializer, 400: ErrorSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request) -> Response:
        tenant = tenant_create(**_valid(self.TenantCreateSerializer, request.data))
        return Response(TenantOpsSerializer(tenant).data, status=status.HTTP_201_CREATED)


def _tenant_detail(tenant: Tenant) -> dict[str, Any]:
    """A tenant's operator record with its quotas and their current use."""
    states = tenant_quota_states(tenant=tenant, now=timezone.now())
    return {**TenantOpsSerializer(tenant).data, "quotas": [s.as_dict() for s in states]}


class TenantDetailApi(OperatorAPIView):
    class TenantLimitsSerializer(serializers.Serializer):
        requests_per_minute = serializers.IntegerField(
            allow_null=True, required=False, help_text="a positive integer, or null for no limit"
        )
        tokens_per_minute = serializers.IntegerField(
            allow_null=True, required=False, help_text="a positive integer, or null for no limit"
        )
        quotas = TenantQuotasPatchSerializer(
            required=False,
            help_text="quota overrides: an integer from 0, or null for the fleet default; "
            "a quota left out keeps its value",
        )

    @extend_schema(
        operation_id="ops_tenants_retrieve",
        responses={200: TenantDetailOpsSerializer, 404: ErrorSerializer},
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(_tenant_detail(tenant_get(name=name)))

    @extend_schema(
        operation_id="ops_tenants_limits_set",
        summary="Set a tenant's rate limits and quotas (a field left out keeps its value)",
        request=TenantLimitsSerializer,
        responses={200: TenantDetailOpsSerializer, 400: ErrorSerializer, 404: ErrorSerializer},
    )
    def patch(self, request: Request, name: str) -> Response:
        tenant = tenant_get(name=name)
        quotas = request.data.get("quotas") if isinstance(request.data, dict) else None
        data = _valid(self.TenantLimitsSerializer, request.data)
        with transaction.atomic():
            tenant = tenant_limits_set(
                tenant=tenant,
                requests_per_minute=data.get("requests_per_minute", tenant.requests_per_minute),
                tokens_per_minute=data.get("tokens_per_minute", tenant.tokens_per_minute),
            )
            if "quotas" in data:
                tenant_quotas_set(tenant=tenant, changes=quotas)
        return Response(_tenant_detail(tenant))


class ApiKeysApi(OperatorAPIView):
    class ApiKeyIssueSerializer(serializers.Serializer):
        tenant = serializers.CharField(required=False, help_text="issue for this tenant")
        operator = serializers.CharField(required=False, help_text="or for this operator")
        name = serializers.CharField(required=False, allow_blank=True, default="")

    @extend_schema(
        operation_id="ops_apikeys_list",
        parameters=[OpenApiParameter("tenant", str)],
        responses={200: LISTS[ApiKeyOpsSerializer], **error_responses(404)},
    )
    def get(self, request: Request) -> Response:
        query_params_check(request, allowed=("tenant",))
        tenant_name = request.query_params.get("tenant")
        tenant = tenant_get(name=tenant_name) if tenant_name else None
        return Response(_listing(ApiKeyOpsSerializer(api_key_list(tenant=tenant), many=True).data))

    @extend_schema(
        operation_id="ops_apikeys_issue",
        request=ApiKeyIssueSerializer,
        responses={
            201: inline_serializer(
                "IssuedApiKey", {"key": serializers.CharField(), "api_key": ApiKeyOpsSerializer()}
            ),
            400: ErrorSerializer,
            **error_responses(404),
        },
    )
    def post(self, request: Request) -> Response:
        data = _valid(self.ApiKeyIssueSerializer, request.data)
        if bool(data.get("tenant")) == bool(data.get("operator")):
            raise HarliError("Give exactly one of 'tenant' or 'operator'.", param="tenant")
        if data.get("tenant"):
            issued = api_key_issue_for_tenant(
                tenant=tenant_get(name=data["tenant"]), name=data["name"]
            )
        else:
            operator = User.objects.filter(
                username=data["operator"], role=UserRole.OPERATOR
            ).first()
            if operator is None:
                raise NotFoundError(f"No operator named {data['operator']!r}.", param="operator")
            issued = api_key_issue(user=operator, name=data["name"])
        body = {"key": issued.key, "api_key": ApiKeyOpsSerializer(issued.api_key).data}
        return Response(body, status=status.HTTP_201_CREATED)


class ApiKeyRevokeApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_apikeys_revoke",
        request=None,
        responses={200: ApiKeyOpsSerializer, 404: ErrorSerializer},
    )
    def post(self, request: Request, key_id: int) -> Response:
        return Response(ApiKeyOpsSerializer(api_key_revoke(prefix_or_id=str(key_id))).data)


class BaseModelsApi(OperatorAPIView):
    class BaseModelRegisterSerializer(serializers.Serializer):
        name = serializers.CharField()
        checkpoint_dir = serializers.CharField(required=False, default="")
        preset = serializers.ChoiceField(choices=sorted(PRESETS), required=False, default="")
        architecture = serializers.CharField(
            required=False,
            help_text="the config's model_type (default: the checkpoint's config.json); one "
            "Harli's engine does not implement is served by vLLM deployments only",
        )
        dtype = serializers.ChoiceField(choices=Dtype.values, default=Dtype.BFLOAT16)
        context_length = serializers.IntegerField(min_value=1, required=False)

    @extend_schema(
        operation_id="ops_basemodels_list", responses={200: LISTS[BaseModelOpsSerializer]}
    )
    def get(self, request: Request) -> Response:
        query_params_check(request)
        return Response(_listing(BaseModelOpsSerializer(base_model_list(), many=True).data))

    @extend_schema(
        operation_id="ops_basemodels_register",
        request=BaseModelRegisterSerializer,
        responses={201: BaseModelOpsSerializer, 400: ErrorSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request) -> Response:
        base_model = base_model_register(**_valid(self.BaseModelRegisterSerializer, request.data))
        return Response(BaseModelOpsSerializer(base_model).data, status=status.HTTP_201_CREATED)


class BaseModelDetailApi(OperatorAPIView):
    @extend_schema(operation_id="ops_basemodels_retrieve", responses={200: BaseModelOpsSerializer})
    def get(self, request: Request, name: str) -> Response:
        return Response(BaseModelOpsSerializer(base_model_get(name=name)).data)


class DeploymentsApi(OperatorAPIView):
    class DeploymentCreateSerializer(serializers.Serializer):
        name = serializers.CharField()
        base_model = serializers.CharField()
        tpot_slo_ms = serializers.FloatField(min_value=0.001)
        ttft_slo_ms = serializers.FloatField(min_value=0.001)
        slo_attainment_target_pct = serializers.FloatField(
            min_value=0.0, max_value=100.0, default=99.0
        )
        tensor_parallel_size = serializers.IntegerField(
            default=1,
            help_text="GPUs each engine group shards the model over; must suit its shape",
        )
        engine = serializers.ChoiceField(
            choices=Engine.values,
            default=Engine.HARLI,
            help_text="what serves it: Harli's engine (trains too) or vLLM (any architecture)",
        )

    @extend_schema(
        operation_id="ops_deployments_list", responses={200: LISTS[DeploymentOpsSerializer]}
    )
    def get(self, request: Request) -> Response:
        query_params_check(request)
        return Response(_listing(DeploymentOpsSerializer(deployment_list(), many=True).data))

    @extend_schema(
        operation_id="ops_deployments_create",
        request=DeploymentCreateSerializer,
        responses={
            201: DeploymentOpsSerializer,
            400: ErrorSerializer,
            409: ErrorSerializer,
            **error_responses(404),
        },
    )
    def post(self, request: Request) -> Response:
        data = _valid(self.DeploymentCreateSerializer, request.data)
        data["base_model"] = base_model_get(name=data["base_model"])
        deployment = deployment_create(**data)
        return Response(DeploymentOpsSerializer(deployment).data, status=status.HTTP_201_CREATED)


class DeploymentDetailApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_deployments_retrieve", responses={200: DeploymentOpsSerializer}
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(DeploymentOpsSerializer(deployment_get(name=name)).data)


class HostsApi(OperatorAPIView):
    class HostRegisterSerializer(serializers.Serializer):
        name = serializers.CharField()
        gpu_kind = serializers.CharField()
        gpu_memory_bytes = serializers.IntegerField(min_value=1)
        gpu_count = serializers.IntegerField(min_value=1, default=1)
        deployment = serializers.CharField(
            required=False,
            help_text="served in engine group 0 from GPU 0 (more: .../engine_groups)",
        )

    @extend_schema(
        operation_id="ops_hosts_list",
        parameters=[OpenApiParameter("status", str, enum=HostStatus.values)],
        responses={200: LISTS[GpuHostOpsSerializer], 400: ErrorSerializer},
    )
    def get(self, request: Request) -> Response:
        query_params_check(request, allowed=("status",))
        hosts = host_list(status=_choice_param(request, "status", HostStatus.values))
        return Response(_listing(GpuHostOpsSerializer(hosts, many=True).data))

    @extend_schema(
        operation_id="ops_hosts_register",
        request=HostRegisterSerializer,
        responses={
            201: GpuHostOpsSerializer,
            400: ErrorSerializer,
            409: ErrorSerializer,
            **error_responses(404),
        },
    )
    def post(self, request: Request) -> Response:
        data = _valid(self.HostRegisterSerializer, request.data)
        if data.get("deployment"):
            data["deployment"] = deployment_get(name=data["deployment"])
        host = host_register(**data)
        return Response(GpuHostOpsSerializer(host).data, status=status.HTTP_201_CREATED)


class HostDetailApi(OperatorAPIView):
    @extend_schema(operation_id="ops_hosts_retrieve", responses={200: GpuHostOpsSerializer})
    def get(self, request: Request, name: str) -> Response:
        return Response(GpuHostOpsSerializer(host_get(name=name)).data)


class HostDrainApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_hosts_drain",
        request=None,
        responses={200: GpuHostOpsSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request, name: str) -> Response:
        return Response(GpuHostOpsSerializer(host_drain(host=host_get(name=name))).data)


class HostUndrainApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_hosts_undrain",
        summary="Return a draining host to service",
        request=None,
        responses={200: GpuHostOpsSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request, name: str) -> Response:
        return Response(GpuHostOpsSerializer(host_undrain(host=host_get(name=name))).data)


class PlacementsApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_placements_list",
        parameters=[
            OpenApiParameter("job", str),
            OpenApiParameter("host", str),
            OpenApiParameter("state", str, enum=PlacementState.values),
        ],
        responses={200: LISTS[PlacementOpsSerializer], 400: ErrorSerializer},
    )
    def get(self, request: Request) -> Response:
        query_params_check(request, allowed=("job", "host", "state"))
        placements = placement_list(
            job_id=request.query_params.get("job"),
            host=request.query_params.get("host"),
            state=_choice_param(request, "state", PlacementState.values),
        )
        return Response(_listing(PlacementOpsSerializer(placements, many=True).data))


class JobsApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_jobs_list",
        parameters=[
            *PAGING_PARAMETERS,
            OpenApiParameter("tenant", str),
            OpenApiParameter("status", str, enum=JobStatus.values),
        ],
        responses={
            200: LISTS[FinetuneJobOpsSerializer],
            400: ErrorSerializer,
            **error_responses(404),
        },
    )
    def get(self, request: Request) -> Response:
        query_params_check(request, allowed=("after", "limit", "tenant", "status"))
        tenant_name = request.query_params.get("tenant")
        jobs = finetune_job_list(
            tenant=tenant_get(name=tenant_name) if tenant_name else None,
            status=_choice_param(request, "status", JobStatus.values),
        )
        page = cursor_page(
            jobs,
            after=request.query_params.get("after"),
            limit=parse_limit(request.query_params.get("limit")),
            order=("created_at", "id"),
        )
        return Response(page_body(page, list(FinetuneJobOpsSerializer(page.items, many=True).data)))


class JobDetailOpsApi(OperatorAPIView):
    @extend_schema(operation_id="ops_jobs_retrieve", responses={200: FinetuneJobOpsSerializer})
    def get(self, request: Request, job_id: str) -> Response:
        return Response(FinetuneJobOpsSerializer(finetune_job_get(tenant=None, job_id=job_id)).data)


class JobEventsOpsApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_jobs_events",
        parameters=PAGING_PARAMETERS,
        responses={200: LISTS[JobEventOpsSerializer], 400: ErrorSerializer, 404: ErrorSerializer},
    )
    def get(self, request: Request, job_id: str) -> Response:
        job = finetune_job_get(tenant=None, job_id=job_id)
        page = cursor_page(
            job_event_list(job=job),
            after=request.query_params.get("after"),
            limit=parse_limit(request.query_params.get("limit")),
            order=("created_at", "id"),
        )
        return Response(page_body(page, list(JobEventOpsSerializer(page.items, many=True).data)))


class JobCancelOpsApi(OperatorAPIView):
    @extend_schema(
        operation_id="ops_jobs_cancel",
        request=None,
        responses={200: FinetuneJobOpsSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
    )
    def post(self, request: Request, job_id: str) -> Response:
        job = finetune_job_cancel(job=finetune_job_get(tenant=None, job_id=job_id))
        return Response(FinetuneJobOpsSerializer(job).data)
