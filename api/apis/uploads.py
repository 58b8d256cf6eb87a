"""`/v1/uploads`: a large file in parts (OpenAI's Uploads API): create, add part, complete,
cancel. The `openai` client's `uploads.upload_file_chunked` drives these routes."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from api.apis.base import TenantScopedAPIView
from api.apis.fields import body_fields_check, serializer_fields
from api.errors import HarliError
from api.idempotency import idempotent
from api.models import Upload, UploadPart
from api.parsers import FormParser, JsonParser, MultiPartParser
from api.selectors import upload_get
from api.serializers import ErrorSerializer, FileObjectSerializer
from api.services.files import UploadSource
from api.services.uploads import upload_cancel, upload_complete, upload_create, upload_part_add


class UploadSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    bytes = serializers.IntegerField()
    created_at = serializers.SerializerMethodField()
    expires_at = serializers.SerializerMethodField()
    filename = serializers.CharField()
    purpose = serializers.CharField()
    status = serializers.CharField()
    file = FileObjectSerializer(allow_null=True)

    def get_object(self, upload: Upload) -> str:
        return "upload"

    def get_created_at(self, upload: Upload) -> int:
        return int(upload.created_at.timestamp())

    def get_expires_at(self, upload: Upload) -> int:
        return int(upload.expires_at.timestamp())


class UploadPartSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    upload_id = serializers.CharField()

    def get_object(self, part: UploadPart) -> str:
        return "upload.part"

    def get_created_at(self, part: UploadPart) -> int:
        return int(part.created_at.timestamp())


PART_FIELDS = frozenset({"data"})


def _json_object(request: Request) -> dict[str, Any]:
    body = request.data
    if not isinstance(body, dict):
        raise HarliError("The request body must be a JSON object.")
    return body


class UploadCollectionApi(TenantScopedAPIView):
    parser_classes = [JsonParser]

    class UploadCreateSerializer(serializers.Serializer):
        """Schema of the body; the service checks every field."""

        filename = serializers.CharField()
        purpose = serializers.CharField(help_text="must be 'fine-tune'")
        bytes = serializers.IntegerField(help_text="the file's total size")
        mime_type = serializers.CharField(help_text="a JSONL type, e.g. text/jsonl")
        expires_after = serializers.JSONField(
            required=False, allow_null=True, help_text="refused (400): files are kept until deleted"
        )

    @extend_schema(
        operation_id="uploads_create",
        request=UploadCreateSerializer,
        responses={200: UploadSerializer, 400: ErrorSerializer},
    )
    @idempotent
    def post(self, request: Request) -> Response:
        body = _json_object(request)
        body_fields_check(body, allowed=serializer_fields(self.UploadCreateSerializer))
        for required in ("filename", "purpose", "bytes", "mime_type"):
            if body.get(required) in (None, ""):
                raise HarliError(f"Missing required parameter: '{required}'.", param=required)
        upload = upload_create(
            tenant=self.tenant,
            filename=body["filename"],
            purpose=body["purpose"],
            declared_bytes=body["bytes"],
            mime_type=body["mime_type"],
            expires_after=body.get("expires_after"),
        )
        return Response(UploadSerializer(upload).data)


class UploadPartsApi(TenantScopedAPIView):
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(
        operation_id="uploads_parts_create",
        request=inline_serializer(
            "UploadPartCreate", {"data": serializers.FileField(help_text="the part's bytes")}
        ),
        responses={
            200: UploadPartSerializer,
            400: ErrorSerializer,
            404: ErrorSerializer,
            409: ErrorSerializer,
            413: ErrorSerializer,
        },
    )
    @idempotent
    def post(self, request: Request, upload_id: str) -> Response:
        upload = upload_get(tenant=self.tenant, upload_id=upload_id)
        body_fields_check({**request.POST, **request.FILES}, allowed=PART_FIELDS)
        data = request.FILES.get("data")
        if data is None:
            raise HarliError("Missing multipart field 'data'.", param="data", code="missing_file")
        part = upload_part_add(upload=upload, data=UploadSource.from_django(data))
        return Response(UploadPartSerializer(part).data)


class UploadCompleteApi(TenantScopedAPIView):
    parser_classes = [JsonParser]

    class UploadCompleteSerializer(serializers.Serializer):
        part_ids = serializers.ListField(child=serializers.CharField(), help_text="in file order")
        md5 = serializers.CharField(required=False, help_text="md5 of the whole file, hex")

    @extend_schema(
        operation_id="uploads_complete",
        request=UploadCompleteSerializer,
        responses={200: UploadSerializer, 400: ErrorSerializer, 404: ErrorSerializer},
    )
    @idempotent
    def post(self, request: Request, upload_id: str) -> Response:
        upload = upload_get(tenant=self.tenant, upload_id=upload_id)
        body = _json_object(request)
        body_fields_check(body, allowed=serializer_fields(self.UploadCompleteSerializer))
        if body.get("part_ids") is None:
            raise HarliError("Missing required parameter: 'part_ids'.", param="part_ids")
        completed = upload_complete(upload=upload, part_ids=body["part_ids"], md5=body.get("md5"))
        return Response(UploadSerializer(completed).data)


class UploadCancelApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="uploads_cancel",
        request=None,
        responses={200: UploadSerializer, 404: ErrorSerializer, 409: ErrorSerializer},
    )
    @idempotent
    def post(self, request: Request, upload_id: str) -> Response:
        upload = upload_cancel(upload=upload_get(tenant=self.tenant, upload_id=upload_id))
        return Response(UploadSerializer(upload).data)
