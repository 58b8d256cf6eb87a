"""Fine-tuning jobs: creation, every status change (through one function), events, checkpoints.

`finetune_job_transition` is the only code that assigns `FinetuneJob.status`; it checks
`api.transitions.JOB_TRANSITIONS` under a row lock and records a JobEvent for every change.
A pause or cancel of a job a host may be training tells that host directly once the transaction
commits (`pause` / `cancel` on its queue `host.<name>`); the heartbeats' stale-placement check
(`api.services.reports`) stays the safety net for a message that never arrives.
"""

from __future__ import annotations

import secrets
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from api.dispatch import host_dispatch
from api.errors import ConflictError, HarliError
from api.file_tokens import job_files_check_tokens
from api.hyperparameters import (
    parse_integrations,
    parse_lora,
    parse_metadata,
    parse_method,
    parse_seed,
    parse_suffix,
)
from api.models import (
    OPEN_PLACEMENT_STATES,
    Adapter,
    BaseModel,
    EventLevel,
    EventType,
    File,
    FilePurpose,
    FileStatus,
    FinetuneJob,
    JobCheckpoint,
    JobEvent,
    JobStatus,
    Placement,
    PlacementState,
    Tenant,
)
from api.selectors import fine_tuned_model_name
from api.services.quotas import quota_job_admit, trained_tokens_record
from api.training_files import check_method_format
from api.transitions import TERMINAL_STATUSES, is_legal_transition

# Leaving these statuses ends the job's hold on a host, so its open placement is released.
_RELEASES_PLACEMENT = TERMINAL_STATUSES | {JobStatus.PAUSED}
# Statuses the control plane sets while a host may still be training the job: the host of each
# released placement gets this command at commit. (Succeeded and failed come from the host.)
_HOST_STOP_COMMANDS: dict[str, str] = {JobStatus.PAUSED: "pause", JobStatus.CANCELLED: "cancel"}


def _training_file(*, tenant: Tenant, file_id: Any, param: str) -> File:
    """The tenant's usable training file; another tenant's file reads as nonexistent."""
    if not isinstance(file_id, str) or not file_id:
        raise HarliError(f"{param} must be a file id.", param=param, code="invalid_file")
    file = File.objects.filter(tenant=tenant, pk=file_id).first()
    if file is None:
        raise HarliError(f"No such file: {file_id}.", param=param, code="invalid_file")
    if file.purpose != FilePurpose.FINE_TUNE:
        raise HarliError(
            f"File {file_id} has purpose {file.purpose!r}, not 'fine-tune'.",
            param=param,
            code="invalid_file",
        )
    return file


def host_detail(
    text: str, *, host: str, placement_id: int | None = None, **extra: Any
) -> dict[str, Any]:
    """An event's `fleet_detail`: the operator's wording `text`, the host it is about and, when
    there is one, the placement (plus any further figures in `extra`)."""
    detail: dict[str, Any] = {"text": text, "host": host, **extra}
    if placement_id is not None:
        detail["placement_id"] = placement_id
    return detail


def job_event_record(
    *,
    job: FinetuneJob,
    message: str,
    level: str = EventLevel.INFO,
    type: str = EventType.MESSAGE,
    data: dict[str, Any] | None = None,
    fleet_detail: dict[str, Any] | None = None,
) -> JobEvent:
    """Append an event to the job's history. `message` and `data` are shown to the tenant and
    name no host; host-level detail goes in `fleet_detail` (operators only)."""
    return JobEvent.objects.create(
        job=job, message=message, level=level, type=type, data=data, fleet_detail=fleet_detail
    )


def finetune_job_transition(
    *,
    job: FinetuneJob,
    to: str,
    message: str,
    level: str = EventLevel.INFO,
    error: dict[str, Any] | None = None,
    fleet_detail: dict[str, Any] | None = None,
) -> FinetuneJob:
    """Move `job` to status `to`, or raise ConflictError when the table forbids it.

    Sets `started_at` on the first `running`, `finished_at` on a terminal status, `error` on
    `failed`, clears the stall flag (`stalled_at`), releases the open placement when the job
    stops holding a host, and records `message` (with the operator-only `fleet_detail`) as a
    JobEvent. Returns the refreshed job.
    """
    with transaction.atomic():
        locked = (
            FinetuneJob.objects.select_for_update()
            .select_related("tenant", "base_model")
            .get(pk=job.pk)
        )
        if not is_legal_transition(locked.status, to):
            raise ConflictError(
                f"Job {locked.id} is {locked.status}; it cannot become {to}.",
                code="invalid_job_state",
                param="status",
            )
        now = timezone.now()
        locked.status = to
        fields = ["status"]
        if to == JobStatus.RUNNING and locked.started_at is None:
            locked.started_at = now
            fields.append("started_at")
        if to in TERMINAL_STATUSES:
            locked.finished_at = now
            fields.append("finished_at")
        if to == JobStatus.FAILED:
            locked.error = error or {"code": "failed", "message": message, "param": None}
            fields.append("error")
        if locked.stalled_at is not None:  # the stall flag is about the run that just changed
            locked.stalled_at = None
            fields.append("stalled_at")
        locked.save(update_fields=fields)
        if to in _RELEASES_PLACEMENT:
            opened = Placement.objects.filter(job=locked, state__in=OPEN_PLACEMENT_STATES)
            released = [(pk, host) for pk, host in opened.values_list("pk", "host__name")]
            Placement.objects.filter(pk__in=[pk for pk, _ in released]).update(
                state=PlacementState.RELEASED, ended_at=now
            )
            command = _HOST_STOP_COMMANDS.get(to)
            if command is not None and released:
                stop = partial(
                    finetune_job_host_stop, job_id=locked.id, placements=released, command=command
                )
                transaction.on_commit(stop, robust=True)
        job_event_record(job=locked, message=message, level=level, fleet_detail=fleet_detail)
    return locked


