"""Placement: put a queued job on an online host that serves its base model.

A host is eligible when it is `online`, serves a deployment of the job's base model, heartbeated
within `HARLI_HOST_LOST_AFTER_S`, is not draining, and reports at least the job's estimated
finetune memory free (:func:`finetune_memory_estimate`, `gpu_runtime.contract.footprint`).
Among eligible hosts, two things decide:

1. **Harvestable throughput**: the host's `harvestable_tokens_per_s` shared with the jobs
   already placed there (divided by 1 + their number). A host with a latency predictor reports
   its predictor's estimate at its recent decode load (`harvest.source == "predictor"`, see
   `gpu_runtime.agent.predictor`); one without reports the finetune tokens/s it achieved
   (`"measured"`).
2. **Memory headroom**: free bytes left after this job's estimate. Hosts whose throughput
   share is within :data:`THROUGHPUT_TOLERANCE` of the best are equally good on throughput
   (the estimates are not that exact); among them the most headroom wins, then the name.

Every candidate, its figures and why it was or was not taken is stored in
`PlacementDecision.reasons`. The placement is sent to the host only after the transaction
commits.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    EventLevel,
    FinetuneJob,
    GpuHost,
    HostAgentState,
    HostStatus,
    JobCheckpoint,
    JobEvent,
    JobMethod,
    JobStatus,
    Placement,
    PlacementDecision,
    PlacementState,
)
from api.selectors import job_checkpoint_latest
from api.services.jobs import job_event_record
from api.services.placement_dispatch import placement_send
from gpu_runtime.contract.footprint import MIN_FINETUNE_BYTES, finetune_footprint_bytes
from gpu_runtime.contract.model_config import ModelConfig
from gpu_runtime.contract.training_data import training_max_seq_len

THROUGHPUT_TOLERANCE = 0.1
"""Throughput shares within this fraction of the best count as equal (headroom decides)."""
POLICY = (
    f"harvestable tokens/s / (1 + open placements), within {THROUGHPUT_TOLERANCE:.0%} of the "
    "best; then the most memory headroom after the job; then the name"
)


def finetune_memory_estimate(*, job: FinetuneJob) -> int:
    """Bytes a job borrows on its host (`gpu_runtime.contract.footprint`).

    Uses the base model's config (preset models); a checkpoint-dir model without a stored
    config is charged :data:`MIN_FINETUNE_BYTES`. Sequences count at min(context, 2048); a
    DPO example is two of them (its preferred and other output).
    """
    if not job.base_model.config:
        return MIN_FINETUNE_BYTES
    batch = job.hyperparameters.get("batch_size")
    micro_batch = batch if isinstance(batch, int) else 1
    rows = 2 if job.method == JobMethod.DPO else 1
    return finetune_footprint_bytes(
        ModelConfig.from_hf_config(job.base_model.config),
        rank=job.lora_rank,
        target_modules=list(job.lora_target_modules),
        tokens=rows * micro_batch * training_max_seq_len(job.base_model.context_length),
    )


def _candidate(
    host: GpuHost, job: FinetuneJob, need: int, fresh_after: Any, load: dict[int, int]
) -> dict[str, Any]:
    state: HostAgentState | None = getattr(host, "agent_state", None)
    row: dict[str, Any] = {
        "host": host.name,
        "status": host.status,
        "free_bytes": state.free_bytes if state else None,
        "harvestable_tokens_per_s": state.harvestable_tokens_per_s if state else None,
        "harvest": dict(state.harvest or {}) if state else None,
        "predictor_version": host.predictor_version,
        "open_placements": load.get(host.pk, 0),
        "eligible": False,
    }
    deployment = host.deployment
    if host.status != HostStatus.ONLINE:
        row["why"] = f"host is {host.status}"
    elif deployment is None or deployment.base_model_id != job.base_model_id:
        row["why"] = f"does not serve {job.base_model.name}"
    elif state is None or state.reported_at is None or state.reported_at < fresh_after:
        row["why"] = "no recent heartbeat"
    elif state.draining:
        row["why"] = "agent is draining"
    elif state.free_bytes < need:
        row["why"] = f"free {state.free_bytes} B < needed {need} B"
    else:
        row["eligible"] = True
        row["score"] = state.harvestable_tokens_per_s / (1 + row["open_placements"])
        row["headroom_bytes"] = state.free_bytes - need
        row["why"] = "eligible"
    return row


def _choose(eligible: list[dict[str, Any]]) -> dict[str, Any]:
    """The module docstring's rule; marks each row's `throughput_tier` ("best" or "below")."""
    top = max(r["score"] for r in eligible)
    for row in eligible:
        row["throughput_tier"] = (
            "best" if row["score"] >= top * (1 - THROUGHPUT_TOLERANCE) else "below"
        )
    best_tier = [r for r in eligible if r["throughput_tier"] == "best"]
    return min(best_tier, key=lambda r: (-r["headroom_bytes"], r["host"]))


def job_place(*, job_id: str) -> Placement | None:
    """Place a queued job without an open placement; None when it needs none, no host fits,
    or its previous host still trains it (a resume right after a pause: it waits for that
    host's stop, see :func:`_still_training`, and for the checkpoint that stop reported, see
    :func:`_checkpoint_in_flight`).

    Idempotent: a job that is not queued, or already has an open placement, is left alone.
    The job's row lock (PostgreSQL; SQLite's write transaction) orders this against a
    concurrent pause or cancel: either the job is paused first and not placed, or its new
    placement is released by the pause and the host told to stop it.
    """
    with transaction.atomic():
        job = (
            FinetuneJob.objects.select_for_update()
            .select_related("base_model", "tenant")
            .filter(pk=job_id)
            .first()
        )
        if job is None or job.status != JobStatus.QUEUED:
            return None
        if Placement.objects.filter(job=job, state__in=OPEN_PLACEMENT_STATES).exists():
            return None
        fresh_after = timezone.now() - timedelta(seconds=fleet_settings().host_lost_after_s)
        previous = (
            Placement.objects.filter(job=job)
            .select_related("host", "host__agent_state")
            .order_by("-created_at", "-id")
            .first()
        )
        latest = job_checkpoint_latest(job=job)
        stopping = _still_training(previous=previous, fresh_after=fresh_after)
        if stopping is not None:
            _note(
                job=job,
                message=f"Waiting for host {stopping.host.name} to stop placement {stopping.pk} "
                "(it checkpoints at its batch boundary first)",
                level=EventLevel.INFO,
            )
            return None
        awaited = _checkpoint_in_flight(previous=previous, latest=latest)
        if awaited is not None:
            _note(
                job=job,
                message=f"Waiting for the checkpoint of step {awaited.stopped_step} that host "
                f"{awaited.host.name} stopped at",
                level=EventLevel.INFO,
            )
            return None
        need = finetune_memory_estimate(job=job)
        load: dict[int, int] = {}
        for host_id in Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES).values_list(
            "host_id", flat=True
        ):
            load[host_id] = load.get(host_id, 0) + 1
        hosts = GpuHost.objects.select_related("deployment", "agent_state").order_by("name")
        rows = [_candidate(h, job, need, fresh_after, load) for h in hosts]
        eligible = [r for r in rows if r["eligible"]]
        if not eligible:
            _note_waiting(job=job, rows=rows)
            return None
        best = _choose(eligible)
        host = next(h for h in hosts if h.name == best["host"])
        placement = Placement.objects.create(job=job, host=host)
        reasons = {
            "policy": POLICY,
            "needed_bytes": need,
            "chosen": host.name,
            "candidates": rows,
        }
        PlacementDecision.objects.create(
            placement=placement, reasons=reasons, resume_step=latest.step if latest else None
        )
        resume = f", resuming from step {latest.step}" if latest else ""
        job_event_record(
            job=job,
            message=f"Placed on host {host.name}{resume}",
            data={"placement_id": placement.pk, "host": host.name, "reasons": reasons},
        )
        placement_id = placement.pk

        transaction.on_commit(partial(placement_send, placement_id=placement_id))
        return placement


def _still_training(*, previous: Placement | None, fresh_after: Any) -> Placement | None:
    """The job's `previous` placement while its host may still train it: released (a pause),
    its host heartbeating recently, no stop from it applied yet, and either the host's latest
    heartbeat names it or no heartbeat has been applied since the host started it (so none
    could have). A resumed job waits for that host's stop (`job_stopped`, or a later heartbeat
    without it), so it never trains on two hosts at once and resumes from the checkpoint its
    pause writes. A host gone silent is not waited for."""
    if previous is None or previous.state != PlacementState.RELEASED:
        return None
    if previous.stopped_at is not None:
        return None
    host = previous.host
    state: HostAgentState | None = getattr(host, "agent_state", None)
    if host.status not in (HostStatus.ONLINE, HostStatus.DRAINING) or state is None:
        return None
    if state.reported_at is None or state.reported_at < fresh_after:
        return None
    if previous.pk in state.placements:
        return previous
    started = previous.started_at
    return previous if started is not None and state.reported_at <= started else None


def _checkpoint_in_flight(
    *, previous: Placement | None, latest: JobCheckpoint | None
) -> Placement | None:
    """The job's `previous` placement when its host reported stopping at a step whose
    checkpoint is not recorded yet (`latest` is the job's latest recorded one): the checkpoint
    report was sent first but may be applied later (a report retried after a transient error
    runs behind the ones sent after it). The job waits for it at most HARLI_REDISPATCH_AFTER_S
    after the stop, then resumes from `latest` (a report the broker lost never comes)."""
    if previous is None or previous.stopped_step is None or previous.stopped_at is None:
        return None
    waited = timezone.now() - previous.stopped_at
    if waited > timedelta(seconds=fleet_settings().redispatch_after_s):
        return None
    recorded = latest.step if latest is not None else 0
    return previous if recorded < previous.stopped_step else None


def _note_waiting(*, job: FinetuneJob, rows: list[dict[str, Any]]) -> None:
    """Record why no host fits, once per distinct reason set (reconciliation retries often)."""
    summary = "; ".join(f"{r['host']}: {r['why']}" for r in rows) or "no hosts registered"
    _note(job=job, message=f"Waiting for a host ({summary})", level=EventLevel.WARN)


def _note(*, job: FinetuneJob, message: str, level: str) -> None:
    """Record `message` unless it is the job's latest event already."""
    last = JobEvent.objects.filter(job=job).order_by("-created_at", "-id").first()
    if last is None or last.message != message:
        job_event_record(job=job, message=message, level=level)
