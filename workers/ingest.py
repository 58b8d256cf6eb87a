"""Applying host reports (heartbeats, job progress, checkpoints, outcomes, metrics).

:func:`host_report_apply` is what the `workers.host_report` task calls. Each report is applied
at most once: its `message_id` is inserted into `ProcessedReport` in the same transaction as its
effect, so a redelivered copy (acks_late, broker restart) changes nothing. A report about a
placement that is no longer open (the job moved after its host was declared lost, or was paused
or cancelled) is stale: it is ignored, and the host is told to stop that placement, by the
report itself for a start or an outcome, and for the per-step reports (progress, checkpoints)
by the next heartbeat that names the placement: a worker a few seconds behind would otherwise
send one stop per step the host trained before its stop arrived.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from api.errors import ConflictError
from api.models import (
    OPEN_PLACEMENT_STATES,
    Adapter,
    DeploymentMetric,
    EventType,
    FinetuneJob,
    GpuHost,
    HostMetric,
    HostStatus,
    JobEvent,
    JobMetric,
    JobStatus,
    Placement,
    PlacementState,
)
from api.services.jobs import (
    finetune_job_fail,
    finetune_job_succeed,
    finetune_job_transition,
    job_checkpoint_record,
    job_event_record,
)
from gpu_runtime.agent.protocol import check_report
from workers.models import HostAgentState, ProcessedReport, RollupSeries
from workers.rollups import rollup_add


def _ts(message: dict[str, Any]) -> datetime:
    sent = message.get("sent_at")
    if isinstance(sent, (int, float)):
        return datetime.fromtimestamp(float(sent), tz=UTC)
    return timezone.now()


def host_report_apply(*, message: dict[str, Any]) -> str:
    """Apply one report; returns "applied", "duplicate", "stale" or "unknown_host"."""
    check_report(message)
    if not GpuHost.objects.filter(name=message["host"]).exists():
        return "unknown_host"  # nothing to apply, so nothing to deduplicate
    with transaction.atomic():
        try:
            with transaction.atomic():
                ProcessedReport.objects.create(
                    message_id=message["message_id"], kind=message["kind"], host=message["host"]
                )
        except IntegrityError:
            return "duplicate"
        host = GpuHost.objects.select_for_update().filter(name=message["host"]).first()
        if host is None:
            return "unknown_host"
        handler = _HANDLERS[message["kind"]]
        return handler(host, message)


def _heartbeat(host: GpuHost, message: dict[str, Any]) -> str:
    now = timezone.now()
    fields = ["last_heartbeat_at"]
    host.last_heartbeat_at = now
    if "predictor_version" in message:  # the latency predictor the agent loaded (or none)
        mape = message.get("predictor_mape")
        host.predictor_version = message["predictor_version"] or None
        host.predictor_mape = float(mape) if mape is not None else None
        fields += ["predictor_version", "predictor_mape"]
    draining = bool(message.get("draining", False))
    if host.status in (HostStatus.OFFLINE, HostStatus.LOST):
        # A host back from the dead that still drains stays drained (the operator's intent).
        host.status = HostStatus.DRAINING if draining else HostStatus.ONLINE
        fields.append("status")
    host.save(update_fields=fields)
    HostAgentState.objects.update_or_create(
        host=host,
        defaults={
            "base_model": str(message.get("base_model", "")),
            "server_url": str(message.get("server_url", "")),
            "draining": bool(message.get("draining", False)),
            "total_bytes": int(message["total_bytes"]),
            "free_bytes": int(message["free_bytes"]),
            "harvestable_tokens_per_s": float(message.get("harvestable_tokens_per_s", 0.0)),
            "harvest": dict(message.get("harvest") or {}),
            "placements": list(message["placements"]),
            "adapters": list(message.get("adapters", [])),
            "reported_at": now,
        },
    )
    # A host back from the dead may still train placements that moved elsewhere: stop them.
    reported = [int(p) for p in message["placements"]]
    stale = Placement.objects.filter(pk__in=reported).exclude(
        host=host, state__in=OPEN_PLACEMENT_STATES
    )
    for placement in stale.select_related("job"):
        _stop_on_commit(host, placement)
    _offer_missing_adapters(host, set(message.get("adapters", [])))
    _offer_base_model(host, str(message.get("base_model", "")))
    # The agent follows the host's status: draining, or back in service (`host_undrain`).
    if (host.status == HostStatus.DRAINING) != draining and host.status in (
        HostStatus.ONLINE,
        HostStatus.DRAINING,
    ):
        from workers.commands import send_host_command

        command = "drain" if host.status == HostStatus.DRAINING else "undrain"
        transaction.on_commit(
            partial(send_host_command, host_name=host.name, command=command), robust=True
        )
    return "applied"


def _offer_base_model(host: GpuHost, serving: str) -> None:
    """Send `load_base_model` when the host serves another model than its deployment's."""
    deployment = host.deployment
    if deployment is None or deployment.base_model.name == serving:
        return
    base = deployment.base_model
    fields = {"base_model": base.name, "model_dir": base.checkpoint_dir or None,
              "preset": base.preset}  # fmt: skip
    name = host.name

    def send() -> None:
        from workers.commands import send_host_command

        send_host_command(host_name=name, command="load_base_model", **fields)

    transaction.on_commit(send)


