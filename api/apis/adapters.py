"""Downloads of a tenant's adapters as PEFT directory archives (`.tar.gz`).

* `GET /v1/models/{model}/content`: a fine-tuned model (the job's `fine_tuned_model`) or a
  checkpoint by its model name (`fine_tuned_model_checkpoint`);
* `GET /v1/fine_tuning/jobs/{id}/checkpoints/{checkpoint_id}/content`: a checkpoint by id.

Another tenant's model or checkpoint is a 404, as one that does not exist.
"""

from __future__ import annotations

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.request import Request

from api.adapter_archives import AdapterArchive, adapter_archive
from api.apis.base import TenantScopedAPIView
from api.errors import NotFoundError
from api.selectors import (
    adapter_find,
    checkpoint_model_find,
    fine_tuned_model_name,
    finetune_job_get,
    job_checkpoint_get,
)
from api.serializers import ErrorSerializer
from gpu_runtime.contract.protocol import checkpoint_model_name

ARCHIVE_RESPONSES = {
    (200, "application/gzip"): OpenApiResponse(
        OpenApiTypes.BINARY,
        description="A tar.gz of one directory holding `adapter_config.json` and "
        "`adapter_model.safetensors` (PEFT format; load it with "
        "`peft.PeftModel.from_pretrained`). No optimizer state.",
    ),
    404: ErrorSerializer,
}


def _archive_response(archive: AdapterArchive) -> StreamingHttpResponse:
    response = StreamingHttpResponse(archive.chunks, content_type="application/gzip")
    response["Content-Disposition"] = f'attachment; filename="{archive.filename}"'
    return response


class ModelContentApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="models_content",
        summary="Download a fine-tuned model or checkpoint as a PEFT archive",
        responses=ARCHIVE_RESPONSES,
    )
    def get(self, request: Request, model: str) -> StreamingHttpResponse:
        adapter = adapter_find(tenant=self.tenant, model_id=model)
        if adapter is not None:
            return _archive_response(
                adapter_archive(
                    storage_key=adapter.path,
                    model_name=adapter.name,
                    base_model_name=adapter.base_model.name,
                )
            )
        checkpoint = checkpoint_model_find(tenant=self.tenant, model_id=model)
        if checkpoint is None:
            raise NotFoundError(f"The model {model!r} does not exist.", param="model")
        return _archive_response(
            adapter_archive(
                storage_key=checkpoint.path,
                model_name=model,
                base_model_name=checkpoint.job.base_model.name,
            )
        )


class JobCheckpointContentApi(TenantScopedAPIView):
    @extend_schema(
        operation_id="fine_tuning_jobs_checkpoints_content",
        summary="Download a checkpoint as a PEFT archive",
        responses=ARCHIVE_RESPONSES,
    )
    def get(
        self, request: Request, fine_tuning_job_id: str, checkpoint_id: str
    ) -> StreamingHttpResponse:
        job = finetune_job_get(tenant=self.tenant, job_id=fine_tuning_job_id)
        checkpoint = job_checkpoint_get(job=job, checkpoint_id=checkpoint_id)
        return _archive_response(
            adapter_archive(
                storage_key=checkpoint.path,
                model_name=checkpoint_model_name(fine_tuned_model_name(job=job), checkpoint.step),
                base_model_name=job.base_model.name,
            )
        )