def finetune_job_host_stop(*, job_id: str, placements: list[tuple[int, str]], command: str) -> None:
    """Send `command` ("pause" or "cancel") for each released `(placement id, host name)` to
    that host's queue. Runs from `transaction.on_commit`, so a host never stops for a change
    that was rolled back. A message the broker does not take is logged and left to the
    heartbeats' stale-placement check; the agent ignores (and logs) a stop for a placement it
    no longer trains, so a late or repeated one changes nothing."""
    for placement_id, host_name in placements:
        host_dispatch().placement_stop_send(
            host_name=host_name, placement_id=placement_id, job_id=job_id, command=command
        )


def finetune_job_dispatch(*, job_id: str) -> None:
    """Hand a queued job to placement. Called through `transaction.on_commit`.

    Records the "queued" event and queues the `workers.place_job` task (id-based), which picks
    a host and sends the placement to its queue after its own commit.
    """
    job = FinetuneJob.objects.filter(pk=job_id).first()
    if job is None or job.status != JobStatus.QUEUED:
        return
    job_event_record(
        job=job, message="Job queued; waiting for a host", data={"status": JobStatus.QUEUED}
    )
    host_dispatch().job_place_queue(job_id=job_id)


def finetune_job_create(
    *,
    tenant: Tenant,
    model: Any,
    training_file: Any,
    validation_file: Any = None,
    hyperparameters: Any = None,
    method: Any = None,
    lora: Any = None,
    suffix: Any = None,
    seed: Any = None,
    metadata: Any = None,
    integrations: Any = None,
) -> FinetuneJob:
    """Create a job for `tenant`, check its files, and queue it (dispatch after commit).

    Every argument is checked before anything is written; a failure leaves no row behind.
    """
    if not isinstance(model, str) or not model:
        raise HarliError("model must be a model name.", param="model", code="model_not_found")
    base_model = BaseModel.objects.filter(name=model).first()
    if base_model is None:
        raise HarliError(
            f"The model {model!r} does not exist or cannot be fine-tuned.",
            param="model",
            code="model_not_found",
        )
    training_method = parse_method(hyperparameters, method)
    lora_options = parse_lora(lora, architecture=base_model.architecture)
    clean_suffix = parse_suffix(suffix)
    clean_seed = parse_seed(seed)
    clean_metadata = parse_metadata(metadata)
    parse_integrations(integrations)
    train = _training_file(tenant=tenant, file_id=training_file, param="training_file")
    valid = (
        _training_file(tenant=tenant, file_id=validation_file, param="validation_file")
        if validation_file is not None
        else None
    )
    _check_method_files(method=training_method.type, train=train, valid=valid)
    job_files_check_tokens(base_model=base_model, training_file=train, validation_file=valid)
    with transaction.atomic():
        # Lock the files' rows, as `file_delete` does: a file deleted meanwhile is refused here.
        for param, file in (("training_file", train), ("validation_file", valid)):
            locked = file is None or File.objects.select_for_update().filter(pk=file.pk).exists()
            if not locked:
                assert file is not None
                raise HarliError(f"No such file: {file.pk}.", param=param, code="invalid_file")
        quota_job_admit(tenant=tenant)
        job = FinetuneJob.objects.create(
            tenant=tenant,
            base_model=base_model,
            training_file=train,
            validation_file=valid,
            status=JobStatus.VALIDATING_FILES,
            hyperparameters=training_method.hyperparameters,
            method=training_method.type,
            dpo_beta=training_method.beta,
            lora_rank=lora_options.rank,
            lora_alpha=lora_options.alpha,
            lora_dropout=lora_options.dropout,
            lora_target_modules=list(lora_options.target_modules),
            suffix=clean_suffix,
            seed=clean_seed if clean_seed is not None else secrets.randbelow(2**31),
            metadata=clean_metadata,
        )
        job_event_record(job=job, message=f"Created fine-tuning job: {job.id}")
        job_event_record(job=job, message=f"Validating training file: {train.id}")
        # Files are validated at upload; re-check that they are still usable now.
        unusable = [f for f in (train, valid) if f is not None and f.status != FileStatus.PROCESSED]
        if unusable:
            raise HarliError(
                f"File {unusable[0].id} is {unusable[0].status}, not processed.",
                param="training_file" if unusable[0] is train else "validation_file",
                code="invalid_file",
            )
        job = finetune_job_transition(
            job=job, to=JobStatus.QUEUED, message="Files validated; job queued"
        )
        job_id = job.id
        transaction.on_commit(lambda: finetune_job_dispatch(job_id=job_id))
    return job


