"""Messages to a host's queue `host.<name>` (formats in `gpu_runtime.contract.protocol`).

Every sender here publishes; callers run it from `transaction.on_commit` so a host never hears
of a row that was rolled back.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from kombu.exceptions import OperationalError as BrokerOperationalError

from api.models import FinetuneJob, JobCheckpoint, JobMethod, Placement
from api.selectors import job_checkpoint_latest
from config.celery import app
from gpu_runtime.contract.protocol import HOST_COMMAND_TASK, adapter_key, check_command, host_queue
from gpu_runtime.contract.training_data import training_max_seq_len
from workers.conf import worker_settings

logger = logging.getLogger(__name__)


def job_spec(*, job: FinetuneJob, resume: JobCheckpoint | None) -> dict[str, Any]:
    """The JobSpec of an apply_placement command (see the protocol module)."""
    from api.services.jobs import fine_tuned_model_name

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
        "checkpoint_every_steps": worker_settings().checkpoint_every_steps,
        "fine_tuned_model": fine_tuned_model_name(job=job),
        "adapter_key": adapter_key(job.id),
        "resume_from": (
            {"step": resume.step, "storage_key": resume.path} if resume is not None else None
        ),
    }


def send_host_command(*, host_name: str, command: str, **fields: Any) -> dict[str, Any]:
    """Publish one command to `host.<host_name>`; returns the message sent."""
    message = check_command({"command": command, "command_id": uuid.uuid4().hex, **fields})
    app.send_task(
        HOST_COMMAND_TASK,
        args=[message],
        queue=host_queue(host_name),
        routing_key=host_queue(host_name),
        retry=True,
        retry_policy={"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5},
    )
    return message


def placement_command(*, placement: Placement) -> dict[str, Any]:
    """apply_placement for `placement`, resuming from the job's latest checkpoint if any."""
    job = placement.job
    resume = job_checkpoint_latest(job=job)
    return {"placement_id": placement.pk, "job": job_spec(job=job, resume=resume)}


def send_placement(*, placement_id: int) -> None:
    """Send (or send again) an open placement to its host; a closed one is not sent."""
    from django.db.models import F
    from django.utils import timezone

    from api.models import OPEN_PLACEMENT_STATES
    from workers.models import PlacementDecision

    placement = (
        Placement.objects.select_related(
            "host", "job", "job__base_model", "job__tenant", "job__training_file"
        )
        .filter(pk=placement_id, state__in=OPEN_PLACEMENT_STATES)
        .first()
    )
    if placement is None:
        return
    send_host_command(
        host_name=placement.host.name,
        command="apply_placement",
        **placement_command(placement=placement),
    )
    PlacementDecision.objects.filter(placement=placement).update(
        last_dispatched_at=timezone.now(), dispatch_count=F("dispatch_count") + 1
    )


def send_stop(*, host_name: str, placement_id: int, job_id: str, command: str) -> bool:
    """Tell a host to pause or cancel a placement; False (logged) when the broker did not take
    the message. Nothing is lost then: while the host still trains the placement, its
    heartbeats name it, and the stale-placement check (`workers.ingest`) sends the stop again.
    """
    try:
        send_host_command(
            host_name=host_name, command=command, placement_id=placement_id, job_id=job_id
        )
    except (BrokerOperationalError, OSError) as exc:
        logger.warning(
            "%s of job %s (placement %s) not sent to host %s: %s; its next heartbeat will stop it",
            command,
            job_id,
            placement_id,
            host_name,
            exc,
        )
        return False
    logger.info("sent %s of job %s (placement %s) to host %s", command, job_id, placement_id,
                host_name)  # fmt: skip
    return True


def send_unload(*, host_name: str, name: str) -> bool:
    """Tell a host to stop serving model `name`; False (logged) when the broker did not take
    it. While the host still serves it, its heartbeats name it and the heartbeat handler
    (`workers.ingest.heartbeat`) sends the unload again."""
    try:
        send_host_command(host_name=host_name, command="unload_adapter", name=name)
    except (BrokerOperationalError, OSError) as exc:
        logger.warning("unload of %s not sent to host %s: %s; its next heartbeat will", name,
                       host_name, exc)  # fmt: skip
        return False
    return True


def unload_everywhere(*, name: str, base_model_id: int) -> list[str]:
    """Send `unload_adapter` for `name` to every host that may serve it: each host of a
    deployment of its base model, and any other host whose last heartbeat named it. Returns
    the host names, sorted."""
    from api.models import GpuHost
    from workers.models import HostAgentState

    hosts = set(
        GpuHost.objects.filter(deployment__base_model_id=base_model_id).values_list(
            "name", flat=True
        )
    )
    for state in HostAgentState.objects.select_related("host"):
        if name in (state.adapters or []):
            hosts.add(state.host.name)
    for host_name in sorted(hosts):
        send_unload(host_name=host_name, name=name)
    return sorted(hosts)
