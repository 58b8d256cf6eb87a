"""`/v1/files`: upload (multipart), list, retrieve, delete, content."""

from __future__ import annotations

from django.http import StreamingHttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.apis.fields import body_fields_check, query_params_check, serializer_fields
from api.errors import HarliError
from api.idempotency import idempotent
from api.pagination import cursor_page, page_body, parse_limit
from api.parsers import FormParser, MultiPartParser
from api.selectors import file_get, file_list
from api.serializers import (
    ErrorSerializer,
    FileDeletedSerializer,
    FileListSerializer,
    FileObjectSerializer,
)
from api.services.files import UploadSource, file_content_chunks, file_create, file_delete
from api.services.quotas import quota_declared_upload_check

PAGING_PARAMETERS = [
    OpenApiParameter("after", str, description="id of the last object of the previous page"),
    OpenApiParameter("limit", int, description="page size, 1-100 (default 20)"),
]


class FileCollectionApi(TenantScopedAPIView):
    parser_classes = [MultiPartParser, FormParser]

    class FileUploadSerializer(serializers.Serializer):
        file = serializers.FileField(help_text="JSONL training file")
        purpose = serializers.CharField(help_text="must be 'fine-tune'")

    @extend_schema(
        operation_id="files_create",
        request=FileUploadSerializer,
        responses={200: FileObjectSerializer, 400: ErrorSerializer, 413: ErrorSerializer},
    )
    @idempotent
    def post(self, request: Request) -> Response:
        # Before request.FILES: a body that cannot fit the quota is not read.
        quota_declared_upload_check(
            tenant=self.tenant, content_length=request.META.get("CONTENT_LENGTH")
        )
        body_fields_check(
            {**request.POST, **request.FILES}, allowed=serializer_fields(self.FileUploadSerializer)
        )
        upload = request.FILES.get("file")
        if upload is None:
            raise HarliError("Missing multipart field 'file'.", param="file", code="missing_file")
        purpose = request.POST.get("purpose")
        if not isinstance(purpose, str) or not purpose:
            raise HarliError("Missing field 'purpose'.", param="purpose", code="missing_purpose")
        file = file_create(
            tenant=self.tenant, purpose=purpose, upload=UploadSource.from_django(upload)
        )
        return Response(FileObjectSerializer(file).data, status=status.HTTP_200_OK)

    @extend_schema(
        operation_id="files_list",
        parameters=[*PAGING_PARAMETERS, OpenApiParameter("purpose", str)],
        responses={200: FileListSerializer},
    )
    def get(self, request: Request) -> Response:
        query_params_check(request, allowed=("after", "limit", "purpose"))
        page = cursor_page(
            file_list(tenant=self.tenant, purpose=request.query_params.get("purpose")),
            after=request.query_params.get("after"),
            limit=parse_limit(request.query_params.get("limit"), default=100),
            order=("created_at", "id"),
        )
        data = FileObjectSerializer(page.items, many=True).data
        return Response(page_body(page, list(data)))


class FileDetailApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="files_retrieve", responses={200: FileObjectSerializer, 404: ErrorSerializer}
    )
    def get(self, request: Request, file_id: str) -> Response:
        return Response(FileObjectSerializer(file_get(tenant=self.tenant, file_id=file_id)).data)

    @extend_schema(
        operation_id="files_delete",
        responses={200: FileDeletedSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
    )
    def delete(self, request: Request, file_id: str) -> Response:
        file = file_get(tenant=self.tenant, file_id=file_id)
        file_delete(file=file)
        return Response({"id": file_id, "object": "file", "deleted": True})


class FileContentApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="files_content",
        responses={
            (200, "application/octet-stream"): inline_serializer(
                "FileContent", {"content": serializers.CharField()}
            ),
            404: ErrorSerializer,
        },
    )
    def get(self, request: Request, file_id: str) -> StreamingHttpResponse:
        file = file_get(tenant=self.tenant, file_id=file_id)
        response = StreamingHttpResponse(
            file_content_chunks(file=file), content_type="application/octet-stream"
        )
        response["Content-Disposition"] = f'attachment; filename="{file.filename}"'
        response["Content-Length"] = str(file.bytes)
        return response
