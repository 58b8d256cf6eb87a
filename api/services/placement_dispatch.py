"""The `apply_placement` command of a placement, and its (re)sending to the host's queue.

A placement is sent once its transaction commits (`api.services.placement`), and again by
reconciliation while its host has not started it (`api.services.reconcile`); each send is
recorded on its `PlacementDecision` (`last_dispatched_at`, `dispatch_count`).
"""

from __future__ import annotations

from typing import Any

from django.db.models import F
from django.utils import timezone

from api.dispatch import host_dispatch
from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    FinetuneJob,
    JobCheckpoint,
    JobMethod,
    Placement,
    PlacementDecision,
)
from api.selectors import fine_tuned_model_name, job_checkpoint_latest
from gpu_runtime.contract.protocol import adapter_key
from gpu_runtime.contract.training_data import training_max_seq_len

_LOOKUP = object()  # placement_command's `resume` not given: read the latest checkpoint


def job_spec(*, job: FinetuneJob, resume: JobCheckpoint | None) -> dict[str, Any]:
    """The JobSpec of an apply_placement command (see the protocol module)."""
    return {
        "id": job.id,
        "base_model": job.base_model.name,
        "training_file": job.training_file_id,
        "training_file_key": job.training_file.storage_key,
        "validation_file": job.validation_file_id,
        "validation_file_key": job.validation_file.storage_key if job.validation_file else None,
        "max_seq_len": training_max_seq_len(job.base_model.context_length),
        "method": job.method,
        "hyperparameters": dict(job.hyperparameters)
        | ({"beta": job.dpo_beta} if job.method == JobMethod.DPO else {}),
        "lora": {
            "rank": job.lora_rank,
            "alpha": job.lora_alpha,
            "dropout": job.lora_dropout,
            "target_modules": list(job.lora_target_modules),
        },
        "seed": job.seed,
        "checkpoint_every_steps": fleet_settings().checkpoint_every_steps,
        "fine_tuned_model": fine_tuned_model_name(job=job),
        "adapter_key": adapter_key(job.id),
        "resume_from": (
            {"step": resume.step, "storage_key": resume.path} if resume is not None else None
        ),
    }


def placement_command(
    *, placement: Placement, resume: JobCheckpoint | None | object = _LOOKUP
) -> dict[str, Any]:
    """apply_placement for `placement`, resuming from the job's latest checkpoint if any
    (`resume`, when the caller read it already); `engine_group` names its group when that is
    not group 0 (what an agent of the one-engine shape trains on)."""
    job = placement.job
    latest = job_checkpoint_latest(job=job) if resume is _LOOKUP else resume
    assert latest is None or isinstance(latest, JobCheckpoint)
    command: dict[str, Any] = {
        "placement_id": placement.pk,
        "job": job_spec(job=job, resume=latest),
    }
    group = placement.engine_group
    if group is not None and group.index:
        command["engine_group"] = group.index
    return command


def placement_send(*, placement_id: int) -> None:
    """Send (or send again) an open placement to its host, and record the dispatch; a closed
    one is not sent. Runs after the placement's transaction committed."""
    placements_send(placement_ids=[placement_id])


def placements_send(*, placement_ids: list[int]) -> list[int]:
    """`placement_send` for many placements in a fixed number of queries (the placements with
    their jobs and files, the jobs' latest checkpoints, one update of the dispatch records) and
    one broker message each. Returns the ids sent (the open ones)."""
    placements = list(
        Placement.objects.select_related(
            "host",
            "engine_group",
            "job",
            "job__base_model",
            "job__tenant",
            "job__training_file",
            "job__validation_file",
        )
        .filter(pk__in=placement_ids, state__in=OPEN_PLACEMENT_STATES)
        .order_by("pk")
    )
    if not placements:
        return []
    latest: dict[str, JobCheckpoint] = {}
    checkpoints = JobCheckpoint.objects.exclude(path="").filter(
        job_id__in=[p.job_id for p in placements]
    )
    for checkpoint in checkpoints.order_by("job_id", "step"):
        latest[checkpoint.job_id] = checkpoint  # ascending: the last one per job stays
    dispatch = host_dispatch()
    for placement in placements:
        dispatch.host_command_send(
            host_name=placement.host.name,
            command="apply_placement",
            **placement_command(placement=placement, resume=latest.get(placement.job_id)),
        )
    sent = [p.pk for p in placements]
    PlacementDecision.objects.filter(placement_id__in=sent).update(
        last_dispatched_at=timezone.now(), dispatch_count=F("dispatch_count") + 1
    )
    return sent
