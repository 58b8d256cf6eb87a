"""Placement: put a queued job on an engine group of an online host that serves its base model.

The candidates are engine groups (`EngineGroup`): a deployment on `tensor_parallel_size` (t)
GPUs of a host. A group is eligible when its host is `online`, heartbeated within
`HARLI_HOST_LOST_AFTER_S` and is not draining, can train (its last heartbeat's capabilities say
`colocation`; a vLLM host's do not: "host cannot train (engine vllm)"), its deployment serves
the job's base model, and each of its GPUs has the job's per-GPU footprint free: the job trains
sharded over the group's t GPUs, so it needs `finetune_memory_estimate(job, t)`
(`gpu_runtime.contract.footprint`, sharded at t) on every one of them, against the least free
bytes of the group's GPUs that the heartbeat reported (`free_bytes_per_gpu`; an agent of the
one-engine shape: its free bytes / t).
Among eligible groups, two things decide:

1. **Harvestable throughput**: the group's `harvestable_tokens_per_s` (its agent's estimate for
   that group, at its TP degree) shared with the jobs already placed on the group (divided by
   1 + their number). An agent with a latency predictor reports its predictor's estimate at
   its recent decode load (`harvest.source == "predictor"`, the predictor keyed by the TP
   degree, see `gpu_runtime.agent.predictor`); one without reports the finetune tokens/s it
   achieved (`"measured"`).
2. **Memory headroom**: per-GPU free bytes left after this job's per-GPU estimate. Groups whose
   throughput share is within :data:`THROUGHPUT_TOLERANCE` of the best are equally good on
   throughput (the estimates are not that exact); among them the most headroom wins, then the
   host's name, then the group's index.

Every candidate (a host's group, or a host that serves nothing), its figures and why it was or
was not taken is stored in `PlacementDecision.reasons`; the placement records its group. The
placement is sent to the host only after the transaction commits.

The candidates and the estimate: `api.services.placement_candidates`; why a job waits before
any host is looked at: `api.services.placement_waiting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from api.fleet_settings import fleet_settings
from api.models import (
    OPEN_PLACEMENT_STATES,
    EngineGroup,
    EventLevel,
    FinetuneJob,
    GpuHost,
    JobEvent,
    JobStatus,
    Placement,
    PlacementDecision,
    Tenant,
)
from api.quotas import running_jobs_limits
from api.services.jobs import host_detail
from api.services.placement_candidates import (
    POLICY,
    THROUGHPUT_TOLERANCE,
    candidate_row,
    choose,
    estimate_at,
    estimate_key,
    finetune_memory_estimate,
    reported_group,
    slots_of,
)
from api.services.placement_dispatch import placements_send
from api.services.placement_waiting import (
    Note,
    notes_record,
    wait_reason,
    waiting_jobs,
)

__all__ = [
    "POLICY",
    "THROUGHPUT_TOLERANCE",
    "finetune_memory_estimate",
    "job_place",
    "placement_pass",
]


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
class _Choice:
    job: FinetuneJob
    host: GpuHost
    group: EngineGroup
    reasons: dict[str, Any]
    resume_step: int | None


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
    waiting = waiting_jobs(job_ids)
    if not waiting:
        return []
    hosts = list(GpuHost.objects.select_related("agent_state").order_by("name"))
    groups = list(EngineGroup.objects.select_related("deployment").order_by("host_id", "index"))
    slots = slots_of(hosts, groups)
    open_placements = Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES)
    load: dict[int, int] = dict(
        open_placements.exclude(engine_group=None)
        .values("engine_group_id")
        .annotate(n=Count("id"))
        .values_list("engine_group_id", "n")
    )
    tenant_ids = {w.job.tenant_id for w in waiting}
    running = _tenant_running(tenant_ids)
    limits = running_jobs_limits(tenant_ids=tenant_ids)
    free: dict[int, int] = {}
    for slot in slots:
        entry = None
        if slot.group is not None:
            entry = reported_group(getattr(slot.host, "agent_state", None), slot.group)
        if slot.group is not None and entry is not None:
            free[slot.group.pk] = int(entry.get("free_bytes_per_gpu", 0))
    notes: list[Note] = []
    choices: list[_Choice] = []
    needs: dict[tuple[Any, ...], int] = {}
    # Jobs of one base model and estimate see the same candidate rows until a placement
    # changes a group's load or memory: computed once per (model, estimate) between placements.
    seen: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    degrees = sorted({s.size for s in slots}) or [1]
    for item in waiting:
        if len(choices) >= conf.placements_per_pass:
            break
        note = wait_reason(item, fresh_after, running, limits)
        if note is not None:
            notes.append(note)
            continue
        job = item.job
        shape = estimate_key(job)
        for size in degrees:
            if (shape, size) not in needs:
                needs[(shape, size)] = estimate_at(job, size)
        if shape not in seen:
            seen[shape] = [
                candidate_row(s, job, needs[(shape, s.size)], fresh_after, load, free)
                for s in slots
            ]
        rows = seen[shape]
        eligible = [r for r in rows if r["eligible"]]
        if not eligible:
            summary = "; ".join(f"{_label(r)}: {r['why']}" for r in rows) or "no hosts registered"
            # The reasons name hosts and their free memory: the operator's detail only.
            detail = {"text": f"Waiting for a host ({summary})", "candidates": rows}
            notes.append(
                Note(item, "Waiting for a host with room for this job", EventLevel.WARN, detail)
            )
            continue
        seen.clear()
        rows = [dict(r) for r in rows]  # this job's own record (the reasons keep it)
        best = choose([r for r in rows if r["eligible"]])
        chosen = next(
            s
            for s in slots
            if s.host.name == best["host"]
            and s.group is not None
            and s.group.index == best["engine_group"]
        )
        assert chosen.group is not None
        need = needs[(shape, chosen.size)]
        load[chosen.group.pk] = load.get(chosen.group.pk, 0) + 1
        free[chosen.group.pk] -= need
        running[job.tenant_id] = running.get(job.tenant_id, 0) + 1
        reasons = {
            "policy": POLICY,
            "needed_bytes": need,
            "needed_bytes_per_gpu": need,
            "tensor_parallel_size": chosen.size,
            "chosen": chosen.host.name,
            "chosen_engine_group": chosen.group.index,
            "candidates": rows,
        }
        choices.append(
            _Choice(
                job=job,
                host=chosen.host,
                group=chosen.group,
                reasons=reasons,
                resume_step=item.latest_step,
            )
        )
    notes_record(notes)
    if not choices:
        return []
    return _placements_write(choices)


def _where(group: EngineGroup) -> str:
    """`, engine group n (GPUs a-b)`, or nothing for a host's group 0 on one GPU."""
    if not group.index and group.tensor_parallel_size == 1:
        return ""
    return f", engine group {group.index} ({group.gpu_range})"


def _label(row: dict[str, Any]) -> str:
    """How a waiting event names a candidate: its host (group 0, or none), `host group n`."""
    return row["host"] + (f" group {row['engine_group']}" if row["engine_group"] else "")


def _tenant_running(tenant_ids: set[int]) -> dict[int, int]:
    """Jobs of each tenant with an open placement (their `running_jobs` use): one query."""
    return dict(
        Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES, job__tenant_id__in=tenant_ids)
        .values("job__tenant_id")
        .annotate(n=Count("job_id", distinct=True))
        .values_list("job__tenant_id", "n")
    )


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
            [Placement(job_id=c.job.pk, host=c.host, engine_group=c.group) for c in kept]
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
                        f"Placed on host {choice.host.name}{_where(choice.group)}{resume}",
                        host=choice.host.name,
                        placement_id=placement.pk,
                        engine_group=choice.group.index,
                        reasons=choice.reasons,
                    ),
                )
            )
        JobEvent.objects.bulk_create(events)
        placement_ids = [p.pk for p in placements]
        if placement_ids:
            transaction.on_commit(partial(placements_send, placement_ids=placement_ids))
    return placements