def _offer_missing_adapters(host: GpuHost, served: set[str]) -> None:
    """Send `load_adapter` for finished adapters of the host's base model it does not serve."""
    if host.deployment_id is None or host.status != HostStatus.ONLINE:
        return
    missing = list(
        Adapter.objects.filter(base_model__deployments__hosts=host)
        .exclude(name__in=served)
        .exclude(path="")
        .values_list("name", "path")
    )
    if not missing:
        return

    def send() -> None:
        from workers.commands import send_host_command

        for name, key in missing:
            send_host_command(
                host_name=host.name, command="load_adapter", name=name, storage_key=key
            )

    transaction.on_commit(send)


def _stop_on_commit(host: GpuHost, placement: Placement) -> None:
    """Tell the host to stop a placement that is no longer open: pause when the job is
    paused (the host checkpoints first), cancel otherwise. The safety net behind the stop that
    a pause or cancel sends at its own commit (`api.services.jobs`); the host ignores a stop
    for a placement it no longer trains."""
    from workers.commands import send_stop

    stop = partial(
        send_stop,
        host_name=host.name,
        placement_id=placement.pk,
        job_id=placement.job_id,
        command="pause" if placement.job.status == JobStatus.PAUSED else "cancel",
    )
    transaction.on_commit(stop, robust=True)


# Reports sent once per optimizer step: a stale one does not send a stop of its own (the
# heartbeats' check does, once per heartbeat).
_PER_STEP_REPORTS = ("job_progress", "checkpoint")


def _open_placement(host: GpuHost, message: dict[str, Any]) -> Placement | None:
    """The open placement the report is about, or None (stale; see the module docstring)."""
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
    if message["kind"] in _PER_STEP_REPORTS and placement.job.status == JobStatus.PAUSED:
        # A pause ends at the host's next batch boundary, after the release here: the steps
        # trained until then and the checkpoint the pause writes still count.
        return placement
    if message["kind"] not in _PER_STEP_REPORTS:
        _stop_on_commit(host, placement)
    return None


def _job(message: dict[str, Any]) -> FinetuneJob:
    return FinetuneJob.objects.select_related("tenant", "base_model").get(pk=message["job_id"])


def _job_started(host: GpuHost, message: dict[str, Any]) -> str:
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
        text = (
            f"Fine-tuning resumed on host {host.name} from checkpoint step {step}"
            if step
            else f"Fine-tuning started on host {host.name}"
        )
        finetune_job_transition(job=job, to=JobStatus.RUNNING, message=text)
    return "applied"


def _job_progress(host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    recorded = _step_record(
        host,
        _job(message),
        _ts(message),
        step=int(message["step"]),
        loss=float(message["train_loss"]),
        total=message.get("total_steps"),
        learning_rate=message.get("learning_rate"),
        tokens_per_s=float(message.get("tokens_per_s", 0.0)),
        valid_loss=message.get("valid_loss"),
    )
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
    recovered: bool = False,
) -> bool:
    """One optimizer step of `job` on `host`: JobMetric, "Step" event, rollup. A step this
    host already reported is skipped (a progress report recovered from a checkpoint report
    first, then redelivered late); False then."""
    if JobEvent.objects.filter(
        job=job, type=EventType.METRICS, data__step=step, data__host=host.name
    ).exists():
        return False
    JobMetric.objects.create(
        job=job, ts=ts, step=step, train_loss=loss, tokens_per_s=tokens_per_s,
        valid_loss=valid_loss,
    )  # fmt: skip
    data: dict[str, Any] = {
        "step": step,
        "total_steps": total,
        "train_loss": loss,
        "learning_rate": learning_rate,
        "tokens_per_s": tokens_per_s,
        "host": host.name,
    }
    if recovered:
        data["recovered"] = True  # its own progress report never arrived
    job_event_record(
        job=job,
        message=f"Step {step}/{total}: training loss={loss:.4f}",
        type=EventType.METRICS,
        data=data,
    )
    rollup_add(
        series=RollupSeries.JOB,
        key=job.id,
        ts=ts,
        values={"train_loss": loss, "tokens_per_s": tokens_per_s, "step": step},
    )
    return True


