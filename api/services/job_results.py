"""What a job's host measures, kept on the job: the settings "auto" became, the tokens trained so
far, the checkpoints it keeps, and the results file of a finished job.

* The results file is a CSV as OpenAI writes it, one row per optimizer step:
  `step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy` (an empty cell where a
  value was not measured: validation runs at checkpoints only). It is a File of purpose
  `fine-tune-results` owned by the job's tenant, downloadable as any file; a row is the latest
  report of its step (a step trained again after a failover counts once, as trained last).
* A job keeps its latest `keep` checkpoints (`HARLI_KEEP_CHECKPOINTS`, `api.fleet_settings`); older
  ones leave the checkpoint list at once and storage after commit. Nothing is pruned while a
  placement of the job is pending: the host it was sent to has yet to load the checkpoint it was
  told to resume from, which a late checkpoint of the previous placement (a pause lets it land)
  must not delete; the next checkpoint report prunes.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from typing import Any

from django.db import transaction

from api.errors import HarliError
from api.models import (
    File,
    FilePurpose,
    FileStatus,
    FinetuneJob,
    JobCheckpoint,
    JobMethod,
    JobMetric,
    Placement,
    PlacementState,
)
from api.models.ids import new_file_id
from api.services.quotas import job_trained_tokens_advance
from api.storage import get_storage

RESULTS_COLUMNS = (
    "step",
    "train_loss",
    "train_accuracy",
    "valid_loss",
    "valid_mean_token_accuracy",
)
RESOLVED_KEYS = ("n_epochs", "batch_size", "learning_rate_multiplier")


def _resolved(job: FinetuneJob, hyperparameters: Any) -> dict[str, Any]:
    """The host's resolved settings, checked: positive integers and a positive multiplier, plus
    a positive `beta` for a DPO job (and only for one)."""
    want = set(RESOLVED_KEYS) | ({"beta"} if job.method == JobMethod.DPO else set())
    if not isinstance(hyperparameters, dict) or set(hyperparameters) != want:
        raise HarliError(
            f"resolved hyperparameters must hold exactly {sorted(want)}, got {hyperparameters!r}.",
            param="hyperparameters",
        )
    epochs, batch, multiplier = (hyperparameters[k] for k in RESOLVED_KEYS)
    for name, value in (("n_epochs", epochs), ("batch_size", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HarliError(f"{name} must be a positive integer, got {value!r}.", param=name)
    positive = {"learning_rate_multiplier": multiplier}
    if "beta" in want:
        positive["beta"] = hyperparameters["beta"]
    for name, value in positive.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise HarliError(f"{name} must be a positive number, got {value!r}.", param=name)
    resolved: dict[str, Any] = {"n_epochs": epochs, "batch_size": batch}
    return resolved | {name: float(value) for name, value in positive.items()}


def finetune_job_settings_record(
    *, job: FinetuneJob, hyperparameters: Any, total_steps: Any
) -> FinetuneJob:
    """Keep what a host resolved the job's settings to, and the steps it counted. Every host
    resolves a job the same way (deterministic in its file), so a later start overwrites with
    the same values."""
    resolved = _resolved(job, hyperparameters)
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise HarliError(f"total_steps must be >= 1, got {total_steps!r}.", param="total_steps")
    with transaction.atomic():
        FinetuneJob.objects.filter(pk=job.pk).update(
            resolved_hyperparameters=resolved, total_steps=total_steps
        )
    job.resolved_hyperparameters, job.total_steps = resolved, total_steps
    return job


def finetune_job_trained_tokens_update(*, job: FinetuneJob, trained_tokens: Any) -> None:
    """The tokens trained so far, as the job's latest progress report counts them."""
    if (
        isinstance(trained_tokens, bool)
        or not isinstance(trained_tokens, int)
        or trained_tokens < 0
    ):
        raise HarliError(
            f"trained_tokens must be >= 0, got {trained_tokens!r}.", param="trained_tokens"
        )
    job_trained_tokens_advance(job=job, trained_tokens=trained_tokens)
    job.trained_tokens = trained_tokens


def job_checkpoints_prune(*, job: FinetuneJob, keep: int) -> list[int]:
    """Delete every checkpoint of `job` but the `keep` latest (by step): the rows now, their
    stored trees after commit (the completeness marker first, so a half-deleted tree never
    reads as a checkpoint). Returns the steps deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if Placement.objects.filter(job=job, state=PlacementState.PENDING).exists():
        return []
    with transaction.atomic():
        kept = list(
            JobCheckpoint.objects.filter(job=job).order_by("-step").values_list("pk", flat=True)
        )[:keep]
        old = JobCheckpoint.objects.filter(job=job).exclude(pk__in=kept)
        doomed = list(old.values_list("step", "path"))
        old.delete()
        paths = [path for _, path in doomed if path]
        if paths:
            transaction.on_commit(lambda: _delete_trees(paths), robust=True)
    return sorted(step for step, _ in doomed)


def _delete_trees(prefixes: list[str]) -> None:
    storage = get_storage()
    for prefix in prefixes:
        storage.delete(f"{prefix}/.complete")
        for key in storage.list_keys(prefix):
            storage.delete(key)


def _csv_cell(value: float | int | None) -> str:
    return "" if value is None else repr(value) if isinstance(value, float) else str(value)


def results_csv(*, job: FinetuneJob) -> bytes:
    """The job's metrics CSV (see the module docstring)."""
    rows: dict[int, tuple[Any, ...]] = {}
    metrics = JobMetric.objects.filter(job=job).order_by("ts", "id")
    for m in metrics.values_list(*RESULTS_COLUMNS):
        rows[m[0]] = m
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULTS_COLUMNS)
    for step in sorted(rows):
        writer.writerow([_csv_cell(v) for v in rows[step]])
    return out.getvalue().encode()


def job_result_file_create(*, job: FinetuneJob) -> File:
    """Write the job's results CSV to storage, then its File row (the bytes go again if the
    transaction fails)."""
    data = results_csv(job=job)
    file_id = new_file_id()
    storage_key = f"files/{job.tenant_id}/{file_id}.csv"
    storage = get_storage()

    def chunks() -> Iterator[bytes]:
        yield data

    try:
        storage.save(storage_key, chunks())
        with transaction.atomic():
            return File.objects.create(
                id=file_id,
                tenant_id=job.tenant_id,
                filename="step_metrics.csv",
                purpose=FilePurpose.FINE_TUNE_RESULTS,
                bytes=len(data),
                line_count=data.count(b"\n") - 1,
                status=FileStatus.PROCESSED,
                storage_key=storage_key,
                job=job,
            )
    except BaseException:
        storage.delete(storage_key)
        raise
