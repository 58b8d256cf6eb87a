"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, pause, resume, events, checkpoints."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.apis.fields import body_fields_check, query_params_check
from api.apis.files import PAGING_PARAMETERS
from api.errors import HarliError
from api.idempotency import idempotent
from api.models import FinetuneJob
from api.pagination import cursor_page, page_body, parse_limit
from api.parsers import JsonParser
from api.progress import job_progress_map
from api.selectors import finetune_job_get, finetune_job_list, job_checkpoint_list, job_event_list
from api.serializers import (
    ErrorSerializer,
    FineTuningJobListSerializer,
    FineTuningJobSerializer,
    JobCheckpointListSerializer,
    JobCheckpointSerializer,
    JobEventListSerializer,
    JobEventSerializer,
)
from api.services.jobs import (
    finetune_job_cancel,
    finetune_job_create,
    finetune_job_pause,
    finetune_job_resume,
)
from gpu_runtime.contract.request_id import bind_log_context

CREATE_FIELDS = frozenset(
    {
        "model",
        "training_file",
        "validation_file",
        "hyperparameters",
        "method",
        "lora",
        "suffix",
        "seed",
        "metadata",
        "integrations",
    }
)
LIST_PARAMETERS = frozenset({"after", "limit"})
METADATA_PARAMETER = re.compile(r"^metadata\[(?P<key>[^\[\]]+)\]$")


def list_metadata_filter(query: Any) -> dict[str, str]:
    """`metadata[<key>]=<value>` pairs of the list's query (OpenAI's shape); any other name
    than those and `after` / `limit` is refused, not ignored."""
    wanted: dict[str, str] = {}
    for name in query:
        match = METADATA_PARAMETER.match(name)
        if match is not None:
            wanted[match["key"]] = query.get(name)
        elif name not in LIST_PARAMETERS:
            raise HarliError(
                f"Unknown query parameter: {name!r}. This list takes after, limit and "
                "metadata[<key>]=<value>.",
                param=name,
                code="unknown_parameter",
            )
    return wanted


class JobCollectionApi(TenantScopedAPIView):
    parser_classes = [JsonParser]

    class JobCreateSerializer(serializers.Serializer):
        """Schema of the body; the service checks every field (OpenAI's names, plus `lora`)."""

        model = serializers.CharField()
        training_file = serializers.CharField()
        validation_file = serializers.CharField(required=False, allow_null=True)
        hyperparameters = serializers.JSONField(required=False)
        method = serializers.JSONField(required=False)
        lora = serializers.JSONField(
            required=False, help_text="{rank, alpha, dropout, target_modules}"
        )
        suffix = serializers.CharField(required=False, allow_null=True)
        seed = serializers.IntegerField(required=False, allow_null=True)
        metadata = serializers.JSONField(required=False, allow_null=True)
        integrations = serializers.JSONField(
            required=False, allow_null=True, help_text="refused (400): none is supported"
        )

    @extend_schema(
        operation_id="fine_tuning_jobs_create",
        request=JobCreateSerializer,
        responses={200: FineTuningJobSerializer, 400: ErrorSerializer, 429: ErrorSerializer},
    )
    @idempotent
    def post(self, request: Request) -> Response:
        body = request.data
        if not isinstance(body, dict):
            raise HarliError("The request body must be a JSON object.")
        body_fields_check(body, allowed=CREATE_FIELDS)
        for required in ("model", "training_file"):
            if body.get(required) in (None, ""):
                raise HarliError(f"Missing required parameter: '{required}'.", param=required)
        job = finetune_job_create(
            tenant=self.tenant,
            model=body.get("model"),
            training_file=body.get("training_file"),
            validation_file=body.get("validation_file"),
            hyperparameters=body.get("hyperparameters"),
            method=body.get("method"),
            lora=body.get("lora"),
            suffix=body.get("suffix"),
            seed=body.get("seed"),
            metadata=body.get("metadata"),
            integrations=body.get("integrations"),
        )
        bind_log_context(job_id=job.id)  # the request's access line names the job it created
        return Response(FineTuningJobSerializer(job).data)

    @extend_schema(
        operation_id="fine_tuning_jobs_list",
        parameters=[
            *PAGING_PARAMETERS,
            OpenApiParameter(
                "metadata",
                {"type": "object", "additionalProperties": {"type": "string"}},
                style="deepObject",
                explode=True,
                description="only jobs whose metadata holds these pairs: metadata[key]=value",
            ),
        ],
        responses={200: FineTuningJobListSerializer, 400: ErrorSerializer},
    )
    def get(self, request: Request) -> Response:
        metadata = list_metadata_filter(request.query_params)
        page = cursor_page(
            finetune_job_list(tenant=self.tenant, metadata=metadata),
            after=request.query_params.get("after"),
            limit=parse_limit(request.query_params.get("limit")),
            order=("created_at", "id"),
        )
        context = {"progress": job_progress_map(jobs=list(page.items))}
        data = FineTuningJobSerializer(page.items, many=True, context=context).data
        return Response(page_body(page, list(data)))


class JobDetailApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="fine_tuning_jobs_retrieve",
        responses={200: FineTuningJobSerializer, 404: ErrorSerializer},
    )
    def get(self, request: Request, fine_tuning_job_id: str) -> Response:
        job = finetune_job_get(tenant=self.tenant, job_id=fine_tuning_job_id)
        return Response(FineTuningJobSerializer(job).data)


def _action_view(
    name: str, action: Callable[..., FinetuneJob], summary: str
) -> type[TenantScopedAPIView]:
    """A POST view that applies one lifecycle service to the tenant's job."""

    @extend_schema(
        operation_id=f"fine_tuning_jobs_{name}",
        summary=summary,
        request=None,
        responses={200: FineTuningJobSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
    )
    @idempotent
    def post(self: TenantScopedAPIView, request: Request, fine_tuning_job_id: str) -> Response:
        job = finetune_job_get(tenant=self.tenant, job_id=fine_tuning_job_id)
        return Response(FineTuningJobSerializer(action(job=job)).data)

    return type(f"Job{name.title()}Api", (TenantScopedAPIView,), {"post": post})


JobCancelApi = _action_view("cancel", finetune_job_cancel, "Cancel a job")
JobPauseApi = _action_view("pause", finetune_job_pause, "Pause a queued or running job")
JobResumeApi = _action_view("resume", finetune_job_resume, "Resume a paused job")


class JobEventsApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="fine_tuning_jobs_events",
        parameters=PAGING_PARAMETERS,
        responses={200: JobEventListSerializer, 404: ErrorSerializer},
    )
    def get(self, request: Request, fine_tuning_job_id: str) -> Response:
        query_params_check(request, allowed=LIST_PARAMETERS)
        job = finetune_job_get(tenant=self.tenant, job_id=fine_tuning_job_id)
        page = cursor_page(
            job_event_list(job=job),
            after=request.query_params.get("after"),
            limit=parse_limit(request.query_params.get("limit")),
            order=("created_at", "id"),
        )
        return Response(page_body(page, list(JobEventSerializer(page.items, many=True).data)))


class JobCheckpointsApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="fine_tuning_jobs_checkpoints",
        parameters=PAGING_PARAMETERS,
        responses={200: JobCheckpointListSerializer, 404: ErrorSerializer},
    )
    def get(self, request: Request, fine_tuning_job_id: str) -> Response:
        query_params_check(request, allowed=LIST_PARAMETERS)
        job = finetune_job_get(tenant=self.tenant, job_id=fine_tuning_job_id)
        page = cursor_page(
            job_checkpoint_list(job=job),
            after=request.query_params.get("after"),
            limit=parse_limit(request.query_params.get("limit"), default=10),
            order=("step", "created_at"),
        )
        data = list(JobCheckpointSerializer(page.items, many=True).data)
        return Response(page_body(page, data))
