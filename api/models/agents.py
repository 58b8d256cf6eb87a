"""What the control plane keeps about its hosts' agents, beside the fleet rows.

* :class:`HostAgentState`: the latest heartbeat of a host's agent (placement reads it).
* :class:`PlacementDecision`: why a placement chose its host, and its dispatch record.
* :class:`ProcessedReport`: the message ids of reports already applied (dedupe under
  at-least-once delivery; written in the same transaction as the report's effect).

The tables keep the names they were created with (`workers_*`).
"""

from __future__ import annotations

from django.db import models

from api.models.finetune import Placement
from api.models.fleet import GpuHost


class HostAgentState(models.Model):
    """The last heartbeat of `host`'s agent."""

    host = models.OneToOneField(
        GpuHost, primary_key=True, on_delete=models.CASCADE, related_name="agent_state"
    )
    base_model = models.CharField(max_length=64, blank=True)
    server_url = models.CharField(max_length=255, blank=True)
    draining = models.BooleanField(default=False)
    total_bytes = models.BigIntegerField(default=0)
    free_bytes = models.BigIntegerField(default=0)
    harvestable_tokens_per_s = models.FloatField(default=0.0)
    harvest = models.JSONField(default=dict)
    """How the agent got `harvestable_tokens_per_s`: `source` ("predictor": its latency
    predictor's estimate at its recent decode load; "measured": finetune tokens/s it achieved)
    and the estimate's inputs (`gpu_runtime.agent.predictor.HarvestEstimate`)."""
    placements = models.JSONField(default=list)
    adapters = models.JSONField(default=list)
    serving = models.JSONField(default=dict)
    """What the gateway routes by (the heartbeat's `serving`, see
    `gpu_runtime.contract.protocol`): running and waiting requests, free KV pages, adapter
    slots and resident adapters, recent TPOT and SLO attainment. Empty until reported."""
    engine_groups = models.JSONField(default=list)
    """Per engine group, what placement reads (`api.services.reports.engine_groups`): `index`,
    `free_bytes_per_gpu` (the least free bytes of its GPUs), `harvestable_tokens_per_s`,
    `harvest`, `predictor_version`. One entry (index 0) for an agent that reports no groups."""
    gpus = models.JSONField(default=list)
    """Per GPU of the host: `index`, `total_bytes`, `free_bytes` (empty when not reported)."""
    engine = models.CharField(max_length=16, default="harli")
    """The host's engine, "harli" or "vllm" (`gpu_runtime.contract.host_capabilities`)."""
    capabilities = models.JSONField(default=dict)
    """What the host can do, defaults filled in (`reported_capabilities`): `colocation`
    (finetune jobs are placed only where true), `architectures`, `max_loras`, `max_lora_rank`.
    Empty before the first heartbeat."""
    engine_state = models.JSONField(default=dict)
    """The supervised server's `state` and `restarts` (vLLM hosts; empty otherwise)."""
    reported_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "workers_hostagentstate"


class PlacementDecision(models.Model):
    """Why `placement` went to its host (`reasons`), and when it was sent there."""

    placement = models.OneToOneField(
        Placement, primary_key=True, on_delete=models.CASCADE, related_name="decision"
    )
    reasons = models.JSONField()
    resume_step = models.PositiveIntegerField(null=True, blank=True)
    dispatch_count = models.PositiveIntegerField(default=0)
    last_dispatched_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "workers_placementdecision"


class ProcessedReport(models.Model):
    """A host report already applied; a redelivered copy with the same id is skipped."""

    message_id = models.CharField(max_length=64, primary_key=True)
    kind = models.CharField(max_length=32)
    host = models.CharField(max_length=64)
    processed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "workers_processedreport"
        indexes = [models.Index(fields=["processed_at"], name="workers_pro_process_19e30f_idx")]


class HostAdapterAction(models.TextChoices):
    LOAD = "load", "Load"
    UNLOAD = "unload", "Unload"


class HostAdapterOrder(models.Model):
    """An operator's last word on serving model `name` on `host` (`manage.py host_adapter`,
    `/api/ops/hosts/<name>/adapters`), and the host's last failure to load it.

    `unload` keeps the heartbeats from offering the model to that host again (they offer every
    finished adapter of its base model otherwise); `load` lifts that. `failure` is the host's
    latest `adapter_load_failed` message (set whether or not an operator asked; cleared when a
    heartbeat names the model as served)."""

    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="adapter_orders")
    name = models.CharField(max_length=255)
    action = models.CharField(max_length=8, choices=HostAdapterAction.choices)
    failure = models.TextField(blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["host", "name"], name="host_adapter_order_unique")
        ]
