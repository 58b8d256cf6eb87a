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

from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import Count, JSONField, OuterRef, Subquery
from django.utils import timezone

from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    BaseModel,
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
    Tenant,
)
from api.quotas import running_jobs_limits
from api.services.jobs import host_detail
from api.services.placement_dispatch import placements_send
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
    host: GpuHost,
    job: FinetuneJob,
    need: int,
    fresh_after: Any,
    load: dict[int, int],
    free: dict[int, int],
) -> dict[str, Any]:
    """One host's row for `job`: `free` is the host's reported free bytes less the estimates
    of the jobs this pass placed on it."""
    state: HostAgentState | None = getattr(host, "agent_state", None)
    free_bytes = free.get(host.pk, 0)
    row: dict[str, Any] = {
        "host": host.name,
        "status": host.status,
        "free_bytes": free_bytes if state else None,
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
    elif free_bytes < need:
        row["why"] = f"free {free_bytes} B < needed {need} B"
    else:
        row["eligible"] = True
        row["score"] = state.harvestable_tokens_per_s / (1 + row["open_placements"])
        row["headroom_bytes"] = free_bytes - need
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
    """Place one queued job without an open placement (the `workers.place_job` task, right
    after the job is queued); None when it needs none, no host fits, its tenant is at its
    `running_jobs` quota, or its previous host still trains it (a resume right after a pause:
    it waits for that host's stop, see :func:`_still_training`, and for the checkpoint that
    stop reported, see :func:`_checkpoint_in_flight`). The same pass as reconciliation's
    (:func:`placement_pass`), over this one job."""
    placed = placement_pass(job_ids=[job_id])
    return placed[0] if placed else None


@dataclass
class _Waiting:
    """A queued job the pass considers, with what it read about it in batched queries."""

    job: FinetuneJob
    previous: Placement | None
    latest_step: int | None
    last_message: str | None
    last_detail_text: str | None
    """The operator's text (`fleet_detail["text"]`) of the job's latest event."""


@dataclass
class _Choice:
    job: FinetuneJob
    host: GpuHost
    reasons: dict[str, Any]
    resume_step: int | None


def _waiting_jobs(job_ids: list[str] | None) -> list[_Waiting]:
    """Queued jobs without an open placement, oldest first, each with its previous placement
    (host and agent state), its latest stored checkpoint's step and its latest event's message:
    three queries whatever their number."""
    open_jobs = Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES).values("job_id")
    jobs = FinetuneJob.objects.filter(status=JobStatus.QUEUED).exclude(pk__in=open_jobs)
    if job_ids is not None:
        jobs = jobs.filter(pk__in=job_ids)
    # Plain rows of only what placement reads (no model instances for 10,000 waiting jobs);
    # the base models come in one query of their own.
    last_event = JobEvent.objects.filter(job=OuterRef("pk")).order_by("-created_at", "-id")
    rows = list(
        jobs.annotate(
            last_message=Subquery(last_event.values("message")[:1]),
            last_detail=Subquery(last_event.values("fleet_detail")[:1], output_field=JSONField()),
            previous_id=Subquery(
                Placement.objects.filter(job=OuterRef("pk"))
                .order_by("-created_at", "-id")
                .values("pk")[:1]
            ),
            latest_step=Subquery(
                JobCheckpoint.objects.filter(job=OuterRef("pk"))
                .exclude(path="")
                .order_by("-step")
                .values("step")[:1]
            ),
        )
        .order_by("created_at", "id")
        .values_list(
            "id",
            "tenant_id",
            "base_model_id",
            "hyperparameters",
            "method",
            "lora_rank",
            "lora_target_modules",
            "last_message",
            "previous_id",
            "latest_step",
            "last_detail",
        )
    )
    models = {m.pk: m for m in BaseModel.objects.filter(pk__in={r[2] for r in rows})}
    previous_ids = [r[8] for r in rows if r[8] is not None]
    previous = {
        p.pk: p
        for p in Placement.objects.filter(pk__in=previous_ids).select_related(
            "host", "host__agent_state"
        )
    }
    waiting = []
    for row in rows:
        job_id, tenant_id, model_id, hyper, method, rank, modules, message, prev, step, detail = row
        job = FinetuneJob(
            id=job_id,
            tenant_id=tenant_id,
            base_model=models[model_id],
            status=JobStatus.QUEUED,
            hyperparameters=hyper,
            method=method,
            lora_rank=rank,
            lora_target_modules=modules,
        )
        job._state.adding = False  # a partial copy for the estimate; never saved or returned
        waiting.append(
            _Waiting(
                job=job,
                previous=previous.get(prev),
                latest_step=step,
                last_message=message,
                last_detail_text=(detail or {}).get("text") if isinstance(detail, dict) else None,
            )
        )
    return waiting


