"""Output shapes of the tenant API, as OpenAI's objects (files, jobs, events, checkpoints, models).

Timestamps are Unix seconds. These serializers only render; input checks live in the services.
A job's `estimated_finish` comes from `api.progress` (the console's ETA); a list view passes the
progress of its page as the `progress` context entry (one query for the page).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from api.models import File, FinetuneJob, JobCheckpoint, JobEvent, JobMethod
from api.progress import JobProgress, job_progress_map
from api.selectors import fine_tuned_model_name
from gpu_runtime.contract.protocol import checkpoint_model_name


def unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.CharField()
    param = serializers.CharField(allow_null=True)
    code = serializers.CharField(allow_null=True)


class ErrorSerializer(serializers.Serializer):
    """The one error body of both APIs."""

    error = ErrorDetailSerializer()


class FileObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    bytes = serializers.IntegerField()
    created_at = serializers.SerializerMethodField()
    expires_at = serializers.SerializerMethodField()
    filename = serializers.CharField()
    purpose = serializers.CharField()
    status = serializers.CharField()
    status_details = serializers.SerializerMethodField()

    def get_object(self, file: File) -> str:
        return "file"

    def get_created_at(self, file: File) -> int:
        return int(file.created_at.timestamp())

    def get_expires_at(self, file: File) -> int | None:
        return None

    def get_status_details(self, file: File) -> str | None:
        return file.status_details or None


class FileDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="file")
    deleted = serializers.BooleanField()


class HyperparametersSerializer(serializers.Serializer):
    n_epochs = serializers.JSONField(help_text='an integer, or "auto" until a host starts the job')
    batch_size = serializers.JSONField(help_text='an integer, or "auto" until a host starts it')
    learning_rate_multiplier = serializers.JSONField(help_text='a number, or "auto" until then')


def job_hyperparameters(job: FinetuneJob) -> dict[str, Any]:
    """What the tenant asked for, with each "auto" replaced by what the job's host resolved it
    to once a host started the job."""
    return {**job.hyperparameters, **(job.resolved_hyperparameters or {})}


def job_method(job: FinetuneJob) -> dict[str, Any]:
    """OpenAI's `method`: `{"type", <type>: {"hyperparameters"}}`; a DPO job's has `beta`."""
    hyperparameters = job_hyperparameters(job)
    if job.method == JobMethod.DPO:
        # a host's resolved "beta" (in resolved_hyperparameters) replaces a requested "auto"
        hyperparameters = {"beta": job.dpo_beta, **hyperparameters}
        return {"type": "dpo", "dpo": {"hyperparameters": hyperparameters}}
    return {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}


class FineTuningJobSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    error = serializers.JSONField(allow_null=True)
    fine_tuned_model = serializers.CharField(allow_null=True)
    finished_at = serializers.SerializerMethodField()
    hyperparameters = serializers.SerializerMethodField()
    method = serializers.SerializerMethodField()
    lora = serializers.SerializerMethodField()
    model = serializers.SerializerMethodField()
    organization_id = serializers.SerializerMethodField()
    result_files = serializers.SerializerMethodField()
    seed = serializers.IntegerField()
    status = serializers.CharField()
    trained_tokens = serializers.IntegerField(allow_null=True)
    training_file = serializers.CharField(source="training_file_id")
    validation_file = serializers.CharField(source="validation_file_id", allow_null=True)
    user_provided_suffix = serializers.SerializerMethodField()
    metadata = serializers.JSONField(allow_null=True)
    integrations = serializers.SerializerMethodField()
    estimated_finish = serializers.SerializerMethodField()

    def get_object(self, job: FinetuneJob) -> str:
        return "fine_tuning.job"

    def get_created_at(self, job: FinetuneJob) -> int:
        return int(job.created_at.timestamp())

    def get_finished_at(self, job: FinetuneJob) -> int | None:
        return unix(job.finished_at)

    @extend_schema_field(HyperparametersSerializer)
    def get_hyperparameters(self, job: FinetuneJob) -> dict[str, Any]:
        return job_hyperparameters(job)

    def get_method(self, job: FinetuneJob) -> dict[str, Any]:
        return job_method(job)

    def get_lora(self, job: FinetuneJob) -> dict[str, Any]:
        return {
            "rank": job.lora_rank,
            "alpha": job.lora_alpha,
            "dropout": job.lora_dropout,
            "target_modules": job.lora_target_modules,
        }

    def get_model(self, job: FinetuneJob) -> str:
        return job.base_model.name

    def get_organization_id(self, job: FinetuneJob) -> str:
        return job.tenant.name

    def get_result_files(self, job: FinetuneJob) -> list[str]:
        return sorted(f.id for f in job.result_files.all())

    def get_user_provided_suffix(self, job: FinetuneJob) -> str | None:
        return job.suffix or None

    def get_integrations(self, job: FinetuneJob) -> list[Any]:
        return []  # the create service refuses every integration

    def get_estimated_finish(self, job: FinetuneJob) -> int | None:
        progress: JobProgress | None = self.context.get("progress", {}).get(job.pk)
        if progress is None:
            progress = job_progress_map(jobs=[job])[job.pk]
        return unix(progress.estimated_finish)


class JobEventSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    level = serializers.CharField()
    message = serializers.CharField()
    type = serializers.CharField()

    def get_fields(self) -> dict[str, serializers.Field]:
        # `data` is declared here because a class attribute would shadow Serializer.data.
        fields = super().get_fields()
        fields["data"] = serializers.JSONField(allow_null=True)
        return fields

    def get_object(self, event: JobEvent) -> str:
        return "fine_tuning.job.event"

    def get_created_at(self, event: JobEvent) -> int:
        return int(event.created_at.timestamp())


class JobCheckpointSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    fine_tuned_model_checkpoint = serializers.SerializerMethodField()
    fine_tuning_job_id = serializers.CharField(source="job_id")
    metrics = serializers.JSONField()
    step_number = serializers.IntegerField(source="step")

    def get_object(self, checkpoint: JobCheckpoint) -> str:
        return "fine_tuning.job.checkpoint"

    def get_created_at(self, checkpoint: JobCheckpoint) -> int:
        return int(checkpoint.created_at.timestamp())

    def get_fine_tuned_model_checkpoint(self, checkpoint: JobCheckpoint) -> str:
        return checkpoint_model_name(fine_tuned_model_name(job=checkpoint.job), checkpoint.step)


class ModelObjectSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.SerializerMethodField()
    created = serializers.SerializerMethodField()
    owned_by = serializers.CharField()

    def get_object(self, entry: Any) -> str:
        return "model"

    def get_created(self, entry: Any) -> int:
        return int(entry.created.timestamp())


class ModelDeletedSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField(default="model")
    deleted = serializers.BooleanField()


def list_serializer(item: type[serializers.Serializer], name: str) -> type[serializers.Serializer]:
    """A schema-only serializer for `{"object": "list", "data": [item], "has_more": ...}`."""
    fields: dict[str, Any] = {
        "object": serializers.CharField(default="list"),
        "data": item(many=True),
        "has_more": serializers.BooleanField(required=False),
        "first_id": serializers.CharField(allow_null=True, required=False),
        "last_id": serializers.CharField(allow_null=True, required=False),
    }
    return type(name, (serializers.Serializer,), fields)


FileListSerializer = list_serializer(FileObjectSerializer, "FileList")
FineTuningJobListSerializer = list_serializer(FineTuningJobSerializer, "FineTuningJobList")
JobEventListSerializer = list_serializer(JobEventSerializer, "FineTuningJobEventList")
JobCheckpointListSerializer = list_serializer(JobCheckpointSerializer, "FineTuningCheckpointList")
ModelListSerializer = list_serializer(ModelObjectSerializer, "ModelList")
