"""Heartbeats: the host's liveness and agent state (host-level, per engine group and per GPU),
and the commands they call for (stop a placement that moved elsewhere, load missing adapters
(not those an operator unloaded there) or an engine group's deployment's base model, unload
models that were deleted, drain or undrain to follow the host's status); a model a heartbeat
names has no recorded load failure any more. The host's engine and capabilities are kept with
the agent state (`gpu_runtime.contract.host_capabilities`; absent: a Harli host)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from api.dispatch import host_dispatch
from api.models import (
    OPEN_PLACEMENT_STATES,
    Adapter,
    EngineGroup,
    FinetuneJob,
    GpuHost,
    HostAgentState,
    HostStatus,
    JobCheckpoint,
    Placement,
)
from api.services.host_adapters import host_adapter_served, host_adapter_unloaded_names
from api.services.reports.common import stop_on_commit
from api.services.reports.engine_groups import (
    agent_group_state,
    gpu_figures,
    host_engine_groups,
    reported_groups,
)
from api.transitions import TERMINAL_STATUSES
from gpu_runtime.contract.host_capabilities import reported_capabilities
from gpu_runtime.contract.protocol import parse_checkpoint_model


def heartbeat_apply(*, host: GpuHost, message: dict[str, Any]) -> str:
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
    groups = host_engine_groups(host)
    pairs = reported_groups("heartbeat", host, message, groups)
    caps = reported_capabilities(message)
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
            "serving": _serving(message.get("serving")),
            "engine_groups": [agent_group_state(g, entry) for g, entry in pairs],
            "gpus": gpu_figures(message.get("gpus")),
            "engine": caps.pop("engine"),
            "capabilities": caps,
            "engine_state": dict(message.get("engine_state") or {}),
            "reported_at": now,
        },
    )
    # A host back from the dead may still train placements that moved elsewhere: stop them.
    reported = [int(p) for p in message["placements"]]
    stale = Placement.objects.filter(pk__in=reported).exclude(
        host=host, state__in=OPEN_PLACEMENT_STATES
    )
    for placement in stale.select_related("job"):
        stop_on_commit(host, placement)
    host_adapter_served(host=host, served=set(message.get("adapters", [])))
    _offer_missing_adapters(host, set(message.get("adapters", [])), bool(groups))
    _retire_deleted_models(host, set(message.get("adapters", [])))
    for group, entry in pairs:
        _offer_base_model(host, group, str(entry.get("base_model") or ""))
    # The agent follows the host's status: draining, or back in service (`host_undrain`).
    if (host.status == HostStatus.DRAINING) != draining and host.status in (
        HostStatus.ONLINE,
        HostStatus.DRAINING,
    ):
        command = "drain" if host.status == HostStatus.DRAINING else "undrain"
        send = partial(host_dispatch().host_command_send, host_name=host.name, command=command)
        transaction.on_commit(send, robust=True)
    return "applied"


_SERVING_COUNTS = ("running", "waiting", "kv_free_pages", "kv_total_pages",
                   "adapter_slots_used", "adapter_slots_total")  # fmt: skip
_SERVING_FIGURES = ("tpot_p50_ms", "slo_attainment")


def _serving(reported: Any) -> dict[str, Any]:
    """The heartbeat's `serving` figures with their types checked; what is malformed is left
    out (the gateway treats a missing figure as unknown)."""
    if not isinstance(reported, dict):
        return {}
    serving: dict[str, Any] = {}
    for name in _SERVING_COUNTS:
        value = reported.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            serving[name] = value
    for name in _SERVING_FIGURES:
        value = reported.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value) and value >= 0:
                serving[name] = float(value)
    resident = reported.get("resident_adapters")
    if isinstance(resident, list):
        serving["resident_adapters"] = [str(n) for n in resident if isinstance(n, str)]
    return serving


def _offer_base_model(host: GpuHost, group: EngineGroup, serving: str) -> None:
    """Send `load_base_model` when an engine group serves another model than its deployment's
    (`engine_group` names the group when it is not group 0, which older agents take it for)."""
    base = group.deployment.base_model
    if base.name == serving:
        return
    fields: dict[str, Any] = {"base_model": base.name, "model_dir": base.checkpoint_dir or None,
                              "preset": base.preset}  # fmt: skip
    if group.index:
        fields["engine_group"] = group.index
    name = host.name

    def send() -> None:
        host_dispatch().host_command_send(host_name=name, command="load_base_model", **fields)

    transaction.on_commit(send)


def _offer_missing_adapters(host: GpuHost, served: set[str], has_groups: bool) -> None:
    """Send `load_adapter` for finished adapters of the base models of the host's engine
    groups it does not serve, except those an operator ordered off it
    (`api.services.host_adapters`)."""
    if not has_groups or host.status != HostStatus.ONLINE:
        return
    missing = list(
        Adapter.objects.filter(base_model__deployments__engine_groups__host=host)
        .distinct()
        .exclude(name__in=served)
        .exclude(name__in=host_adapter_unloaded_names(host=host))
        .exclude(path="")
        .values_list("name", "path")
    )
    if not missing:
        return

    def send() -> None:
        for name, key in missing:
            host_dispatch().host_command_send(
                host_name=host.name, command="load_adapter", name=name, storage_key=key
            )

    transaction.on_commit(send)


def deleted_models(served: set[str]) -> list[str]:
    """The fine-tuned names among `served` that the control plane no longer has: a checkpoint
    whose row is gone (deleted, pruned, or its job deleted), or an adapter with no row whose
    job has ended or is gone (deleted). A job that has not ended yet keeps its name: its host
    serves the adapter before the control plane has recorded the success."""
    if not served:
        return []
    adapters = set(Adapter.objects.filter(name__in=served).values_list("name", flat=True))
    checkpoints: dict[str, tuple[str, int]] = {}
    plain: dict[str, str] = {}
    for name in served - adapters:
        parsed = parse_checkpoint_model(name)
        if parsed is not None:
            checkpoints[name] = (parsed[1], parsed[2])
        elif name.startswith("ft:"):
            plain[name] = name.rsplit(":", 1)[-1]
    job_ids = {job for job, _ in checkpoints.values()} | set(plain.values())
    kept = set(JobCheckpoint.objects.filter(job_id__in=job_ids).values_list("job_id", "step"))
    live = set(
        FinetuneJob.objects.filter(pk__in=job_ids)
        .exclude(status__in=TERMINAL_STATUSES)
        .values_list("pk", flat=True)
    )
    gone = [name for name, entry in checkpoints.items() if entry not in kept]
    gone += [name for name, job_id in plain.items() if job_id not in live]
    return sorted(gone)


def _retire_deleted_models(host: GpuHost, served: set[str]) -> None:
    """Send `unload_adapter` for what the host serves that was deleted: the safety net behind
    the unload sent when the deletion committed (`api.services.models`)."""
    gone = deleted_models(served)
    if not gone:
        return

    def send() -> None:
        for name in gone:
            host_dispatch().model_unload_send(host_name=host.name, name=name)

    transaction.on_commit(send)