def placement_pass(*, job_ids: list[str] | None = None) -> list[Placement]:
    """Place waiting jobs, the oldest first, at most `HARLI_PLACEMENTS_PER_PASS` of them; returns
    the placements made (sent to their hosts after commit).

    Reads the waiting jobs, the hosts and the open placements in a fixed number of queries
    (none per job), decides in memory, then writes in one transaction: a job placed in this
    pass counts in its host's load and its estimate comes off the host's free memory for the
    rest of the pass (a heartbeat has not reported it yet), and in its tenant's
    `running_jobs`. A job that must wait gets one event naming why (once per distinct reason;
    bulk-inserted). The bound keeps one pass's writes and broker messages short whatever the
    queue; a new job does not wait for it (its own `place_job` task places it at once).

    Ordering against concurrent writers: the pass locks the jobs it chose, then their tenants
    (PostgreSQL row locks; SQLite's write transaction), and decides again on what it
    finds there: a job paused, cancelled or placed meanwhile is skipped, and a tenant's
    `running_jobs` is counted under its lock, so two passes cannot pass it together.
    """
    conf = fleet_settings()
    fresh_after = timezone.now() - timedelta(seconds=conf.host_lost_after_s)
    waiting = _waiting_jobs(job_ids)
    if not waiting:
        return []
    hosts = list(GpuHost.objects.select_related("deployment", "agent_state").order_by("name"))
    open_placements = Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES)
    load: dict[int, int] = dict(
        open_placements.values("host_id").annotate(n=Count("id")).values_list("host_id", "n")
    )
    tenant_ids = {w.job.tenant_id for w in waiting}
    running = _tenant_running(tenant_ids)
    limits = running_jobs_limits(tenant_ids=tenant_ids)
    free = {
        h.pk: h.agent_state.free_bytes for h in hosts if getattr(h, "agent_state", None) is not None
    }
    notes: list[_Note] = []
    choices: list[_Choice] = []
    needs: dict[tuple[Any, ...], int] = {}
    # Jobs of one base model and estimate see the same candidate rows until a placement
    # changes a host's load or memory: computed once per (model, estimate) between placements.
    seen: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for item in waiting:
        if len(choices) >= conf.placements_per_pass:
            break
        note = _wait_reason(item, fresh_after, running, limits)
        if note is not None:
            notes.append(note)
            continue
        job = item.job
        shape = _estimate_key(job)
        if shape not in needs:
            needs[shape] = finetune_memory_estimate(job=job)
        need = needs[shape]
        group = (job.base_model_id, need)
        if group not in seen:
            seen[group] = [_candidate(h, job, need, fresh_after, load, free) for h in hosts]
        rows = seen[group]
        eligible = [r for r in rows if r["eligible"]]
        if not eligible:
            summary = "; ".join(f"{r['host']}: {r['why']}" for r in rows) or "no hosts registered"
            # The reasons name hosts and their free memory: the operator's detail only.
            detail = {"text": f"Waiting for a host ({summary})", "candidates": rows}
            notes.append(
                _Note(item, "Waiting for a host with room for this job", EventLevel.WARN, detail)
            )
            continue
        seen.clear()
        rows = [dict(r) for r in rows]  # this job's own record (the reasons keep it)
        best = _choose([r for r in rows if r["eligible"]])
        host = next(h for h in hosts if h.name == best["host"])
        load[host.pk] = load.get(host.pk, 0) + 1
        free[host.pk] -= need
        running[job.tenant_id] = running.get(job.tenant_id, 0) + 1
        reasons = {"policy": POLICY, "needed_bytes": need, "chosen": host.name, "candidates": rows}
        choices.append(_Choice(job=job, host=host, reasons=reasons, resume_step=item.latest_step))
    _notes_record(notes)
    if not choices:
        return []
    return _placements_write(choices)


def _estimate_key(job: FinetuneJob) -> tuple[Any, ...]:
    """What :func:`finetune_memory_estimate` reads of a job."""
    batch = job.hyperparameters.get("batch_size")
    return (job.base_model_id, batch, job.method, job.lora_rank, tuple(job.lora_target_modules))


def _tenant_running(tenant_ids: set[int]) -> dict[int, int]:
    """Jobs of each tenant with an open placement (their `running_jobs` use): one query."""
    return dict(
        Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES, job__tenant_id__in=tenant_ids)
        .values("job__tenant_id")
        .annotate(n=Count("job_id", distinct=True))
        .values_list("job__tenant_id", "n")
    )


@dataclass
class _Note:
    """Why a job waits: the tenant's `message` and the operator's `fleet_detail`."""

    item: _Waiting
    message: str
    level: str
    fleet_detail: dict[str, Any] | None = None


