"""Tenants' finetuning: training files, jobs, their events and checkpoints, adapters, placements.

A job's `status` changes only through `api.services.jobs.finetune_job_transition`, which checks
`api.transitions.JOB_TRANSITIONS`. Nothing else may assign `FinetuneJob.status`.
"""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models

from api.models.fleet import BaseModel, GpuHost
from api.models.ids import (
    PUBLIC_ID_MAX_LENGTH,
    new_checkpoint_id,
    new_event_id,
    new_file_id,
    new_job_id,
)
from api.models.tenancy import Tenant
from gpu_runtime.contract import hparams, training_data


class FilePurpose(models.TextChoices):
    FINE_TUNE = "fine-tune", "fine-tune"
    FINE_TUNE_RESULTS = "fine-tune-results", "fine-tune-results"
    """A finished job's metrics CSV (written by the platform; never uploaded, never trained on)."""


class FileStatus(models.TextChoices):
    UPLOADED = "uploaded", "Uploaded"  # bytes stored, not validated yet
    PROCESSED = "processed", "Processed"  # validated; usable as a training file
    ERROR = "error", "Error"  # validation failed (see status_details)


class FileFormat(models.TextChoices):
    CHAT = training_data.CHAT_FORMAT, "Chat messages"
    PROMPT_COMPLETION = training_data.PROMPT_COMPLETION_FORMAT, "Prompt / completion"
    PREFERENCE = training_data.PREFERENCE_FORMAT, "Preference pairs (DPO)"


class File(models.Model):
    """An uploaded training file, or a job's results file (purpose `fine-tune-results`, `job`
    set). Its bytes live in `api.storage` under `storage_key`."""

    id = models.CharField(primary_key=True, max_length=PUBLIC_ID_MAX_LENGTH, default=new_file_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="files")
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=32, choices=FilePurpose.choices)
    bytes = models.BigIntegerField()
    line_count = models.PositiveIntegerField(default=0)
    format = models.CharField(max_length=32, choices=FileFormat.choices, blank=True)
    status = models.CharField(max_length=16, choices=FileStatus.choices)
    status_details = models.TextField(blank=True)
    storage_key = models.CharField(max_length=255, unique=True)
    job = models.ForeignKey(
        "FinetuneJob",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="result_files",
        help_text="the job whose results this file holds (purpose fine-tune-results)",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]


class JobStatus(models.TextChoices):
    VALIDATING_FILES = "validating_files", "Validating files"
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


class JobMethod(models.TextChoices):
    SUPERVISED = "supervised", "Supervised"
    DPO = "dpo", "DPO"  # trains on a preference file


DEFAULT_LORA_TARGET_MODULES = list(hparams.DEFAULT_LORA_TARGET_MODULES)


def default_lora_target_modules() -> list[str]:
    return list(DEFAULT_LORA_TARGET_MODULES)


class FinetuneJob(models.Model):
    """A LoRA finetuning job, in the lifecycle of OpenAI's fine-tuning jobs plus `paused`.

    `hyperparameters` holds what the tenant asked for: `n_epochs`, `batch_size` and
    `learning_rate_multiplier`, each a number or the string "auto" (hosts resolve "auto" from
    these, so they never change); `resolved_hyperparameters` holds the numbers the host that
    started the job resolved them to, and `total_steps` the optimizer steps it counted (both null
    until a host starts it). `method` is supervised or DPO, whose `dpo_beta` is a number or
    "auto" (null for supervised). `trained_tokens` grows with each progress report. `error` is
    null or `{"code", "message", "param"}`. `fine_tuned_model` is set on success, named
    `ft:<base>:<tenant>:<suffix>:<job id>`. The training files are referenced without a database
    constraint so that deleting a file after the job ended keeps the job's record intact.
    """

    id = models.CharField(primary_key=True, max_length=PUBLIC_ID_MAX_LENGTH, default=new_job_id)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="jobs")
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="jobs")
    training_file = models.ForeignKey(
        File, on_delete=models.DO_NOTHING, db_constraint=False, related_name="training_jobs"
    )
    validation_file = models.ForeignKey(
        File,
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="validation_jobs",
    )
    status = models.CharField(
        max_length=20, choices=JobStatus.choices, default=JobStatus.VALIDATING_FILES
    )
    hyperparameters = models.JSONField()
    method = models.CharField(
        max_length=16, choices=JobMethod.choices, default=JobMethod.SUPERVISED
    )
    dpo_beta = models.JSONField(null=True, blank=True)
    resolved_hyperparameters = models.JSONField(null=True, blank=True)
    total_steps = models.PositiveIntegerField(null=True, blank=True)
    lora_rank = models.PositiveIntegerField(
        default=hparams.DEFAULT_LORA_RANK, validators=[MinValueValidator(1)]
    )
    lora_alpha = models.FloatField(default=hparams.DEFAULT_LORA_ALPHA)
    lora_dropout = models.FloatField(default=hparams.DEFAULT_LORA_DROPOUT)
    lora_target_modules = models.JSONField(default=default_lora_target_modules)
    suffix = models.CharField(max_length=64, blank=True)
    seed = models.BigIntegerField()
    metadata = models.JSONField(null=True, blank=True)
    trained_tokens = models.BigIntegerField(null=True, blank=True)
    fine_tuned_model = models.CharField(max_length=255, null=True, blank=True, unique=True)
    error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    stalled_at = models.DateTimeField(null=True, blank=True)
    """Set while the job runs with no progress from its host for `HARLI_JOB_STALL_AFTER_S`
    (`api.services.reconcile`); cleared by its next progress report or status change."""

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"]), models.Index(fields=["status"])]

    def __str__(self) -> str:
        return self.id


