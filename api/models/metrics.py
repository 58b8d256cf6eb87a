"""Time series the runtime hosts report (written by the report ingestion, `api.services.reports`),
and their per-minute rollups.

One row per report. `ts` is when the host measured it. Fractions are 0..1, times in ms, sizes
in bytes, rates per second. The console reads these; nothing else in the control plane does.
"""

from __future__ import annotations

from django.db import models

from api.models.engine_groups import EngineGroup
from api.models.finetune import FinetuneJob
from api.models.fleet import Deployment, GpuHost


class HostMetric(models.Model):
    """A host's GPU memory split and harvested finetune throughput at `ts`."""

    host = models.ForeignKey(GpuHost, on_delete=models.CASCADE, related_name="metrics")
    ts = models.DateTimeField()
    weights_bytes = models.BigIntegerField()
    kv_used_bytes = models.BigIntegerField()
    finetune_lent_bytes = models.BigIntegerField()
    free_bytes = models.BigIntegerField()
    finetune_tokens_per_s = models.FloatField(default=0.0)
    gpus = models.JSONField(default=list)
    """Per GPU: `index`, `total_bytes`, `free_bytes`, `kv_used_bytes`, `finetune_lent_bytes`
    (the report's `gpus`; empty from an agent that does not send them)."""

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [models.Index(fields=["host", "-ts"]), models.Index(fields=["ts"])]


class EngineGroupMetric(models.Model):
    """One engine group's memory and finetune figures over a reporting window ending at `ts`
    (sums over its GPUs; `gpus` lists the GPUs' own figures as in `HostMetric.gpus`)."""

    engine_group = models.ForeignKey(EngineGroup, on_delete=models.CASCADE, related_name="metrics")
    ts = models.DateTimeField()
    kv_used_bytes = models.BigIntegerField(default=0)
    finetune_lent_bytes = models.BigIntegerField(default=0)
    free_bytes = models.BigIntegerField(default=0)
    finetune_tokens_per_s = models.FloatField(default=0.0)
    gpus = models.JSONField(default=list)

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [models.Index(fields=["engine_group", "-ts"])]


class DeploymentMetric(models.Model):
    """Decode figures of one deployment on one host over a reporting window ending at `ts`.

    `slo_attainment` is the fraction of decode iterations whose TPOT met the deployment's
    `tpot_slo_ms`. `predicted_iter_ms` / `observed_iter_ms` pair the host's latency predictor
    (version `predictor_version`) with what happened, for the predictor-accuracy view.
    """

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="metrics")
    host = models.ForeignKey(
        GpuHost, null=True, blank=True, on_delete=models.SET_NULL, related_name="deployment_metrics"
    )
    engine_group = models.ForeignKey(
        EngineGroup,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="deployment_metrics",
    )
    """The group that decoded (null for rows from before groups, or of a removed group)."""
    ts = models.DateTimeField()
    tpot_p50_ms = models.FloatField()
    tpot_p99_ms = models.FloatField()
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p99_ms = models.FloatField(null=True, blank=True)
    """Time to first token of the requests that finished in the window (null: none did)."""
    slo_attainment = models.FloatField()
    goodput_tokens_per_s = models.FloatField(default=0.0)
    request_rate = models.FloatField(default=0.0)
    predicted_iter_ms = models.FloatField(null=True, blank=True)
    observed_iter_ms = models.FloatField(null=True, blank=True)
    predictor_version = models.CharField(max_length=64, null=True, blank=True)

    class Meta:
        ordering = ["-ts", "-id"]
        indexes = [models.Index(fields=["deployment", "ts"]), models.Index(fields=["ts"])]
        constraints = [
            models.CheckConstraint(
                name="deployment_metric_attainment_fraction",
                condition=models.Q(slo_attainment__gte=0, slo_attainment__lte=1),
            )
        ]


class JobMetric(models.Model):
    """A finetune job's training progress at optimizer step `step`."""

    job = models.ForeignKey(FinetuneJob, on_delete=models.CASCADE, related_name="metrics")
    ts = models.DateTimeField()
    step = models.PositiveIntegerField()
    train_loss = models.FloatField()
    train_accuracy = models.FloatField(null=True, blank=True)
    """Mean token accuracy of the step's batch."""
    valid_loss = models.FloatField(null=True, blank=True)
    """Validation loss at this step (steps that wrote a checkpoint, with a validation file)."""
    valid_mean_token_accuracy = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(default=0.0)

    class Meta:
        ordering = ["ts", "step"]
        indexes = [models.Index(fields=["job", "ts"])]


class RollupSeries(models.TextChoices):
    HOST = "host", "host"
    DEPLOYMENT = "deployment", "deployment"
    JOB = "job", "job"


class MetricRollup(models.Model):
    """One minute of one series: sample count, per-field sums and maxima.

    `key` is the host name (host), `<deployment>@<host>` (deployment; `<deployment>@<host>#<n>`
    for engine group n > 0 of the host) or the job id (job);
    a field's mean over the minute is `sums[field] / samples`.
    """

    series = models.CharField(max_length=16, choices=RollupSeries.choices)
    key = models.CharField(max_length=160)
    minute = models.DateTimeField()
    samples = models.PositiveIntegerField(default=0)
    sums = models.JSONField(default=dict)
    maxima = models.JSONField(default=dict)

    class Meta:
        db_table = "workers_metricrollup"
        ordering = ["series", "key", "minute"]
        constraints = [
            models.UniqueConstraint(fields=["series", "key", "minute"], name="rollup_unique_minute")
        ]
