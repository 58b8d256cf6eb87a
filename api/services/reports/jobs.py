"""Reports about one placement of a fine-tuning job: its start, optimizer steps, checkpoints,
and outcome (succeeded, failed, stopped). A report about a placement that is no longer open is
stale (see the package docstring, `api.services.reports`)."""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from api.dispatch import host_dispatch
from api.errors import ConflictError, HarliError
from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    EventType,
    FinetuneJob,
    GpuHost,
    HostAgentState,
    HostStatus,
    JobEvent,
    JobMetric,
    JobStatus,
    Placement,
    PlacementState,
    RollupSeries,
)
from api.services.job_results import (
    finetune_job_settings_record,
    finetune_job_trained_tokens_update,
    job_checkpoints_prune,
    job_result_file_create,
)
from api.services.jobs import (
    finetune_job_fail,
    finetune_job_succeed,
    finetune_job_transition,
    host_detail,
    job_checkpoint_record,
    job_event_record,
)
from api.services.reports.common import pausing, report_time, stop_on_commit
from api.services.rollups import rollup_add
from api.tenant_text import without_locations
from gpu_runtime.contract.protocol import PREFERENCE_METRICS, ProtocolError

# Reports sent once per optimizer step: a stale one does not send a stop of its own (the
# heartbeats' check does, once per heartbeat).
_PER_STEP_REPORTS = ("job_progress", "checkpoint")


def _open_placement(host: GpuHost, message: dict[str, Any]) -> Placement | None:
    """The placement the report is about while it counts, or None (stale; see the package
    docstring). Besides open placements, per-step reports count from the job's latest
    placement once a pause released it, while the job is paused or resumed and waiting for
    this host's stop (`api.services.placement`): the steps the host trained until its batch
    boundary, and the checkpoint the pause writes there, are what the job resumes from.

    Locks the job's row before the placement's: every writer that holds both takes them in
    that order (a tenant's pause or cancel locks the job, then releases its placement), so a
    report applied at the moment of a pause cannot deadlock with it."""
    FinetuneJob.objects.select_for_update().filter(pk=message["job_id"]).exists()
    placement = (
        Placement.objects.select_for_update()
        .select_related("job")
        .filter(pk=int(message["placement_id"]), job_id=message["job_id"], host=host)
        .first()
    )
    if placement is None:
        return None
    if placement.state in OPEN_PLACEMENT_STATES:
        return placement
    if message["kind"] in _PER_STEP_REPORTS:
        if pausing(placement):
            return placement
    else:
        stop_on_commit(host, placement)
    return None


def _job(message: dict[str, Any]) -> FinetuneJob:
    return FinetuneJob.objects.select_related("tenant", "base_model").get(pk=message["job_id"])


def job_started_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    placement = _open_placement(host, message)
    if placement is None:
        return "stale"
    if placement.state == PlacementState.PENDING:
        placement.state = PlacementState.ACTIVE
        placement.started_at = timezone.now()
        placement.save(update_fields=["state", "started_at"])
    job = _job(message)
    step = int(message["resumed_from_step"])
    if job.status == JobStatus.QUEUED:
        text, detail = (
            (
                f"Fine-tuning resumed from checkpoint step {step}",
                f"Fine-tuning resumed on host {host.name} from checkpoint step {step}",
            )
            if step
            else ("Fine-tuning started", f"Fine-tuning started on host {host.name}")
        )
        finetune_job_transition(
            job=job,
            to=JobStatus.RUNNING,
            message=text,
            fleet_detail=host_detail(detail, host=host.name, placement_id=placement.pk),
        )
    if "hyperparameters" in message:
        try:
            finetune_job_settings_record(
                job=job,
                hyperparameters=message["hyperparameters"],
                total_steps=message.get("total_steps"),
            )
        except HarliError as exc:  # the whole report is then dropped as malformed
            raise ProtocolError(f"job_started of job {job.id}: {exc}") from exc
    return "applied"


def _progressed(host: GpuHost, job: FinetuneJob) -> None:
    """Progress from the job's host clears its stall flag (`api.services.reconcile`), with an
    event."""
    if job.stalled_at is None:
        return
    FinetuneJob.objects.filter(pk=job.pk).update(stalled_at=None)
    since = job.stalled_at.isoformat(timespec="seconds")
    job_event_record(
        job=job,
        message=f"Training progress again (stalled since {since})",
        fleet_detail=host_detail(
            f"Progress from host {host.name} again (stalled since {since})", host=host.name
        ),
    )
    job.stalled_at = None


def job_progress_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    job = _job(message)
    _progressed(host, job)
    recorded = _step_record(
        host,
        job,
        report_time(message),
        step=int(message["step"]),
        loss=float(message["train_loss"]),
        total=message.get("total_steps"),
        learning_rate=message.get("learning_rate"),
        tokens_per_s=float(message.get("tokens_per_s", 0.0)),
        valid_loss=message.get("valid_loss"),
        train_accuracy=message.get("train_accuracy"),
        valid_accuracy=message.get("valid_mean_token_accuracy"),
        preference={k: float(message[k]) for k in PREFERENCE_METRICS if k in message},
    )
    if recorded and "trained_tokens" in message:
        finetune_job_trained_tokens_update(job=job, trained_tokens=message["trained_tokens"])
    return "applied" if recorded else "duplicate"