class EventLevel(models.TextChoices):
    INFO = "info", "info"
    WARN = "warn", "warn"
    ERROR = "error", "error"


class EventType(models.TextChoices):
    MESSAGE = "message", "message"
    METRICS = "metrics", "metrics"


class JobEvent(models.Model):
    """One line of a job's history, as shown by `GET /v1/fine_tuning/jobs/{id}/events`.

    `message` and `data` are the tenant's: they never name a host or state the fleet's
    capacity. `fleet_detail` holds that host-level detail (`text`: the operator's wording of the
    event, plus fields such as `host`) and is shown only to operators (the console's job page,
    `GET /api/ops/jobs/{id}/events`).
    """

    id = models.CharField(primary_key=True, max_length=PUBLIC_ID_MAX_LENGTH, default=new_event_id)
    job = models.ForeignKey(FinetuneJob, on_delete=models.CASCADE, related_name="events")
    level = models.CharField(max_length=8, choices=EventLevel.choices, default=EventLevel.INFO)
    type = models.CharField(max_length=16, choices=EventType.choices, default=EventType.MESSAGE)
    message = models.TextField()
    data = models.JSONField(null=True, blank=True)
    fleet_detail = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]


class JobCheckpoint(models.Model):
    """An adapter checkpoint saved at `step`; `metrics` holds `train_loss`, `valid_loss`, ...

    `path` is where the host stored the PEFT adapter; a job that loses its host resumes from its
    latest checkpoint.
    """

    id = models.CharField(
        primary_key=True, max_length=PUBLIC_ID_MAX_LENGTH, default=new_checkpoint_id
    )
    job = models.ForeignKey(FinetuneJob, on_delete=models.CASCADE, related_name="checkpoints")
    step = models.PositiveIntegerField()
    metrics = models.JSONField(default=dict)
    path = models.CharField(max_length=1024, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-step", "-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["job", "step"], name="job_checkpoint_unique_step")
        ]


class Adapter(models.Model):
    """A finished LoRA adapter a tenant can call by `name` (the job's `fine_tuned_model`)."""

    name = models.CharField(max_length=255, unique=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    job = models.OneToOneField(FinetuneJob, on_delete=models.CASCADE, related_name="adapter")
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="adapters")
    path = models.CharField(max_length=1024, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name


class PlacementState(models.TextChoices):
    PENDING = "pending", "Pending"  # sent to the host, not yet acknowledged
    ACTIVE = "active", "Active"  # the host runs the job
    RELEASED = "released", "Released"  # ended normally (job finished, paused or cancelled)
    LOST = "lost", "Lost"  # the host was lost; the job must resume elsewhere


OPEN_PLACEMENT_STATES = (PlacementState.PENDING, PlacementState.ACTIVE)


class Placement(models.Model):
    """A job assigned to a host. At most one open (pending or active) placement per job.

    `engine_group` is the host's engine group that trains it (null for placements made before
    hosts had groups, or whose group an operator removed after the placement closed)."""

    job = models.ForeignKey(FinetuneJob, on_delete=models.CASCADE, related_name="placements")
    host = models.ForeignKey(GpuHost, on_delete=models.PROTECT, related_name="placements")
    engine_group = models.ForeignKey(
        "api.EngineGroup",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="placements",
    )
    state = models.CharField(
        max_length=16, choices=PlacementState.choices, default=PlacementState.PENDING
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    stopped_step = models.PositiveIntegerField(null=True, blank=True)
    """The step its host reported stopping at (`job_stopped`): a pause's checkpoint is there."""
    stopped_at = models.DateTimeField(null=True, blank=True)
    """When that stop report was applied."""

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["job"],
                condition=models.Q(state__in=["pending", "active"]),
                name="placement_one_open_per_job",
            )
        ]
