"""Per-tenant quotas on fine-tuning: the operator's overrides and the monthly trained tokens.

The quotas themselves (names, fleet defaults, how use is counted) are in `api.quotas`; the
overrides are written only by `api.services.quotas.tenant_quotas_set`, the monthly counter only
by `api.services.quotas.trained_tokens_record`.
"""

from __future__ import annotations

from django.db import models

from api.models.tenancy import Tenant


class TenantQuota(models.Model):
    """One tenant's quota overrides. A null field takes the fleet default
    (settings `HARLI_QUOTA_*`); a tenant without a row takes every default.

    `running_jobs`: jobs holding a host at once (placement waits beyond it).
    `queued_jobs`: jobs waiting for a host (job creation and resume are refused at it).
    `stored_bytes`: bytes of the tenant's files (an upload that would pass it is refused).
    `trained_tokens_per_month`: tokens trained in one UTC calendar month (job creation is
    refused once the month's count reaches it).
    """

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    running_jobs = models.PositiveIntegerField(null=True, blank=True)
    queued_jobs = models.PositiveIntegerField(null=True, blank=True)
    stored_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    trained_tokens_per_month = models.PositiveBigIntegerField(null=True, blank=True)

    def __str__(self) -> str:
        return f"quota of tenant {self.tenant_id}"


class TenantTrainedTokens(models.Model):
    """Tokens the tenant's jobs trained in one UTC calendar month (`month` is its first day).

    Grows by the increase of each job's `trained_tokens` as its host reports it, counted in
    the month the report is applied."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="trained_tokens")
    month = models.DateField()
    trained_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "month"], name="tenant_trained_tokens_month")
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id}@{self.month:%Y-%m}: {self.trained_tokens}"