def _step_record(
    host: GpuHost,
    job: FinetuneJob,
    ts: datetime,
    *,
    step: int,
    loss: float,
    total: Any,
    learning_rate: Any,
    tokens_per_s: float,
    valid_loss: Any = None,
    train_accuracy: Any = None,
    valid_accuracy: Any = None,
    recovered: bool = False,
    preference: dict[str, float] | None = None,
) -> bool:
    """One optimizer step of `job` on `host`: JobMetric, "Step" event, rollup. A step this
    host already reported is skipped (a progress report recovered from a checkpoint report
    first, then redelivered late); False then."""
    if JobEvent.objects.filter(
        job=job, type=EventType.METRICS, data__step=step, fleet_detail__host=host.name
    ).exists():
        return False
    JobMetric.objects.create(
        job=job, ts=ts, step=step, train_loss=loss, tokens_per_s=tokens_per_s,
        valid_loss=valid_loss, train_accuracy=train_accuracy,
        valid_mean_token_accuracy=valid_accuracy,
    )  # fmt: skip
    data: dict[str, Any] = {
        "step": step,
        "total_steps": total,
        "train_loss": loss,
        "train_mean_token_accuracy": train_accuracy,
        "learning_rate": learning_rate,
        "tokens_per_s": tokens_per_s,
    }
    data.update(preference or {})  # a DPO step's preference metrics
    if valid_loss is not None:
        data["valid_loss"] = valid_loss
        data["valid_mean_token_accuracy"] = valid_accuracy
    if recovered:
        data["recovered"] = True  # its own progress report never arrived
    text = f"Step {step}/{total}: training loss={loss:.4f}"
    if valid_loss is not None:
        text += f", validation loss={float(valid_loss):.4f}"
    job_event_record(
        job=job,
        message=text,
        type=EventType.METRICS,
        data=data,
        fleet_detail=host_detail(f"{text} on host {host.name}", host=host.name),
    )
    rollup_add(
        series=RollupSeries.JOB,
        key=job.id,
        ts=ts,
        values={"train_loss": loss, "tokens_per_s": tokens_per_s, "step": step},
    )
    return True


def checkpoint_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    job = _job(message)
    _progressed(host, job)
    ts = report_time(message)
    for entry in message.get("recent_steps") or []:  # steps whose progress report was lost
        _step_record(
            host,
            job,
            ts,
            step=int(entry["step"]),
            loss=float(entry["train_loss"]),
            total=message.get("total_steps"),
            learning_rate=entry.get("learning_rate"),
            tokens_per_s=0.0,
            train_accuracy=entry.get("train_accuracy"),
            recovered=True,
        )
    metrics = {k: v for k, v in dict(message["metrics"]).items() if k != "step"}
    step = int(message["step"])
    try:
        job_checkpoint_record(job=job, step=step, metrics=metrics, path=message["storage_key"])
    except ConflictError:
        # The same step again (written before a failover): keep the first record.
        return "duplicate"
    if metrics.get("valid_loss") is not None:  # the step's row, if its progress report was lost
        JobMetric.objects.filter(job=job, step=step, valid_loss__isnull=True).update(
            valid_loss=metrics["valid_loss"],
            valid_mean_token_accuracy=metrics.get("valid_mean_token_accuracy"),
        )
    job_checkpoints_prune(job=job, keep=fleet_settings().keep_checkpoints)
    if job.status == JobStatus.QUEUED:  # a resumed job may wait for this checkpoint
        _place_on_commit(job.id)
    return "applied"


def job_succeeded_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    job = finetune_job_succeed(
        job=_job(message),
        trained_tokens=int(message["trained_tokens"]),
        adapter_path=str(message["adapter_key"]),
    )
    job_result_file_create(job=job)
    name, key, base = job.fine_tuned_model, str(message["adapter_key"]), job.base_model_id
    hosts = list(
        GpuHost.objects.filter(
            status__in=(HostStatus.ONLINE, HostStatus.DRAINING),
            engine_groups__deployment__base_model_id=base,
        ).distinct()
    )

    def announce() -> None:
        for target in hosts:
            host_dispatch().host_command_send(
                host_name=target.name, command="load_adapter", name=name, storage_key=key
            )

    transaction.on_commit(announce)
    return "applied"


def job_failed_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    text = without_locations(str(message["message"]))  # hosts send none; a safety net
    finetune_job_fail(job=_job(message), code=str(message["code"]), message=text)
    return "applied"


def job_stopped_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
    """The host released a placement (paused at a batch boundary, or cancelled). From now on
    it does not train it: the host's agent state forgets the placement at once (its next
    heartbeat says so too), and a job resumed meanwhile is placed again."""
    job = _job(message)
    at_step = f"at step {message.get('step', '?')}"
    job_event_record(
        job=job,
        message=f"Training stopped ({message['reason']}) {at_step}",
        data={
            "reason": message["reason"],
            "step": message.get("step"),
            "stopped_at": message.get("sent_at"),  # Unix s, the host's clock
        },
        fleet_detail=host_detail(
            f"Host {host.name} stopped training ({message['reason']}) {at_step}",
            host=host.name,
            placement_id=int(message["placement_id"]),
        ),
    )
    placement_id = int(message["placement_id"])
    _forget_placement(host, placement_id)
    step = message.get("step")
    if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
        Placement.objects.filter(pk=placement_id, job=job).update(
            stopped_step=step, stopped_at=timezone.now()
        )
    if job.status == JobStatus.QUEUED:
        _place_on_commit(job.id)
    return "applied"


def _place_on_commit(job_id: str) -> None:
    """Place a queued job once this transaction commits (a resumed job that waited)."""

    transaction.on_commit(partial(host_dispatch().job_place_queue, job_id=job_id), robust=True)


def _forget_placement(host: GpuHost, placement_id: int) -> None:
    """Drop `placement_id` from what the host's agent state says it trains."""
    state = HostAgentState.objects.select_for_update().filter(host=host).first()
    if state is not None and placement_id in state.placements:
        state.placements = [p for p in state.placements if p != placement_id]
        state.save(update_fields=["placements"])
