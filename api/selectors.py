"""Every read the APIs and CLI do. Tenant-facing selectors always take the tenant.

A `*_get` for a tenant raises NotFoundError both when the object does not exist and when it
belongs to another tenant; the two cases are indistinguishable to the caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet
from django.db.models.fields.json import KeyTransform

from api.errors import NotFoundError
from api.models import (
    Adapter,
    ApiKey,
    BaseModel,
    Deployment,
    File,
    FinetuneJob,
    GpuHost,
    JobCheckpoint,
    JobEvent,
    Placement,
    Tenant,
    Upload,
)
from gpu_runtime.contract.protocol import parse_checkpoint_model

BASE_MODEL_OWNER = "harli"


def fine_tuned_model_name(*, job: FinetuneJob) -> str:
    """`ft:<base>:<tenant>:<suffix>:<job id>` (suffix may be empty, as in OpenAI's names)."""
    return f"ft:{job.base_model.name}:{job.tenant.name}:{job.suffix}:{job.id}"


def file_list(*, tenant: Tenant, purpose: str | None = None) -> QuerySet[File]:
    files = File.objects.filter(tenant=tenant)
    return files.filter(purpose=purpose) if purpose else files


def file_get(*, tenant: Tenant, file_id: str) -> File:
    file = File.objects.filter(tenant=tenant, pk=file_id).first()
    if file is None:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id")
    return file


def upload_get(*, tenant: Tenant, upload_id: str) -> Upload:
    upload = Upload.objects.filter(tenant=tenant, pk=upload_id).select_related("tenant").first()
    if upload is None:
        raise NotFoundError(f"No such Upload object: {upload_id}", param="upload_id")
    return upload


def finetune_job_list(
    *, tenant: Tenant | None, status: str | None = None, metadata: dict[str, str] | None = None
) -> QuerySet[FinetuneJob]:
    """Jobs of `tenant`; `tenant=None` means every tenant and is for operator views only.
    `metadata`: only jobs whose metadata holds every one of these pairs."""
    jobs = FinetuneJob.objects.select_related("tenant", "base_model").prefetch_related(
        "result_files"
    )
    if tenant is not None:
        jobs = jobs.filter(tenant=tenant)
    for index, (key, value) in enumerate(sorted((metadata or {}).items())):
        # a key transform, not `metadata__<key>`: a key may hold "__" or a lookup's name
        alias = f"metadata_{index}"
        jobs = jobs.alias(**{alias: KeyTransform(key, "metadata")}).filter(**{alias: value})
    return jobs.filter(status=status) if status else jobs


def finetune_job_get(*, tenant: Tenant | None, job_id: str) -> FinetuneJob:
    job = finetune_job_list(tenant=tenant).filter(pk=job_id).first()
    if job is None:
        raise NotFoundError(f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id")
    return job


def job_event_list(*, job: FinetuneJob) -> QuerySet[JobEvent]:
    return JobEvent.objects.filter(job=job)


def job_checkpoint_list(*, job: FinetuneJob) -> QuerySet[JobCheckpoint]:
    return JobCheckpoint.objects.filter(job=job).select_related("job__tenant", "job__base_model")


def job_checkpoint_latest(*, job: FinetuneJob) -> JobCheckpoint | None:
    """The job's latest stored checkpoint (the one it resumes from), or None."""
    return JobCheckpoint.objects.filter(job=job).exclude(path="").order_by("-step").first()


def job_checkpoint_get(*, job: FinetuneJob, checkpoint_id: str) -> JobCheckpoint:
    """One checkpoint of `job` (already scoped to the tenant by `finetune_job_get`)."""
    checkpoint = job_checkpoint_list(job=job).filter(pk=checkpoint_id).first()
    if checkpoint is None:
        raise NotFoundError(f"No such checkpoint: {checkpoint_id}", param="checkpoint_id")
    return checkpoint


def checkpoint_model_find(*, tenant: Tenant, model_id: str) -> JobCheckpoint | None:
    """The tenant's checkpoint named `model_id` (`<job's fine-tuned model>:ckpt-step-<N>`, as
    `fine_tuned_model_checkpoint` names it), or None. The whole name must match the job's."""
    parsed = parse_checkpoint_model(model_id)
    if parsed is None:
        return None
    model, job_id, step = parsed
    checkpoint = (
        JobCheckpoint.objects.select_related("job__tenant", "job__base_model")
        .filter(job__tenant=tenant, job_id=job_id, step=step)
        .first()
    )
    if checkpoint is None or fine_tuned_model_name(job=checkpoint.job) != model:
        return None
    return checkpoint


def adapter_find(*, tenant: Tenant, model_id: str) -> Adapter | None:
    """The tenant's finished adapter named `model_id`, or None."""
    return (
        Adapter.objects.select_related("job", "base_model", "tenant")
        .filter(tenant=tenant, name=model_id)
        .first()
    )


@dataclass(frozen=True)
class ModelEntry:
    """One entry of `GET /v1/models`: a base model or one of the tenant's adapters."""

    id: str
    created: datetime
    owned_by: str


def model_list(*, tenant: Tenant) -> list[ModelEntry]:
    """Base models, then the tenant's finished adapters (newest first)."""
    entries = [
        ModelEntry(id=m.name, created=m.created_at, owned_by=BASE_MODEL_OWNER)
        for m in BaseModel.objects.order_by("name")
    ]
    entries += [
        ModelEntry(id=a.name, created=a.created_at, owned_by=tenant.name)
        for a in Adapter.objects.filter(tenant=tenant)
    ]
    return entries


def model_get(*, tenant: Tenant, model_id: str) -> ModelEntry:
    """A base model, one of the tenant's adapters, or one of its jobs' checkpoints."""
    base_model = BaseModel.objects.filter(name=model_id).first()
    if base_model is not None:
        return ModelEntry(
            id=base_model.name, created=base_model.created_at, owned_by=BASE_MODEL_OWNER
        )
    adapter = adapter_find(tenant=tenant, model_id=model_id)
    if adapter is not None:
        return ModelEntry(id=adapter.name, created=adapter.created_at, owned_by=tenant.name)
    checkpoint = checkpoint_model_find(tenant=tenant, model_id=model_id)
    if checkpoint is not None:  # retrievable, not listed (as OpenAI's checkpoints)
        return ModelEntry(id=model_id, created=checkpoint.created_at, owned_by=tenant.name)
    raise NotFoundError(f"The model {model_id!r} does not exist.", param="model")


# Operator reads: the whole fleet, every tenant.


def tenant_list() -> QuerySet[Tenant]:
    return Tenant.objects.all()


def tenant_get(*, name: str) -> Tenant:
    tenant = Tenant.objects.filter(name=name).first()
    if tenant is None:
        raise NotFoundError(f"No tenant named {name!r}.", param="tenant")
    return tenant


def api_key_list(*, tenant: Tenant | None = None) -> QuerySet[ApiKey]:
    keys = ApiKey.objects.select_related("user", "user__tenant")
    return keys.filter(user__tenant=tenant) if tenant is not None else keys


def base_model_list() -> QuerySet[BaseModel]:
    return BaseModel.objects.all()


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("base_model")


def host_list(*, status: str | None = None) -> QuerySet[GpuHost]:
    hosts = GpuHost.objects.select_related("agent_state").prefetch_related(
        "engine_groups__deployment"
    )
    return hosts.filter(status=status) if status else hosts


def placement_list(
    *, job_id: str | None = None, host: str | None = None, state: str | None = None
) -> QuerySet[Placement]:
    placements = Placement.objects.select_related("job", "host", "engine_group__deployment")
    if job_id:
        placements = placements.filter(job_id=job_id)
    if host:
        placements = placements.filter(host__name=host)
    if state:
        placements = placements.filter(state=state)
    return placements
