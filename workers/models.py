"""What the control plane keeps about its hosts' agents, beyond the `api` domain rows.

* :class:`HostAgentState`: the latest heartbeat of a host's agent (placement reads it).
* :class:`PlacementDecision`: why a placement chose its host, and its dispatch record.
* :class:`ProcessedReport`: the message ids of reports already applied (dedupe under
  at-least-once delivery; written in the same transaction as the report's effect).
* :class:`MetricRollup`: per-minute aggregates of the metric time series.
"""

from __future__ import annotations

from django.db import models

from api.models import GpuHost, Placement


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
    reported_at = models.DateTimeField(null=True, blank=True)


class PlacementDecision(models.Model):
    """Why `placement` went to its host (`reasons`), and when it was sent there."""

    placement = models.OneToOneField(
        Placement, primary_key=True, on_delete=models.CASCADE, related_name="decision"
    )
    reasons = models.JSONField()
    resume_step = models.PositiveIntegerField(null=True, blank=True)
    dispatch_count = models.PositiveIntegerField(default=0)
    last_dispatched_at = models.DateTimeField(null=True, blank=True)


class ProcessedReport(models.Model):
    """A host report already applied; a redelivered copy with the same id is skipped."""

    message_id = models.CharField(max_length=64, primary_key=True)
    kind = models.CharField(max_length=32)
    host = models.CharField(max_length=64)
    processed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["processed_at"])]


class RollupSeries(models.TextChoices):
    HOST = "host", "host"
    DEPLOYMENT = "deployment", "deployment"
    JOB = "job", "job"


class MetricRollup(models.Model):
    """One minute of one series: sample count, per-field sums and maxima.

    `key` is the host name (host), `<deployment>@<host>` (deployment) or the job id (job);
    a field's mean over the minute is `sums[field] / samples`.
    """

    series = models.CharField(max_length=16, choices=RollupSeries.choices)
    key = models.CharField(max_length=160)
    minute = models.DateTimeField()
    samples = models.PositiveIntegerField(default=0)
    sums = models.JSONField(default=dict)
    maxima = models.JSONField(default=dict)

    class Meta:
        ordering = ["series", "key", "minute"]
        constraints = [
            models.UniqueConstraint(fields=["series", "key", "minute"], name="rollup_unique_minute")
        ]