def _wait_reason(
    item: _Waiting, fresh_after: Any, running: dict[int, int], limits: dict[int, int]
) -> _Note | None:
    """Why the job waits before any host is looked at, or None."""
    tenant_id = item.job.tenant_id
    if running.get(tenant_id, 0) >= limits[tenant_id]:
        return _Note(
            item,
            f"Waiting: the tenant has {running.get(tenant_id, 0)} jobs on hosts, its "
            f"running_jobs quota is {limits[tenant_id]}",
            EventLevel.INFO,
        )
    stopping = _still_training(previous=item.previous, fresh_after=fresh_after)
    if stopping is not None:
        return _Note(
            item,
            "Waiting for the previous run to stop (it checkpoints at its batch boundary first)",
            EventLevel.INFO,
            host_detail(
                f"Waiting for host {stopping.host.name} to stop placement {stopping.pk}",
                host=stopping.host.name,
                placement_id=stopping.pk,
            ),
        )
    awaited = _checkpoint_in_flight(previous=item.previous, latest_step=item.latest_step)
    if awaited is not None:
        return _Note(
            item,
            f"Waiting for the checkpoint of step {awaited.stopped_step}",
            EventLevel.INFO,
            host_detail(
                f"Waiting for the checkpoint of step {awaited.stopped_step} that host "
                f"{awaited.host.name} stopped at",
                host=awaited.host.name,
                placement_id=awaited.pk,
            ),
        )
    return None


def _notes_record(notes: list[_Note]) -> None:
    """Record each waiting job's reason unless it is the job's latest event already, with the
    same operator text (passes repeat often): one insert for all."""
    fresh = [
        JobEvent(
            job_id=note.item.job.pk,
            message=note.message,
            level=note.level,
            fleet_detail=note.fleet_detail,
        )
        for note in notes
        if note.item.last_message != note.message
        or note.item.last_detail_text != (note.fleet_detail or {}).get("text")
    ]
    if fresh:
        JobEvent.objects.bulk_create(fresh)


def _placements_write(choices: list[_Choice]) -> list[Placement]:
    """Write the pass's placements in one transaction, after locking and checking again (see
    :func:`placement_pass`); their sends are queued for after commit."""
    with transaction.atomic():
        # Jobs before tenants, as a job's status change locks them (`finetune_job_transition`
        # locks the job's row with its tenant's): the same order everywhere, no deadlock.
        ids = [c.job.pk for c in choices]
        still = set(
            FinetuneJob.objects.select_for_update()
            .filter(pk__in=ids, status=JobStatus.QUEUED)
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        tenant_ids = sorted({c.job.tenant_id for c in choices})
        list(Tenant.objects.select_for_update().filter(pk__in=tenant_ids).order_by("pk"))
        still -= set(
            Placement.objects.filter(job_id__in=ids, state__in=OPEN_PLACEMENT_STATES).values_list(
                "job_id", flat=True
            )
        )
        running = _tenant_running(set(tenant_ids))
        limits = running_jobs_limits(tenant_ids=set(tenant_ids))
        kept: list[_Choice] = []
        for choice in choices:
            tenant_id = choice.job.tenant_id
            if choice.job.pk not in still or running.get(tenant_id, 0) >= limits[tenant_id]:
                continue
            running[tenant_id] = running.get(tenant_id, 0) + 1
            kept.append(choice)
        placements = Placement.objects.bulk_create(
            [Placement(job_id=c.job.pk, host=c.host) for c in kept]
        )
        PlacementDecision.objects.bulk_create(
            [
                PlacementDecision(placement=p, reasons=c.reasons, resume_step=c.resume_step)
                for p, c in zip(placements, kept, strict=True)
            ]
        )
        events = []
        for placement, choice in zip(placements, kept, strict=True):
            resume = f", resuming from step {choice.resume_step}" if choice.resume_step else ""
            events.append(
                JobEvent(
                    job_id=choice.job.pk,
                    message=f"Placed for training{resume}",
                    fleet_detail=host_detail(
                        f"Placed on host {choice.host.name}{resume}",
                        host=choice.host.name,
                        placement_id=placement.pk,
                        reasons=choice.reasons,
                    ),
                )
            )
        JobEvent.objects.bulk_create(events)
        placement_ids = [p.pk for p in placements]
        if placement_ids:
            transaction.on_commit(partial(placements_send, placement_ids=placement_ids))
    return placements


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
    *, previous: Placement | None, latest_step: int | None
) -> Placement | None:
    """The job's `previous` placement when its host reported stopping at a step whose
    checkpoint is not recorded yet (`latest` is the job's latest recorded one): the checkpoint
    report was sent first but may be applied later (a report retried after a transient error
    runs behind the ones sent after it). The job waits for it at most HARLI_REDISPATCH_AFTER_S
    after the stop, then resumes from `latest_step` (a report the broker lost never comes)."""
    if previous is None or previous.stopped_step is None or previous.stopped_at is None:
        return None
    waited = timezone.now() - previous.stopped_at
    if waited > timedelta(seconds=fleet_settings().redispatch_after_s):
        return None
    recorded = latest_step if latest_step is not None else 0
    return previous if recorded < previous.stopped_step else None