def _check_method_files(*, method: str, train: File, valid: File | None) -> None:
    """The training and validation files must be of a format the method trains on (a DPO
    job's both preference files). (A file not processed is refused later, for that.)"""
    if train.status == FileStatus.PROCESSED:
        check_method_format(
            method=method, file_format=train.format, file_id=train.id, param="training_file"
        )
    if valid is not None and valid.status == FileStatus.PROCESSED:
        check_method_format(
            method=method, file_format=valid.format, file_id=valid.id, param="validation_file"
        )


def finetune_job_cancel(*, job: FinetuneJob) -> FinetuneJob:
    return finetune_job_transition(job=job, to=JobStatus.CANCELLED, message="Job cancelled")


def finetune_job_pause(*, job: FinetuneJob) -> FinetuneJob:
    return finetune_job_transition(job=job, to=JobStatus.PAUSED, message="Job paused")


def finetune_job_resume(*, job: FinetuneJob) -> FinetuneJob:
    """Paused -> queued, then dispatch again after commit (it resumes from its checkpoint)."""
    with transaction.atomic():
        # The job's row before the tenant's, the order of every status change (a transition
        # locks both), so a pause racing this resume cannot deadlock with it.
        FinetuneJob.objects.select_for_update().filter(pk=job.pk).exists()
        quota_job_admit(tenant=job.tenant)
        job = finetune_job_transition(job=job, to=JobStatus.QUEUED, message="Job resumed; queued")
        job_id = job.id
        transaction.on_commit(lambda: finetune_job_dispatch(job_id=job_id))
    return job


def finetune_job_start(*, job: FinetuneJob) -> FinetuneJob:
    """A host began training the job."""
    return finetune_job_transition(job=job, to=JobStatus.RUNNING, message="Fine-tuning started")


def finetune_job_fail(
    *, job: FinetuneJob, code: str, message: str, param: str | None = None
) -> FinetuneJob:
    return finetune_job_transition(
        job=job,
        to=JobStatus.FAILED,
        message=f"Job failed: {message}",
        level=EventLevel.ERROR,
        error={"code": code, "message": message, "param": param},
    )


def finetune_job_succeed(
    *, job: FinetuneJob, trained_tokens: int, adapter_path: str
) -> FinetuneJob:
    """Finish the job: name the fine-tuned model and register its adapter, atomically."""
    if trained_tokens < 0:
        raise HarliError("trained_tokens must be >= 0.", param="trained_tokens")
    with transaction.atomic():
        job = finetune_job_transition(
            job=job, to=JobStatus.SUCCEEDED, message="The job has successfully completed"
        )
        job.fine_tuned_model = fine_tuned_model_name(job=job)
        trained_tokens_record(
            tenant_id=job.tenant_id, increase=trained_tokens - (job.trained_tokens or 0)
        )
        job.trained_tokens = trained_tokens
        job.save(update_fields=["fine_tuned_model", "trained_tokens"])
        Adapter.objects.create(
            name=job.fine_tuned_model,
            tenant=job.tenant,
            job=job,
            base_model=job.base_model,
            path=adapter_path,
        )
        job_event_record(job=job, message=f"New fine-tuned model created: {job.fine_tuned_model}")
    return job


def job_checkpoint_record(
    *, job: FinetuneJob, step: int, metrics: dict[str, Any], path: str = ""
) -> JobCheckpoint:
    """Record an adapter checkpoint at `step` (unique per job) with its metrics."""
    if step < 0:
        raise HarliError("step must be >= 0.", param="step")
    with transaction.atomic():
        if JobCheckpoint.objects.filter(job=job, step=step).exists():
            raise ConflictError(
                f"Job {job.id} already has a checkpoint at step {step}.",
                code="checkpoint_exists",
                param="step",
            )
        checkpoint = JobCheckpoint.objects.create(
            job=job, step=step, metrics={"step": step, **metrics}, path=path
        )
        job_event_record(
            job=job,
            message=f"Checkpoint saved at step {step}",
            type=EventType.METRICS,
            data={"step": step, **metrics},
        )
    return checkpoint
