"""The gateway's reads: what a tenant's model name resolves to, and the hosts that can serve.

Synchronous ORM reads; the gateway calls them from worker threads (`api.gateway.db`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone

from api.fleet_settings import fleet_settings
from api.gateway.routing import HostCandidate
from api.models import BaseModel, HostAgentState, HostStatus, Tenant
from api.selectors import adapter_find, checkpoint_model_find


@dataclass(frozen=True)
class InferenceTarget:
    """A model name a tenant may call, and the base model whose hosts serve it."""

    model: str
    base_model: str
    kind: str
    """"base", "adapter" or "checkpoint"."""


def inference_target_get(*, tenant: Tenant, model_id: str) -> InferenceTarget | None:
    """What `model_id` is for `tenant`: a base model, one of its adapters, or one of its jobs'
    checkpoints; None for anything else (another tenant's model reads as nonexistent)."""
    base = BaseModel.objects.filter(name=model_id).values_list("name", flat=True).first()
    if base is not None:
        return InferenceTarget(model_id, base, "base")
    adapter = adapter_find(tenant=tenant, model_id=model_id)
    if adapter is not None:
        return InferenceTarget(model_id, adapter.base_model.name, "adapter")
    checkpoint = checkpoint_model_find(tenant=tenant, model_id=model_id)
    if checkpoint is not None:
        return InferenceTarget(model_id, checkpoint.job.base_model.name, "checkpoint")
    return None


def routable_hosts() -> list[HostCandidate]:
    """Online hosts that are not draining, whose agent reported a server URL within the time
    after which a silent host is lost, as routing candidates."""
    fresh_since = timezone.now() - timedelta(seconds=fleet_settings().host_lost_after_s)
    states = (
        HostAgentState.objects.select_related("host")
        .prefetch_related("host__engine_groups__deployment__base_model")
        .filter(
            host__status=HostStatus.ONLINE,
            draining=False,
            reported_at__gte=fresh_since,
        )
        .exclude(server_url="")
        .exclude(base_model="")
    )
    return [_candidate(state) for state in states]


def _candidate(state: HostAgentState) -> HostCandidate:
    """The host as a candidate; its SLO is that of its first engine group serving the base
    model its agent reports (the first group when none does)."""
    serving = state.serving or {}
    groups = list(state.host.engine_groups.all())
    serving_groups = [g for g in groups if g.deployment.base_model.name == state.base_model]
    chosen = (serving_groups or groups)[:1]
    deployment = chosen[0].deployment if chosen else None
    return HostCandidate(
        name=state.host.name,
        base_model=state.base_model,
        server_url=state.server_url.rstrip("/"),
        adapters=frozenset(state.adapters or ()),
        resident_adapters=frozenset(serving.get("resident_adapters", ())),
        running=int(serving.get("running", 0)),
        waiting=int(serving.get("waiting", 0)),
        kv_free_pages=serving.get("kv_free_pages"),
        kv_total_pages=serving.get("kv_total_pages"),
        tpot_p50_ms=serving.get("tpot_p50_ms"),
        tpot_slo_ms=deployment.tpot_slo_ms if deployment is not None else None,
        slo_attainment=serving.get("slo_attainment"),
        attainment_target=(
            deployment.slo_attainment_target_pct / 100.0 if deployment is not None else 0.0
        ),
    )
