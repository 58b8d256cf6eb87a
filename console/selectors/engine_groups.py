"""A host's engine groups and GPUs as the console shows them: per group its deployment, GPUs,
newest fresh memory/finetune row (`EngineGroupMetric`) and decode row (`DeploymentMetric`), its
agent's harvest figures, and the jobs placed on it; per GPU its newest memory figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db.models import Count
from django.utils import timezone

from api.models import (
    OPEN_PLACEMENT_STATES,
    DeploymentMetric,
    EngineGroup,
    EngineGroupMetric,
    GpuHost,
    HostMetric,
    Placement,
)
from console.selectors.series import FRESHNESS


@dataclass
class EngineGroupRow:
    group: EngineGroup
    metric: EngineGroupMetric | None
    decode: DeploymentMetric | None
    agent: dict[str, Any] | None
    """The group's entry of the host's last heartbeat (`HostAgentState.engine_groups`)."""
    placements: list[Placement] = field(default_factory=list)
    """Its open placements (the jobs it trains now)."""


def _newest(rows: Any, key: str) -> dict[int, Any]:
    newest: dict[int, Any] = {}
    for row in rows.order_by("-ts", "-id"):
        newest.setdefault(getattr(row, key), row)
    return newest


def host_engine_groups(*, host: GpuHost, now: datetime | None = None) -> list[EngineGroupRow]:
    """The host's groups in index order with their newest figures (a fixed number of queries)."""
    since = (now or timezone.now()) - FRESHNESS
    groups = list(host.engine_groups.select_related("deployment").order_by("index"))
    ids = [g.pk for g in groups]
    metrics = _newest(
        EngineGroupMetric.objects.filter(engine_group_id__in=ids, ts__gte=since), "engine_group_id"
    )
    decode = _newest(
        DeploymentMetric.objects.filter(engine_group_id__in=ids, ts__gte=since), "engine_group_id"
    )
    state = getattr(host, "agent_state", None)
    entries = {e.get("index"): e for e in (state.engine_groups if state else []) or []}
    rows = {
        g.pk: EngineGroupRow(g, metrics.get(g.pk), decode.get(g.pk), entries.get(g.index))
        for g in groups
    }
    open_placements = Placement.objects.filter(
        engine_group_id__in=ids, state__in=OPEN_PLACEMENT_STATES
    ).order_by("created_at", "id")
    for placement in open_placements:
        rows[placement.engine_group_id].placements.append(placement)  # type: ignore[index]
    return list(rows.values())


def group_open_placements() -> dict[int, int]:
    """Open placements per engine group id (one query)."""
    rows = (
        Placement.objects.filter(state__in=OPEN_PLACEMENT_STATES)
        .exclude(engine_group=None)
        .values("engine_group_id")
        .annotate(n=Count("id"))
        .values_list("engine_group_id", "n")
    )
    return {int(group): int(n) for group, n in rows}


def host_gpu_rows(*, host: GpuHost, metric: HostMetric | None) -> list[dict[str, Any]]:
    """One row per GPU of the host: `index`, the engine group holding it (or None), and its
    newest figures (`total_bytes`, `free_bytes`, `kv_used_bytes`, `finetune_lent_bytes`; from
    the newest fresh metrics row, else the last heartbeat; None when neither has them)."""
    state = getattr(host, "agent_state", None)
    figures = {g["index"]: g for g in (metric.gpus if metric else []) or []}
    for gpu in (state.gpus if state else []) or []:
        figures.setdefault(gpu["index"], gpu)
    holders = {gpu: g for g in host.engine_groups.all() for gpu in g.gpu_indices}
    names = ("total_bytes", "free_bytes", "kv_used_bytes", "finetune_lent_bytes")
    return [
        {"index": i, "group": holders.get(i)} | {n: figures.get(i, {}).get(n) for n in names}
        for i in range(host.gpu_count)
    ]
