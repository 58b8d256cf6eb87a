"""Inference usage: what each tenant's calls through the gateway consumed, minute by minute.

Written only by `api.services.usage.usage_record_batch` (fed by `api.usage_recorder`), read by
`api.usage_selectors`. One row per (tenant, model, minute); counts only grow.
"""

from __future__ import annotations

from django.db import models

from api.models.tenancy import Tenant


class TenantUsage(models.Model):
    """One tenant's calls to one model in one minute.

    `model` is the name the request called (a base model, an adapter or a checkpoint name);
    `minute` is the UTC minute the calls finished in (seconds and microseconds zero).
    `prompt_tokens` and `completion_tokens` are the host's counts, as in the response's `usage`.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    model = models.CharField(max_length=255)
    minute = models.DateTimeField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "model", "minute"], name="tenant_usage_unique_minute"
            )
        ]
        indexes = [
            # a tenant's time range over all its models (the unique index has model before minute)
            models.Index(fields=["tenant", "minute"], name="tenant_usage_tenant_minute"),
            # every tenant's time range (the operator's reads)
            models.Index(fields=["minute"], name="tenant_usage_minute"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id}/{self.model}@{self.minute:%Y-%m-%dT%H:%M}"