def _checkpoint(host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    job = _job(message)
    ts = _ts(message)
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
            recovered=True,
        )
    metrics = {k: v for k, v in dict(message["metrics"]).items() if k != "step"}
    try:
        job_checkpoint_record(
            job=job, step=int(message["step"]), metrics=metrics, path=message["storage_key"]
        )
    except ConflictError:
        # The same step again (written before a failover): keep the first record.
        return "duplicate"
    return "applied"


def _job_succeeded(host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    job = finetune_job_succeed(
        job=_job(message),
        trained_tokens=int(message["trained_tokens"]),
        adapter_path=str(message["adapter_key"]),
    )
    name, key, base = job.fine_tuned_model, str(message["adapter_key"]), job.base_model_id
    hosts = list(
        GpuHost.objects.filter(
            status__in=(HostStatus.ONLINE, HostStatus.DRAINING), deployment__base_model_id=base
        )
    )

    def announce() -> None:
        from workers.commands import send_host_command

        for target in hosts:
            send_host_command(
                host_name=target.name, command="load_adapter", name=name, storage_key=key
            )

    transaction.on_commit(announce)
    return "applied"


def _job_failed(host: GpuHost, message: dict[str, Any]) -> str:
    if _open_placement(host, message) is None:
        return "stale"
    finetune_job_fail(job=_job(message), code=str(message["code"]), message=str(message["message"]))
    return "applied"


def _job_stopped(host: GpuHost, message: dict[str, Any]) -> str:
    job = _job(message)
    job_event_record(
        job=job,
        message=f"Host {host.name} stopped training ({message['reason']}) at step "
        f"{message.get('step', '?')}",
        data={
            "host": host.name,
            "reason": message["reason"],
            "step": message.get("step"),
            "stopped_at": message.get("sent_at"),  # Unix s, the host's clock
        },
    )
    return "applied"


def _metrics(host: GpuHost, message: dict[str, Any]) -> str:
    ts = _ts(message)
    hm = dict(message["host_metrics"])
    HostMetric.objects.create(
        host=host,
        ts=ts,
        weights_bytes=int(hm["weights_bytes"]),
        kv_used_bytes=int(hm["kv_used_bytes"]),
        finetune_lent_bytes=int(hm["finetune_lent_bytes"]),
        free_bytes=int(hm["free_bytes"]),
        finetune_tokens_per_s=float(hm.get("finetune_tokens_per_s", 0.0)),
    )
    rollup_add(series=RollupSeries.HOST, key=host.name, ts=ts, values=hm)
    dm = message.get("deployment_metrics")
    if dm and host.deployment_id is not None:
        DeploymentMetric.objects.create(
            deployment_id=host.deployment_id,
            host=host,
            ts=ts,
            tpot_p50_ms=float(dm["tpot_p50_ms"]),
            tpot_p99_ms=float(dm["tpot_p99_ms"]),
            ttft_p50_ms=_optional_float(dm.get("ttft_p50_ms")),
            ttft_p99_ms=_optional_float(dm.get("ttft_p99_ms")),
            slo_attainment=min(1.0, max(0.0, float(dm["slo_attainment"]))),
            goodput_tokens_per_s=float(dm.get("goodput_tokens_per_s", 0.0)),
            request_rate=float(dm.get("request_rate", 0.0)),
            predicted_iter_ms=dm.get("predicted_iter_ms"),
            observed_iter_ms=dm.get("observed_iter_ms"),
            predictor_version=dm.get("predictor_version"),
        )
        key = f"{host.deployment.name if host.deployment else host.deployment_id}@{host.name}"
        numeric: dict[str, float | None] = {
            str(k): float(v) for k, v in dm.items() if isinstance(v, (int, float))
        }
        rollup_add(series=RollupSeries.DEPLOYMENT, key=key, ts=ts, values=numeric)
    return "applied"


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


_HANDLERS = {
    "heartbeat": _heartbeat,
    "job_started": _job_started,
    "job_progress": _job_progress,
    "checkpoint": _checkpoint,
    "job_succeeded": _job_succeeded,
    "job_failed": _job_failed,
    "job_stopped": _job_stopped,
    "metrics": _metrics,
}
